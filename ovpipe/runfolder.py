"""The run folder: ``RUN/<step>/{config.json, executor.json, completions/, stats/, logs/, running/, <kind>/}``.

A task is done when its empty ``completions/{rank:05d}`` marker exists; the marker is
written last, after the task's parts and stats. A rerun skips done ranks, redoes the
others from scratch (their parts are simply overwritten), and refuses a changed task
count or config unless ``overwrite`` — mixing parts made under two configs would give a
manifest nobody asked for.

Run safety (what keeps two commands, a dead upstream or a killed parent from corrupting a step):

* **Lock.** ``step_lock`` takes ``fcntl.flock`` on ``RUN/<step>/.lock`` and writes the holder's
  host, pid, start time and command into it. ``prepare`` holds it while it (re)creates the
  folder, the local executor for the whole run (every rank and the finalize), the Slurm
  executor while it submits. A second command refuses (``StepLocked``, naming the holder) or,
  with ``wait=True`` (``--wait-lock``), waits. The lock file itself is never deleted (an
  ``--overwrite`` clears everything else), so a lock is always on the file others open.
  The lock is re-entrant within one process.
* **Upstream.** ``input_steps`` gives the step folders a step reads (``ovpipe.inputs.resolve``, the
  resolver its reads go through too); ``prepare`` refuses to
  start until each is finalized, and records their config hashes in ``executor.json``
  (``{"inputs": {"ingest": "<config hash>"}}``). A rerun whose upstream config changed (or
  whose set of input folders changed) is refused unless ``overwrite``; each task re-checks at
  start (a Slurm array may start long after the submit).
* **Running ranks.** A task writes ``running/{rank:05d}`` (host, pid, Slurm job id) and touches
  it every ``HEARTBEAT_S`` seconds; it is removed when the task ends. ``step_status`` tells a
  running rank (live pid / fresh heartbeat) from a failed one (``failures/{rank}``) and a stale
  one (started, neither done nor failed nor alive: killed).
* **Temp files.** Atomic writes go through ``.tmp-{pid}-{name}`` files; a kill or a full disk
  leaves them behind. ``clean_temp_files`` removes every ``.tmp-*`` under the step folder; the
  local executor calls it at the start of a run, under the lock, when no rank is running
  (so no live writer can own one), and each task removes its own rank's part/stats temp
  files when it (re)starts (the Slurm case, where no lock spans the tasks).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

from ovpipe.config import config_hash, config_json
from ovpipe.step import Stats, save_json

FINALIZED = "finalized"
REDUCED = "reduced"         # completions/reduced: the reduce ran; it holds the digest of reduced/
APPLY = "apply"             # apply-phase markers: completions/apply-{rank:05d} (content: the reduce digest applied)
LOCK_NAME = ".lock"
HEARTBEAT_S = 10.0          # a running task touches running/{rank} this often
STALE_AFTER_S = 60.0        # a heartbeat older than this is a dead task
EXTERNAL = "external"       # the recorded "hash" of an input folder no executor made


class RunFolderError(RuntimeError):
    pass


class StepLocked(RunFolderError):
    pass


def step_dir(run_dir: Path, step: str) -> Path:
    return Path(run_dir) / step


# ---------------------------------------------------------------------------------------- lock

_HELD: dict[str, list] = {}     # lock path -> [fd, depth]: re-entrant within a process
_HELD_GUARD = threading.Lock()


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


def _clear_step_dir(sdir: Path) -> None:
    """``--overwrite``: remove everything in the step folder but its lock file (held by us)."""
    for p in sdir.iterdir():
        if p.name == LOCK_NAME:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


# ------------------------------------------------------------------------------------ upstream

def input_steps(run_dir: Path, step, cfg, name: str | None = None) -> list[Path]:
    """The step folders ``step`` reads under ``cfg``: every declared input, resolved by
    ``ovpipe.inputs.resolve`` (the same folders its tasks read)."""
    from ovpipe.inputs import input_folders

    run_dir = Path(run_dir)
    return [run_dir / f for f in input_folders(step, cfg, run_dir, name) if (run_dir / f).is_dir()]


def _slurm_pending(d: Path) -> bool:
    """The folder's Slurm merge job is still queued or running (its finalize will come)."""
    f = d / "slurm_jobs.json"
    if not f.exists():
        return False
    try:
        from ovpipe.slurm_jobs import job_active

        merge = json.loads(f.read_text()).get("merge")
        return bool(merge) and job_active(merge)
    except (OSError, ValueError):
        return False


