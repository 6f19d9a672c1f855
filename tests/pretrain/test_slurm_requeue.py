"""Training on Slurm end to end, on a loopback cluster of two slurmd nodes (node1, node2, both on 127.0.0.1:
``SlurmCluster(nodes=2)``), one CPU rank each. `ovpipe pretrain --executor slurm --nodes 2 --wait` submits a
short stage as the core's distributed job — srun starts rank 0 on node1 and rank 1 on node2, the rendezvous at
node1's address. After its step-2 checkpoint `scontrol requeue` kills it (SIGTERM, then SIGKILL after
KillWait), Slurm starts it again, and it resumes from its last checkpoint; the ``--wait`` rides through the
requeue and returns once the stage is done. Its losses equal, bit for bit (CPU, fp32), those of the same two
ranks started by torchrun on one machine without a break."""
import json
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
from slurm_cluster import SlurmCluster, release_requeued  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow]   # Slurm: tests/conftest.py NEEDS

STEPS = 8
ARGS = ["--recipe", "tiny", "--stage", "1.5", "--init", "scratch", "--steps", str(STEPS), "--micro-batch", "1",
        "--lr", "0.003", "--save-every", "2", "--global-batch", "2"]


def _losses(run):
    from ovpipe.summary import stage_metrics   # the last record per step: a step replayed after the requeue once

    return [(m["loss"], m["grad_norm"], m["lr"])
            for m in stage_metrics(run / "pretrain" / "stage-1.5" / "metrics.jsonl")]


def _wait(cond, timeout, what, info=lambda: ""):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if cond():
            return
        time.sleep(0.5)
    raise TimeoutError(f"no {what} after {timeout}s\n{info()}")


def _start(args, env):
    return subprocess.Popen([sys.executable, "-m", "ovpipe.cli", "pretrain", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def _stop(*procs):
    for p in procs:
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)        # a failed test leaves no rank or waiter behind
            p.wait()


def test_two_nodes_requeued_resume_and_match_two_local_processes(packed_demo, tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    shutil.copytree(packed_demo, ref)
    shutil.copytree(packed_demo, run)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the uninterrupted run, locally, beside the Slurm one (whose time is mostly the requeue's waits)
    local, submit = _start([*ARGS, "--run-dir", str(ref), "--nproc", "2"], env), None
    sdir = run / "pretrain" / "stage-1.5"
    try:
        with SlurmCluster(nodes=2, cpus=2) as slurm:
            env = {**env, **slurm.env}
            submit = _start([*ARGS, "--run-dir", str(run), "--executor", "slurm", "--nodes", "2", "--gpus-per-node",
                             "0", "--tasks-per-node", "1", "--slurm-time", "00:20:00", "--wait"], env)
            job, at = _requeue_after_step_2(sdir, env, submit)
            out, err = submit.communicate(timeout=900)
            assert submit.returncode == 0, out[-3000:] + err[-3000:]       # --wait: through the requeue, to the end
            assert f"submitted map {job}" in out
            assert subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True,
                                  text=True).stdout.strip() == ""           # it returned with nothing left queued
    except BaseException:
        _stop(local, submit)
        raise
    _, err = local.communicate(timeout=600)
    assert local.returncode == 0, err[-3000:]
    script = (sdir / "launch_script.slurm").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script
    # rank 0 on node1, rank 1 on node2: each process says where it ran
    assert "on node1" in (sdir / "logs" / "task_00000.log").read_text()
    assert "process 1 of 2 on node2" in (sdir / "logs" / "process_00001.log").read_text()
    stage = json.loads((sdir / "stage.json").read_text())
    assert (stage["dp"], stage["tp"]) == (2, 1)
    assert (sdir / "completions" / "finalized").exists()
    text = "\n".join(p.read_text(errors="replace") for p in sorted((sdir / "logs").glob("*")))   # whole logs
    resumed = [int(x) for x in re.findall(r"resuming at step (\d+)", text)]
    assert resumed and resumed[0] >= at >= 2, text                   # from its last checkpoint, not from scratch
    assert _losses(run) == _losses(ref) and len(_losses(run)) == STEPS       # the same stage, bit for bit


def _requeue_after_step_2(sdir: Path, env: dict, submit: subprocess.Popen) -> tuple[str, int]:
    """``scontrol requeue`` once the stage has a checkpoint at step 2 or later, then the requeued job started
    at once; returns the job id and the step of that checkpoint."""
    from pretrain.trainer import checkpoint

    def log():
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((sdir / "logs").glob("*")))

    jobs = sdir / "slurm_jobs.json"
    _wait(lambda: jobs.exists() or submit.poll() is not None, 120, "slurm_jobs.json")
    assert submit.poll() is None, submit.communicate()
    (job,) = [j["job"] for j in json.loads(jobs.read_text())["chain"] if j["phase"] == "map"]
    ckpts = sdir / "dist_ckpt"
    _wait(lambda: (checkpoint.newest(ckpts, log=None) or (0,))[0] >= 2 and
          (sdir / "metrics.jsonl").exists() and len((sdir / "metrics.jsonl").read_text().splitlines()) >= 3,
          600, "checkpoint at step 2", log)
    at = checkpoint.newest(ckpts, log=None)[0]
    subprocess.run(["scontrol", "requeue", job], env=env, check=True)
    release_requeued(job, env, info=log)
    return job, at
