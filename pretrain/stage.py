"""A pretrain stage as an ordinary ovpipe step: ``ovpipe pretrain --stage S`` writes ``RUN/pretrain/stage-<S>/``.

    ovpipe pretrain --stage 1.5 --run-dir RUN --steps 30                       (this machine, one process)
    ovpipe pretrain --stage 1.5 --run-dir RUN --nproc 2 --tp 2                 (torchrun: gloo on CPU, NCCL on GPU)
    ovpipe pretrain --stage 1.5 --run-dir RUN --executor slurm --nodes 2       (one Slurm job, srun per rank)

The stage goes through the core's one lifecycle (``ovpipe.cli.execute``): the step lock, the check of its
declared inputs before any work, ``executor.json`` with their config hashes (a changed input or config is
refused naming it, unless ``--overwrite``), the running marker and heartbeat, ``completions/`` and
``stats.json``, ``ovpipe status`` and the Slurm ``afterok`` chain. The step is ``distributed``
(``ovpipe.step.Step``): its one task is a group of processes the executor starts.

**Declared inputs.** ``packs`` from the pack step ``data`` (the stage's own by default: stage 1
``pack-align``, 1.5 ``pack``, 2 ``pack-instruct``), and ``dist_ckpt`` from ``start_from``: the stage it
starts from (``pretrain/stage-<previous>``, trained, or written by ``import-model``). A missing start is
refused before any work, naming it; ``--init scratch`` starts from random initialisation instead, and says so.

**One config, resolved once.** ``StageConfig`` is the step's config (``config.json``): what changes the
result is hashed (recipe, stage, length, data, batch, lr, seed, the start); how it runs is saved but not
hashed (``NOT_HASHED``: the TP/PP/CP layout — checkpoints reshard, so a stage resumes at another layout —,
kernels, recompute, save cadence). The task turns it into the trainer's ``TrainConfig``, which the
trainer resolves once against the device and world (``TrainConfig.resolve``) and passes whole.

**Stopping.** SIGTERM / SIGUSR1 save at the next step boundary and stop the task (``ovpipe.step.Stopped``):
no completion, no failure; rerunning the command (or the Slurm job's requeue) resumes it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ovpipe.config import NOT_HASHED
from ovpipe.inputs import Input
from ovpipe.step import Step, Stopped, TaskContext, save_json
from pretrain.recipes import stage_folder

PROGRESS = "progress.json"
# A stage on a cluster saves on a clock unless told otherwise: SIGTERM / USR1 saves cover a time limit and a
# pre-emption, not a node that dies without a signal (a hardware fault, a collective's timeout), which would
# send the job back to its last save. 30 minutes bounds that loss to about 1% of a 48-hour job; a save is one
# checkpoint write per interval (its time is logged: "checkpoint: step N saved in S s").
CLUSTER_SAVE_MINUTES = 30.0
_RUN = dict(metadata=NOT_HASHED)        # how the stage runs, not what it makes


@dataclass(frozen=True)
class StageConfig:
    stage: str = "1.5"                       # "1" | "1.5" | "2" (pretrain.recipes.STAGES)
    recipe: str = "tiny"                     # pretrain.recipes.RECIPES
    steps: int | None = None                 # exactly one of steps / epochs (neither: 30 steps)
    epochs: float | None = None  # passes over the packs (instead of steps)
    data: str = ""                           # the pack step read; "": the stage's
    micro_batch: int = 2  # packs per micro-batch per DP rank
    grad_accum: int = 1  # micro-batches per optimizer step
    global_batch: int | None = None          # packs per optimizer step over all DP ranks
    lr: float | None = None                  # None: the stage's
    seed: int = 0  # initialisation and data order
    tokenizer: str | None = None             # None: RUN/tokenizer
    init: Literal["previous", "scratch"] = "previous"   # scratch: random initialisation, no start checkpoint
    start_from: str = ""                     # the checkpoint's step folder; "": pretrain/stage-<previous>
    tp: int = field(default=1, **_RUN)  # tensor-parallel size
    pp: int = field(default=1, **_RUN)  # pipeline-parallel size
    cp: int = field(default=1, **_RUN)  # context-parallel size
    sequence_parallel: bool = field(default=False, **_RUN)  # megatron's sequence parallelism (with tp > 1)
    # shard the optimizer state over DP ranks; auto: on with DP > 1
    distributed_optimizer: Literal["auto", "on", "off"] = field(default="auto", **_RUN)
    fp32: bool = field(default=False, **_RUN)  # train in fp32 (the CPU demo); default: bf16 on a GPU
    precision: str | None = field(default=None, **_RUN)            # bf16 | fp32 | fp8 | fp8-tensorwise | fp8-rowwise
    grad_reduce_dtype: str | None = field(default=None, **_RUN)    # fp32 | bf16: DP's gradient reduce (fp32)
    optimizer_offload: float | None = field(default=None, **_RUN)  # share of the optimizer on the host
    # activation recompute: full | selective | mlp | none | auto (ovpipe pretrain --help)
    recompute: str | None = field(default=None, **_RUN)
    # the tower's recompute: full | selective | none; None: follows recompute
    vision_recompute: str | None = field(default=None, **_RUN)
    loader_workers: int | None = field(default=None, **_RUN)  # data loader worker processes; None: the stage's default
    # eager | fused (compiled rotary/RMSNorm + megatron's fused kernels)
    kernels: str | None = field(default=None, **_RUN)
    loss_kernel: str | None = field(default=None, **_RUN)  # the cross-entropy kernel; None: the stage's default
    save_every: int = field(default=0, **_RUN)  # a checkpoint every N steps; 0: at the end only
    save_every_minutes: float = field(default=0.0, **_RUN)  # a checkpoint every N minutes of training; 0: off
    keep: int = field(default=2, **_RUN)  # checkpoints kept (the latest K)
    stop_after: int | None = field(default=None, **_RUN)  # stop (saved, resumable) after this many steps of this run

    def __post_init__(self):
        from pretrain.recipes import STAGES, start_folder

        if self.stage not in STAGES:
            raise ValueError(f"stage must be one of {sorted(STAGES)}, got {self.stage!r}")
        if self.steps is None and self.epochs is None:
            object.__setattr__(self, "steps", 30)
        object.__setattr__(self, "data", self.data or STAGES[self.stage].data)
        if not self.start_from and self.init == "previous":
            object.__setattr__(self, "start_from", start_folder(self.stage))
        if self.init == "scratch" and self.start_from:
            raise ValueError(f"start_from={self.start_from!r} with init='scratch': a stage starts from a "
                             f"checkpoint or from scratch, not both")
        if self.start_from and (self.start_from.startswith("/") or ".." in Path(self.start_from).parts):
            raise ValueError(f"start_from must be a step folder of the run, got {self.start_from!r}")
        self.train_config(Path("."))        # the trainer's checks, naming the field, before any work

    def train_config(self, run_dir: Path):
        """The trainer's ``TrainConfig`` for this stage in ``run_dir`` (resolved by the trainer, once)."""
        from pretrain.trainer.config import TrainConfig

        return TrainConfig(
            run_dir=Path(run_dir), recipe=self.recipe, stage=self.stage, steps=self.steps, epochs=self.epochs,
            data=self.data, micro_batch=self.micro_batch, grad_accum=self.grad_accum,
            global_batch=self.global_batch, lr=self.lr, seed=self.seed, tokenizer=self.tokenizer,
            init=self.init, start_from=self.start_from or None, tp=self.tp, pp=self.pp, cp=self.cp,
            sequence_parallel=self.sequence_parallel,
            distributed_optimizer={"auto": None, "on": True, "off": False}[self.distributed_optimizer],
            bf16=False if self.fp32 else None, precision=self.precision, optimizer_offload=self.optimizer_offload,
            grad_reduce_dtype=self.grad_reduce_dtype,
            recompute=self.recompute, vision_recompute=self.vision_recompute,
            loader_workers=self.loader_workers, kernels=self.kernels, loss_kernel=self.loss_kernel,
            save_every=self.save_every, save_every_minutes=self.save_every_minutes, keep=self.keep,
            stop_after=self.stop_after)


