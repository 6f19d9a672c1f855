"""Resume with megatron's distributed optimizer on a GPU (no Transformer Engine / Apex: torch AdamW,
whose per-parameter ``step`` megatron-core 0.19.2 drops at load — ``pretrain.trainer.checkpoint.adam_step_per_parameter``
gives it back). A run stopped after step k and resumed continues with the uninterrupted run's losses
and grad norms: bit for bit in fp32, within bf16 noise in bf16."""
import shutil

import pytest

STEPS, K = 6, 3


@pytest.mark.gpu
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_resume_with_the_distributed_optimizer(megatron_single, conversation_run, tmp_path, bf16):
    from pretrain.train import train
    from pretrain.trainer.config import TrainConfig

    run, _ = conversation_run
    kw = dict(recipe="tiny", stage="1.5", steps=STEPS, micro_batch=1, lr=3e-3, data="pack-conv",
              distributed_optimizer=True, bf16=bf16)
    quiet = (lambda *_: None)
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(run, a)
    shutil.copytree(run, b)
    full = train(TrainConfig(run_dir=a, **kw), log=quiet)["metrics"]
    first = train(TrainConfig(run_dir=b, stop_after=K, **kw), log=quiet)     # killed after step K, checkpointed
    assert [m["step"] for m in first["metrics"]] == list(range(1, K + 1))
    rest = train(TrainConfig(run_dir=b, **kw), log=quiet)["metrics"]         # KeyError: 'step' here before the fix
    assert [m["step"] for m in rest] == list(range(K + 1, STEPS + 1))
    got = [(m["loss"], m["grad_norm"]) for m in rest]
    want = [(m["loss"], m["grad_norm"]) for m in full[K:]]
    worst = max(max(abs(g - w) / abs(w) for g, w in zip(gp, wp)) for gp, wp in zip(got, want))
    print(f"\nresume {'bf16' if bf16 else 'fp32'} + distributed optimizer: steps {K + 1}..{STEPS} "
          f"max relative difference of loss / grad norm {worst:.3e}\n  resumed {got}\n  full    {want}")
    if bf16:
        assert worst < 2e-2            # bf16 noise (8 mantissa bits); a wrong Adam step count gives more
    else:
        assert got == want


@pytest.mark.gpu
def test_megatron_alone_loses_the_adam_step(megatron_single, conversation_run, tmp_path, monkeypatch):
    """The reason for the fix, kept as a canary: without it megatron-core's load raises
    ``KeyError: 'step'``. When an upgrade makes this fail, the fix can go (docs/pretrain.md)."""
    import contextlib

    from pretrain.trainer import checkpoint
    from pretrain.train import train
    from pretrain.trainer.config import TrainConfig

    run, _ = conversation_run
    b = tmp_path / "b"
    shutil.copytree(run, b)
    kw = dict(run_dir=b, recipe="tiny", stage="1.5", steps=STEPS, micro_batch=1, lr=3e-3, data="pack-conv",
              distributed_optimizer=True, bf16=True)
    train(TrainConfig(stop_after=K, **kw), log=lambda *_: None)
    monkeypatch.setattr(checkpoint, "adam_step_per_parameter", lambda opt: contextlib.nullcontext())
    with pytest.raises(KeyError, match="step"):
        train(TrainConfig(**kw), log=lambda *_: None)
