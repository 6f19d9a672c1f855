"""The task body both executors run: load the saved config, run one rank, write its
parts, then its stats, then — last — its completion marker.

A step with a reduce (``Step.reduce``/``Step.apply``, ``ovpipe/step.py``) runs up to three bodies:
``run_task(phase="map")`` per rank (marker ``completions/{rank}``; none in a reduce-first step),
``reduce_step`` once (marker ``completions/reduced``, holding
a digest of ``reduced/``), ``run_task(phase="apply")`` per rank (marker ``completions/apply-{rank}``,
holding the digest it applied), then ``finalize_step``. A (re)run map rank invalidates the reduce
and the finalize; a redone reduce whose artifact comes out different makes every apply rank
pending again (their markers hold the old digest); a (re)run apply rank invalidates the finalize."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import traceback
import warnings
from pathlib import Path

from ovpipe import console
from ovpipe.config import load_config
from ovpipe.registry import get_step
from ovpipe.runfolder import markers
from ovpipe.runfolder.cleanup import clean_temp_files
from ovpipe.runfolder.heartbeat import RunningMarker
from ovpipe.runfolder.upstream import check_inputs_current
from ovpipe.step import Stopped, TaskContext, save_json

# Fault injection for resume tests and drills: OVPIPE_FAIL_RANKS="ingest:2,pack:0" makes
# those ranks raise after their work but before their completion marker (a killed task).
FAIL_ENV = "OVPIPE_FAIL_RANKS"


STOPPED = "stopped"       # a task saved and stopped on a signal (``ovpipe.step.Stopped``): holds the signal


class TaskFailed(RuntimeError):
    pass


def _should_fail(step: str, rank: int) -> bool:
    spec = os.environ.get(FAIL_ENV, "")
    return f"{step}:{rank}" in {s.strip() for s in spec.split(",")}


def _file_logger(path: Path) -> logging.Handler:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")          # a fresh log per try, then appended: console.task_output writes to it too
    h = logging.FileHandler(path, mode="a")
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(h)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    return h


def load_step_config(step, sdir: Path):
    return load_config(step.config, json.loads((sdir / "config.json").read_text()))


def run_task(step_name: str, run_dir: str | Path, rank: int, world_size: int, workers: int = 1,
             name: str | None = None, phase: str = "map") -> dict:
    """Run rank ``rank`` of ``step_name`` in ``run_dir`` (``phase``: ``map``, the step's ``run``, or
    ``apply``, its ``apply`` after the reduce); returns its stats dict.

    Raises ``TaskFailed`` (after writing ``failures/{rank}`` and the traceback to the log)
    if the step raises; the completion marker is then absent and a rerun redoes the rank.
    """
    if phase not in ("map", "apply"):
        raise ValueError(f"phase must be map or apply, got {phase!r}")
    run_dir = Path(run_dir)
    step = get_step(step_name)
    if phase not in step.phases:
        raise ValueError(f"step {step_name!r} has no {phase} phase (its phases: {' → '.join(step.phases)})")
    name = name or step_name  # the step folder: a step can run twice in one run under two names
    sdir = run_dir / name
    proc = int(os.environ.get("RANK", "0")) if step.distributed else 0
    if proc != 0:
        return _run_process(step, run_dir, sdir, name, proc)
    who = f"{name} rank {rank}" if phase == "map" else f"{name} apply rank {rank}"
    log = logging.getLogger("ovpipe")
    with _task_scope(sdir, rank, phase, who):
        # Its input steps must still be finalized with the config this step was prepared on.
        check_inputs_current(run_dir, sdir)
        if phase == "apply":
            if not markers.is_reduced(sdir):
                raise TaskFailed(f"{who}: the reduce has not run (no {sdir / 'completions' / markers.REDUCED}); "
                                 f"rerun the step")
            if rank in markers.done_ranks(sdir, "apply"):   # a Slurm array over every rank, resumed
                log.info("%s: already applied the current reduce", who)
                return json.loads((sdir / "stats" / f"{markers.rank_name(rank, phase)}.json").read_text())
        # A restarted rank: drop the temp files a killed (or ENOSPC'd) earlier try left behind.
        clean_temp_files(sdir, rank)
        cfg = load_step_config(step, sdir)
        # A (re)run rank invalidates an earlier finalize (it must see this rank's new part) and, for a
        # map rank of a three-phase step, the reduce (it must see this rank's new partial).
        (sdir / "completions" / markers.FINALIZED).unlink(missing_ok=True)
        if phase == "map":
            (sdir / "completions" / markers.REDUCED).unlink(missing_ok=True)
        task = TaskContext.for_step(step, cfg, run_dir, rank, world_size, name, workers=workers, phase=phase)
        log.info("start %s %s rank %d/%d on %s", step_name, phase, rank, world_size, _node())
        t0 = time.perf_counter()
        (step.run if phase == "map" else step.apply)(cfg, task)
        task.stats.timings["total" if phase == "map" else "apply"] += time.perf_counter() - t0
        _record_peak_rss(task, markers.rank_name(rank, phase))
        if _should_fail(name if phase == "map" else f"{name}/apply", rank):
            raise RuntimeError(f"injected failure ({FAIL_ENV}) in {who}")
        stats = task.stats.to_dict()
        save_json(sdir / "stats" / f"{markers.rank_name(rank, phase)}.json", stats)
        markers.mark_done(sdir, rank, phase)
        log.info("done %s %s rank %d: %s", step_name, phase, rank, json.dumps(stats["counters"]))
        return stats


def _node() -> str:
    """Where this process runs: the Slurm node's name (two nodes may share a host), else the host's."""
    import socket

    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _run_process(step, run_dir: Path, sdir: Path, name: str, proc: int) -> dict:
    """Process ``proc`` > 0 of a distributed step's one task: the same body, its output in
    ``logs/process_{proc:05d}.log``; markers, stats and failures are process 0's (an exception here ends
    this process non-zero, and the launcher — torchrun, srun ``--kill-on-bad-exit`` — stops the group)."""
    with console.task_output(sdir / "logs" / f"process_{proc:05d}.log"):
        print(f"{name}: process {proc} of {os.environ.get('WORLD_SIZE', '?')} on {_node()}", flush=True)
        cfg = load_step_config(step, sdir)
        step.run(cfg, TaskContext.for_step(step, cfg, run_dir, 0, 1, name))
    return {}


@contextlib.contextmanager
def _task_scope(sdir: Path, rank: int, phase: str, who: str):
    """What every task of a step (a map or apply rank, the reduce) runs inside: its log file, its
    ``running/`` marker (pid/host/Slurm job + heartbeat, removed at the end) and a fresh peak-memory
    count; on an exception, the traceback in the log and ``failures/``, re-raised as ``TaskFailed``
    (interrupts as they are) — the completion marker is then absent and a rerun redoes the task."""
    log_file = markers.log_path(sdir, rank, phase)
    handler = _file_logger(log_file)
    marker = RunningMarker(sdir, rank, phase=phase)
    output = contextlib.ExitStack()
    try:
        output.enter_context(console.task_output(log_file))   # third-party noise → the log, not the terminal
        # Each task's log shows its own warnings, whatever an earlier task in this process already warned
        # (entering catch_warnings resets the once-per-location registries), and a task's filters end with it.
        output.enter_context(warnings.catch_warnings())
        marker.__enter__()
        (sdir / STOPPED).unlink(missing_ok=True)
        _reset_peak_rss()    # a pool worker runs several tasks: each records its own peak
        yield
    except Stopped as e:      # saved and stopped on a signal: neither done nor failed; a rerun resumes
        logging.getLogger("ovpipe").info("%s: %s", who, e)
        (sdir / STOPPED).write_text(f"{e.signum}\n")    # what the launcher (torchrun) cannot pass on
        raise
    except BaseException as e:
        tb = traceback.format_exc()
        logging.getLogger("ovpipe").error("%s failed:\n%s", who, tb)
        markers.write_failure(sdir, rank, tb, phase)
        if isinstance(e, (KeyboardInterrupt, SystemExit, TaskFailed)):
            raise
        raise TaskFailed(f"{who} failed: {e!r} (log: {log_file})") from e
    finally:
        marker.__exit__(None, None, None)
        output.close()
        logging.getLogger().removeHandler(handler)
        handler.close()


PEAK_RSS = "peak_rss_bytes/"      # + the task's name: the key of its peak in its stats' ``info``


def _reset_peak_rss() -> None:
    """Reset this process's VmHWM to its current RSS (Linux ``clear_refs`` 5), so the peak a task
    records is its own and not an earlier task's in the same pool worker."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _record_peak_rss(task: TaskContext, who: str) -> None:
    """``info["peak_rss_bytes/<rank, reduce or finalize>"]`` in the task's stats (merged into ``stats.json``):
    what each task of a step needed, for sizing the cluster's memory per task."""
    from ovpipe.mapreduce import vmhwm_bytes

    peak = vmhwm_bytes()
    if peak is not None:
        task.stats.info[f"{PEAK_RSS}{who}"] = peak


