"""The task body both executors run: load the saved config, run one rank, write its
parts, then its stats, then — last — its completion marker."""
from __future__ import annotations

import json
import logging
import os
import time
import traceback
from pathlib import Path

from ovpipe import runfolder
from ovpipe.config import load_config
from ovpipe.registry import get_step
from ovpipe.step import TaskContext, save_json

# Fault injection for resume tests and drills: OVPIPE_FAIL_RANKS="ingest:2,pack:0" makes
# those ranks raise after their work but before their completion marker (a killed task).
FAIL_ENV = "OVPIPE_FAIL_RANKS"


class TaskFailed(RuntimeError):
    pass


def _should_fail(step: str, rank: int) -> bool:
    spec = os.environ.get(FAIL_ENV, "")
    return f"{step}:{rank}" in {s.strip() for s in spec.split(",")}


def _file_logger(path: Path) -> logging.Handler:
    path.parent.mkdir(parents=True, exist_ok=True)
    h = logging.FileHandler(path, mode="w")
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(h)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    return h


def load_step_config(step, sdir: Path):
    return load_config(step.config, json.loads((sdir / "config.json").read_text()))


def run_task(step_name: str, run_dir: str | Path, rank: int, world_size: int, workers: int = 1,
             name: str | None = None) -> dict:
    """Run rank ``rank`` of ``step_name`` in ``run_dir``; returns its stats dict.

    Raises ``TaskFailed`` (after writing ``failures/{rank}`` and the traceback to the log)
    if the step raises; the completion marker is then absent and a rerun redoes the rank.
    """
    run_dir = Path(run_dir)
    step = get_step(step_name)
    name = name or step_name  # the step folder: a step can run twice in one run under two names
    sdir = run_dir / name
    handler = _file_logger(sdir / "logs" / f"task_{rank:05d}.log")
    log = logging.getLogger("ovpipe")
    marker = runfolder.RunningMarker(sdir, rank)
    try:
        marker.__enter__()   # running/{rank}: pid/host/Slurm job + heartbeat, removed at the end
        # Its input steps must still be finalized with the config this step was prepared on.
        runfolder.check_inputs_current(run_dir, sdir)
        # A restarted rank: drop the temp files a killed (or ENOSPC'd) earlier try left behind.
        runfolder.clean_temp_files(sdir, rank)
        cfg = load_step_config(step, sdir)
        # A (re)run rank invalidates an earlier finalize: it must see this rank's new part.
        (sdir / "completions" / runfolder.FINALIZED).unlink(missing_ok=True)
        task = TaskContext(step=name, rank=rank, world_size=world_size, run_dir=run_dir, workers=workers)
        log.info("start %s rank %d/%d", step_name, rank, world_size)
        t0 = time.perf_counter()
        step.run(cfg, task)
        task.stats.timings["total"] += time.perf_counter() - t0
        if _should_fail(name, rank):
            raise RuntimeError(f"injected failure ({FAIL_ENV}) in {name} rank {rank}")
        stats = task.stats.to_dict()
        save_json(sdir / "stats" / f"{rank:05d}.json", stats)
        runfolder.mark_done(sdir, rank)
        log.info("done %s rank %d: %s", step_name, rank, json.dumps(stats["counters"]))
        return stats
    except BaseException as e:
        tb = traceback.format_exc()
        log.error("rank %d failed:\n%s", rank, tb)
        runfolder.write_failure(sdir, rank, tb)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise TaskFailed(f"{name} rank {rank} failed: {e!r} (log: {sdir/'logs'/f'task_{rank:05d}.log'})") from e
    finally:
        marker.__exit__(None, None, None)
        logging.getLogger().removeHandler(handler)
        handler.close()


def finalize_step(step_name: str, run_dir: str | Path, name: str | None = None) -> dict:
    """After every rank is done: the step's global ``finalize`` (once), then merged stats."""
    run_dir = Path(run_dir)
    step = get_step(step_name)
    name = name or step_name
    sdir = run_dir / name
    meta = json.loads((sdir / "executor.json").read_text())
    pending = runfolder.pending_ranks(sdir, meta["tasks"])
    if pending:
        raise TaskFailed(f"{name}: ranks {pending} are not complete; rerun the step to finish them")
    if step.finalize is not None and not runfolder.is_finalized(sdir):
        handler = _file_logger(sdir / "logs" / "finalize.log")
        try:
            cfg = load_step_config(step, sdir)
            task = TaskContext(step=name, rank=0, world_size=meta["tasks"], run_dir=run_dir)
            t0 = time.perf_counter()
            step.finalize(cfg, task)
            task.stats.timings["finalize"] += time.perf_counter() - t0
            save_json(sdir / "stats" / "finalize.json", task.stats.to_dict())
        finally:
            logging.getLogger().removeHandler(handler)
            handler.close()
    (sdir / "completions" / runfolder.FINALIZED).touch()
    return runfolder.merge_stats(sdir, meta["tasks"])
