"""Local executor: the incomplete ranks in a process pool on this machine, with a tqdm bar.

The whole run — every rank, the reduce and apply ranks of a step that has them, and the finalize —
holds the step lock (``runfolder.lock.step_lock``):
a second command on the same step folder refuses, naming the holder, or waits with
``wait_lock``. At the start, under the lock and with no rank running, leftover ``.tmp-*``
files of killed runs are removed. Pool workers die with the parent: a parent-death signal
(Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``) and a watchdog thread polling ``os.getppid()``.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from ovpipe.executors.task import STOPPED, TaskFailed, finalize_step, reduce_step, run_task
from ovpipe.runfolder import RunFolderError
from ovpipe.runfolder.cleanup import clean_temp_files
from ovpipe.runfolder.heartbeat import running_ranks
from ovpipe.runfolder.lock import step_lock
from ovpipe.runfolder.markers import pending_ranks

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int, poll_s: float = 1.0) -> None:
    """Pool initializer: make this worker die when ``parent_pid`` does (no orphans running queued
    ranks, then idling forever, after the parent was killed)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:      # the parent died before the signal was armed
        os._exit(1)

    def watchdog() -> None:
        while True:
            threading.Event().wait(poll_s)
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watchdog, name="ovpipe-parent-watchdog", daemon=True).start()


class LocalExecutor:
    """``nproc``: the processes of a distributed step's task (``Step.distributed``), started by ``torchrun``
    on this machine (gloo on CPU, NCCL on GPU); one runs in this process."""

    def __init__(self, workers: int = 1, progress: bool = True, wait_lock: bool = False, nproc: int = 1):
        self.workers = max(1, workers)
        self.progress = progress
        self.wait_lock = wait_lock
        self.nproc = max(1, nproc)

    def run(self, step, run_dir: Path, tasks: int, name: str | None = None) -> dict:
        name = name or step.name
        sdir = Path(run_dir) / name
        with step_lock(sdir, wait=self.wait_lock):
            live = running_ranks(sdir)
            if live:
                raise RunFolderError(f"{sdir}: ranks {sorted(live)} are still running; wait for them")
            clean_temp_files(sdir)
            return self._run(step, Path(run_dir), tasks, name, sdir)

    def _run(self, step, run_dir: Path, tasks: int, name: str, sdir: Path) -> dict:
        """map ranks → reduce → apply ranks → finalize (the phases the step has: ``Step.phases``), all
        under the step lock."""
        if "map" in step.phases:
            self._run_phase(step, run_dir, tasks, name, pending_ranks(sdir, tasks), "map")
        if "apply" in step.phases:
            reduce_step(step.name, run_dir, name)
            self._run_phase(step, run_dir, tasks, name, pending_ranks(sdir, tasks, "apply"), "apply")
        return finalize_step(step.name, run_dir, name)

    def _run_phase(self, step, run_dir: Path, tasks: int, name: str, pending: list[int], phase: str) -> None:
        failures: list[str] = []
        from tqdm import tqdm

        bar = tqdm(total=tasks, initial=tasks - len(pending), desc=name if phase == "map" else f"{name} ({phase})",
                   unit="task", leave=False,
                   disable=not self.progress or step.distributed)    # one task: its own log shows its progress
        if step.distributed and self.nproc > 1:
            for rank in pending:
                self._torchrun(step, run_dir, name, rank, tasks)
                bar.update(1)
        elif self.workers == 1 or len(pending) <= 1:
            # In-process: cheaper than a pool for one worker, same task body.
            for rank in pending:
                try:
                    run_task(step.name, run_dir, rank, tasks, self.workers, name, phase)
                except TaskFailed as e:
                    failures.append(str(e))
                bar.update(1)
        else:
            # spawn, not fork: DuckDB/polars/torch thread pools do not survive fork.
            ctx = mp.get_context("spawn")
            with ProcessPoolExecutor(max_workers=min(self.workers, len(pending)), mp_context=ctx,
                                     initializer=_die_with_parent, initargs=(os.getpid(),)) as pool:
                futs = {pool.submit(run_task, step.name, str(run_dir), r, tasks, 1, name, phase): r for r in pending}
                for fut in as_completed(futs):
                    try:
                        fut.result()
                    except TaskFailed as e:
                        failures.append(str(e))
                    except Exception as e:  # a worker that died (OOM-kill, segfault)
                        failures.append(f"{name} {'' if phase == 'map' else phase + ' '}rank {futs[fut]} died: {e!r}")
                    bar.update(1)
        bar.close()
        if failures:
            what = "tasks" if phase == "map" else f"{phase} tasks"
            raise TaskFailed(f"{len(failures)} of {tasks} {what} failed; rerun the same command to retry them:\n  "
                             + "\n  ".join(sorted(failures)))

    def _torchrun(self, step, run_dir: Path, name: str, rank: int, tasks: int) -> None:
        """The task as ``nproc`` processes under ``torchrun --standalone`` (each runs ``ovpipe _task``; process 0
        keeps the markers). A process that stopped on a signal after saving (exit 128 + signum) is
        ``Stopped``; any other failure is ``TaskFailed`` naming the logs."""
        import subprocess

        from ovpipe.step import Stopped

        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.nproc}",
               "-m", "ovpipe.cli", "_task", step.name, "--run-dir", str(run_dir), "--rank", str(rank),
               "--world-size", str(tasks), "--name", name]
        rc = subprocess.call(cmd)
        if rc == 0:
            return
        sdir = Path(run_dir) / name
        if (sdir / STOPPED).exists():
            raise Stopped(int((sdir / STOPPED).read_text() or 0))
        raise TaskFailed(f"{name} rank {rank} ({self.nproc} processes under torchrun) failed with exit code {rc} "
                         f"(logs: {sdir / 'logs'})")

