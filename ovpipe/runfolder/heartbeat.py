"""Running tasks: ``running/{rank:05d}`` (``running/apply-{rank}``, ``running/reduce``) holds the task's
host, pid and Slurm job, and its mtime is a heartbeat touched every ``HEARTBEAT_S`` seconds; it is
removed when the task ends. A marker whose pid is alive (same host) or whose heartbeat is fresh
(another host) is a running task; any other is a killed one (``status``: stale).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

from ovpipe.runfolder.markers import APPLY, running_path
from ovpipe.step import save_json

HEARTBEAT_S = 10.0          # a running task touches running/{rank} this often
STALE_AFTER_S = 60.0        # a heartbeat older than this is a dead task


class RunningMarker:
    """``running/{rank}`` (``running/apply-{rank}``, ``running/reduce``) for the life of a task: host,
    pid, Slurm job; its mtime is the heartbeat."""

    def __init__(self, sdir: Path, rank: int, heartbeat_s: float | None = None, phase: str = "map"):
        self.path = running_path(sdir, rank, phase)
        self.heartbeat_s = HEARTBEAT_S if heartbeat_s is None else heartbeat_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self):
        job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
        task = os.environ.get("SLURM_ARRAY_TASK_ID")
        info = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                "slurm_job": (f"{job}_{task}" if job and task else job)}
        save_json(self.path, info)
        self._thread = threading.Thread(target=self._beat, name=f"ovpipe-heartbeat-{self.path.name}", daemon=True)
        self._thread.start()
        return self

    def _beat(self):
        while not self._stop.wait(self.heartbeat_s):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.path.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def rank_alive(path: Path) -> tuple[bool, dict]:
    try:
        info = json.loads(path.read_text())
        age = time.time() - path.stat().st_mtime
    except (OSError, ValueError):
        return False, {}
    info["heartbeat_age_s"] = round(age, 1)
    fresh = age < STALE_AFTER_S
    if info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int):
        return fresh and _pid_alive(info["pid"]), info
    return fresh, info


def running_ranks(sdir: Path) -> dict[str, dict]:
    """Tasks with a ``running/`` marker that are alive (local pid, or a fresh heartbeat elsewhere),
    keyed ``"3"`` (map rank 3), ``"apply 3"``, ``"reduce"``."""
    out = {}
    rdir = Path(sdir) / "running"
    if rdir.is_dir():
        for p in rdir.iterdir():
            if p.name.startswith(".tmp-"):
                continue
            phase, _, num = p.name.rpartition("-")
            if not (p.name.isdigit() or p.name == "reduce" or (phase == APPLY and num.isdigit())):
                continue
            alive, info = rank_alive(p)
            if alive:
                key = str(int(p.name)) if p.name.isdigit() else "reduce" if p.name == "reduce" else f"{phase} {int(num)}"
                out[key] = info
    return out


def describe_running(info: dict) -> str:
    where = f"pid {info.get('pid')} on {info.get('host')}"
    if info.get("slurm_job"):
        where += f", slurm job {info['slurm_job']}"
    return where + f", heartbeat {info.get('heartbeat_age_s')}s ago"
