"""A step's inputs as the run folder sees them: finalized, and the same configs as when it was prepared.

``input_steps`` gives the step folders a step reads (``ovpipe.inputs.resolve``, the resolver its
reads go through too); ``prepare`` refuses to start until each is finalized, and records their config
hashes in ``executor.json`` (``{"inputs": {"ingest": "<config hash>"}}``). A rerun whose upstream
config changed (or whose set of input folders changed) is refused unless ``overwrite``; each task
re-checks at start (``check_inputs_current``: a Slurm array may start long after the submit), and
``ovpipe status`` shows a finished step whose inputs changed since as stale (``stale_inputs``).
"""
from __future__ import annotations

import json
from pathlib import Path

from ovpipe.runfolder import RunFolderError
from ovpipe.runfolder.markers import done_ranks, is_finalized

EXTERNAL = "external"       # the recorded "hash" of an input folder no executor made


def input_steps(run_dir: Path, step, cfg, name: str | None = None) -> list[Path]:
    """The step folders ``step`` reads under ``cfg``: every declared input, resolved by
    ``ovpipe.inputs.resolve`` (the same folders its tasks read)."""
    from ovpipe.inputs import input_folders

    run_dir = Path(run_dir)
    return [run_dir / f for f in input_folders(step, cfg, run_dir, name) if (run_dir / f).is_dir()]


def slurm_pending(d: Path) -> bool:
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
    run_dir = Path(run_dir)
    for d in input_steps(run_dir, step, cfg, name):
        key = d.relative_to(run_dir).as_posix()      # a nested folder (pretrain/stage-1) keeps its path
        meta_path = d / "executor.json"
        if not meta_path.exists():
            out[key] = EXTERNAL
            continue
        meta = json.loads(meta_path.read_text())
        if not is_finalized(d) and not (allow_pending and slurm_pending(d)):
            done = len(done_ranks(d))
            raise RunFolderError(
                f"{name or step.name}: its input step {key!r} is not finalized ({done}/{meta.get('tasks')} "
                f"ranks done); finish it first (rerun `ovpipe {meta.get('step', key)}` on this run folder)")
        out[key] = meta.get("config_hash")
    return out


def upstream_changes(have: dict, want: dict) -> list[str]:
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
        reasons = upstream_changes(recorded, upstream_hashes(run_dir, step, cfg, folder))
    except RunFolderError as e:
        reasons = [str(e).split(": ", 1)[-1]]
    for k, h in sorted(recorded.items()):
        if h != EXTERNAL and (run_dir / k / "executor.json").exists() and stale_inputs(run_dir, k, seen):
            reasons.append(f"input step {k!r} is stale")
    seen[folder] = reasons
    return reasons


def stale_input_steps(run_dir: Path, inputs: dict) -> list[str]:
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