def recorded_peaks(sdir: Path) -> dict[str, int]:
    """{task: peak resident bytes} of the tasks of step folder ``sdir`` that have finished so far, as each
    recorded it in ``stats/`` (VmHWM of the process that ran it, reset as it started): map ranks
    ``00003``, apply ranks ``apply-00003`` and ``reduce`` (the names of their ``running/`` markers), and
    ``finalize``. The one peak-memory figure: a benchmark reads it here rather than polling the processes."""
    peaks = {}
    for f in sorted((Path(sdir) / "stats").glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            for k, v in json.loads(f.read_text()).get("info", {}).items():
                if k.startswith(PEAK_RSS):
                    peaks[k[len(PEAK_RSS):]] = v
    return peaks


def _after_map_ranks(step_name: str, run_dir, name: str | None):
    """The step, its folder and ``executor.json`` — refused while a map rank is not complete (a
    reduce-first step has none)."""
    run_dir = Path(run_dir)
    step = get_step(step_name)
    name = name or step_name
    sdir = run_dir / name
    meta = json.loads((sdir / "executor.json").read_text())
    pending = markers.pending_ranks(sdir, meta["tasks"]) if "map" in step.phases else []
    if pending:
        raise TaskFailed(f"{name}: map ranks {pending} are not complete; rerun the step to finish them")
    return run_dir, step, name, sdir, meta


def reduce_step(step_name: str, run_dir: str | Path, name: str | None = None) -> str:
    """Once, after every map rank (first thing, for a reduce-first step): the step's ``reduce`` (partials → ``reduced/``), then the
    ``completions/reduced`` marker with the artifact's digest. A no-op when already reduced.
    Returns the digest."""
    run_dir, step, name, sdir, meta = _after_map_ranks(step_name, run_dir, name)
    digest = markers.reduce_digest(sdir)
    if digest is not None:
        return digest
    with _task_scope(sdir, 0, "reduce", f"{name} reduce"):
        check_inputs_current(run_dir, sdir)
        # A restarted reduce (a requeued Slurm job): drop what a killed earlier try left in reduced/.
        for leftover in (sdir / "reduced").glob(".tmp-*") if (sdir / "reduced").is_dir() else []:
            leftover.unlink(missing_ok=True)
        cfg = load_step_config(step, sdir)
        (sdir / "completions" / markers.FINALIZED).unlink(missing_ok=True)
        task = TaskContext.for_step(step, cfg, run_dir, 0, meta["tasks"], name, phase="reduce")
        t0 = time.perf_counter()
        step.reduce(cfg, task)
        task.stats.timings["reduce"] += time.perf_counter() - t0
        _record_peak_rss(task, "reduce")
        save_json(sdir / "stats" / "reduce.json", task.stats.to_dict())
        digest = markers.mark_reduced(sdir)
        logging.getLogger("ovpipe").info("reduce %s done: digest %s", name, digest)
        return digest


def finalize_step(step_name: str, run_dir: str | Path, name: str | None = None) -> dict:
    """After every rank is done: the step's global ``finalize`` (once), then merged stats."""
    run_dir, step, name, sdir, meta = _after_map_ranks(step_name, run_dir, name)
    if step.apply is not None:
        if not markers.is_reduced(sdir):
            raise TaskFailed(f"{name}: the reduce has not run; rerun the step")
        pending = markers.pending_ranks(sdir, meta["tasks"], "apply")
        if pending:
            raise TaskFailed(f"{name}: apply ranks {pending} are not complete; rerun the step to finish them")
    if step.finalize is not None and not markers.is_finalized(sdir):
        handler = _file_logger(sdir / "logs" / "finalize.log")
        try:
            with console.task_output(sdir / "logs" / "finalize.log"):
                cfg = load_step_config(step, sdir)
                task = TaskContext.for_step(step, cfg, run_dir, 0, meta["tasks"], name, phase="finalize")
                _reset_peak_rss()    # (this process may have run tasks before: the local executor)
                t0 = time.perf_counter()
                step.finalize(cfg, task)
                task.stats.timings["finalize"] += time.perf_counter() - t0
                _record_peak_rss(task, "finalize")
                save_json(sdir / "stats" / "finalize.json", task.stats.to_dict())
        finally:
            logging.getLogger().removeHandler(handler)
            handler.close()
    merged = markers.merge_stats(sdir, meta["tasks"])
    # the marker last: whoever waits on it (``--wait``, the next step's check, ``ovpipe status``) then
    # finds the step's stats.json already written
    (sdir / "completions" / markers.FINALIZED).touch()
    return merged
