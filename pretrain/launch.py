"""``ovpipe pretrain``: run a stage locally (in-process for TP=1, ``torchrun`` for TP>1) or submit
it to Slurm (``srun`` + ``torchrun`` over N nodes × G GPUs, ``pretrain.slurm``)."""
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
    ap.add_argument("--executor", choices=["local", "slurm"], default="local")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--partition")
    ap.add_argument("--dry-run", action="store_true", help="slurm: write the script, do not submit")
    a = ap.parse_args(argv)
    args = ["--run-dir", a.run_dir, "--recipe", a.recipe, "--stage", a.stage, "--steps", str(a.steps),
            "--micro-batch", str(a.micro_batch)] + (["--lr", str(a.lr)] if a.lr is not None else [])
    if a.executor == "slurm":
        from pathlib import Path

        from pretrain.slurm import render_pretrain_sbatch

        out = Path(a.run_dir) / "pretrain" / f"stage-{a.stage}"
        out.mkdir(parents=True, exist_ok=True)
        script = out / "launch_script.slurm"
        script.write_text(render_pretrain_sbatch(Path(a.run_dir), a.recipe, a.stage, a.nodes, a.gpus_per_node,
                                                 a.steps, a.partition))
        print(script)
        return 0 if a.dry_run else subprocess.call(["sbatch", str(script)])
    if a.tp > 1:
        return subprocess.call(["torchrun", "--standalone", f"--nproc-per-node={a.tp}", "-m", "pretrain.train", *args])
    from pretrain.train import main as train_main

    return train_main(args)


if __name__ == "__main__":
    sys.exit(main())
