"""The trainer's checkpoints, in one module: what a save writes, how a kill cannot lose one, where a
stage starts, and when to save.

**Format.** One checkpoint is a megatron-core ``dist_checkpointing`` folder (``torch_dist``,
reshardable: saved at one TP/PP/CP/DP layout, it loads at any other): the LLM's
``sharded_state_dict()`` (TP-sharded tensors, global layer numbers), the RICE-ViT and projector tensors
as replicated ``ShardedTensor``s (written once, by the rank with replica id 0), and the megatron
optimizer's ``sharded_state_dict`` (Adam moments sharded like their parameters, plus the common step),
then ``step.json`` (the step and the loader's position), written last.

**Atomic saves.** A stage's checkpoint root ``RUN/pretrain/stage-<S>/dist_ckpt/`` (Megatron-LM's names)::

    iter_0000012/          one complete checkpoint + step.json
    iter_0000014/
    latest                 "iter_0000014": written last, by a rename
    .tmp-iter_0000016/     a save in progress (or killed): never read, removed by the next save

A save writes ``.tmp-iter_<step>/`` (megatron's writer fsyncs its shard files), writes ``step.json``
into it, fsyncs every file and the folder, renames it to ``iter_<step>/``, fsyncs the root, then
replaces ``latest`` (``manifests.io.atomic_write``, fsynced) and only then removes checkpoints beyond the
newest ``keep``. A kill at any point leaves the previous complete checkpoint and its pointer intact.

**Load.** The newest complete ``iter_*`` (complete = ``step.json`` present; the pointer only breaks
ties and is never trusted alone). A half-written folder is skipped with one log line. A stage whose
own checkpoints exist but none is readable is an error naming them: it never falls back to the
previous stage (that would silently throw the stage's days of work away). Every ``load_*`` takes a
root (its newest complete checkpoint) or one checkpoint folder.

**Where a stage starts** (``StageCheckpoints``): its own newest readable checkpoint (model, optimizer
and the loader's position), else the stage it starts from (weights only: the previous stage, or the
weights ``import-model`` wrote), else — only when the config says ``init: scratch`` — the
initialisation. A missing starting checkpoint is refused before any work (``pretrain.stage``).

**When to save** (``SavePolicy``): every N steps, every M minutes, and at the next step boundary after
SIGTERM / SIGUSR1 (then the run stops; rerunning the same command continues it).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
from pathlib import Path

import torch

from manifests.io import atomic_write

LATEST = "latest"
STEP_FILE = "step.json"
TMP_PREFIX = ".tmp-"


class CheckpointError(RuntimeError):
    """The stage has checkpoints, and none of them can be resumed from."""


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Every file under ``path``, then every folder bottom-up: the bytes and the names are on disk."""
    for d, _, files in os.walk(path, topdown=False):
        for f in files:
            _fsync_path(Path(d) / f)
        _fsync_path(Path(d))


