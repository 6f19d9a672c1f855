"""Checkpoints a kill cannot lose: atomic ``iter_<step>`` folders, a ``latest`` pointer, the last K kept,
and when to save (every N steps, every M minutes, on SIGTERM / SIGUSR1).

Layout of a stage's checkpoint root ``RUN/pretrain/stage-<S>/dist_ckpt/`` (Megatron-LM's names)::

    iter_0000012/          one complete megatron dist checkpoint (``pretrain.dist_ckpt``) + step.json
    iter_0000014/
    latest                 "iter_0000014": written last, by a rename
    .tmp-iter_0000016/     a save in progress (or killed): never read, removed by the next save

A save writes ``.tmp-iter_<step>/`` (megatron's writer fsyncs its shard files), writes ``step.json``
into it, fsyncs every file and the folder, renames it to ``iter_<step>/``, fsyncs the root, then
replaces ``latest`` (``manifests.io.atomic_write``, fsynced) and only then removes checkpoints beyond the
newest ``keep``. A kill at any point leaves the previous complete checkpoint and its pointer intact.

Load takes the newest complete ``iter_*`` (complete = ``step.json`` present; the pointer only breaks
ties and is never trusted alone). A half-written folder is skipped with one log line. A stage whose
own checkpoints exist but none is readable is an error naming them: it never falls back to the
previous stage (that would silently throw the stage's days of work away).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

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
