"""``ovpipe pretrain``: run a stage locally (in-process for one process, ``torchrun`` with
``--nproc`` processes otherwise: gloo on CPU, NCCL on GPU) or submit it to Slurm (``srun`` +
``torchrun`` over N nodes × G GPUs, ``pretrain.slurm``). The layout (TP/PP/CP, sequence parallel,
distributed optimizer) is validated against the recipe before anything starts; DP is what is left
of the world size. The stage follows the run folder's rules (``pretrain.stage_run``): the stage's
lock (``--wait-lock``), its inputs finalized and unchanged, its config unchanged unless ``--overwrite``."""
from __future__ import annotations

import argparse
import subprocess
import time
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ovpipe pretrain")
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--stage", choices=["1", "1.5", "2"], required=True)
    ap.add_argument("--run-dir", required=True)
    length = ap.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="optimizer steps (default 30)")
    length.add_argument("--epochs", type=float,
                        help="passes over the data step's packs: steps = "
                        "ceil(E × packs / global batch), global batch = micro_batch × grad_accum × dp")
    ap.add_argument("--data", help="pack step to read (default: the stage's: 1 pack-align, 1.5 pack, 2 pack-instruct)")
    ap.add_argument("--micro-batch", type=int, default=2)
    batch = ap.add_mutually_exclusive_group()
    batch.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step and DP rank")
    batch.add_argument("--global-batch", type=int, help="packs per optimizer step over all DP ranks (megatron's "
                       "--global-batch-size): grad_accum = global_batch / (micro_batch × dp)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--distributed-optimizer", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--nproc", type=int, help="local: processes (default tp·pp·cp)")
    ap.add_argument("--lr", type=float)
    ap.add_argument("--executor", choices=["local", "slurm"], default="local")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--partition")
    ap.add_argument("--tasks-per-node", type=int, help="slurm: ranks per node (default --gpus-per-node; "
                    "with --gpus-per-node 0, CPU ranks: 1)")
    ap.add_argument("--slurm-time", default="48:00:00")
    ap.add_argument("--dry-run", action="store_true", help="slurm: write the script, do not submit")
    ap.add_argument("--dependency", help="slurm: extra job id this stage must wait for (afterok); the previous "
                                         "stage's job, while queued or running, is added on its own")
    ap.add_argument("--wait", action="store_true",
                    help="slurm: block until the stage's job (and those it is afterok on) ends; exit 1 if it failed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (besides the end and "
                    "SIGTERM/SIGUSR1)")
    ap.add_argument("--save-every-minutes", type=float, default=0.0, help="checkpoint when M minutes passed since "
                    "the last save")
    ap.add_argument("--keep", type=int, default=2, help="checkpoints kept (the newest K)")
    ap.add_argument("--overwrite", action="store_true", help="discard the stage's checkpoints made with another "
                    "config or on changed inputs, and start it over")
    ap.add_argument("--wait-lock", action="store_true",
                    help="wait for another command running this stage to finish, instead of refusing")
    a = ap.parse_args(argv)
    from ovpipe import console

    # megatron's import-time notices ("Transformer Engine and Apex are not installed") go to the stage's
    # log, not the terminal, like every step's third-party output (--verbose / OVPIPE_VERBOSE=1: shown)
    with console.warnings_to(Path(a.run_dir) / "pretrain" / f"stage-{a.stage}" / "logs" / "launch.log"):
        return _launch(ap, a)


def _launch(ap, a) -> int:
    from pretrain.recipes import RECIPES, Parallelism, validate
    from pretrain.trainer.config import accumulation

    if a.recipe not in RECIPES:
        ap.error(f"--recipe {a.recipe!r}: known recipes are {', '.join(sorted(RECIPES))}")
    per_node = a.tasks_per_node or a.gpus_per_node or 1
    world = a.nodes * per_node if a.executor == "slurm" else (a.nproc or a.tp * a.pp * a.cp)
    try:
        validate(RECIPES[a.recipe], Parallelism(tp=a.tp, pp=a.pp, cp=a.cp, sequence_parallel=a.sequence_parallel,
                                                distributed_optimizer=a.distributed_optimizer == "on",
                                                world_size=world))
    except ValueError as e:
        ap.error(str(e))
    dp = world // (a.tp * a.pp * a.cp)
    if a.global_batch is not None:
        try:
            accumulation(a.global_batch, a.micro_batch, dp)
        except ValueError as e:
            ap.error(str(e))
    accum = ["--global-batch", str(a.global_batch)] if a.global_batch is not None else ["--grad-accum",
                                                                                          str(a.grad_accum)]
    parallel = ["--tp", str(a.tp), "--pp", str(a.pp), "--cp", str(a.cp), *accum,
                "--distributed-optimizer", a.distributed_optimizer] + (
                   ["--sequence-parallel"] if a.sequence_parallel else [])
    steps = 30 if a.steps is None and a.epochs is None else a.steps
    length = ["--epochs", repr(a.epochs)] if a.epochs is not None else ["--steps", str(steps)]
    data = ["--data", a.data] if a.data else []
    saving = ["--save-every", str(a.save_every), "--save-every-minutes", repr(a.save_every_minutes),
              "--keep", str(a.keep), "--seed", str(a.seed)]
    train_args = ["--micro-batch", str(a.micro_batch), *parallel, *data, *saving] + (
        ["--lr", repr(a.lr)] if a.lr is not None else [])
    args = ["--run-dir", a.run_dir, "--recipe", a.recipe, "--stage", a.stage, *length, *train_args]
    if a.executor == "slurm" and a.dry_run:      # only the script: no run-folder state is touched
        print(_write_script(a, steps, train_args))
        return 0
    from ovpipe.runfolder import RunFolderError, lock
    from pretrain.checkpoint import CheckpointError
    from pretrain.recipes import STAGES
    from pretrain.stage_run import StageRunConfig, prepare, stage_dir

    run_dir = Path(a.run_dir)
    cfg = StageRunConfig(recipe=a.recipe, stage=a.stage, steps=steps if a.epochs is None else None, epochs=a.epochs,
                         data=a.data or STAGES[a.stage].data, micro_batch=a.micro_batch,
                         global_batch=a.global_batch or a.micro_batch * a.grad_accum * dp, lr=a.lr,
                         seed=a.seed)
    try:
        with lock.step_lock(stage_dir(run_dir, a.stage), wait=a.wait_lock):
            if prepare(run_dir, cfg, overwrite=a.overwrite) == "done":
                print(f"pretrain stage {a.stage}: already done (same config and inputs) → "
                      f"{stage_dir(run_dir, a.stage)}")
                return 0
            if a.executor == "slurm":
                from pretrain.slurm import submit_stage

                script = _write_script(a, steps, train_args)
                print(script)
                # afterok on the previous stage's live job; slurm_jobs.json for `ovpipe status` and --wait
                record = submit_stage(run_dir, a.stage, script, a.dependency)
            else:
                return _train_here(a, run_dir, world, args)

    except (RunFolderError, CheckpointError) as e:
        print(f"ovpipe pretrain: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:      # sbatch refused the script
        print(f"ovpipe pretrain: {e}", file=sys.stderr)
        return 1
    if not a.wait:
        return 0
    from pretrain.slurm import wait_stage

    return wait_stage(run_dir, a.stage, record)      # outside the stage lock: the job takes it itself


def _train_here(a, run_dir: Path, world: int, args: list[str]) -> int:
    """The stage on this machine (in-process for one process, torchrun otherwise). The terminal gets the
    progress bar and one summary line; megatron's / torch's notices go to the stage's train.log
    (--verbose or OVPIPE_VERBOSE=1: everything on the terminal)."""
    from ovpipe import console
    from pretrain.stage_run import stage_dir

    sdir, t0 = stage_dir(run_dir, a.stage), time.perf_counter()
    with console.task_output(sdir / "logs" / "train.log"):
        if world > 1:
            rc = subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  f"--nproc-per-node={world}", "-m", "pretrain.train", *args])
        else:
            from pretrain.train import main as train_main

            rc = train_main(args)
    print(stage_line(sdir, a.stage, rc, time.perf_counter() - t0))
    return rc


