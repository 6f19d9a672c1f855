"""The sbatch script for a pretrain stage on N nodes × G tasks (one per GPU; ``--gpus-per-node 0``:
CPU tasks). ``srun`` starts every rank itself (``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` from Slurm's
``SLURM_PROCID`` / ``SLURM_LOCALID`` / ``SLURM_NTASKS``; rendezvous at the first node), so a signal
reaches the training processes directly — no launcher in between that would die of it.

Pre-emption: ``--signal=B:USR1@300`` warns the batch shell 5 minutes before the time limit; its trap
forwards USR1 to ``srun``, which forwards it to every rank; the ranks agree to save at the end of the
current step and stop (``pretrain.checkpoint.SavePolicy``); the script then requeues the job
(``scontrol requeue``), which resumes from that checkpoint. A job requeued or pre-empted by Slurm
itself gets SIGTERM, handled the same way within Slurm's ``KillWait``; a kill that lands inside a save
leaves the previous checkpoint intact (the save is atomic).
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path


def render_pretrain_sbatch(run_dir: Path, recipe: str, stage: str, nodes: int, gpus_per_node: int, steps: int,
                           partition: str | None = None, time: str = "48:00:00", extra: list[str] | None = None,
                           python: str | None = None, port: int | None = None, train_args: list[str] | None = None,
                           tasks_per_node: int | None = None, signal_lead_s: int = 300) -> str:
    python = python or sys.executable
    run_dir = Path(run_dir).resolve()
    sdir = run_dir / "pretrain" / f"stage-{stage}"
    ntasks = tasks_per_node or gpus_per_node or 1
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name=ovpipe-pretrain-{recipe}-s{stage}",
             f"#SBATCH --nodes={nodes}",
             f"#SBATCH --ntasks-per-node={ntasks}"]
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    lines += [f"#SBATCH --time={time}",
              f"#SBATCH --output={sdir}/logs/slurm-%j.out",
              "#SBATCH --open-mode=append",
              f"#SBATCH --signal=B:USR1@{signal_lead_s}",
              "#SBATCH --requeue"]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += [f"#SBATCH {x}" for x in extra or []]
    train = (f"exec {shlex.quote(python)} -m pretrain.train --run-dir {shlex.quote(str(run_dir))} --recipe {recipe} "
             f"--stage {stage} --steps {steps} {' '.join(shlex.quote(x) for x in train_args or [])}").rstrip()
    rank_env = "export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS; "
    lines += ["",
              "set -uo pipefail",
              'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              "export MASTER_ADDR",
              # a port per job (two jobs may share a node): from the job id unless given
              f"export MASTER_PORT={port}" if port else "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
              "export CUDA_DEVICE_MAX_CONNECTIONS=1   # megatron-core: ordered TP comm/compute overlap",
              f"STAGE_DIR={shlex.quote(str(sdir))}",
              "preempted=0",
              "# USR1 (the time-limit warning): the ranks save at the end of this step and stop; then requeue",
              'forward() { preempted=1; kill -USR1 "$train" 2>/dev/null; }',
              "trap forward USR1",
              f"srun --kill-on-bad-exit=1 bash -c {shlex.quote(rank_env + train)} &",
              "train=$!",
              'wait "$train"; rc=$?',
              'while kill -0 "$train" 2>/dev/null; do wait "$train"; rc=$?; done   # a trap interrupts wait',
              'if [ "$preempted" = 1 ] && [ ! -e "$STAGE_DIR/completions/finalized" ]; then',
              '  scontrol requeue "$SLURM_JOB_ID"',
              "  exit 0",
              "fi",
              'exit "$rc"',
              ""]
    return "\n".join(lines)


def submit_stage(run_dir: Path, stage: str, script: Path, dependency: str | None = None) -> dict:
    """``sbatch`` the stage's script, ``afterok`` on the previous stage's job while that one is queued or
    running (and on ``dependency``); records the job in ``stage-<S>/slurm_jobs.json`` (``ovpipe status``
    shows its state) and returns that record."""
    import json
    import time as _time

    from ovpipe.executors.slurm import describe_jobs, sbatch
    from ovpipe.slurm_jobs import job_active
    from pretrain.recipes import PREVIOUS

    run_dir = Path(run_dir).resolve()
    sdir = run_dir / "pretrain" / f"stage-{stage}"
    after = [dependency] if dependency else []
    prev = run_dir / "pretrain" / f"stage-{PREVIOUS.get(stage, '')}" / "slurm_jobs.json"
    if prev.exists():
        job = json.loads(prev.read_text()).get("merge")
        if job and job_active(job):
            after.append(job)
    args = ([f"--dependency=afterok:{':'.join(after)}", "--kill-on-invalid-dep=yes"] if after else []) + [str(script)]
    job = sbatch(args)
    # one job: "merge" is the id later stages chain on, as for every ovpipe step
    record = {"stage": stage, "merge": job, "ranks": [0], "submitted_at": _time.time(),
              "chain": [{"phase": "train", "job": job, "after": after}]}
    tmp = sdir / ".slurm_jobs.json.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(sdir / "slurm_jobs.json")
    print(f"Submitted batch job {job}  (pretrain stage {stage}: {describe_jobs(record)})", flush=True)
    return record


def wait_stage(run_dir: Path, stage: str, record: dict) -> int:
    """Block until the stage's job ends (``SlurmExecutor.wait_for``); 1, naming its log, if it did not finish."""
    from ovpipe.executors.slurm import SlurmChainFailed, SlurmExecutor

    try:
        SlurmExecutor().wait_for(record, Path(run_dir).resolve() / "pretrain" / f"stage-{stage}")
    except SlurmChainFailed as e:
        print(f"ovpipe pretrain: {e}", file=sys.stderr)
        return 1
    return 0
