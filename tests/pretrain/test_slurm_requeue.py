"""Slurm requeue end to end on the loopback cluster (tests/slurm_cluster.py): `ovpipe pretrain --executor
slurm` submits a short stage, `scontrol requeue` kills it mid-run (SIGTERM, then SIGKILL after KillWait),
Slurm starts it again, and it resumes from its last checkpoint and ends with an uninterrupted run's
losses, bit for bit (CPU, fp32)."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from slurm_cluster import SlurmCluster  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow]   # Slurm: tests/conftest.py NEEDS

STEPS = 8
ARGS = ["--recipe", "tiny", "--stage", "1.5", "--init", "scratch", "--steps", str(STEPS), "--micro-batch", "1",
        "--lr", "0.003", "--save-every", "2"]


def _losses(run):
    from ovpipe.summary import stage_metrics   # the last record per step: a step replayed after the requeue once

    return [(m["loss"], m["grad_norm"]) for m in stage_metrics(run / "pretrain" / "stage-1.5" / "metrics.jsonl")]


def _wait(cond, timeout, what, info=lambda: ""):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if cond():
            return
        time.sleep(0.5)
    raise TimeoutError(f"no {what} after {timeout}s\n{info()}")


# Two nodes only: one job script (render_distributed_job) serves any node count, and the two-node job runs all of
# it that one node does — the USR1 forwarded by srun, the save, the requeue, the resume — plus the rendezvous
# across nodes; `nodes=1` is the same test at a minute more of the suite (pytest -k "requeue" after adding it).
@pytest.mark.parametrize("nodes", [2])
def test_requeue_resumes_from_the_last_checkpoint(packed_demo, tmp_path, monkeypatch, capsys, nodes):
    """Two loopback nodes with one CPU rank each (DP=2 at the same global batch, against two local
    processes)."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    shutil.copytree(packed_demo, ref)
    shutil.copytree(packed_demo, run)
    args = [*ARGS, "--global-batch", "2"] if nodes == 2 else ARGS
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the uninterrupted run, locally, beside the Slurm one (whose time is mostly the requeue's waits)
    local = subprocess.Popen([sys.executable, "-m", "ovpipe.cli", "pretrain", *args, "--run-dir", str(ref), "--nproc",
                              str(nodes)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True)
    try:
        _on_slurm(args, run, nodes, monkeypatch, capsys)
    except BaseException:
        os.killpg(local.pid, signal.SIGKILL)                # a failed test leaves no rank behind
        local.wait()
        raise
    _, err = local.communicate(timeout=600)
    assert local.returncode == 0, err[-3000:]
    assert _losses(run) == _losses(ref)                              # the same stage, bit for bit
    assert len(_losses(run)) == STEPS


def _on_slurm(args, run, nodes, monkeypatch, capsys):
    """The stage submitted, requeued after its step-2 checkpoint, and resumed from it."""
    from ovpipe.cli import main
    from pretrain.trainer import checkpoint

    with SlurmCluster(nodes=nodes, cpus=2 if nodes == 2 else 4) as slurm:
        env = {**os.environ, **slurm.env}
        monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        capsys.readouterr()
        assert main(["pretrain", *args, "--run-dir", str(run), "--executor", "slurm", "--nodes", str(nodes),
                     "--gpus-per-node", "0", "--tasks-per-node", "1", "--slurm-time", "00:20:00"]) == 0
        out = capsys.readouterr().out
        job = re.search(r"submitted map (\d+)", out).group(1)
        sdir = run / "pretrain" / "stage-1.5"

        def log():
            return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((sdir / "logs").glob("*")))

        ckpts = sdir / "dist_ckpt"
        _wait(lambda: (checkpoint.newest(ckpts, log=None) or (0,))[0] >= 2 and
              (sdir / "metrics.jsonl").exists() and len((sdir / "metrics.jsonl").read_text().splitlines()) >= 3,
              600, "checkpoint at step 2", log)
        at = checkpoint.newest(ckpts, log=None)[0]
        subprocess.run(["scontrol", "requeue", job], env=env, check=True)
        # slurmctld holds a requeued batch job back (its BeginTime) for about two minutes; let it start
        # as soon as the old allocation is gone, as an operator would with the same command.
        _wait(lambda: subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env,
                                     capture_output=True).returncode == 0 and
              "PENDING" in subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True,
                                          text=True).stdout, 120, "requeued job pending", log)
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, capture_output=True)
        _wait(lambda: (sdir / "completions" / "finalized").exists(), 900, "finished stage after the requeue", log)
        _wait(lambda: subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True,
                                     text=True).stdout.strip() == "", 60, "job gone from the queue", log)
    text = "\n".join(p.read_text(errors="replace") for p in sorted((sdir / "logs").glob("*")))   # whole logs
    resumed = [int(x) for x in re.findall(r"resuming at step (\d+)", text)]
    assert resumed and resumed[0] >= at >= 2, text                   # from its last checkpoint, not from scratch
