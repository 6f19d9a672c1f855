"""The sbatch script for a pretrain stage on N nodes × G GPUs: ``srun`` starts one ``torchrun`` per
node, which rendezvous through the first node of the allocation (c10d); the stage resumes from its
latest checkpoint, so a requeue (``--signal=B:USR1@…`` → ``scontrol requeue``) continues where it
stopped.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path


def render_pretrain_sbatch(run_dir: Path, recipe: str, stage: str, nodes: int, gpus_per_node: int, steps: int,
                           partition: str | None = None, time: str = "48:00:00", extra: list[str] | None = None,
                           python: str | None = None, port: int = 29500, train_args: list[str] | None = None) -> str:
    python = python or sys.executable
    run_dir = Path(run_dir).resolve()
    logs = run_dir / "pretrain" / f"stage-{stage}"
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name=ovpipe-pretrain-{recipe}-s{stage}",
             f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1",
             f"#SBATCH --gpus-per-node={gpus_per_node}",
             f"#SBATCH --time={time}",
             f"#SBATCH --output={logs}/slurm-%j.out",
             "#SBATCH --open-mode=append",
             "#SBATCH --signal=B:USR1@300",
             "#SBATCH --requeue"]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += [f"#SBATCH {x}" for x in extra or []]
    lines += ["",
              "set -uo pipefail",
              'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              "export MASTER_ADDR",
              f"export MASTER_PORT={port}",
              "export CUDA_DEVICE_MAX_CONNECTIONS=1   # megatron-core: ordered TP comm/compute overlap",
              "requeue() { scontrol requeue \"$SLURM_JOB_ID\"; exit 0; }",
              "trap requeue USR1",
              f"srun --kill-on-bad-exit=1 {shlex.quote(python)} -m torch.distributed.run "
              f"--nnodes={nodes} --nproc-per-node={gpus_per_node} --rdzv-backend=c10d "
              f'--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" '
              f"-m pretrain.train --run-dir {shlex.quote(str(run_dir))} --recipe {recipe} --stage {stage} "
              f"--steps {steps} --save-every 100 {' '.join(shlex.quote(x) for x in train_args or [])} &",
              "wait $!",
              ""]
    return "\n".join(lines)
