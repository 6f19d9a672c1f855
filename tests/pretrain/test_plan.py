"""`ovpipe plan`: properties the model of the trainer must keep (the tower's time under CP, the network's, offload's,
padding's), its DP traffic read from the trainer's own DDP config, its parameter counts against the real modules,
the calibration file, every printed layout accepted by the trainer's checks, and the commands the docs name."""
import dataclasses
import json
import math

import pytest

from pretrain.plan import GPUS, PACK_FILL, comm_bytes, parse_gpus, plan, predict, rank_params
from pretrain.plan.model import packed_stats, stage_seconds, trainer_ddp


def _recipe(name):
    from pretrain.recipes import RECIPES

    return RECIPES[name]


def test_cp_never_shrinks_the_tower():
    """A micro-batch of image tokens only: at any CP (and TP) the first stage takes at least as long as the same
    tower in front of an LLM too small to count, since every TP and CP rank runs the whole tower."""
    from pretrain.plan.calibration import default_calibration
    from pretrain.recipes import Recipe

    r4b = _recipe("llava-ov-1.5-4b")
    tower_only = Recipe("tower-only", r4b.vit, _recipe("tiny").llm)
    gpu, cal = GPUS["H100"], default_calibration()
    stats = packed_stats(8192, 1000, image_share=1.0)

    def first(recipe, tp, cp):
        ddp = trainer_ddp(r4b, "1.5", 1)           # the DDP settings do not depend on the shapes
        return stage_seconds(recipe, "1.5", gpu, cal, tp, 1, cp, 1, 1, 8192, stats, "none", "none", ddp)[0]["compute"]

    tower = first(tower_only, 1, 1)
    times = {(tp, cp): first(r4b, tp, cp) for tp in (1, 2) for cp in (1, 2, 4)}
    assert all(t >= tower for t in times.values())
    # and what CP or TP saves is at most the LLM's share: the tower's part never divides
    assert min(times.values()) >= tower + (times[1, 1] - tower) / 8


def test_a_faster_network_never_slows_a_layout():
    recipe = _recipe("llava-ov-1.5-8b")
    slow = GPUS["A800"]
    for tp, pp, cp, dp, ga in [(1, 1, 1, 128, 8), (1, 2, 2, 32, 32), (2, 4, 1, 16, 64)]:
        times = []
        for net, nvl in [(12.5, 100.0), (50.0, 200.0), (400.0, 900.0)]:
            gpu = dataclasses.replace(slow, network_gbs=net, nvlink_gbs=nvl)
            times.append(predict(recipe, "1.5", gpu, 128, tp, pp, cp, dp, ga, 1, 8192, 1000, 100).step_s)
        assert times == sorted(times, reverse=True), (tp, pp, cp, dp, times)
        assert times[0] > times[-1]          # and the network is in the model at all


def test_offload_never_outranks_a_layout_that_fits_with_no_more_compute():
    """The 8B on four A800s: a layout that needs the optimizer partly on the host ranks below every layout that
    fits without it whose compute is no larger."""
    plans = plan("llava-ov-1.5-8b", "1.5", "4xA800", steps=100, global_batch=64)
    off = [p for p in plans if p.offload]
    fit = [p for p in plans if not p.offload]
    assert off and fit
    for o in off:
        assert o.parts["optimizer"] > 0
        for f in fit:
            if f.parts["compute"] <= o.parts["compute"]:
                assert plans.index(f) < plans.index(o), (f, o)
    # the same layout and recompute on a card with room for the optimizer: offload only ever adds time
    o = off[0]
    roomy = dataclasses.replace(GPUS["A800"], memory_gib=1000.0)
    kw = dict(micro_batch=1, seq_len=8192, sample_len=1000, steps=100, recompute="full")
    on_host = predict(_recipe("llava-ov-1.5-8b"), "1.5", GPUS["A800"], 4, o.tp, o.pp, o.cp, o.dp, o.grad_accum, **kw)
    on_gpu = predict(_recipe("llava-ov-1.5-8b"), "1.5", roomy, 4, o.tp, o.pp, o.cp, o.dp, o.grad_accum, **kw)
    assert on_host.offload and not on_gpu.offload
    assert on_host.parts["compute"] == on_gpu.parts["compute"] and on_host.step_s > on_gpu.step_s


