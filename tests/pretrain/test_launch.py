"""`ovpipe pretrain` as a step of the core: its Slurm job script (the core's distributed job: N nodes × T
processes, srun starting each rank of `ovpipe _task pretrain`), the layout checked before anything starts,
the layout kept out of the config hash, and the declared start of a stage."""
import json
import subprocess

import pytest

from ovpipe.cli import main
from ovpipe.executors.slurm import SlurmOptions, render_distributed_job


def test_the_distributed_job_script(tmp_path):
    opts = SlurmOptions(partition="gpu", nodes=16, tasks_per_node=8, gpus_per_node=8, requeue_grace_s=300)
    s = render_distributed_job("pretrain", tmp_path, opts, python="/opt/py", name="pretrain/stage-1.5",
                               after=["41"])
    lines = s.splitlines()
    for want in ("#SBATCH --nodes=16", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --requeue", "#SBATCH --partition=gpu", "#SBATCH --signal=B:USR1@300", "trap forward USR1",
                 "#SBATCH --dependency=afterok:41"):
        assert want in lines
    cmd = next(ln for ln in lines if ln.startswith("srun"))
    # srun starts the ranks itself, so its forwarded USR1 reaches them (no launcher between to die of it)
    assert "RANK=$SLURM_PROCID" in cmd and "WORLD_SIZE=$SLURM_NTASKS" in cmd
    assert "exec /opt/py -m ovpipe.cli _task pretrain" in cmd and "--name pretrain/stage-1.5" in cmd
    assert any("scontrol requeue" in ln for ln in lines)
    subprocess.run(["bash", "-n", "-c", s], check=True)


def test_cli_writes_the_script(tmp_path, capsys):
    assert main(["pretrain", "--recipe", "tiny", "--stage", "2", "--run-dir", str(tmp_path), "--executor", "slurm",
                 "--nodes", "2", "--dry-run"]) == 0
    script = tmp_path / "pretrain" / "stage-2" / "launch_script.slurm"
    assert script.exists() and "#SBATCH --nodes=2" in script.read_text().splitlines()
    assert not (tmp_path / "pretrain" / "stage-2" / "executor.json").exists()      # a dry run prepares nothing


def test_cli_rejects_bad_layouts_before_anything(tmp_path, capsys):
    assert main(["pretrain", "--recipe", "llava-ov-1.5-8b", "--stage", "1.5", "--run-dir", str(tmp_path),
                 "--executor", "slurm", "--nodes", "4", "--gpus-per-node", "8", "--tp", "4", "--pp", "2",
                 "--cp", "2", "--sequence-parallel", "--dry-run"]) == 0
    with pytest.raises(SystemExit):           # 3 nodes × 8 GPUs is not a multiple of tp·pp·cp = 16
        main(["pretrain", "--recipe", "llava-ov-1.5-8b", "--stage", "1.5", "--run-dir", str(tmp_path),
              "--executor", "slurm", "--nodes", "3", "--tp", "4", "--pp", "2", "--cp", "2", "--dry-run"])
    assert "world_size=24" in capsys.readouterr().err
    with pytest.raises(SystemExit):            # 16 DP ranks × 1 pack does not divide 24
        main(["pretrain", "--recipe", "tiny", "--stage", "1.5", "--run-dir", str(tmp_path / "b"), "--executor",
              "slurm", "--nodes", "2", "--gpus-per-node", "8", "--micro-batch", "1", "--global-batch", "24",
              "--dry-run"])
    assert "micro_batch × dp = 1 × 16" in capsys.readouterr().err
    both = ["--stage", "2", "--run-dir", str(tmp_path), "--steps", "3", "--epochs", "1"]
    from pretrain.train import main as train_main

    for entry in (lambda: main(["pretrain", *both]), lambda: train_main(both)):
        with pytest.raises(SystemExit):
            entry()
        err = capsys.readouterr().err
        assert "--epochs" in err and "--steps" in err
    with pytest.raises(SystemExit):
        main(["pretrain", "--stage", "1.5", "--run-dir", str(tmp_path / "c"), "--grad-accum", "2",
              "--global-batch", "8"])


