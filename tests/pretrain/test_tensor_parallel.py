"""TP=2 (two gloo processes under torchrun) gives the TP=1 loss on the same batch; a dist checkpoint
saved at TP=2 loads into TP=1 (resharded) with the same loss."""
import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_tp2_matches_tp1(packed_demo, tmp_path):
    run = packed_demo
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    ck = tmp_path / "ckpt-tp2"
    for n, name, extra in ((1, "tp1", []), (2, "tp2", ["--save", str(ck)]), (1, "resharded", ["--seed", "7", "--load", str(ck)])):
        subprocess.run([*torchrun, f"--nproc-per-node={n}", "-m", "pretrain.tp_check", "--run-dir", str(run),
                        "--out", str(tmp_path / f"{name}.json"), *extra], check=True, env=env, timeout=300,
                       capture_output=True)
    one = json.loads((tmp_path / "tp1.json").read_text())
    two = json.loads((tmp_path / "tp2.json").read_text())
    assert (one["tp"], two["tp"]) == (1, 2)
    assert abs(one["loss"] - two["loss"]) <= 1e-5
    assert abs(one["projector_grad_norm"] - two["projector_grad_norm"]) <= 1e-4 * max(1.0, one["projector_grad_norm"])
    resharded = json.loads((tmp_path / "resharded.json").read_text())
    assert resharded["tp"] == 1 and abs(resharded["loss"] - two["loss"]) <= 1e-5
    assert abs(resharded["loss_before_load"] - two["loss"]) > 1e-4      # the load did the work, not the seed
