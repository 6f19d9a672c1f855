"""optimizer_offload: megatron-core's HybridDeviceOptimizer. On the CPU: the config, the memory model,
``recompute: auto`` choosing it where nothing else fits one card, ``ovpipe plan`` listing it. megatron's
offload path asks for CUDA streams when it is built (``torch.cuda.current_stream()``), so the training
check (3 steps' losses against the non-offloaded run) is a GPU test."""
import shutil

import pytest

from pretrain.recipes import RECIPES
from pretrain.trainer import memory
from pretrain.trainer.config import TrainConfig

B4 = RECIPES["llava-ov-1.5-4b"]


def cfg(tmp_path, **kw):
    return TrainConfig(run_dir=tmp_path, stage="1.5", steps=1, recipe="llava-ov-1.5-4b", **kw)


@pytest.mark.parametrize("kw, cuda, match", [
    ({"optimizer_offload": 1.5}, True, "optimizer_offload must be <= 1"),
    ({"optimizer_offload": True}, True, "optimizer_offload must be a number"),
    ({"optimizer_offload": 0.5}, False, "optimizer_offload=0.5 needs CUDA"),
    ({"optimizer_offload": 0.5, "distributed_optimizer": False}, True, "needs distributed_optimizer"),
])
def test_wrong_offload_fails_before_any_work_naming_the_field(tmp_path, kw, cuda, match):
    with pytest.raises(ValueError, match=match):
        cfg(tmp_path, **kw).resolve(cuda=cuda)


def test_offload_moves_adams_share_of_the_card_to_the_host():
    c = memory.param_counts(B4)                           # stage 1.5 trains everything
    n = c["llm_layer"] * B4.llm.num_layers + c["embedding"] + c["output"] + c["vit"] + c["projector"]
    on, off = memory.Layout(), memory.Layout(offload=1.0)
    # the card keeps bf16 weights and the fp32 gradient buffer; the host the fp32 master copy, both moments
    # and a pinned copy of the gradient
    assert memory.state_bytes(B4, "all", on) == pytest.approx(18 * n)
    assert memory.state_bytes(B4, "all", off) == pytest.approx(6 * n)
    assert memory.host_bytes(B4, "all", off) == pytest.approx(16 * n)
    assert memory.host_bytes(B4, "all", on) == 0
    half = memory.Layout(offload=0.5, dp=2)              # the distributed optimizer's shard, half of it offloaded
    assert memory.state_bytes(B4, "all", half) == pytest.approx((6 + 12 * 0.5 / 2) * n)


def _auto(tmp_path, gib, **kw):
    c = cfg(tmp_path, recompute="auto", **kw)._device_defaults(cuda=True)
    lines = []
    out, choice = memory.resolve_auto(c, B4, "all", {"tp": 1, "pp": 1, "cp": 1, "dp": 1}, 8192, 8192 * 190.0, gib,
                                      log=lines.append)
    return out, choice, lines


def test_auto_offloads_the_4b_stage_15_on_an_80gb_card_and_says_so(tmp_path):
    h100 = memory.CARDS["h100"]
    with pytest.raises(ValueError, match="more than this GPU's 79.2 GiB"):
        _auto(tmp_path, h100, optimizer_offload=0.0)      # without offload: refused, as before
    out, choice, lines = _auto(tmp_path, h100)
    assert 0 < out.optimizer_offload <= 1 and choice.fits
    assert out.optimizer_offload in (0.25, 0.5, 0.75, 1.0)
    lay = memory.Layout(offload=out.optimizer_offload)
    assert memory.state_bytes(B4, "all", lay) / memory.GIB < h100
    assert len(lines) == 1 and lines[0].startswith(f"optimizer offload {out.optimizer_offload:.0%}")
    # the least share that fits: one step less does not
    less = out.optimizer_offload - 0.25
    if less > 0:
        with pytest.raises(ValueError):
            _auto(tmp_path, h100, optimizer_offload=less)
    # a card that holds it keeps the optimizer on the GPU
    out, _, lines = _auto(tmp_path, memory.CARDS["h200"])
    assert out.optimizer_offload == 0.0 and lines == []


def test_plan_lists_the_offloaded_layout_on_one_80gb_card(capsys):
    from pretrain.plan import main

    assert main(["--recipe", "llava-ov-1.5-4b", "--stage", "1.5", "--gpus", "1xH100", "--steps", "10",
                 "--global-batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "offload" in out and "host" in out


@pytest.mark.gpu
def test_offloaded_losses_match_the_gpu_optimizer(megatron_single, conversation_run, tmp_path):
    """3 steps of the tiny recipe with the whole optimizer on the host against the same run with it on the
    GPU: the same AdamW arithmetic in fp32 on another device, so the losses agree to bf16 noise."""
    from pretrain.train import train

    run, _ = conversation_run
    kw = dict(recipe="tiny", stage="1.5", steps=3, micro_batch=1, lr=3e-3, data="pack-conv",
              distributed_optimizer=True, bf16=True)
    losses = {}
    for f in (0.0, 1.0):
        d = tmp_path / str(f)
        shutil.copytree(run, d)
        losses[f] = [m["loss"] for m in train(TrainConfig(run_dir=d, optimizer_offload=f, **kw),
                                              log=lambda *_: None)["metrics"]]
    print(f"\noffload 0 {losses[0.0]}\noffload 1 {losses[1.0]}")
    assert losses[0.0][0] == losses[1.0][0]            # before any update: the same model and data
    assert max(abs(a - b) / abs(b) for a, b in zip(losses[1.0], losses[0.0])) < 2e-2
