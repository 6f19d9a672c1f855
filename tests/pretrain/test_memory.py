"""``recompute: auto`` (``pretrain.trainer.memory``): the peak estimate against the H200 peaks it was
fitted to, the parameter counts against the built model, and the choices it makes for the cards and
layouts a lab runs (the 4B on one H200, on one H100, on a DP = 8 node; the tiny recipe anywhere)."""
import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pretrain.recipes import RECIPES
from pretrain.trainer import memory as m

B4 = RECIPES["llava-ov-1.5-4b"]
H200, H100 = 139.8, 79.2          # torch.cuda.get_device_properties(0).total_memory / 2**30
CAPTION_SQ = 8192 * 190           # Σ sample length² of an 8K pack of ~190-token caption samples


def test_the_calibration_is_the_least_squares_fit_of_the_measured_peaks_and_reproduces_each():
    cp = m.CALIBRATION_POINTS
    lay = m.Layout()
    states = m.state_bytes(B4, "all", lay) / m.GIB
    rows, want = [], []
    unscaled = {"overhead_gib": 0.0, "llm": 1.0, "vit": 1.0, "loss": 1.0}
    for lm, vm, lk, peak in cp["peaks"]:
        terms = m.estimate(B4, "all", lm, vm, lk, cp["tokens"], lay, cp["vit_tokens"], unscaled)
        rows.append([1.0, terms["llm_activations"], terms["vit_activations"], terms["loss"]])
        want.append(peak - states)
        got = m.estimate(B4, "all", lm, vm, lk, cp["tokens"], lay, cp["vit_tokens"])["total"]
        assert abs(got - peak) < m.ERROR_GIB, (lm, vm, lk, peak, got)
    fit, *_ = np.linalg.lstsq(np.array(rows), np.array(want), rcond=None)
    c = m.CALIBRATION
    assert np.allclose(fit, [c["overhead_gib"], c["llm"], c["vit"], c["loss"]], rtol=2e-3, atol=2e-3), fit


def test_states_count_weights_gradients_and_sharded_adam_per_trained_parameter():
    p = m.param_counts(B4)
    n = p["llm_layer"] * B4.llm.num_layers + p["embedding"] + p["output"] + p["vit"] + p["projector"]
    assert 4.3e9 < n < 4.4e9                                  # RICE-ViT-L + Qwen3-4B (tied) + the projector
    assert m.state_bytes(B4, "all", m.Layout()) == pytest.approx(18 * n)
    assert m.state_bytes(B4, "all", m.Layout(dp=8)) == pytest.approx((2 + 4 + 12 / 8) * n)
    assert m.state_bytes(B4, "all", m.Layout(dp=8, distributed_optimizer=False)) == pytest.approx(18 * n)
    assert m.state_bytes(B4, "projector", m.Layout()) == pytest.approx(2 * n + 16 * p["projector"])
    assert m.state_bytes(B4, "all", m.Layout(bf16=False)) == pytest.approx(16 * n)    # fp32: no master copy
    fp32 = m.estimate(B4, "all", "selective", "selective", "megatron", 8192, m.Layout(bf16=False))
    bf16 = m.estimate(B4, "all", "selective", "selective", "megatron", 8192, m.Layout())
    assert fp32["llm_activations"] == pytest.approx(2 * bf16["llm_activations"])
    # PP = 2: the first stage (tower, projector, embedding, 18 layers) is the larger; a tied output is a copy
    first = p["vit"] + p["projector"] + 18 * p["llm_layer"] + p["embedding"]
    assert m.state_bytes(B4, "all", m.Layout(pp=2)) == pytest.approx(18 * first)
    assert m.state_bytes(B4, "all", m.Layout(tp=2)) < 0.6 * m.state_bytes(B4, "all", m.Layout())


def test_parameter_counts_are_the_built_models_matrices(megatron_single):
    from pretrain.model.vlm import VLM

    r = RECIPES["tiny"]
    model = VLM(r, 7, backend="sdpa")
    p = m.param_counts(r)
    counted = p["llm_layer"] * r.llm.num_layers + p["embedding"] + p["output"] + p["vit"] + p["projector"]
    matrices = sum(x.numel() for x in model.parameters() if x.dim() >= 2)
    everything = sum(x.numel() for x in model.parameters())
    assert counted <= everything
    assert abs(counted - matrices) <= 0.02 * everything, (counted, matrices, everything)


def test_auto_picks_the_measured_fastest_for_the_4b_on_one_h200():
    c = m.choose(B4, "all", ("megatron", "liger"), 8192, CAPTION_SQ, m.Layout(), H200)
    # measured there (grad-accum 4): LLM kept whole, tower selective, liger's loss 41.0% / 40.4% MFU at 129 GiB;
    # the same with megatron's loss 40.2% at 134 GiB; tower fully recomputed 38.0-39.2%; selective 36.3%;
    # nothing recomputed ran out of memory
    assert (c.recompute, c.vision_recompute, c.loss_kernel, c.fits) == ("none", "selective", "liger", True)
    assert c.peak_gib <= m.HEADROOM * H200
    by_mode = {(lm, vm, lk): pk for lm, vm, lk, pk, _ in c.table}
    assert by_mode[("none", "none", "liger")] > H200                # the measured out-of-memory
    assert by_mode[("none", "selective", "megatron")] > m.HEADROOM * H200
    # with megatron's loss named, the LLM stays whole and the tower is recomputed instead
    named = m.choose(B4, "all", "megatron", 8192, CAPTION_SQ, m.Layout(), H200)
    assert (named.recompute, named.vision_recompute, named.loss_kernel) == ("none", "full", "megatron")
    assert {lk for _, _, lk, _, _ in named.table} == {"megatron"}


