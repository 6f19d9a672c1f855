"""A dist checkpoint saved at TP=2 (two gloo processes under torchrun) loads into TP=1 (resharded) with the
same loss on the same batch. (TP=2 training equal to one process, step by step, and TP=1 → TP=2 resharding
with the Adam state are ``test_parallel_parity.py``'s.)"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TP_CHECK = Path(__file__).with_name("tp_check.py")   # the ranks' entry point, run by path


@pytest.mark.slow
def test_a_tp2_checkpoint_loads_resharded_at_tp1(packed_demo, tmp_path):
    run = packed_demo
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    ck = tmp_path / "ckpt-tp2"
    for n, name, extra in ((2, "tp2", ["--save", str(ck)]), (1, "resharded", ["--seed", "7", "--load", str(ck)])):
        subprocess.run([*torchrun, f"--nproc-per-node={n}", str(TP_CHECK), "--run-dir", str(run),
                        "--out", str(tmp_path / f"{name}.json"), *extra], check=True, env=env, timeout=300,
                       capture_output=True)
    two = json.loads((tmp_path / "tp2.json").read_text())
    assert two["tp"] == 2
    resharded = json.loads((tmp_path / "resharded.json").read_text())
    assert resharded["tp"] == 1 and abs(resharded["loss"] - two["loss"]) <= 1e-5
    assert abs(resharded["loss_before_load"] - two["loss"]) > 1e-4      # the load did the work, not the seed
