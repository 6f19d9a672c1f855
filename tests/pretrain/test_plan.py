"""`ovpipe plan`: its arithmetic against a hand computation on small cases, every layout it prints accepted by
the trainer's own checks, and the command the issue names printing layouts and a time."""
import math

import pytest

from pretrain.plan import GPUS, MEASURED_MFU, PACK_FILL, parse_gpus, plan, predict


def _flops(recipe, stage, tokens, sample_len, share):
    from pretrain.recipes import STAGES
    from pretrain.trainer.flops import model_flops

    merged = share * tokens
    stats = {"tokens": tokens, "attn_sq": tokens * sample_len, "vit_tokens": 4 * merged, "vit_sq": 4 * merged * 1024,
             "merged": merged}
    return model_flops(recipe, STAGES[stage].trainable, stats, "none", "none")


def test_one_gpu_is_the_measured_efficiency_times_the_flops():
    from pretrain.recipes import RECIPES

    recipe, gpu = RECIPES["tiny"], GPUS["H100"]
    p = predict(recipe, "1.5", gpu, 1, 1, 1, 1, 1, grad_accum=4, micro_batch=1, seq_len=512, sample_len=100, steps=10,
                image_share=0.5)
    mf, hf = _flops(recipe, "1.5", 512, 100, 0.5)
    assert p.recompute == "none"                       # the tiny model fits whole
    want = 4 * hf / (MEASURED_MFU["H100"] * gpu.peak_tflops * 1e12)
    assert p.step_s == pytest.approx(want, rel=1e-9)
    assert p.parts["bubble"] == p.parts["tp"] == p.parts["cp"] == p.parts["dp"] == 0
    assert p.hours == pytest.approx(10 * want / 3600, rel=1e-9)
    assert p.tokens_per_s_per_gpu == pytest.approx(4 * 512 * PACK_FILL / want, rel=1e-9)


def test_the_communication_terms_by_hand():
    """DP=2 over NVLink: reduce-scatter + all-gather of the bf16 shard, ring (n−1)/n, hidden behind one
    micro-batch; TP=2: four all-reduces per layer and micro-batch; PP=2: one micro-batch of bubble."""
    from pretrain.recipes import RECIPES
    from pretrain.trainer.memory import param_counts

    recipe, gpu = RECIPES["tiny"], GPUS["A800"]
    base = dict(micro_batch=1, seq_len=512, sample_len=100, steps=1, image_share=0.5)
    one = predict(recipe, "1.5", gpu, 1, 1, 1, 1, 1, grad_accum=2, **base)
    micro = one.step_s / 2
    dp = predict(recipe, "1.5", gpu, 2, 1, 1, 1, 2, grad_accum=2, **base)
    shard = sum(param_counts(recipe).values()) * 2
    t_dp = 2 * shard * (1 / 2) / (gpu.nvlink_gbs * 1e9)
    assert dp.parts["dp"] == pytest.approx(max(0.0, t_dp - micro), abs=1e-15)
    tp = predict(recipe, "1.5", gpu, 2, 2, 1, 1, 1, grad_accum=2, **base)
    act = 512 * recipe.llm.hidden_size * 2
    assert tp.parts["tp"] == pytest.approx(2 * recipe.llm.num_layers * 4 * 2 * act * (1 / 2) / (gpu.nvlink_gbs * 1e9))
    assert tp.parts["compute"] == pytest.approx(one.parts["compute"] / 2)
    pp = predict(recipe, "1.5", gpu, 2, 1, 2, 1, 1, grad_accum=2, **base)
    assert pp.parts["bubble"] == pytest.approx(pp.parts["compute"] / 2)      # (pp − 1) of accum micro-batches


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


def test_the_command_prints_layouts_and_a_time(capsys):
    from ovpipe.cli import main

    assert main(["plan", "--recipe", "llava-ov-1.5-8b", "--stage", "1.5", "--samples", "85000000",
                 "--gpus", "128xA800"]) == 0
    out = capsys.readouterr().out
    steps = math.ceil(85_000_000 * 1000 / (8192 * PACK_FILL) / 1024)
    assert f"{steps:,} steps × 1,024 packs" in out and "not this card's" in out
    best = next(ln for ln in out.splitlines() if ln.startswith("best: "))
    assert " h (" in best and "days)" in best and "--executor slurm --nodes 16" in best
    assert main(["plan", "--recipe", "llava-ov-1.5-4b", "--stage", "1.5", "--samples", "1000000",
                 "--gpus", "1xH100"]) == 0                   # the 4B stage 1.5 fits one 80 GB card offloaded
    assert "offloaded to the host" in capsys.readouterr().out
    assert main(["plan", "--recipe", "llava-ov-1.5-8b", "--stage", "1.5", "--samples", "1000000",
                 "--gpus", "1xH100", "--seq-len", "65536"]) == 1     # 64K-token packs: not even offloaded
    assert "no layout fits" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "--gpus", "8xB200", "--samples", "10"])
    assert "KIND one of H100, H200, A100, A800" in capsys.readouterr().err


def test_the_data_of_a_run(packed_demo, capsys):
    """--run-dir reads the pack step's count, sample length and seq_len: the demo's tiny packs."""
    import pyarrow.parquet as pq

    from ovpipe.cli import main
    from pretrain.plan import run_data

    packs, sample_len, _, seq_len = run_data(packed_demo, "pack")
    rows = sum(pq.read_metadata(f).num_rows for f in (packed_demo / "pack" / "packs").glob("part-*.parquet"))
    assert packs == rows and 0 < sample_len <= seq_len == 512
    assert main(["plan", "--recipe", "tiny", "--stage", "1.5", "--run-dir", str(packed_demo), "--gpus", "2xH100",
                 "--global-batch", "2"]) == 0
    assert f"{math.ceil(rows / 2):,} steps × 2 packs of 512 tokens" in capsys.readouterr().out
