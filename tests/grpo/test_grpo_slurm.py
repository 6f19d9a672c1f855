"""`ovpipe grpo` at two ranks: on the loopback Slurm cluster (two slurmd nodes on 127.0.0.1, one CPU rank each,
srun starting them, the rendezvous at node1), and under torchrun on this machine beside it. accelerate runs DDP
over gloo; each rank takes half of every generation batch — one whole group of 8 rollouts (TRL's RepeatSampler
yields a prompt's rollouts together and accelerate hands rank r the r-th half). Shuffle-R1 is on: each rank keeps
2 of its group's 4 pairs and trains on those 4 rows only (the reshaper refuses a buffer that splits a group); the
metrics rank 0 writes are the whole batch's, summed over both ranks. Both runs write one metrics manifest and one
model from rank 0, and their metrics are equal."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from demo.word_lm import word_lm, write_split  # noqa: E402
from slurm_cluster import SlurmCluster  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow]   # Slurm: tests/conftest.py NEEDS

ROWS = [{"question": "say yes", "answer": "yes"}, {"question": "say no", "answer": "no"}] * 2
ARGS = ["--set", "steps=2", "--set", "batch_size=16", "--set", "num_generations=8", "--set", "micro_batch=4",
        "--set", "max_completion_length=1", "--set", "learning_rate=0.05", "--set", "save_every=100",
        "--set", "stages=[answer_only]", "--set", "reward_workers=1", "--set", "cpu_threads=1",
        "--set", "shuffle_r1={alpha: 0.5, S: 2}"]
COLS = ["step", "reward_mean", "loss", "grad_norm", "token_utilization", "zero_std_group_share",
        "small_advantage_share", "extras"]
RESHAPE = ["reshape_rows_in", "reshape_rows_out", "reshape_pairs_kept", "reshape_S", "reshape_T",
           "reshape_processes", "reshape_token_utilization", "reshape_small_advantage_share",
           "reshape_token_utilization_in", "reshape_small_advantage_share_in"]


def _metrics(run):
    import pyarrow.parquet as pq

    rows = pq.read_table(next((run / "grpo" / "grpo_metrics").glob("part-*.parquet")), columns=COLS).to_pylist()
    for r in rows:                  # the reshaper's figures (extras' reshape_*), not the step's wall times
        extras = json.loads(r.pop("extras"))
        r.update({k: extras.get(k) for k in RESHAPE})
    return rows


def test_two_ranks_on_slurm_and_under_torchrun_train_alike(tmp_path):
    lm = word_lm(tmp_path / "lm")
    local, slurm_run = tmp_path / "local", tmp_path / "slurm"
    for run in (local, slurm_run):
        write_split(run, "stage1-answer-only", ROWS)
    cmd = [sys.executable, "-m", "ovpipe.cli", "grpo", "--set", f"model={lm}", *ARGS, "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    beside = subprocess.Popen([*cmd, "--run-dir", str(local), "--nproc", "2"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        with SlurmCluster(nodes=2, cpus=2) as slurm:
            r = subprocess.run([*cmd, "--run-dir", str(slurm_run), "--executor", "slurm", "--nodes", "2",
                                "--gpus-per-node", "0", "--tasks-per-node", "1", "--slurm-time", "00:20:00",
                                "--wait"], env={**env, **slurm.env}, capture_output=True, text=True, timeout=900)
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
            script = (slurm_run / "grpo" / "launch_script.slurm").read_text()
            assert "--nodes=2" in script and "srun" in script
    finally:
        out, _ = beside.communicate(timeout=900)
    assert beside.returncode == 0, out[-3000:]
    for run in (local, slurm_run):
        stats = json.loads((run / "grpo" / "stats.json").read_text())
        assert stats["info"]["world"] == 2 and stats["counters"]["steps"] == 2, stats
        assert (run / "grpo" / "model" / "config.json").exists()
    assert _metrics(slurm_run) == _metrics(local)
    assert [m["step"] for m in _metrics(local)] == [1, 2]
    for m in _metrics(local):
        # 2 ranks × 8 generated (one group each) → 2 × 2 pairs kept, 4 rows a rank: each trained its kept rows only
        assert (m["reshape_rows_in"], m["reshape_rows_out"], m["reshape_pairs_kept"], m["reshape_S"], m["reshape_T"],
                m["reshape_processes"]) == (16, 8, 4, 2, 2, 2), m
        assert m["token_utilization"] == m["reshape_token_utilization"] is not None
        assert m["small_advantage_share"] == m["reshape_small_advantage_share"] is not None
        assert m["reshape_small_advantage_share"] <= m["reshape_small_advantage_share_in"]
