"""Creating or re-opening a step folder for a run (``prepare``), and telling a rerun that has nothing to do
(``up_to_date``).

A rerun skips done ranks, redoes the others from scratch (their parts are simply overwritten), and
refuses a changed task count, config or input step unless ``overwrite`` — mixing parts made under
two configs would give a manifest nobody asked for.
"""
from __future__ import annotations

import json
from pathlib import Path

from ovpipe.config import config_hash, config_json
from ovpipe.runfolder import RunFolderError, step_dir
from ovpipe.runfolder.cleanup import clear_step_dir
from ovpipe.runfolder.heartbeat import describe_running, running_ranks
from ovpipe.runfolder.lock import step_lock
from ovpipe.runfolder.markers import is_finalized, is_reduced, pending_ranks
from ovpipe.runfolder.upstream import stale_input_steps, upstream_changes, upstream_hashes
from ovpipe.step import save_json


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
                                 f"({'; '.join(describe_running(v) for _, v in sorted(live.items()))}); "
                                 f"wait for them or stop them first")
        inputs = upstream_hashes(run_dir, step, cfg, name)
        stale = stale_input_steps(Path(run_dir), inputs)
        if stale:    # rebuilding on a stale input would make an output that matches neither version
            raise RunFolderError(f"{sdir}: {'; '.join(stale)}")
        meta_path = sdir / "executor.json"
        want = {"step": step.name, "tasks": tasks, "config_hash": config_hash(cfg),
                "outputs": list(step.outputs), "inputs": inputs, "phases": list(step.phases)}
        if meta_path.exists():
            have = json.loads(meta_path.read_text())
            changed = [k for k in ("tasks", "config_hash") if have.get(k) != want[k]]
            upstream = upstream_changes(have["inputs"], inputs) if "inputs" in have else []
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
                clear_step_dir(sdir)
        elif overwrite:
            clear_step_dir(sdir)
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
        if ("map" in step.phases and pending_ranks(sdir, tasks)) or not is_finalized(sdir):
            return None
        if "apply" in step.phases and (not is_reduced(sdir) or pending_ranks(sdir, tasks, "apply")):
            return None
        if "inputs" in meta and meta["inputs"] != upstream_hashes(run_dir, step, cfg, name, allow_pending=False):
            return None
        if stale_input_steps(Path(run_dir), meta.get("inputs") or {}):
            return None
        return json.loads((sdir / "stats.json").read_text())
    except (OSError, ValueError, RunFolderError):
        return None