def test_liger_is_chosen_only_where_it_lets_less_be_recomputed():
    """At DP = 8 on H200s everything fits: megatron's loss, nothing recomputed; liger is never the tie-break."""
    c = m.choose(B4, "all", ("megatron", "liger"), 8192, CAPTION_SQ, m.Layout(dp=8), H200)
    assert (c.recompute, c.vision_recompute, c.loss_kernel) == ("none", "none", "megatron")


def test_core_attention_recompute_is_kept_only_where_its_flops_are_small():
    short = m.choose(B4, "all", "megatron", 8192, CAPTION_SQ, m.Layout(dp=2), H200)
    long = m.choose(B4, "all", "megatron", 8192, 8192 ** 2, m.Layout(dp=2), H200)
    shares = {(lm, vm): x for lm, vm, _, _, x in long.table}
    assert shares[("selective", "full")] - shares[("mlp", "full")] > m.TIE       # one 8K sample: attention is dear
    assert long.recompute != "selective"
    assert short.peak_gib <= m.HEADROOM * H200 and long.peak_gib <= m.HEADROOM * H200


def test_the_4b_on_one_h100_fails_before_any_work_naming_the_layouts_that_fit():
    cfg = _cfg()
    with pytest.raises(ValueError) as e:
        m.resolve_auto(cfg, B4, "all", {"tp": 1, "pp": 1, "cp": 1, "dp": 1}, 8192, CAPTION_SQ, H100, log=_no)
    assert "79.2 GiB" in str(e.value) and "error" in str(e.value)
    assert "dp=2" in str(e.value) and "tp=2" in str(e.value) and "--recompute" in str(e.value)


def test_the_4b_on_a_node_of_eight_h100s_runs_the_least_recompute_that_fits():
    cfg, c = m.resolve_auto(_cfg(), B4, "all", {"tp": 1, "pp": 1, "cp": 1, "dp": 8}, 8192, CAPTION_SQ, H100,
                            log=_no)
    assert c.fits and c.peak_gib <= m.HEADROOM * H100
    assert (cfg.recompute, cfg.vision_recompute) == (c.recompute, c.vision_recompute)
    share = {(lm, vm, lk): x for lm, vm, lk, _, x in c.table}[(c.recompute, c.vision_recompute, c.loss_kernel)]
    for lm, vm, lk, peak, x in c.table:
        if x < share - m.TIE:                       # anything cheaper by more than the tie does not fit
            assert peak > m.HEADROOM * H100, (lm, vm, peak, x)
    # the Adam state sharded 8 ways leaves room that one GPU lacks: it fits where DP = 1 fails
    assert m.estimate(B4, "all", c.recompute, c.vision_recompute, c.loss_kernel, 8192, m.Layout())["total"] > H100


def test_a_set_tower_mode_is_kept_and_the_llms_chosen_around_it():
    cfg, c = m.resolve_auto(_cfg(vision_recompute="none"), B4, "all", {"tp": 1, "pp": 1, "cp": 1, "dp": 1}, 8192,
                            CAPTION_SQ, H200, log=_no)
    assert cfg.vision_recompute == "none" and all(vm == "none" for _, vm, _, _, _ in c.table)


def test_the_tiny_recipe_keeps_everything_and_stage_1_keeps_no_tower_activations():
    c = m.choose(RECIPES["tiny"], "all", ("megatron", "liger"), 512, 512 * 64, m.Layout(), H100)
    assert (c.recompute, c.vision_recompute, c.loss_kernel) == ("none", "none", "megatron")
    frozen = m.estimate(B4, "projector", "none", "none", "megatron", 8192, m.Layout())
    assert frozen["vit_activations"] == 0 and frozen["states"] < 10


def test_stage_1_weighs_the_llms_modes_alone_and_keeps_the_4b_whole_on_one_h100():
    """The frozen tower recomputes nothing in any mode, so stage 1 has one row per (LLM mode, loss
    kernel), and with only the projector's Adam state the whole LLM fits an 80 GB card."""
    c = m.choose(B4, "projector", ("megatron", "liger"), 8192, CAPTION_SQ, m.Layout(), H100)
    assert len(c.table) == len(m.LLM_MODES) * 2 and {vm for _, vm, _, _, _ in c.table} == {"none"}
    assert (c.recompute, c.vision_recompute, c.loss_kernel, c.fits) == ("none", "none", "megatron", True)
    assert m.candidates("projector", vision="full") == [(lm, "full") for lm in m.LLM_MODES]   # a named mode stays


