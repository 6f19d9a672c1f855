"""TP=2 (two gloo processes under torchrun) gives the TP=1 loss on the same batch."""
import json
import os
import shutil
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_tp2_matches_tp1(packed_demo, tmp_path):
    run = packed_demo
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    for n in (1, 2):
        subprocess.run([*torchrun, f"--nproc-per-node={n}", "-m", "pretrain.tp_check", "--run-dir", str(run),
                        "--out", str(tmp_path / f"tp{n}.json")], check=True, env=env, timeout=300,
                       capture_output=True)
    one = json.loads((tmp_path / "tp1.json").read_text())
    two = json.loads((tmp_path / "tp2.json").read_text())
    assert (one["tp"], two["tp"]) == (1, 2)
    assert abs(one["loss"] - two["loss"]) <= 1e-5
    assert abs(one["projector_grad_norm"] - two["projector_grad_norm"]) <= 1e-4 * max(1.0, one["projector_grad_norm"])