def stage_line(sdir: Path, stage: str, rc: int, seconds: float) -> str:
    """``pretrain stage 1.5: 30 steps, loss 6.260 → 4.102, 60 packs, data wait 1.2% — 12.3 s →
    RUN/pretrain/stage-1.5`` (data wait: the share of the step time spent waiting for the loader; a large one means the loader,
    not the model, sets the pace — more ``--loader-workers``)."""
    from ovpipe.summary import stage_metrics
    from pretrain.trainer.metrics import data_wait_share

    rows = stage_metrics(sdir / "metrics.jsonl")
    wait = data_wait_share(rows)
    what = (f"{len(rows)} steps, loss {rows[0]['loss']:.3f} → {rows[-1]['loss']:.3f}, "
            f"{sum(r.get('packs', 0) for r in rows):,} packs" + (f", data wait {wait:.1%}" if wait is not None else "")
            if rows else "no steps")
    state = "" if rc == 0 else f" (exit {rc}: see {sdir / 'logs' / 'train.log'})"
    return f"pretrain stage {stage}: {what}{state} — {seconds:.1f} s → {sdir}"


def _write_script(a, steps: int | None, train_args: list[str]) -> Path:
    from pretrain.slurm import render_pretrain_sbatch

    out = Path(a.run_dir) / "pretrain" / f"stage-{a.stage}"
    (out / "logs").mkdir(parents=True, exist_ok=True)
    script = out / "launch_script.slurm"
    text = render_pretrain_sbatch(Path(a.run_dir), a.recipe, a.stage, a.nodes, a.gpus_per_node,
                                  steps if steps is not None else 0, a.partition, time=a.slurm_time,
                                  train_args=train_args, tasks_per_node=a.tasks_per_node)
    if a.epochs is not None:    # render_pretrain_sbatch always writes --steps: swap in --epochs
        text = text.replace(" --steps 0 ", f" --epochs {a.epochs!r} ", 1)
    script.write_text(text)
    return script

if __name__ == "__main__":
    sys.exit(main())
