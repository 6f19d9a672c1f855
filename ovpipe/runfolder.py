"""The run folder: ``RUN/<step>/{config.json, executor.json, completions/, stats/, logs/, <kind>/}``.

A task is done when its empty ``completions/{rank:05d}`` marker exists; the marker is
written last, after the task's parts and stats. A rerun skips done ranks, redoes the
others from scratch (their parts are simply overwritten), and refuses a changed task
count or config unless ``overwrite`` — mixing parts made under two configs would give a
manifest nobody asked for.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ovpipe.config import config_hash, config_json
from ovpipe.step import Stats, save_json

FINALIZED = "finalized"


class RunFolderError(RuntimeError):
    pass


def step_dir(run_dir: Path, step: str) -> Path:
    return Path(run_dir) / step


def prepare(run_dir: Path, step, cfg, tasks: int, overwrite: bool = False, name: str | None = None) -> Path:
    """Create or re-open ``RUN/<name>`` (default: the step's name) for ``tasks`` tasks of ``cfg``."""
    sdir = step_dir(run_dir, name or step.name)
    meta_path = sdir / "executor.json"
    want = {"step": step.name, "tasks": tasks, "config_hash": config_hash(cfg)}
    if meta_path.exists():
        have = json.loads(meta_path.read_text())
        changed = [k for k in ("tasks", "config_hash") if have.get(k) != want[k]]
        if changed and not overwrite:
            what = " and ".join("task count" if c == "tasks" else "config" for c in changed)
            detail = (f"tasks {have.get('tasks')} → {tasks}" if "tasks" in changed else
                      f"see {sdir/'config.json'}")
            raise RunFolderError(
                f"{sdir}: the {what} changed since the last run ({detail}); "
                f"rerun with --overwrite to discard its outputs, or use another --run-dir")
        if changed and overwrite:
            shutil.rmtree(sdir)
    elif sdir.exists() and overwrite:
        shutil.rmtree(sdir)
    for sub in ("completions", "stats", "logs"):
        (sdir / sub).mkdir(parents=True, exist_ok=True)
    (sdir / "config.json").write_text(config_json(cfg))
    save_json(meta_path, want)
    return sdir


def done_ranks(sdir: Path) -> set[int]:
    comp = sdir / "completions"
    if not comp.is_dir():
        return set()
    return {int(p.name) for p in comp.iterdir() if p.name.isdigit()}


def pending_ranks(sdir: Path, tasks: int) -> list[int]:
    done = done_ranks(sdir)
    return [r for r in range(tasks) if r not in done]


def failure_path(sdir: Path, rank: int) -> Path:
    return sdir / "failures" / f"{rank:05d}"


def mark_done(sdir: Path, rank: int) -> None:
    fp = failure_path(sdir, rank)
    if fp.exists():
        fp.unlink()
    (sdir / "completions" / f"{rank:05d}").touch()


def is_finalized(sdir: Path) -> bool:
    return (sdir / "completions" / FINALIZED).exists()


def merge_stats(sdir: Path, tasks: int) -> dict:
    """Per-rank stats plus the finalize stats, summed into ``stats.json``."""
    files = sorted((sdir / "stats").glob("*.json"))
    merged = Stats.merge([json.loads(f.read_text()) for f in files])
    merged["tasks"] = tasks
    save_json(sdir / "stats.json", merged)
    return merged


def step_status(sdir: Path) -> dict:
    """ranks done / failed / pending (failed: raised, or started and never finished)."""
    meta = json.loads((sdir / "executor.json").read_text())
    tasks = meta["tasks"]
    done = done_ranks(sdir)
    failed, pending = [], []
    for r in range(tasks):
        if r in done:
            continue
        log = sdir / "logs" / f"task_{r:05d}.log"
        if failure_path(sdir, r).exists() or (log.exists() and log.stat().st_size > 0):
            failed.append((r, str(log)))
        else:
            pending.append(r)
    return {"step": sdir.name, "tasks": tasks, "done": len(done), "failed": failed,
            "pending": pending, "finalized": is_finalized(sdir)}


def write_failure(sdir: Path, rank: int, text: str) -> None:
    fp = failure_path(sdir, rank)
    fp.parent.mkdir(parents=True, exist_ok=True)
    tmp = fp.with_name(f".tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, fp)