def upstream_hashes(run_dir: Path, step, cfg, name: str | None = None, allow_pending: bool = True) -> dict:
    """``{folder: config hash}`` of the inputs of ``step``; raises ``RunFolderError`` if one is not
    finalized. A folder without ``executor.json`` (parts written by hand, or by another tool) is an
    external input: accepted as is and recorded as ``"external"``. With ``allow_pending`` an input
    whose Slurm merge job is still live is accepted (the tasks re-check when they start)."""
    out = {}
    for d in input_steps(run_dir, step, cfg, name):
        meta_path = d / "executor.json"
        if not meta_path.exists():
            out[d.name] = EXTERNAL
            continue
        meta = json.loads(meta_path.read_text())
        if not is_finalized(d) and not (allow_pending and _slurm_pending(d)):
            done = len(done_ranks(d))
            raise RunFolderError(
                f"{name or step.name}: its input step {d.name!r} is not finalized ({done}/{meta.get('tasks')} "
                f"ranks done); finish it first (rerun `ovpipe {meta.get('step', d.name)}` on this run folder)")
        out[d.name] = meta.get("config_hash")
    return out


def _upstream_changes(have: dict, want: dict) -> list[str]:
    msgs = []
    for k in sorted(set(have) | set(want)):
        if k not in want:
            msgs.append(f"input step {k!r} is gone")
        elif k not in have:
            msgs.append(f"input step {k!r} is new")
        elif have[k] != want[k]:
            msgs.append(f"input step {k!r} was rerun with another config (config hash {have[k]} → {want[k]})")
    return msgs


def stale_inputs(run_dir: Path, folder: str, _seen: dict | None = None) -> list[str]:
    """Why step folder ``folder`` no longer matches what it read: an input step rerun with another config,
    gone, new or not finalized (its inputs resolved now, ``ovpipe.inputs.resolve``, against the config
    hashes ``executor.json`` recorded), or an input that is itself stale. ``[]`` when it is current, or
    when it cannot be judged (no recorded inputs, a step not in the registry)."""
    from ovpipe.inputs import upstream_config

    seen = {} if _seen is None else _seen
    if folder in seen:
        return seen[folder]
    seen[folder] = []                      # a cycle (hand-made folders) ends here
    run_dir = Path(run_dir)
    try:
        recorded = json.loads((run_dir / folder / "executor.json").read_text())["inputs"]
        step, cfg = upstream_config(run_dir, folder)
    except (OSError, ValueError, KeyError, ImportError):
        return []
    try:
        reasons = _upstream_changes(recorded, upstream_hashes(run_dir, step, cfg, folder))
    except RunFolderError as e:
        reasons = [str(e).split(": ", 1)[-1]]
    for k, h in sorted(recorded.items()):
        if h != EXTERNAL and (run_dir / k / "executor.json").exists() and stale_inputs(run_dir, k, seen):
            reasons.append(f"input step {k!r} is stale")
    seen[folder] = reasons
    return reasons


def _stale_input_steps(run_dir: Path, inputs: dict) -> list[str]:
    return [f"its input step {k!r} is stale ({'; '.join(r)}); rerun {k!r} first"
            for k, h in sorted(inputs.items()) if h != EXTERNAL and (r := stale_inputs(run_dir, k))]


def check_inputs_current(run_dir: Path, sdir: Path) -> None:
    """At task start: every input recorded in ``executor.json`` is still finalized, same config."""
    meta = json.loads((sdir / "executor.json").read_text())
    for k, h in (meta.get("inputs") or {}).items():
        if h == EXTERNAL:
            continue
        d = Path(run_dir) / k
        try:
            now = json.loads((d / "executor.json").read_text()).get("config_hash")
        except (OSError, ValueError):
            now = None
        if now != h:
            raise RunFolderError(f"{sdir.name}: its input step {k!r} changed since this step was "
                                 f"prepared (config hash {h} → {now}); rerun with --overwrite")
        if not is_finalized(d):
            raise RunFolderError(f"{sdir.name}: its input step {k!r} is not finalized; finish it first")