def test_dp_bytes_are_what_the_trainers_ddp_config_moves():
    """The gradient bytes follow the reduce dtype of ``ddp_config`` (halved by a bf16 reduce), the parameter
    gather exists only with the distributed optimizer, and stage 1 moves the projector alone, counted on the
    real module."""
    from pretrain.model.vision import Projector, RiceViT
    from pretrain.trainer.config import TrainConfig
    from pretrain.trainer.optimizer import ddp_config

    recipe = _recipe("llava-ov-1.5-4b")
    args = (recipe, "1.5", 1, 1, 1, 8, 4, 1, 8192)
    fp32 = ddp_config(TrainConfig(run_dir="x", recipe=recipe.name, stage="1.5", steps=1), 8)
    bf16 = ddp_config(TrainConfig(run_dir="x", recipe=recipe.name, stage="1.5", steps=1, grad_reduce_dtype="bf16"), 8)
    assert fp32.grad_reduce_in_fp32 and not bf16.grad_reduce_in_fp32
    a, b = comm_bytes(*args, ddp=fp32), comm_bytes(*args, ddp=bf16)
    assert comm_bytes(*args) == a                               # the default reads the trainer's config
    assert a["dp_grad"] == 2 * b["dp_grad"] == 2 * a["dp_param"] == 2 * b["dp_param"] > 0
    plain = ddp_config(TrainConfig(run_dir="x", recipe=recipe.name, stage="1.5", steps=1,
                                   distributed_optimizer=False), 8)
    assert comm_bytes(*args, ddp=plain)["dp_param"] == 0 and comm_bytes(*args, ddp=plain)["dp_grad"] == a["dp_grad"]
    s1 = comm_bytes(recipe, "1", 1, 1, 1, 8, 4, 1, 8192)
    projector = sum(p.numel() for p in Projector(recipe.vit.hidden_size, recipe.llm.hidden_size).parameters())
    assert s1["dp_grad"] == 4 * projector and s1["dp_param"] == 2 * projector
    tiny = _recipe("tiny")
    assert rank_params(tiny, "all", 1, 1)["vit"] == sum(p.numel() for p in RiceViT(tiny.vit).parameters())


def test_tp_and_cp_bytes_grow_with_the_micro_batch_and_vanish_without_the_split():
    recipe = _recipe("llava-ov-1.5-8b")
    one = comm_bytes(recipe, "1.5", 1, 1, 1, 8, 4, 1, 8192)
    assert one["tp"] == one["cp"] == one["pp"] == 0
    split = comm_bytes(recipe, "1.5", 2, 2, 2, 2, 4, 1, 8192)
    twice = comm_bytes(recipe, "1.5", 2, 2, 2, 2, 8, 1, 8192)
    assert all(split[k] > 0 for k in ("tp", "cp", "pp"))
    assert twice["cp"] == 2 * split["cp"] and twice["dp_grad"] == split["dp_grad"]     # DP once a step
    frozen = comm_bytes(recipe, "1", 2, 1, 1, 2, 4, 1, 8192)
    assert 0 < frozen["tp"] < comm_bytes(recipe, "1.5", 2, 1, 1, 2, 4, 1, 8192)["tp"]  # no weight gradients


