"""Clearing a step folder: everything but its lock (``--overwrite``), and the temp files of killed writers.

Atomic writes go through ``.tmp-{pid}-{name}`` files; a kill or a full disk leaves them behind.
``clean_temp_files`` removes every ``.tmp-*`` under the step folder; the local executor calls it at
the start of a run, under the lock, when no rank is running (so no live writer can own one), and each
task removes its own rank's part/stats temp files when it (re)starts (the Slurm case, where no lock
spans the tasks).
"""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from ovpipe.runfolder.lock import LOCK_NAME


def clear_step_dir(sdir: Path) -> None:
    """``--overwrite``: remove everything in the step folder but its lock file (held by us)."""
    for p in sdir.iterdir():
        if p.name == LOCK_NAME:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def clean_temp_files(sdir: Path, rank: int | None = None) -> int:
    """Remove leftover ``.tmp-{pid}-{name}`` files (a kill or ENOSPC between write and rename).

    ``rank=None``: every ``.tmp-*`` under the step folder — call only under the step lock with no
    rank running. ``rank``: only that rank's own part and stats temp files (``part-{rank:05d}.*``
    under ``<kind>/``, ``{rank:05d}.json`` under ``stats/``) and its resumable chunks' (``chunks/{rank:05d}/``,
    ``TaskContext.chunk_dir``), and its merges' ``.merge-{rank:05d}-*`` folders, safe while other ranks run."""
    sdir = Path(sdir)
    if not sdir.is_dir():
        return 0
    if rank is None:
        files = [p for p in sdir.rglob(".tmp-*") if p.is_file() or p.is_symlink()]
    else:
        files = [p for p in sdir.glob(f"*/.tmp-*-part-{rank:05d}.*")]
        files += list((sdir / "partials").glob(f".tmp-*-{rank:05d}.npz"))
        files += list((sdir / "stats").glob(f".tmp-*-{rank:05d}.json"))
        files += list((sdir / "failures").glob(f".tmp-*-{rank:05d}"))
        files += list((sdir / "chunks" / f"{rank:05d}").glob(".tmp-*"))
    # a k-way merge's intermediate runs (``ovpipe.shuffle``): the rank's own folders, or all of them
    dirs = [d for d in sdir.rglob(".merge-*" if rank is None else f".merge-{rank:05d}-*") if d.is_dir()]
    n = 0
    for p in files:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            n += 1
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
        n += 1
    return n
