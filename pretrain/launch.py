"""``ovpipe pretrain``: run a stage locally (in-process for TP=1, ``torchrun`` for TP>1).

Work in progress: the Slurm launcher (``srun torchrun`` over N nodes) and PP/CP are not built yet.
"""
from __future__ import annotations

import argparse
import subprocess
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ovpipe pretrain")
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--stage", choices=["1", "1.5", "2"], required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--executor", choices=["local"], default="local")
    a = ap.parse_args(argv)
    args = ["--run-dir", a.run_dir, "--recipe", a.recipe, "--stage", a.stage, "--steps", str(a.steps),
            "--micro-batch", str(a.micro_batch)] + (["--lr", str(a.lr)] if a.lr is not None else [])
    if a.tp > 1:
        return subprocess.call(["torchrun", "--standalone", f"--nproc-per-node={a.tp}", "-m", "pretrain.train", *args])
    from pretrain.train import main as train_main

    return train_main(args)


if __name__ == "__main__":
    sys.exit(main())