def test_padding_dominates_issue_72_and_packing_removes_it():
    """LLaVA-OneVision-2 issue 72's samples (stage 1, 1,000 tokens each on average) padded to 8,192: most of the
    compute is padding and the run takes several times the packed one; unpacked at micro-batch 1 nothing is padded."""
    from pretrain.plan.data import from_samples

    recipe = _recipe("llava-ov-1.5-4b")
    data = from_samples(23000 * 5888, 1000, 0.5)
    assert data.padding_share(recipe, "projector", "padded", 8192, 1) > 0.75
    assert data.padding_share(recipe, "projector", "unpacked", 8192, 1) == pytest.approx(0, abs=1e-9)
    assert data.padding_share(recipe, "projector", "packed", 8192, 1) < 0.05
    assert data.padding_share(recipe, "projector", "unpacked", 8192, 4) > 0.2     # padded to the longest of 4
    hours = {}
    for form in ("padded", "packed"):
        stats, useful = data.micro(form, 8192, 1)
        slots = data.slots(form, 8192)
        gbs = 5888 if form == "padded" else 736
        p = predict(recipe, "1", GPUS["A800"], 184, 1, 1, 1, 184, gbs // 184, 1, 8192, 1000,
                    math.ceil(slots / gbs), stats=stats, useful_tokens=useful)
        hours[form] = p.hours
    assert hours["padded"] > 4 * hours["packed"]


def test_issue_72_in_one_command(capsys):
    from ovpipe.cli import main

    assert main(["plan", "--recipe", "llava-ov-1.5-4b", "--stage", "1", "--gpus", "184xA800", "--steps", "23000",
                 "--global-batch", "5888", "--slots", "samples", "--tokens-per-sample", "1000",
                 "--tokens-sigma", "0.5", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "unpacked, as the official trainer runs it: 23,000 steps × 5,888 samples" in out
    lines = {k: next(ln for ln in out.splitlines() if ln.strip().startswith(k))
             for k in ("ovpipe's packs", "unpacked", "each sample padded")}
    days = {k: float(v.split(" h (")[1].split(" days")[0].replace(",", "")) for k, v in lines.items()}
    assert days["each sample padded"] > 4 * days["ovpipe's packs"]
    assert "padding 0% of the compute" in lines["unpacked"]
    assert "neither a lower nor an upper bound" in out and "H200" in out and "cdf4d0d" in out


def test_the_calibration_file(tmp_path, capsys):
    """The committed bench_mfu JSON is the default; a lab's file for its own card is taken as measured there and
    sets the compute rate; a file missing a field fails naming it."""
    from pretrain.plan import main
    from pretrain.plan.calibration import DEFAULT, default_calibration, load

    cal = default_calibration()
    assert cal.card == "H200" and cal.commit == "cdf4d0d" and cal.mfu == pytest.approx(0.41, abs=0.005)
    doc = json.loads(DEFAULT.read_text())
    doc["summary"].update(device="NVIDIA A800-SXM4-80GB", peak_tflops=312.0, commit="abc1234",
                          hfu_median=doc["summary"]["hfu_median"] / 2)
    mine = tmp_path / "a800.json"
    mine.write_text(json.dumps(doc))
    a800 = load(mine)
    assert a800.card == "A800" and a800.flops_per_s < cal.flops_per_s
    args = ["--recipe", "llava-ov-1.5-8b", "--stage", "1.5", "--gpus", "16xA800", "--samples", "1000000", "--top", "1"]
    assert main(args) == 0
    default = capsys.readouterr().out
    assert main(args + ["--calibration", str(mine)]) == 0
    measured = capsys.readouterr().out
    assert "measured on this card" in measured and "abc1234" in measured and "neither" not in measured
    hours = [float(o.split("best: ")[1].split(", ")[1].split(" h")[0]) for o in (default, measured)]
    assert hours[1] > hours[0]           # half the H200's share of the peak: slower
    del doc["summary"]["fwd_bwd_s_median"]
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(SystemExit):
        main(args + ["--calibration", str(tmp_path / "bad.json")])
    assert "summary.fwd_bwd_s_median is missing" in capsys.readouterr().err


def test_every_printed_layout_passes_the_trainers_checks():
    from pretrain.recipes import RECIPES, Parallelism, validate
    from pretrain.trainer.config import TrainConfig

    n, _ = parse_gpus("64xH100")
    plans = plan("llava-ov-1.5-8b", "1.5", "64xH100", steps=100, global_batch=512)
    assert plans and plans == sorted(plans, key=lambda p: (p.hours, p.tp * p.pp * p.cp))
    for p in plans:
        assert p.tp * p.pp * p.cp * p.dp == n and p.grad_accum * p.dp * p.micro_batch == 512
        validate(RECIPES["llava-ov-1.5-8b"], Parallelism(tp=p.tp, pp=p.pp, cp=p.cp, sequence_parallel=p.tp > 1,
                                                          seq_len=8192, world_size=n))
        cfg = TrainConfig(run_dir="/tmp/x", recipe="llava-ov-1.5-8b", stage="1.5", steps=100, micro_batch=1,
                          global_batch=512, tp=p.tp, pp=p.pp, cp=p.cp, sequence_parallel=p.tp > 1,
                          recompute=p.recompute, vision_recompute=p.vision_recompute, loss_kernel=p.loss_kernel)
        assert cfg.resolve(False, world=n).grad_accum == p.grad_accum
        assert (p.comm_bytes["dp_grad"] > 0) == (p.dp * p.cp > 1) and len(p.stage_s) == p.pp


def test_the_command_prints_layouts_and_a_time(capsys):
    from ovpipe.cli import main

    assert main(["plan", "--recipe", "llava-ov-1.5-8b", "--stage", "1.5", "--samples", "85000000",
                 "--gpus", "128xA800", "--top", "3"]) == 0
    out = capsys.readouterr().out
    steps = math.ceil(math.ceil(85_000_000 * 1000 / (8192 * PACK_FILL)) / 1024)
    assert f"{steps:,} steps × 1,024 packs" in out
    best = next(ln for ln in out.splitlines() if ln.startswith("best: "))
    assert " h (" in best and "days)" in best and "--executor slurm --nodes 16" in best
    assert main(["plan", "--recipe", "llava-ov-1.5-8b", "--stage", "1.5", "--samples", "1000000",
                 "--gpus", "1xH100", "--seq-len", "65536"]) == 1     # 64K-token packs: not even offloaded
    assert "no layout fits" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "--gpus", "8xB200", "--samples", "10"])
    assert "KIND one of H100, H200, A100, A800" in capsys.readouterr().err