def test_the_layout_is_saved_but_not_hashed():
    """A stage resumes at another layout (checkpoints reshard): tp/pp/cp, kernels and the save cadence are in
    config.json but not in the config hash; what changes the result is."""
    from ovpipe.config import config_hash, config_json
    from pretrain.stage import StageConfig

    a = StageConfig(stage="1.5", steps=4, init="scratch")
    b = StageConfig(stage="1.5", steps=4, init="scratch", tp=2, cp=2, kernels="eager", save_every=1)
    assert config_hash(a) == config_hash(b) and json.loads(config_json(b))["tp"] == 2
    assert config_hash(a) != config_hash(StageConfig(stage="1.5", steps=4, init="scratch", lr=1e-3))
    assert StageConfig(stage="2").start_from == "pretrain/stage-1.5" and StageConfig(stage="1").data == "pack-align"


def test_a_stage_without_its_start_refuses_naming_it(tmp_path, capsys):
    """Stage 2 on a run with no stage 1.5 checkpoint: refused before any work, naming the folder and the ways on
    (train it, import into it, or --init scratch) — never a silent random initialisation."""
    (tmp_path / "pack-instruct").mkdir()
    assert main(["pretrain", "--stage", "2", "--run-dir", str(tmp_path), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "pretrain/stage-1.5" in err and "--init scratch" in err and "import-model" in err
    assert not (tmp_path / "pretrain" / "stage-2" / "executor.json").exists()


@pytest.mark.slow
def test_two_processes_through_the_step_match_one(megatron_single, packed_demo, tmp_path):
    """`ovpipe pretrain --nproc 2` goes through the core's local executor: torchrun starts two processes of
    `ovpipe _task pretrain` (gloo, DP=2 at the same global batch); process 0 keeps the markers and stats,
    process 1 its own log; the losses are the one-process run's (`--nproc 1`: the stage in the command's own
    process, here this one)."""
    import shutil
    import sys

    from ovpipe.summary import stage_metrics

    runs = {}
    for n in (1, 2):
        run = tmp_path / f"n{n}"
        shutil.copytree(packed_demo, run)
        args = ["pretrain", "--stage", "1.5", "--init", "scratch", "--steps", "2", "--micro-batch", "1",
                "--global-batch", "2", "--lr", "0.003", "--run-dir", str(run), "--nproc", str(n)]
        if n == 1:
            assert main(args) == 0
        else:
            res = subprocess.run([sys.executable, "-m", "ovpipe.cli", *args], capture_output=True, text=True,
                                 timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
            assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
        sdir = run / "pretrain" / "stage-1.5"
        assert (sdir / "completions" / "finalized").exists() and (sdir / "stats.json").exists()
        meta = json.loads((sdir / "executor.json").read_text())
        assert meta["step"] == "pretrain" and meta["tasks"] == 1
        runs[n] = [(m["loss"], m["grad_norm"]) for m in stage_metrics(sdir / "metrics.jsonl")]
    assert (tmp_path / "n2" / "pretrain" / "stage-1.5" / "logs" / "process_00001.log").exists()
    assert json.loads((tmp_path / "n2" / "pretrain" / "stage-1.5" / "stage.json").read_text())["dp"] == 2
    assert len(runs[2]) == 2 and all(abs(a[0] - b[0]) <= 1e-5 * abs(a[0]) for a, b in zip(runs[1], runs[2])), runs


def test_a_cluster_stage_saves_on_a_clock_by_default(tmp_path, capsys):
    """On Slurm a stage saves every 30 minutes unless told otherwise (a node lost without a signal costs at most
    that); locally the clock is off; an explicit --save-every-minutes wins. The dry run shows the config."""
    def dry(*extra):
        assert main(["pretrain", "--recipe", "llava-ov-1.5-8b", "--stage", "1.5", "--run-dir", str(tmp_path),
                     "--executor", "slurm", "--nodes", "16", "--dry-run", *extra]) == 0
        out = capsys.readouterr().out
        return json.loads(out[out.index("{"):])

    assert dry()["save_every_minutes"] == 30.0
    assert dry("--save-every-minutes", "0")["save_every_minutes"] == 0.0
    from pretrain.stage import StageConfig

    assert StageConfig(stage="1.5").save_every_minutes == 0.0