# ------------------------------------------------------------------------------------- prepare

def _changed_fields(old_json: Path, cfg) -> list[str]:
    try:
        old = json.loads(old_json.read_text())
    except (OSError, ValueError):
        return []
    new = json.loads(config_json(cfg))
    # "field: old → new", so the refusal says what changed, not only that something did
    return [f"{k}: {json.dumps(old.get(k))} → {json.dumps(new.get(k))}"
            for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def prepare(run_dir: Path, step, cfg, tasks: int, overwrite: bool = False, name: str | None = None,
            wait_lock: bool = False) -> Path:
    """Create or re-open ``RUN/<name>`` (default: the step's name) for ``tasks`` tasks of ``cfg``.

    Under the step lock: refuses while another command holds it (``wait_lock``: waits), while
    a rank of the step is still running (a Slurm task of an earlier submit), until its input
    steps are finalized, and — unless ``overwrite`` — when the task count, the config or an
    input step's config changed since the last run."""
    sdir = step_dir(run_dir, name or step.name)
    with step_lock(sdir, wait=wait_lock):
        live = running_ranks(sdir)
        if live:
            raise RunFolderError(f"{sdir}: ranks {sorted(live)} are still running "
                                 f"({'; '.join(_describe_running(v) for _, v in sorted(live.items()))}); "
                                 f"wait for them or stop them first")
        inputs = upstream_hashes(run_dir, step, cfg, name)
        stale = _stale_input_steps(Path(run_dir), inputs)
        if stale:    # rebuilding on a stale input would make an output that matches neither version
            raise RunFolderError(f"{sdir}: {'; '.join(stale)}")
        meta_path = sdir / "executor.json"
        want = {"step": step.name, "tasks": tasks, "config_hash": config_hash(cfg),
                "outputs": list(step.outputs), "inputs": inputs, "phases": list(step.phases)}
        if meta_path.exists():
            have = json.loads(meta_path.read_text())
            changed = [k for k in ("tasks", "config_hash") if have.get(k) != want[k]]
            upstream = _upstream_changes(have["inputs"], inputs) if "inputs" in have else []
            if (changed or upstream) and not overwrite:
                parts = []
                if "tasks" in changed:
                    parts.append(f"the task count changed (tasks {have.get('tasks')} → {tasks})")
                if "config_hash" in changed:
                    fields = _changed_fields(sdir / "config.json", cfg)
                    parts.append("the config changed" + (f" (fields: {', '.join(fields)};" if fields else " (")
                                 + f" see {sdir / 'config.json'})")
                parts += upstream
                raise RunFolderError(
                    f"{sdir}: {'; '.join(parts)} since the last run; "
                    f"rerun with --overwrite to discard its outputs, or use another --run-dir")
            if changed or upstream:
                _clear_step_dir(sdir)
        elif overwrite:
            _clear_step_dir(sdir)
        for sub in ("completions", "stats", "logs"):
            (sdir / sub).mkdir(parents=True, exist_ok=True)
        (sdir / "config.json").write_text(config_json(cfg))
        save_json(meta_path, want)
    return sdir


def up_to_date(run_dir: Path, step, cfg, tasks: int, name: str | None = None) -> dict | None:
    """The merged stats of a step folder that is fully done (every rank, finalize) under this very
    config and task count *and* on the same inputs (the config hashes recorded in ``executor.json``
    still match, each input still finalized) — a rerun is then a no-op that writes nothing.
    ``None`` otherwise: go through ``prepare``, which explains what changed."""
    sdir = step_dir(run_dir, name or step.name)
    try:
        meta = json.loads((sdir / "executor.json").read_text())
        if (meta.get("step"), meta.get("tasks"), meta.get("config_hash")) != (step.name, tasks, config_hash(cfg)):
            return None
        if pending_ranks(sdir, tasks) or not is_finalized(sdir):
            return None
        if step.apply is not None and (not is_reduced(sdir) or pending_ranks(sdir, tasks, "apply")):
            return None
        if "inputs" in meta and meta["inputs"] != upstream_hashes(run_dir, step, cfg, name, allow_pending=False):
            return None
        if _stale_input_steps(Path(run_dir), meta.get("inputs") or {}):
            return None
        return json.loads((sdir / "stats.json").read_text())
    except (OSError, ValueError, RunFolderError):
        return None


# ------------------------------------------------------------------------------ ranks & status

def rank_name(rank: int, phase: str = "map") -> str:
    """The name of a rank's marker files: ``00003`` (map, as every step always had), ``apply-00003``."""
    return f"{rank:05d}" if phase == "map" else f"{phase}-{rank:05d}"


def reduce_digest(sdir: Path) -> str | None:
    """The digest of the reduce's artifacts recorded when it completed (None: not reduced)."""
    try:
        return (Path(sdir) / "completions" / REDUCED).read_text().strip() or None
    except OSError:
        return None


def is_reduced(sdir: Path) -> bool:
    return reduce_digest(sdir) is not None


def mark_reduced(sdir: Path) -> str:
    """Record the reduce as done, with a digest of ``reduced/*`` (names + bytes): an apply rank done
    under another digest (the reduce was redone and came out different) is pending again."""
    import hashlib

    h = hashlib.sha256()
    rdir = Path(sdir) / "reduced"
    for f in sorted(p for p in rdir.rglob("*") if p.is_file() and not p.name.startswith(".")) if rdir.is_dir() else []:
        h.update(str(f.relative_to(rdir)).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    digest = h.hexdigest()[:16]
    fp = failure_path(sdir, 0, "reduce")
    fp.unlink(missing_ok=True)
    from manifests.io import atomic_write   # (pyarrow: not at import, so `ovpipe status` stays light)

    with atomic_write(Path(sdir) / "completions" / REDUCED) as tmp:
        tmp.write_text(digest + "\n")
    return digest


def done_ranks(sdir: Path, phase: str = "map") -> set[int]:
    """Ranks with a completion marker. Apply ranks count only if they applied the current reduce."""
    comp = sdir / "completions"
    if not comp.is_dir():
        return set()
    if phase == "map":
        return {int(p.name) for p in comp.iterdir() if p.name.isdigit()}
    digest = reduce_digest(sdir)
    if digest is None:
        return set()
    prefix = f"{phase}-"
    out = set()
    for p in comp.iterdir():
        if p.name.startswith(prefix) and p.name[len(prefix):].isdigit():
            try:
                if p.read_text().strip() == digest:
                    out.add(int(p.name[len(prefix):]))
            except OSError:
                pass
    return out


def pending_ranks(sdir: Path, tasks: int, phase: str = "map") -> list[int]:
    done = done_ranks(sdir, phase)
    return [r for r in range(tasks) if r not in done]


def failure_path(sdir: Path, rank: int, phase: str = "map") -> Path:
    return sdir / "failures" / ("reduce" if phase == "reduce" else rank_name(rank, phase))


def running_path(sdir: Path, rank: int, phase: str = "map") -> Path:
    return sdir / "running" / ("reduce" if phase == "reduce" else rank_name(rank, phase))


def mark_done(sdir: Path, rank: int, phase: str = "map") -> None:
    fp = failure_path(sdir, rank, phase)
    if fp.exists():
        fp.unlink()
    marker = sdir / "completions" / rank_name(rank, phase)
    if phase == "map":
        marker.touch()
    else:
        marker.write_text((reduce_digest(sdir) or "") + "\n")


def is_finalized(sdir: Path) -> bool:
    return (sdir / "completions" / FINALIZED).exists()


def merge_stats(sdir: Path, tasks: int) -> dict:
    """Per-rank stats plus the finalize stats, summed into ``stats.json``."""
    files = sorted((sdir / "stats").glob("*.json"))
    merged = Stats.merge([json.loads(f.read_text()) for f in files])
    merged["tasks"] = tasks
    save_json(sdir / "stats.json", merged)
    return merged


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


def _rank_alive(path: Path) -> tuple[bool, dict]:
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
            alive, info = _rank_alive(p)
            if alive:
                key = str(int(p.name)) if p.name.isdigit() else "reduce" if p.name == "reduce" else f"{phase} {int(num)}"
                out[key] = info
    return out


def _describe_running(info: dict) -> str:
    where = f"pid {info.get('pid')} on {info.get('host')}"
    if info.get("slurm_job"):
        where += f", slurm job {info['slurm_job']}"
    return where + f", heartbeat {info.get('heartbeat_age_s')}s ago"


def log_path(sdir: Path, rank: int, phase: str = "map") -> Path:
    """``logs/task_00003.log`` (map), ``logs/apply_00003.log``, ``logs/reduce.log``."""
    if phase == "reduce":
        return sdir / "logs" / "reduce.log"
    return sdir / "logs" / f"{'task' if phase == 'map' else phase}_{rank:05d}.log"


def _phase_status(sdir: Path, tasks: int, phase: str) -> dict:
    done = done_ranks(sdir, phase)
    failed, stale, running, pending = [], [], [], []
    for r in range(tasks):
        if r in done:
            continue
        log = log_path(sdir, r, phase)
        rp = running_path(sdir, r, phase)
        if rp.exists():
            alive, info = _rank_alive(rp)
            if alive:
                running.append((r, _describe_running(info)))
                continue
        if failure_path(sdir, r, phase).exists():
            failed.append((r, str(log)))
        elif rp.exists() or (log.exists() and log.stat().st_size > 0 and phase == "map"):
            stale.append((r, str(log)))
        else:
            pending.append(r)
    return {"tasks": tasks, "done": len(done), "failed": failed, "stale": stale, "running": running,
            "pending": pending}


def _reduce_status(sdir: Path) -> str:
    """done | running (…) | failed | stale | pending"""
    if is_reduced(sdir):
        return "done"
    rp = running_path(sdir, 0, "reduce")
    if rp.exists():
        alive, info = _rank_alive(rp)
        if alive:
            return f"running ({_describe_running(info)})"
        return "stale"
    return "failed" if failure_path(sdir, 0, "reduce").exists() else "pending"


def step_status(sdir: Path) -> dict:
    """Ranks done / running / failed / stale / pending (of the map phase, the only phase of most steps).

    running: a ``running/{rank}`` marker whose task is alive (same host: its pid lives and the
    heartbeat is fresh; another host: the heartbeat is fresh). failed: ``failures/{rank}`` (the
    task raised). stale: started and neither done, failed nor alive (a killed task: its marker's
    pid is dead or its heartbeat old, or no marker but a non-empty log). pending: never started.
    A three-phase step adds ``phases``: ``{"reduce": "done" | "running (…)" | "failed" | "stale" |
    "pending", "apply": {the same counts for the apply ranks}}``."""
    meta = json.loads((sdir / "executor.json").read_text())
    tasks = meta["tasks"]
    out = {"step": sdir.name, **_phase_status(sdir, tasks, "map"), "finalized": is_finalized(sdir)}
    if "apply" in meta.get("phases", ()):
        out["phases"] = {"reduce": _reduce_status(sdir), "apply": _phase_status(sdir, tasks, "apply")}
    return out


def slurm_chain(sdir: Path) -> tuple[list[str], bool]:
    """``slurm: map 12 → reduce 13 (afterok:12) → apply 14 (afterok:13) → merge 15 (afterok:14)``: the jobs of
    the last Slurm submit of the step, as ``slurm_jobs.json`` records them (no queue asked), and False.
    ``ovpipe status`` passes ``executors.slurm.status_lines`` instead, which adds each job's state."""
    try:
        rec = json.loads((Path(sdir) / "slurm_jobs.json").read_text())
    except (OSError, ValueError):
        return [], False
    parts = [f"{j['phase']} {j['job']}" + (f" (afterok:{':'.join(j['after'])})" if j.get("after") else "")
             for j in rec.get("chain") or []]
    return ([f"    slurm: {' → '.join(parts)}"] if parts else []), False


def _rank_counts_line(label: str, st: dict) -> str:
    return (f"{label:<16} {st['done']:>3}/{st['tasks']:<2} {len(st['running']):>7} {len(st['failed']):>6} "
            f"{len(st['stale']):>5} {len(st['pending']):>7}")


def _rank_detail_lines(st: dict, what: str) -> tuple[list[str], bool]:
    """The running / failed / stale ranks of one phase, and whether any failed or is stale."""
    lines = [f"    {what} {rank} running: {info}" for rank, info in st["running"]]
    lines += [f"    {what} {rank} failed: {log}" for rank, log in st["failed"]]
    lines += [f"    {what} {rank} stale (killed? neither done nor running): {log}" for rank, log in st["stale"]]
    return lines, bool(st["failed"] or st["stale"])


def print_status(run_dir: Path, out=None, slurm_lines=None) -> int:
    """``ovpipe status RUN``: one line per step, then each running / failed / stale rank; a three-phase
    step adds its reduce and apply lines, and a Slurm step the chain of its jobs. A finished step whose
    inputs changed since it ran (``stale_inputs``) shows ``stale`` in the ``final`` column, with why.
    Exit code 1 when a rank (or the reduce) failed or is stale (killed), or a job of its Slurm chain failed
    or was cancelled, else 0 (running or pending is no error). ``slurm_lines(sdir) -> (lines, failed)``
    describes a step's Slurm chain (default: the job ids only, ``slurm_chain``)."""
    out = out or sys.stdout
    run_dir = Path(run_dir)
    # step folders, and step folders one level down (``pretrain/stage-<S>``: a stage is a step)
    steps = sorted(p.parent for p in [*run_dir.glob("*/executor.json"), *run_dir.glob("*/*/executor.json")])
    if not steps:
        print(f"{run_dir}: no steps run yet", file=out)
        return 0
    rc = 0
    print(f"{'step':<16} {'done':>6} {'running':>7} {'failed':>6} {'stale':>5} {'pending':>7}  final", file=out)
    seen: dict = {}
    for sdir in steps:
        st = step_status(sdir)
        label = str(sdir.relative_to(run_dir))
        stale = stale_inputs(run_dir, label, seen)
        final = "stale" if stale and st["finalized"] else "yes" if st["finalized"] else "no"
        print(f"{_rank_counts_line(label, st)}  {final}", file=out)
        lines, bad = _rank_detail_lines(st, "rank")
        lines += [f"    stale: {why}; rerun with --overwrite" for why in stale]
        progress = _progress_line(sdir)
        if progress:
            lines.insert(0, progress)
        if "phases" in st:   # a three-phase step: map (the line above) → reduce → apply
            red = st["phases"]["reduce"]
            lines.append(f"{'  ├ reduce':<16} {red:>6}")
            apply_lines, apply_bad = _rank_detail_lines(st["phases"]["apply"], "apply rank")
            lines += [_rank_counts_line("  └ apply", st["phases"]["apply"]), *apply_lines]
            bad = bad or apply_bad or red in ("failed", "stale")
        chain, chain_failed = (slurm_lines or slurm_chain)(sdir)
        lines += chain
        bad = bad or chain_failed
        for line in lines:
            print(line, file=out)
        rc |= int(bad)
    # Slurm jobs of a folder with no executor.json (submitted outside the step model)
    for sdir in sorted(p.parent for p in run_dir.glob("*/*/slurm_jobs.json") if not (p.parent / "executor.json").exists()):
        chain, chain_failed = (slurm_lines or slurm_chain)(sdir)
        if chain:
            print(str(sdir.relative_to(run_dir)), file=out)
            for line in chain:
                print(line, file=out)
        rc |= int(chain_failed)
    return rc


def _progress_line(sdir: Path) -> str | None:
    """``progress.json`` of a long single task (a pretrain stage): ``at step 12/30 (loss 5.61)``."""
    try:
        p = json.loads((Path(sdir) / "progress.json").read_text())
    except (OSError, ValueError):
        return None
    loss = f" (loss {p['loss']:.4f})" if isinstance(p.get("loss"), (int, float)) else ""
    return f"    at step {p.get('step')}/{p.get('steps')}{loss}"


def write_failure(sdir: Path, rank: int, text: str, phase: str = "map") -> None:
    from manifests.io import atomic_write

    with atomic_write(failure_path(sdir, rank, phase)) as tmp:
        tmp.write_text(text)


# ---------------------------------------------------------------------------------- temp files

def clean_temp_files(sdir: Path, rank: int | None = None) -> int:
    """Remove leftover ``.tmp-{pid}-{name}`` files (a kill or ENOSPC between write and rename).

    ``rank=None``: every ``.tmp-*`` under the step folder — call only under the step lock with no
    rank running. ``rank``: only that rank's own part and stats temp files (``part-{rank:05d}.*``
    under ``<kind>/``, ``{rank:05d}.json`` under ``stats/``), safe while other ranks run."""
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
    n = 0
    for p in files:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            n += 1
    return n