def test_the_data_of_a_run(packed_demo, capsys):
    """A pack step gives its packs, their samples' lengths and seq_len; a lengths step its samples and image
    share; both plan the same samples."""
    import pyarrow.parquet as pq

    from ovpipe.cli import main
    from pretrain.plan.data import from_run

    packs = from_run(packed_demo, "pack")
    rows = sum(pq.read_metadata(f).num_rows for f in (packed_demo / "pack" / "packs").glob("part-*.parquet"))
    assert packs.packs == rows and 0 < packs.mean <= 512
    lengths = from_run(packed_demo, "lengths")
    assert lengths.packs is None and lengths.samples >= packs.samples and 0 < lengths.image_share < 1
    assert main(["plan", "--recipe", "tiny", "--stage", "1.5", "--run-dir", str(packed_demo), "--gpus", "2xH100",
                 "--global-batch", "2"]) == 0
    assert f"{math.ceil(rows / 2):,} steps × 2 packs of 512 tokens" in capsys.readouterr().out


def test_packs_that_leave_a_rank_waiting_plan_slower_and_balanced_ones_do_not(tmp_path):
    """The plan reads a run's own pack costs: the same total cost, dealt so that every step has a heavy and a
    light rank, is slower at DP 2 than the same cost dealt evenly, which plans as if ranks never waited."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pretrain.plan import run_stragglers
    from pretrain.plan.model import plan

    plans = [p for p in plan("tiny", "1.5", "2xH100", steps=10, global_batch=2, seq_len=512) if p.dp == 2]
    assert plans
    runs = {}
    for name, cost in (("even", [2.0] * 8), ("skewed", [1.0, 3.0] * 4)):
        (tmp_path / name / "pack" / "packs").mkdir(parents=True)
        pq.write_table(pa.table({"cost": np.array(cost)}), tmp_path / name / "pack" / "packs" / "part-00000.parquet")
        runs[name], costed = run_stragglers(tmp_path / name, "pack", plans)
        assert costed
    for plain, even, skewed in zip(plans, runs["even"], runs["skewed"]):
        assert even.hours == plain.hours and "straggler" not in even.parts
        assert skewed.hours > plain.hours and skewed.parts["straggler"] > 0
        assert skewed.tokens_per_s_per_gpu < plain.tokens_per_s_per_gpu
    (tmp_path / "old" / "pack" / "packs").mkdir(parents=True)          # a pack step written before costs
    pq.write_table(pa.table({"total_tokens": [512] * 4}), tmp_path / "old" / "pack" / "packs" / "part-00000.parquet")
    assert run_stragglers(tmp_path / "old", "pack", plans) == (plans, False)


def test_gradient_buckets_count_parameters_whatever_the_reduce_dtype():
    """megatron's ``bucket_size`` counts parameters: a bf16 reduce halves each call's bytes, not the bucket count
    (counting 4 bytes an element made the plan's exposed last bucket twice what it is)."""
    from pretrain.plan.model import collectives, grad_buckets

    recipe = _recipe("llava-ov-1.5-8b")
    fp32 = trainer_ddp(recipe, "1.5", 16)
    bf16 = dataclasses.replace(fp32, grad_reduce_in_fp32=False)
    counts = {}
    for name, ddp in (("fp32", fp32), ("bf16", bf16)):
        calls = [x for x in collectives(recipe, "1.5", 1, 1, 1, 16, 1, 8192, ddp) if x.per == "step"]
        grad = max(x.nbytes for x in calls if x.kind == "dp_grad")
        counts[name] = (grad, grad_buckets(calls, ddp))
    assert counts["bf16"][0] * 2 == counts["fp32"][0]
    params = counts["fp32"][0] / 4
    assert counts["bf16"][1] == counts["fp32"][1] == math.ceil(params / fp32.bucket_size)


def test_the_plans_straggler_figure_covers_the_runs_epochs(tmp_path):
    """ovpipe issue 67: packs balanced for DP 2 (every pair of pack_id order is an even step) with n = 9, so one pack is
    left over each epoch. Replayed as one stream, epoch 2 pairs pack 8 with pack 0 and every later step is
    uneven; the balanced stream keeps every epoch's pairs and carries the leftover until it fills a step, so a
    run of ~4.4 epochs plans exactly as if no rank waited."""
    import dataclasses
    import json

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ovpipe.config import load_config
    from packing.compute_balance import straggler_loss
    from packing.pack import PackConfig
    from pretrain.plan import run_stragglers
    from pretrain.plan.model import plan

    cost = np.array([1.0, 1.0, 3.0, 3.0, 2.0, 2.0, 5.0, 5.0, 7.0])
    steps = 20                                                      # 40 packs: 4.4 epochs
    assert straggler_loss(cost, 2) == 0 and straggler_loss(np.tile(cost, 5)[:2 * steps], 2) > 0.2
    d = tmp_path / "pack"
    (d / "packs").mkdir(parents=True)
    pq.write_table(pa.table({"cost": cost}), d / "packs" / "part-00000.parquet")
    (d / "config.json").write_text(json.dumps(dataclasses.asdict(load_config(PackConfig, {"balance_dp": 2}))))
    (d / "executor.json").write_text(json.dumps({"step": "pack"}))
    plans = [p for p in plan("tiny", "1.5", "2xH100", steps=steps, global_batch=2, seq_len=512) if p.dp == 2]
    assert plans and all(p.micro_batch == p.grad_accum == 1 for p in plans)
    got, costed = run_stragglers(tmp_path, "pack", plans, steps)
    assert costed and [p.hours for p in got] == [p.hours for p in plans]
    assert all("straggler" not in p.parts for p in got)