def check_start(cfg: StageConfig, run_dir: Path) -> None:
    """Before any work: the checkpoint the stage starts from is there (``init: previous``), or the user
    asked for random initialisation. One line naming the folder and the three ways on. And the pack step it
    reads was packed for ovpipe's trainer (``pretrain.data.check_pack_step``)."""
    from pretrain.data import check_pack_step

    check_pack_step(run_dir, cfg.data)
    if cfg.init == "scratch" or (Path(run_dir) / cfg.start_from / "executor.json").exists() \
            or (Path(run_dir) / cfg.start_from / "dist_ckpt").is_dir():
        return
    raise ValueError(
        f"pretrain stage {cfg.stage} starts from the checkpoint in {Path(run_dir) / cfg.start_from}, which does "
        f"not exist: train that stage first, import weights into it (`ovpipe import-model --stage "
        f"{cfg.start_from.rsplit('-', 1)[-1]}`), or pass --init scratch to train from random initialisation")


def write_progress(sdir: Path) -> dict | None:
    """``progress.json`` (``ovpipe status``: ``at step 12/30``): the last record of ``metrics.jsonl`` and
    the planned steps."""
    try:
        with open(Path(sdir) / "metrics.jsonl", "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 4096))
            last = json.loads(f.read().decode(errors="replace").strip().splitlines()[-1])
        steps = json.loads((Path(sdir) / "stage.json").read_text()).get("steps")
    except (OSError, ValueError, IndexError):
        return None
    rec = {"step": last.get("step"), "steps": steps, "loss": last.get("loss")}
    save_json(Path(sdir) / PROGRESS, rec)
    return rec


def run(cfg: StageConfig, task: TaskContext) -> None:
    import torch

    from pretrain.train import train

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    rank0 = int(os.environ.get("RANK", "0")) == 0
    sdir = task.run_dir / stage_folder(cfg.stage)
    if cfg.init == "scratch" and rank0:
        print(f"stage {cfg.stage}: init scratch — training from random initialisation, no start checkpoint")
    res = train(cfg.train_config(task.run_dir),
                on_step=(lambda rec, ddp: write_progress(sdir)) if rank0 else None)
    if rank0:
        write_progress(sdir)
    if res.get("preempted"):
        raise Stopped(int(res["preempted"]), f"saved at step {res.get('step', '?')} and stopped on a signal; "
                                             f"rerun the same command (or let Slurm requeue it) to resume")
    rows = res.get("metrics") or []
    task.stats.inc("steps", len(rows))
    task.stats.inc("packs", sum(r.get("packs", 0) for r in rows))
    task.stats.inc("samples", sum(r.get("samples", 0) for r in rows))
    task.stats.info.update({k: res[k] for k in ("tp", "pp", "cp", "dp") if k in res})


STEP = Step("pretrain", StageConfig, run, max_tasks=1, distributed=True,
            inputs={"packs": "data", "dist_ckpt": Input("start_from", when=lambda c: c.init == "previous")},
            outputs=("dist_ckpt",), check=check_start,
            description="one stage of RICE-ViT + projector + Qwen3 training (megatron-core)")


# ------------------------------------------------------------------------------ ovpipe pretrain

# `ovpipe pretrain --help`'s text: what a user runs (the module docstring above is the developer's contract)
USAGE = """Train one stage of the recipe (1: projector alignment, 1.5: mid-training, 2: instruct) on a pack step,
as an ordinary ovpipe step: RUN/pretrain/stage-<S>/ with its checkpoints, train_metrics and status.

    ovpipe pretrain --recipe tiny --stage 1.5 --run-dir RUN --steps 30                 (this machine)
    ovpipe pretrain --recipe tiny --stage 1.5 --run-dir RUN --nproc 2 --tp 2           (torchrun)
    ovpipe pretrain --recipe llava-ov-1.5-4b --stage 1.5 --run-dir RUN --epochs 1 \\
        --executor slurm --nodes 4 --gpus-per-node 8 --account lab                    (one Slurm job)

Each stage reads its own pack step (1: pack-align, 1.5: pack, 2: pack-instruct; --data STEP for another) and
starts from the previous stage's checkpoint (--init scratch: random initialisation). docs/pretrain.md."""


def main(argv=None) -> int:
    from pretrain.recipes import RECIPES

    ap = argparse.ArgumentParser(prog="ovpipe pretrain", description=USAGE,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="tiny", choices=sorted(RECIPES),
                    help="the model and its stage settings (pretrain/recipes.py; default tiny, the demo's)")
    ap.add_argument("--stage", choices=["1", "1.5", "2"], required=True)
    ap.add_argument("--run-dir", required=True)
    from pretrain.train import add_stage_args

    add_stage_args(ap)
    ap.add_argument("--start-from", help="step folder of the checkpoint to start from (default: the previous "
                                         "stage's, pretrain/stage-<S>; an import-model folder works too)")
    e = ap.add_argument_group("executor")
    e.add_argument("--executor", choices=["local", "slurm"], default="local")
    e.add_argument("--nproc", type=int, help="local: processes under torchrun (default tp·pp·cp)")
    e.add_argument("--nodes", type=int, default=1)
    e.add_argument("--gpus-per-node", type=int, default=8)
    e.add_argument("--tasks-per-node", type=int, help="slurm: processes per node (default --gpus-per-node; "
                   "with --gpus-per-node 0, CPU processes: 1)")
    e.add_argument("--partition")
    e.add_argument("--slurm-time", default="48:00:00")
    e.add_argument("--cpus-per-task", type=int, default=1)
    e.add_argument("--mem")
    from ovpipe.cli import add_site_flags

    add_site_flags(e)
    e.add_argument("--dry-run", action="store_true", help="slurm: write the job script, submit nothing")
    e.add_argument("--dependency", help="slurm: extra job id this stage must wait for (afterok); the jobs of "
                                        "its inputs, while queued or running, are added on their own")
    e.add_argument("--wait", action="store_true", help="slurm: block until the stage's jobs end")
    e.add_argument("--wait-timeout", type=float)
    e.add_argument("--overwrite", action="store_true", help="discard the stage's checkpoints made with another "
                   "config or on changed inputs, and start it over")
    e.add_argument("--wait-lock", action="store_true",
                   help="wait for another command running this stage to finish, instead of refusing")
    e.add_argument("--verbose", action="store_true", help="the trainer's output on the terminal, not only its log")
    a = ap.parse_args(argv)
    from ovpipe import console

    console.set_verbose(a.verbose)
    # megatron's and torch's import-time notices go to the stage's log, not the terminal
    with console.warnings_to(Path(a.run_dir) / stage_folder(a.stage) / "logs" / "launch.log"):
        try:
            cfg = _config(a)
        except ValueError as err:
            ap.error(str(err))
        per_node = a.tasks_per_node or a.gpus_per_node or 1
        world = a.nodes * per_node if a.executor == "slurm" else (a.nproc or a.tp * a.pp * a.cp)
        try:
            _check_layout(cfg, world)
        except ValueError as err:
            ap.error(str(err))
        return _execute(a, cfg, world, per_node)


def _config(a) -> StageConfig:
    from ovpipe.config import load_config
    from pretrain.recipes import RECIPES

    if a.recipe not in RECIPES:
        raise ValueError(f"--recipe {a.recipe!r}: known recipes are {', '.join(sorted(RECIPES))}")
    fields = {f.name for f in dataclasses.fields(StageConfig)}
    values = {k: v for k, v in vars(a).items() if k in fields and v is not None}
    values["start_from"] = a.start_from or ""
    values["data"] = a.data or ""
    if a.save_every_minutes is None and a.executor == "slurm":
        values["save_every_minutes"] = CLUSTER_SAVE_MINUTES
    return load_config(StageConfig, values)


def _check_layout(cfg: StageConfig, world: int) -> None:
    """The layout against the recipe and the world size, and the global batch against DP, before anything
    starts (``ValueError`` naming both settings)."""
    from pretrain.recipes import RECIPES, Parallelism, validate
    from pretrain.trainer.config import accumulation

    validate(RECIPES[cfg.recipe], Parallelism(tp=cfg.tp, pp=cfg.pp, cp=cfg.cp,
                                              sequence_parallel=cfg.sequence_parallel,
                                              distributed_optimizer=cfg.distributed_optimizer == "on",
                                              world_size=world))
    if cfg.global_batch is not None:
        accumulation(cfg.global_batch, cfg.micro_batch, world // (cfg.tp * cfg.pp * cfg.cp))


def _execute(a, cfg: StageConfig, world: int, per_node: int) -> int:
    from ovpipe.cli import UsageError, execute
    from ovpipe.config import ConfigError
    from ovpipe.runfolder import RunFolderError
    from pretrain.trainer.checkpoint import CheckpointError

    name = stage_folder(cfg.stage)
    from ovpipe.cli import SITE_FLAGS

    run_dir = Path(a.run_dir).expanduser().resolve()
    args = argparse.Namespace(
        run_dir=str(run_dir), name=name, executor=a.executor, tasks=1, workers=1, overwrite=a.overwrite,
        quiet=False, wait_lock=a.wait_lock, partition=a.partition, slurm_time=a.slurm_time,
        cpus_per_task=a.cpus_per_task, mem=a.mem, dependency=a.dependency, wait=a.wait,
        wait_timeout=a.wait_timeout, nproc=world, nodes=a.nodes, tasks_per_node=per_node,
        gpus_per_node=a.gpus_per_node, sbatch_args=a.sbatch_args,
        **{dest: getattr(a, dest) for _, dest, _ in SITE_FLAGS})
    if a.executor == "slurm" and a.dry_run:      # only the script: no run-folder state is touched
        from ovpipe.config import config_json

        print(write_script(run_dir, name, args))
        print(f"with the config the job's ranks would read (config.json):\n{config_json(cfg)}", end="")
        return 0
    try:
        return execute(STEP, cfg, args,
                       summary=lambda seconds, where: stage_line(run_dir / name, cfg.stage, seconds, where))
    except (UsageError, ConfigError, RunFolderError, CheckpointError) as err:
        print(f"ovpipe pretrain: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:      # sbatch refused the script
        print(f"ovpipe pretrain: {err}", file=sys.stderr)
        return 1


def write_script(run_dir: Path, name: str, args) -> Path:
    """``--dry-run``: the job script the Slurm executor would submit, written to the stage's folder."""
    from ovpipe.cli import slurm_options
    from ovpipe.executors.slurm import render_distributed_job

    sdir = run_dir / name
    (sdir / "logs").mkdir(parents=True, exist_ok=True)
    script = sdir / "launch_script.slurm"
    script.write_text(render_distributed_job(STEP.name, run_dir, slurm_options(args), name=name))
    return script


def stage_line(sdir: Path, stage: str, seconds: float, where: str = "") -> str:
    """``pretrain/stage-1.5: 30 steps, loss 6.260 → 4.102, 60 packs, data wait 1.2% — 12.3 s → RUN/pretrain/stage-1.5``
    (the step folder first, as every step's summary line)
    (data wait: the share of the step time spent waiting for the loader; a large one means the loader, not
    the model, sets the pace — more ``--loader-workers``)."""
    from ovpipe.summary import stage_metrics
    from pretrain.trainer.metrics import data_wait_share

    rows = stage_metrics(sdir / "metrics.jsonl")
    wait = data_wait_share(rows)
    what = (f"{len(rows)} steps, loss {rows[0]['loss']:.3f} → {rows[-1]['loss']:.3f}, "
            f"{sum(r.get('packs', 0) for r in rows):,} packs" + (f", data wait {wait:.1%}" if wait is not None else "")
            if rows else "no steps")
    return f"{stage_folder(stage)}: {what} — {seconds:.1f} s{where} → {sdir}"


if __name__ == "__main__":
    sys.exit(main())