def test_headroom_short_warns_and_runs_full():
    lines = []
    # over the headroom but inside the card less the estimate's error: runs, with the advice
    full = m.estimate(B4, "all", "full", "full", "megatron", 8192, m.Layout())["total"]
    assert full > m.HEADROOM * (full + m.ERROR_GIB + 0.1)
    cfg, c = m.resolve_auto(_cfg(loss_kernel="megatron"), B4, "all", {"tp": 1, "pp": 1, "cp": 1, "dp": 1}, 8192,
                            CAPTION_SQ, full + m.ERROR_GIB + 0.1, log=lines.append)
    assert (cfg.recompute, c.fits) == ("full", False) and "warning" in lines[0] and "dp=2" in lines[0]


def test_cpu_runs_keep_everything_and_gpu_runs_resolve_auto_at_build():
    from pretrain.trainer.config import TrainConfig

    for given in (None, "auto"):
        cpu = TrainConfig(run_dir="/tmp/x", stage="1.5", steps=1, recompute=given).resolve(cuda=False)
        assert (cpu.recompute, cpu.vision_recompute) == ("none", "none")
        gpu = TrainConfig(run_dir="/tmp/x", stage="1.5", steps=1, recompute=given).resolve(cuda=True)
        assert (gpu.recompute, gpu.vision_recompute) == ("auto", None)
    assert TrainConfig(run_dir="/tmp/x", stage="1.5", steps=1, recompute="mlp").resolve(True).vision_recompute == \
        "selective"
    with pytest.raises(ValueError, match="recompute must be one of"):
        TrainConfig(run_dir="/tmp/x", stage="1.5", steps=1, recompute="some")
    from pretrain.trainer.build import recompute_overrides

    with pytest.raises(ValueError):
        recompute_overrides("auto")


def test_pack_shape_reads_seq_len_and_the_densest_pack(tmp_path):
    from pretrain.data import pack_shape

    (tmp_path / "pack" / "packs").mkdir(parents=True)
    t = pa.table({"pack_id": [0, 1], "sample_ids": [["a", "b"], ["c"]], "lengths": [[3, 4], [6]],
                  "offsets": [[0, 3], [0]], "total_tokens": [7, 6], "shard": ["s", "s"]})
    pq.write_table(t, tmp_path / "pack" / "packs" / "part-00000.parquet")
    assert pack_shape(tmp_path, "pack") == (7, 36.0)
    (tmp_path / "pack" / "config.json").write_text(json.dumps({"seq_len": 4096}))   # as `ovpipe pack` leaves them
    (tmp_path / "pack" / "executor.json").write_text(json.dumps({"step": "pack"}))
    assert pack_shape(tmp_path, "pack") == (4096, 36.0)
    with pytest.raises(FileNotFoundError, match="pack-instruct"):
        pack_shape(tmp_path, "pack-instruct")


def _cfg(**kw):
    from pretrain.trainer.config import TrainConfig

    base = TrainConfig(run_dir="/tmp/x", recipe="llava-ov-1.5-4b", stage="1.5", steps=1, micro_batch=1,
                       recompute="auto").resolve(cuda=True)
    return dataclasses.replace(base, **kw)


def _no(*_):
    pass


@pytest.mark.gpu
def test_a_gpu_run_resolves_auto_and_records_it(megatron_single, conversation_run, tmp_path):
    import shutil

    import torch

    from pretrain.train import train
    from pretrain.trainer.config import TrainConfig

    run, _ = conversation_run
    shutil.copytree(run, tmp_path / "r")
    torch.cuda.reset_peak_memory_stats()
    train(TrainConfig(run_dir=tmp_path / "r", recipe="tiny", stage="1.5", steps=1, micro_batch=1, data="pack-conv"),
          log=_no)
    ran = json.loads((tmp_path / "r" / "pretrain" / "stage-1.5" / "stage.json").read_text())
    assert (ran["recompute"], ran["vision_recompute"], ran["loss_kernel"]) == ("none", "none", "megatron")
    auto = ran["recompute_auto"]
    assert len(auto["candidates"]) == len(m.candidates()) * len(m.loss_kernels_for(1)) and auto["memory_gib"] > 10
    assert torch.cuda.max_memory_allocated() / m.GIB < auto["peak_estimate_gib"] + m.CALIBRATION["overhead_gib"]


def test_the_planner_prints_every_pair_and_the_pick_without_a_gpu(capsys):
    assert m.main(["--recipe", "llava-ov-1.5-4b", "--gpu", "h100", "--dp", "8"]) == 0
    out = capsys.readouterr().out
    rows = len(m.candidates()) * len(m.loss_kernels_for(1))
    assert "79.2 GiB per GPU" in out and out.count("<- auto") == 1 and len(out.splitlines()) == 2 + rows
    assert m.main(["--recipe", "llava-ov-1.5-4b", "--gpu", "h100"]) == 1
    assert "it fits at dp=2" in capsys.readouterr().out
    assert m.main(["--recipe", "llava-ov-1.5-4b", "--gpu", "139.8"]) == 0
    assert "none       selective  liger" in [ln for ln in capsys.readouterr().out.splitlines() if "<- auto" in ln][0]
