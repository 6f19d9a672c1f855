"""The trainer's config fails before any work, naming the field; device defaults resolve per device."""
import pytest


@pytest.mark.parametrize("bad, match", [
    ({"micro_batch": 0}, "micro_batch must be >= 1, got 0"),
    ({"grad_accum": 1.5}, "grad_accum must be an integer, got 1.5"),
    ({"steps": None}, "give exactly one of steps and epochs"),
    ({"epochs": 1.0}, "give exactly one of steps and epochs"),
    ({"recipe": "tiny2"}, "recipe must be one of"),
    ({"stage": "3"}, "stage must be one of"),
    ({"recompute": "some"}, "recompute must be one of"),
    ({"data": "../pack"}, "data must be a step folder name"),
    ({"lr": -1e-3}, "lr must be >= 0"),
    ({"peak_tflops": 0.0}, "peak_tflops must be > 0"),
    ({"save_every_minutes": float("nan")}, "save_every_minutes must be a finite number"),
    ({"sequence_parallel": "yes"}, "sequence_parallel must be true or false"),
    ({"global_batch": 0}, "global_batch must be >= 1, got 0"),
    ({"global_batch": 8, "grad_accum": 2}, "give grad_accum or global_batch, not both"),
    ({"global_batch": 7, "micro_batch": 2}, "global_batch must be a multiple of micro_batch"),
])
def test_a_wrong_value_names_the_field(bad, match, tmp_path):
    from pretrain.trainer.config import TrainConfig

    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        TrainConfig(**{"run_dir": tmp_path, "stage": "1.5", "steps": 3, **bad})


def test_device_defaults_resolve(tmp_path):
    from pretrain.trainer.config import TrainConfig

    cfg = TrainConfig(run_dir=str(tmp_path), stage="1.5", steps=3)
    cpu, gpu = cfg.resolve(cuda=False), cfg.resolve(cuda=True)
    assert cpu.run_dir == tmp_path and (cpu.data, cpu.lr) == ("pack", 1e-5)
    assert (cpu.bf16, cpu.recompute, cpu.loader_workers, cpu.distributed_optimizer) == (False, "none", 0, True)
    assert (gpu.bf16, gpu.recompute, gpu.loader_workers, gpu.distributed_optimizer) == (True, "auto", 4, True)
    assert cfg.resolve(cuda=False) == cpu and TrainConfig(run_dir=tmp_path, stage="1", steps=1, lr=0.0,
                                                          recompute="full").resolve(cuda=False).recompute == "full"


def test_a_global_batch_sets_grad_accum_per_dp_size(tmp_path):
    from pretrain.trainer.config import TrainConfig

    cfg = TrainConfig(run_dir=tmp_path, stage="1.5", steps=3, micro_batch=2, global_batch=16)
    assert [cfg.resolve(False, world=dp).grad_accum for dp in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert cfg.resolve(False, world=8).global_batch is None          # folded into grad_accum, once
    with pytest.raises(ValueError, match=r"global_batch=16 is not a multiple of micro_batch × dp = 2 × 3"):
        cfg.resolve(False, world=3)
    plain = TrainConfig(run_dir=tmp_path, stage="1.5", steps=3, grad_accum=3)
    assert plain.resolve(False, world=8).grad_accum == 3


def test_the_cli_refuses_before_any_work(tmp_path, capsys):
    from pretrain.train import main

    with pytest.raises(SystemExit) as e:
        main(["--run-dir", str(tmp_path / "run"), "--stage", "1.5", "--micro-batch", "0"])
    assert e.value.code == 2 and "micro_batch must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