def _step_of(folder: Path) -> int | None:
    """The step of a complete checkpoint folder (its ``step.json``), else None."""
    try:
        return int(json.loads((folder / STEP_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def tmp_path(root: Path, step: int) -> Path:
    return Path(root) / f"{TMP_PREFIX}{iter_name(step)}"


def begin(root: Path, step: int) -> Path:
    """(Rank 0, before the writers.) The temp folder of the save of ``step``, emptied."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(root, step)
    if tmp.exists():                              # a save of this step killed earlier
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def commit(root: Path, step: int, keep: int = 2, extra: dict | None = None) -> Path:
    """(Rank 0, after every writer is done.) ``step.json``, fsync, rename into place, ``latest``,
    then prune to the newest ``keep``; returns the final folder."""
    root = Path(root)
    tmp, final = tmp_path(root, step), root / iter_name(step)
    (tmp / STEP_FILE).write_text(json.dumps({"step": step, "saved_at": time.time(), **(extra or {})}))
    fsync_tree(tmp)
    if final.exists():                            # the same step saved before (a rerun after a kill)
        old = root / f"{TMP_PREFIX}old-{iter_name(step)}"
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
        shutil.rmtree(old)
    os.rename(tmp, final)
    _fsync_path(root)
    with atomic_write(root / LATEST) as ptr, open(ptr, "w") as f:
        f.write(iter_name(step) + "\n")
        f.flush()
        os.fsync(f.fileno())
    _fsync_path(root)
    prune(root, keep)
    return final


def prune(root: Path, keep: int) -> list[Path]:
    """Remove complete checkpoints beyond the newest ``keep`` and leftover temp folders (rank 0,
    when no save is in flight). The folder ``latest`` names is always kept."""
    root = Path(root)
    done = complete(root)
    pointed = _pointer(root)
    gone = [p for _, p in done[:-keep] if p.name != pointed] if keep > 0 else []
    gone += [p for p in root.glob(f"{TMP_PREFIX}*") if p.is_dir()]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def _pointer(root: Path) -> str | None:
    try:
        return (Path(root) / LATEST).read_text().strip() or None
    except OSError:
        return None


def complete(root: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of the complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.glob("iter_*"):
        s = _step_of(p) if p.is_dir() else None
        if s is not None:
            out.append((s, p))
    return sorted(out)


def incomplete(root: Path) -> list[Path]:
    """Folders that look like checkpoints and are not complete (killed saves, damaged folders)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in [*root.glob("iter_*"), *root.glob(f"{TMP_PREFIX}iter_*")]
                  if p.is_dir() and _step_of(p) is None)


def newest(root: Path, log=print) -> tuple[int, Path] | None:
    """The checkpoint to resume from: the newest complete one. A legacy single-folder checkpoint
    (``root/step.json``) counts as one. Half-written folders are named in one log line."""
    root = Path(root)
    if _step_of(root) is not None:                # a checkpoint root that is itself a checkpoint
        return _step_of(root), root
    bad = incomplete(root)
    done = complete(root)
    if bad and log is not None:
        log(f"checkpoint: skipping {len(bad)} incomplete folder(s) (killed saves): "
            f"{', '.join(p.name for p in bad)}")
    return done[-1] if done else None


def has_any(root: Path) -> bool:
    return _step_of(Path(root)) is not None or bool(complete(root)) or bool(
        [p for p in Path(root).glob("iter_*") if p.is_dir()] if Path(root).is_dir() else [])


def resolve(path: Path) -> Path:
    """A checkpoint folder from a root (its newest complete ``iter_*``) or from a folder itself."""
    found = newest(Path(path), log=None)
    if found is None:
        raise FileNotFoundError(f"no complete checkpoint under {path}")
    return found[1]


def resume_point(own: Path, previous: Path | None, loadable, log=print) -> tuple[str, int, Path | None]:
    """Where a stage starts: ``("resume", step, folder)`` from its own newest loadable checkpoint,
    ``("previous", 0, folder)`` from the previous stage's, or ``("init", 0, None)``.

    ``loadable(folder) -> bool`` tries a checkpoint (reading its metadata). Own checkpoints that
    exist (``iter_*`` folders: each was complete when it was renamed) but none of which loads raise
    ``CheckpointError`` naming them — never the previous stage. Temp folders of killed saves alone
    are no checkpoint: the stage never saved one whole, so it starts as it would have."""
    own = Path(own)
    log = log or (lambda *_: None)
    done = complete(own)
    if _step_of(own) is not None:
        done = [(_step_of(own), own)]
    newest(own, log=log)                          # logs the half-written ones
    tried = []
    for step, folder in reversed(done):
        if loadable(folder):
            return "resume", step, folder
        tried.append(folder)
        log(f"checkpoint: {folder} is not readable; trying an older one")
    damaged = [p for p in incomplete(own) if not p.name.startswith(TMP_PREFIX)]   # renamed once, now broken
    if tried or damaged:
        names = [str(p) for p in tried + damaged]
        raise CheckpointError(f"{own}: this stage has checkpoints but none can be resumed from "
                              f"({', '.join(names)}); refusing to restart it from the previous stage. Move "
                              f"them aside (or delete them) to start the stage over")
    if previous is not None:
        prev = newest(Path(previous), log=log)
        if prev is not None:
            return "previous", 0, prev[1]
    return "init", 0, None


# ------------------------------------------------------------------------------ when to save

class SavePolicy:
    """When to save inside a stage: every ``every_steps`` steps, every ``every_minutes`` minutes of
    wall time since the last save, and at the next step boundary after SIGTERM or SIGUSR1 (the
    signals Slurm sends before a time limit or pre-emption), after which the stage stops.

    All ranks must save at the same step, so ``decide`` reduces rank-local facts (a signal seen,
    the clock) with a MAX over the world: one tiny all-reduce per step (skipped for one process)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, every_steps: int = 0, every_minutes: float = 0.0, log=print):
        self.every_steps, self.every_minutes, self.log = every_steps, every_minutes, log
        self.signalled: int | None = None
        self.last_save = time.monotonic()
        self._old: dict = {}

    def _handler(self, signum, frame):
        if self.signalled is None:
            self.signalled = signum
            self.log(f"checkpoint: got {signal.Signals(signum).name}: saving at the end of this step, then stopping")

    def install(self) -> None:
        """Catch SIGTERM / SIGUSR1 until ``restore`` (main thread only: elsewhere a no-op)."""
        import threading

        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handler) for s in self.SIGNALS}

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}

    def decide(self, step: int, device=None) -> tuple[bool, bool]:
        """After optimizer step ``step`` (1-based): ``(save, stop)``, the same on every rank."""
        due_steps = bool(self.every_steps) and step % self.every_steps == 0
        due_time = bool(self.every_minutes) and time.monotonic() - self.last_save >= 60 * self.every_minutes
        flags = [float(self.signalled is not None), float(due_time)]
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            import torch

            t = torch.tensor(flags, dtype=torch.float32, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flags = t.tolist()
        stop = flags[0] > 0
        return due_steps or flags[1] > 0 or stop, stop

    def saved(self) -> None:
        self.last_save = time.monotonic()


# ------------------------------------------------------------------------------ megatron dist checkpoints

# The distributed optimizer's state is saved in its canonical per-parameter form (gathered over DP
# at save, sliced per rank at load), so a checkpoint reshards over TP/PP/DP. megatron-core 0.19's
# default ('fully_sharded_model_space') writes flattened ShardedTensors its own save rejects: every
# GPU checkpoint fails with it (CheckpointingException: ShardedTensor.flattened_range is not supported).
# Saving, ``distrib_optim_fully_reshardable_mem_efficient`` gathers each bucket's state over DP with
# gloo to DP rank 0 only (one bucket at a time), instead of all-gathering full fp32 buffers on every
# rank with NCCL; megatron reads both layouts back the same way, so load keeps the default.
OPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
OPT_SAVE_METADATA = {**OPT_METADATA, "distrib_optim_fully_reshardable_mem_efficient": True}


def model_sharded_state_dict(model) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedTensor

    sd = dict(model.llm.sharded_state_dict(prefix="llm."))
    replica = (0, ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(with_context_parallel=True))
    for part in ("vision", "projector"):          # plain torch modules, replicated; first PP stage only
        if getattr(model, part, None) is None:
            continue
        for k, t in getattr(model, part).state_dict(keep_vars=True).items():
            key = f"{part}.{k}"
            # the Parameter itself (not .data): the optimizer maps its state to params by identity
            sd[key] = ShardedTensor.from_rank_offsets(key, t, replica_id=replica)
    return sd


@contextlib.contextmanager
def _results_in_process():
    """megatron-core's writer hands its write results back through a ``multiprocessing`` Manager queue, made at a
    process's first save with the ``spawn`` context: a server process that starts a fresh interpreter and imports
    the trainer's modules (about 2 CPU-s per rank, and a process left running beside it). That queue is for an
    asynchronous save, whose writer runs in another process; this save writes in this process, so a plain queue
    carries the results. The module's own queue is put back after, for a caller that saves asynchronously."""
    import queue

    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:                         # another layout of megatron-core: its own queue, at its cost
        yield
        return
    if not hasattr(filesystem_async, "_results_queue"):
        yield
        return
    kept, filesystem_async._results_queue = filesystem_async._results_queue, queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = kept


def save(root: Path, model, opt, step: int, keep: int = 2, data: dict | None = None) -> Path:
    """``opt``: a megatron optimizer (its sharded state is saved with the model) or None. Writes
    ``root/iter_<step>/`` atomically and keeps the newest ``keep``; returns that folder. ``data``:
    the loader's state (``pretrain.train``: packs consumed), kept in ``step.json``."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    root = Path(root)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        begin(root, step)
    if dist.is_initialized():
        dist.barrier()
    model_sd = model_sharded_state_dict(model)
    sd = {"model": model_sd}
    if opt is not None:
        fresh_adam_state(opt)        # a save before the first step (a stage of 0 steps)
        sd["optimizer"] = opt.sharded_state_dict(model_sd, metadata=OPT_SAVE_METADATA)
    with _results_in_process():
        dist_checkpointing.save(sd, str(tmp_path(root, step)))
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        commit(root, step, keep, {"data": data} if data else None)
    if dist.is_initialized():
        dist.barrier()
    return root / iter_name(step)


def data_state(path: Path) -> dict | None:
    """The loader state saved with the checkpoint (a root or a folder; None: an older checkpoint
    without one)."""

    return json.loads((resolve(path) / "step.json").read_text()).get("data")


def is_complete(path: Path) -> bool:
    """``path`` is a complete checkpoint, or a root holding one."""

    return newest(Path(path), log=None) is not None


def step_of(path: Path) -> int:

    return json.loads((resolve(path) / "step.json").read_text())["step"]


def readable(path: Path) -> bool:
    """Megatron's ``metadata.json`` and torch DCP's tensor index (``.metadata``) both read back: a
    cheap check before resuming from the checkpoint (no tensor is read)."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return bool(dist_checkpointing.check_is_distributed_checkpoint(str(path))) and bool(
            FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    except Exception:
        return False


def load_model(path: Path, model) -> int:
    """Load the weights in place (any layout); returns the saved step."""
    from megatron.core import dist_checkpointing

    path = resolve(path)
    loaded = dist_checkpointing.load({"model": model_sharded_state_dict(model)}, str(path))["model"]
    state = {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise KeyError(f"checkpoint {path} does not match the model: missing {missing[:5]}, "
                       f"unexpected {unexpected[:5]}")
    return json.loads((Path(path) / "step.json").read_text())["step"]


def fresh_adam_state(opt) -> None:
    """Adam state for a DistributedOptimizer that has taken no step: megatron's describes (saves, loads) its
    state only once it exists. megatron's own dummy step makes it, at lr 0 and no weight decay so no
    parameter moves, and the step counters go back to 0: the state of a fresh Adam, zero moments and no
    steps (a save at step 0 holds exactly that; a load replaces it in place)."""
    for o in getattr(opt, "chained_optimizers", [opt]):
        init = getattr(o, "_init_optimizer_states_with_dummy_values", None)
        if init is None or o.optimizer.state:
            continue
        kept = [(g["lr"], g["weight_decay"]) for g in o.optimizer.param_groups]
        for g in o.optimizer.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
        try:
            init()
        finally:
            for g, (lr, wd) in zip(o.optimizer.param_groups, kept):
                g["lr"], g["weight_decay"] = lr, wd
        for st in o.optimizer.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"].zero_()


def load_optimizer(path: Path, model, opt) -> None:
    """The megatron optimizer's state, resharded to this rank's parameters."""
    from megatron.core import dist_checkpointing

    path = resolve(path)
    fresh_adam_state(opt)            # replaced in place by the load
    sd = {"optimizer": opt.sharded_state_dict(model_sharded_state_dict(model), is_loading=True,
                                              metadata=OPT_METADATA)}
    loaded = dist_checkpointing.load(sd, str(path))["optimizer"]
    with adam_step_per_parameter(opt):
        opt.load_state_dict(loaded)


@contextlib.contextmanager
def adam_step_per_parameter(opt):
    """Give torch Adam's per-parameter ``step`` back while megatron's DistributedOptimizer loads.

    Without Transformer Engine or Apex, megatron-core 0.19.2 uses ``torch.optim.AdamW``, which keeps
    ``state[p]["step"]`` as a tensor per parameter. ``DistributedOptimizer.load_state_dict`` puts the
    saved step (kept in the param groups) back into the inner state as *one* tensor shared by every
    parameter; then ``load_parameter_state_from_fully_reshardable`` drops the ``"step"`` key from
    the tensors it hands to ``_set_main_param_and_optimizer_states``, which copies every tensor of
    the inner state and so asks for ``tensors["step"]``: ``KeyError: 'step'``. We shadow that method
    on the instance for the load (megatron's files stay as they are): it is handed the parameter's
    own step, a fresh tensor of the saved value, so each parameter again counts its steps alone
    (a shared tensor would be advanced once per parameter by ``step_t += 1``, skewing Adam's bias
    correction). The TE/Apex optimizers keep the step in the param groups, have no ``"step"`` state,
    and pass through unchanged. See docs/pretrain.md (Exact resume)."""
    patched = []
    for o in getattr(opt, "chained_optimizers", [opt]):
        setter = getattr(type(o), "_set_main_param_and_optimizer_states", None)
        if setter is None or not hasattr(o, "model_param_group_index_map"):
            continue

        def with_step(model_param, tensors, _o=o, _setter=setter):
            gi, go = _o.model_param_group_index_map[model_param]
            main = _o.optimizer.param_groups[gi]["params"][go]
            state = _o.optimizer.state.get(main, {})
            if isinstance(state.get("step"), torch.Tensor) and "step" not in tensors:
                state["step"] = state["step"].detach().clone()
                tensors = {**tensors, "step": state["step"]}
            _setter(_o, model_param, tensors)

        o._set_main_param_and_optimizer_states = with_step
        patched.append(o)
    try:
        yield
    finally:
        for o in patched:
            del o._set_main_param_and_optimizer_states


def load_state_dict(path: Path, recipe: str) -> dict:
    """The full (TP=1) state dict of a saved stage, for export and inspection (needs megatron's
    parallel state initialised, e.g. ``pretrain.trainer.build.setup_distributed(1)``). Always megatron's
    local layer spec, on GPU too: its parameter names are the ones ``llava_ov.qwen3`` maps, and its
    ``sharded_state_dict_keys_map`` reads checkpoints a Transformer Engine run saved."""
    from pretrain.recipes import RECIPES
    from pretrain.model.vlm import VLM

    model = VLM(RECIPES[recipe], image_pad_id=0, tp=1, backend="sdpa")
    load_model(path, model)
    return model.state_dict()


# ------------------------------------------------------------------------------ a stage's start and saves

class StageCheckpoints:
    """``RUN/pretrain/stage-<S>/dist_ckpt/`` of one stage reading pack step ``data``, starting from the
    checkpoint in step folder ``start_from`` (None: from the initialisation)."""

    def __init__(self, run_dir: Path, stage: str, data: str, keep: int, start_from: str | None = None,
                 log=None):
        from pretrain.recipes import stage_folder

        self.root = Path(run_dir) / stage_folder(stage) / "dist_ckpt"
        # the stage it starts from (None: random initialisation, ``init: scratch``)
        self.previous = None if start_from is None else Path(run_dir) / start_from / "dist_ckpt"
        self.stage, self.data, self.keep, self.log = stage, data, keep, log
        self.how, self.start, self.src = resume_point(self.root, self.previous, readable,
                                                                 log=log)

    @property
    def resuming(self) -> bool:
        """A mid-stage resume: optimizer state and data position come back too (step 0 of a stage
        holds imported weights and no optimizer state)."""
        return self.how == "resume" and bool(self.start)

    def load_model(self, model) -> None:
        if self.src is None:
            return
        load_model(self.src, model)
        if self.log is not None:
            what = f"resuming at step {self.start}" if self.how == "resume" else "starting"
            self.log(f"stage {self.stage}: {what} from {self.src}")

    def load_optimizer(self, model, opt) -> None:
        if self.resuming:
            load_optimizer(self.src, model, opt)

    def start_pack(self, gbs: int) -> int:
        """The first pack of the stream not consumed: the checkpoint's loader state (checkpoints
        without one: the steps done × the global batch), so a resumed run reads what the
        uninterrupted run would have read next."""
        state = data_state(self.src) if self.resuming else None
        if state is not None and state.get("step") not in (None, self.data):
            raise ValueError(f"the checkpoint {self.src} was reading pack step {state['step']!r}, "
                             f"this run reads {self.data!r}")
        return state["packs_consumed"] if state is not None else self.start * gbs

    def save(self, model, opt, step: int, packs_consumed: int) -> Path:
        return save(self.root, model, opt, step, self.keep,
                              {"step": self.data, "packs_consumed": packs_consumed})

    def newest_step(self) -> int | None:
        found = newest(self.root, log=None)
        return None if found is None else found[0]
