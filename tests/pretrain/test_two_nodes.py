"""A two-node launch, tried: `ovpipe pretrain --executor slurm --nodes 2` on a loopback cluster of two slurmd
nodes (node1, node2, both on 127.0.0.1: `SlurmCluster(nodes=2)`), CPU ranks, one per node. The job is the
core's distributed job — srun starts rank 0 on node1 and rank 1 on node2, the rendezvous at node1's address —
and its losses are the same, bit for bit, as the same two ranks started by torchrun on one machine."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from slurm_cluster import SlurmCluster  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow]   # Slurm: tests/conftest.py NEEDS

ARGS = ["--recipe", "tiny", "--stage", "1.5", "--init", "scratch", "--steps", "3", "--micro-batch", "1",
        "--global-batch", "2", "--lr", "0.003"]


def _losses(run):
    from ovpipe.summary import stage_metrics

    return [(m["loss"], m["grad_norm"], m["lr"]) for m in stage_metrics(run / "pretrain" / "stage-1.5" / "metrics.jsonl")]


def test_two_nodes_match_two_local_processes(packed_demo, tmp_path, monkeypatch, capsys):
    import json

    from ovpipe.cli import main

    local, nodes = tmp_path / "local", tmp_path / "nodes"
    shutil.copytree(packed_demo, local)
    shutil.copytree(packed_demo, nodes)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "ovpipe.cli", "pretrain", *ARGS, "--run-dir", str(local),
                          "--nproc", "2"], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    with SlurmCluster(nodes=2, cpus=2) as slurm:
        monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert main(["pretrain", *ARGS, "--run-dir", str(nodes), "--executor", "slurm", "--nodes", "2",
                     "--gpus-per-node", "0", "--tasks-per-node", "1", "--slurm-time", "00:20:00", "--wait"]) == 0
        sdir = nodes / "pretrain" / "stage-1.5"
        script = (sdir / "launch_script.slurm").read_text()
        assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script
        # rank 0 on node1, rank 1 on node2: each process says where it ran
        assert "on node1" in (sdir / "logs" / "task_00000.log").read_text()
        assert "process 1 of 2 on node2" in (sdir / "logs" / "process_00001.log").read_text()
    stage = json.loads((sdir / "stage.json").read_text())
    assert (stage["dp"], stage["tp"]) == (2, 1)
    assert (sdir / "completions" / "finalized").exists()
    assert _losses(nodes) == _losses(local) and len(_losses(nodes)) == 3       # bit for bit
