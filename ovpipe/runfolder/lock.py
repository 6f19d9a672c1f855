"""The step lock: ``fcntl.flock`` on ``RUN/<step>/.lock``, its holder written into it.

``prepare`` holds it while it (re)creates the folder, the local executor for the whole run (every
rank and the finalize), the Slurm executor while it submits. A second command refuses
(``StepLocked``, naming the holder) or, with ``wait=True`` (``--wait-lock``), waits. The lock file
itself is never deleted (an ``--overwrite`` clears everything else, ``cleanup.clear_step_dir``), so a
lock is always on the file others open. The lock is re-entrant within one process.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from ovpipe.runfolder import RunFolderError

LOCK_NAME = ".lock"

_HELD: dict[str, list] = {}     # lock path -> [fd, depth]: re-entrant within a process
_HELD_GUARD = threading.Lock()


class StepLocked(RunFolderError):
    pass


def _holder_info() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
            "started_at": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)[:500]}


def lock_holder(sdir: Path) -> dict | None:
    """What the lock file of ``sdir`` says about its holder (meaningful only while it is held)."""
    try:
        text = (Path(sdir) / LOCK_NAME).read_text()
        return json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None


def _describe_holder(h: dict | None) -> str:
    if not h:
        return "another process (no holder recorded yet)"
    return (f"pid {h.get('pid')} on {h.get('host')} since {h.get('started_at')}"
            + (f" ({h['command']})" if h.get("command") else ""))


@contextlib.contextmanager
def step_lock(sdir: Path, wait: bool = False):
    """Hold the step's lock (``flock`` on ``RUN/<step>/.lock``) for the ``with`` block.

    Refuses with ``StepLocked`` naming the holder, or with ``wait=True`` blocks until it is free.
    Re-entrant in one process (``prepare`` then the executor, under one command-wide lock)."""
    sdir = Path(sdir)
    sdir.mkdir(parents=True, exist_ok=True)
    path = sdir / LOCK_NAME
    key = str(path.resolve())
    with _HELD_GUARD:
        if key in _HELD:
            _HELD[key][1] += 1
            nested = True
        else:
            nested = False
    if nested:
        try:
            yield
        finally:
            with _HELD_GUARD:
                _HELD[key][1] -= 1
        return
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
                holder = _describe_holder(lock_holder(sdir))
                if not wait:
                    raise StepLocked(f"{sdir}: step is locked by {holder}; wait for it to end, or rerun "
                                     f"with --wait-lock to wait") from None
                print(f"ovpipe: {sdir.name} is locked by {holder}; waiting for it...", file=sys.stderr)
                fcntl.flock(fd, fcntl.LOCK_EX)
            # The file we locked must still be the one at the path (nobody deletes it, but be sure).
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        break
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(_holder_info()) + "\n").encode(), 0)
    with _HELD_GUARD:
        _HELD[key] = [fd, 1]
    try:
        yield
    finally:
        with _HELD_GUARD:
            del _HELD[key]
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
