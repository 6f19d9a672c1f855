import subprocess

from ovpipe.cli import main
from pretrain.slurm import render_pretrain_sbatch


def test_sbatch_script(tmp_path):
    s = render_pretrain_sbatch(tmp_path, "llava-ov-1.5-8b", "1.5", nodes=16, gpus_per_node=8, steps=1000,
                               partition="gpu", python="/opt/py")
    lines = s.splitlines()
    for want in ("#SBATCH --nodes=16", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --requeue", "#SBATCH --partition=gpu", "#SBATCH --signal=B:USR1@300", "trap forward USR1"):
        assert want in lines
    cmd = next(l for l in lines if l.startswith("srun"))
    # srun starts the ranks itself, so its forwarded USR1 reaches them (no launcher between to die of it)
    assert "RANK=$SLURM_PROCID" in cmd and "WORLD_SIZE=$SLURM_NTASKS" in cmd and "exec /opt/py -m pretrain.train" in cmd
    assert "--stage 1.5" in cmd and "--recipe llava-ov-1.5-8b" in cmd
    assert any("scontrol requeue" in l for l in lines)
    subprocess.run(["bash", "-n", "-c", s], check=True)


def test_cli_writes_the_script(tmp_path, capsys):
    assert main(["pretrain", "--recipe", "tiny", "--stage", "2", "--run-dir", str(tmp_path), "--executor", "slurm",
                 "--nodes", "2", "--dry-run"]) == 0
    script = tmp_path / "pretrain" / "stage-2" / "launch_script.slurm"
    assert script.exists() and "#SBATCH --nodes=2" in script.read_text().splitlines()


def test_cli_passes_the_layout_and_rejects_bad_ones(tmp_path, capsys):
    import pytest

    assert main(["pretrain", "--recipe", "llava-ov-1.5-8b", "--stage", "1.5", "--run-dir", str(tmp_path),
                 "--executor", "slurm", "--nodes", "4", "--gpus-per-node", "8", "--tp", "4", "--pp", "2",
                 "--cp", "2", "--sequence-parallel", "--dry-run"]) == 0
    cmd = next(l for l in (tmp_path / "pretrain" / "stage-1.5" / "launch_script.slurm").read_text().splitlines()
               if l.startswith("srun"))
    assert "--tp 4 --pp 2 --cp 2" in cmd and "--sequence-parallel" in cmd
    with pytest.raises(SystemExit):           # 3 nodes × 8 GPUs is not a multiple of tp·pp·cp = 16
        main(["pretrain", "--recipe", "llava-ov-1.5-8b", "--stage", "1.5", "--run-dir", str(tmp_path),
              "--executor", "slurm", "--nodes", "3", "--tp", "4", "--pp", "2", "--cp", "2", "--dry-run"])
    assert "world_size=24" in capsys.readouterr().err


def test_cli_epochs_and_data(tmp_path, capsys):
    """--epochs / --data reach the trainer's command line; --steps with --epochs is refused, naming both."""
    import pytest

    assert main(["pretrain", "--recipe", "tiny", "--stage", "2", "--run-dir", str(tmp_path), "--executor", "slurm",
                 "--epochs", "1.5", "--data", "pack-mix", "--dry-run"]) == 0
    cmd = next(l for l in (tmp_path / "pretrain" / "stage-2" / "launch_script.slurm").read_text().splitlines()
               if l.startswith("srun"))
    assert "--epochs 1.5" in cmd and "--steps" not in cmd and "--data pack-mix" in cmd
    from pretrain.train import main as train_main

    both = ["--stage", "2", "--run-dir", str(tmp_path), "--steps", "3", "--epochs", "1"]
    for entry in (lambda: main(["pretrain", *both]), lambda: train_main(both)):
        with pytest.raises(SystemExit):
            entry()
        err = capsys.readouterr().err
        assert "--epochs" in err and "--steps" in err


def test_cli_global_batch_reaches_the_trainer_and_must_split_over_dp(tmp_path, capsys):
    """--global-batch goes to every rank as is (each folds it into its grad_accum at its DP size); one the
    job's DP size cannot split is refused before the script is written."""
    import pytest

    assert main(["pretrain", "--recipe", "tiny", "--stage", "1.5", "--run-dir", str(tmp_path), "--executor", "slurm",
                 "--nodes", "2", "--gpus-per-node", "8", "--micro-batch", "1", "--global-batch", "64",
                 "--dry-run"]) == 0
    cmd = next(l for l in (tmp_path / "pretrain" / "stage-1.5" / "launch_script.slurm").read_text().splitlines()
               if l.startswith("srun"))
    assert "--global-batch 64" in cmd and "--grad-accum" not in cmd
    with pytest.raises(SystemExit):            # 16 DP ranks × 1 pack does not divide 24
        main(["pretrain", "--recipe", "tiny", "--stage", "1.5", "--run-dir", str(tmp_path / "b"), "--executor",
              "slurm", "--nodes", "2", "--gpus-per-node", "8", "--micro-batch", "1", "--global-batch", "24",
              "--dry-run"])
    assert "micro_batch × dp = 1 × 16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["pretrain", "--stage", "1.5", "--run-dir", str(tmp_path / "c"), "--grad-accum", "2",
              "--global-batch", "8"])
