"""``ovpipe status``: per step folder, its ranks done / running / failed / stale / pending, its reduce and
apply phases, whether its inputs changed since it ran, and the chain of its Slurm jobs.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ovpipe.runfolder.heartbeat import describe_running, rank_alive
from ovpipe.runfolder.markers import done_ranks, failure_path, is_finalized, is_reduced, log_path, running_path
from ovpipe.runfolder.upstream import stale_inputs


def _phase_status(sdir: Path, tasks: int, phase: str) -> dict:
    done = done_ranks(sdir, phase)
    failed, stale, running, pending = [], [], [], []
    for r in range(tasks):
        if r in done:
            continue
        log = log_path(sdir, r, phase)
        rp = running_path(sdir, r, phase)
        if rp.exists():
            alive, info = rank_alive(rp)
            if alive:
                running.append((r, describe_running(info)))
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
        alive, info = rank_alive(rp)
        if alive:
            return f"running ({describe_running(info)})"
        return "stale"
    return "failed" if failure_path(sdir, 0, "reduce").exists() else "pending"


def step_status(sdir: Path) -> dict:
    """Ranks done / running / failed / stale / pending: of the map phase (the only phase of most steps),
    or of the apply phase for a reduce-first step (``executor.json`` ``phases``: ``["reduce", "apply"]``).

    running: a ``running/{rank}`` marker whose task is alive (same host: its pid lives and the
    heartbeat is fresh; another host: the heartbeat is fresh). failed: ``failures/{rank}`` (the
    task raised). stale: started and neither done, failed nor alive (a killed task: its marker's
    pid is dead or its heartbeat old, or no marker but a non-empty log). pending: never started.
    A step with a reduce adds ``phases``: ``{"reduce": "done" | "running (…)" | "failed" | "stale" |
    "pending", "apply": {the same counts for the apply ranks}}``; ``order`` lists the phases as they run."""
    meta = json.loads((sdir / "executor.json").read_text())
    tasks = meta["tasks"]
    order = list(meta.get("phases") or ["map"])
    ranks = "map" if "map" in order else "apply"
    out = {"step": sdir.name, **_phase_status(sdir, tasks, ranks), "finalized": is_finalized(sdir), "order": order}
    if "apply" in order:
        out["phases"] = {"reduce": _reduce_status(sdir),
                         "apply": {k: out[k] for k in ("tasks", "done", "failed", "stale", "running", "pending")}
                         if ranks == "apply" else _phase_status(sdir, tasks, "apply")}
    return out


def slurm_chain(sdir: Path) -> tuple[list[str], bool]:
    """``slurm: map 12 → reduce 13 (afterok:12) → apply 14 (afterok:13) → merge 15 (afterok:14)``: the jobs of
    the last Slurm submit of the step, as ``slurm_jobs.json`` records them (no queue asked), and False.
    ``ovpipe status`` passes ``executors.slurm.status_lines`` instead, which adds each job's state."""
    try:
        rec = json.loads((Path(sdir) / "slurm_jobs.json").read_text())
    except (OSError, ValueError):
        return [], False
    parts: list[str] = []
    for j in rec.get("chain") or []:
        text = f"{j['phase']} {j['job']}" + (f" (afterok:{':'.join(j['after'])})" if j.get("after") else "")
        if parts and j["phase"] in ("map", "apply") and parts[-1].startswith(f"{j['phase']} "):
            parts[-1] += f", {text}"      # the chunks of one array phase (MaxArraySize), side by side
        else:
            parts.append(text)
    return ([f"    slurm: {' → '.join(parts)}"] if parts else []), False


def _rank_counts_line(label: str, st: dict, width: int = 16) -> str:
    return (f"{label:<{width}} {st['done']:>3}/{st['tasks']:<2} {len(st['running']):>7} {len(st['failed']):>6} "
            f"{len(st['stale']):>6} {len(st['pending']):>7}")


def _rank_detail_lines(st: dict, what: str) -> tuple[list[str], bool]:
    """The running / failed / stale ranks of one phase, and whether any failed or is stale."""
    lines = [f"    {what} {rank} running: {info}" for rank, info in st["running"]]
    lines += [f"    {what} {rank} failed: {log}" for rank, log in st["failed"]]
    lines += [f"    {what} {rank} killed (stale: neither done, failed nor running): {log}" for rank, log in st["stale"]]
    return lines, bool(st["failed"] or st["stale"])


def _first_start(sdir: Path) -> float:
    """When the step first ran here: its oldest task log (a rerun rewrites only the ranks it redoes), else
    when ``executor.json`` was last written."""
    times = []
    for p in [*sdir.glob("logs/*"), sdir / "executor.json"]:
        try:
            times.append(p.stat().st_mtime)
        except OSError:
            pass
    return min(times, default=0.0)


def pipeline_order(run_dir: Path) -> list[Path]:
    """The run's step folders (``RUN/<step>``, and one level down: ``pretrain/stage-<S>``, a stage is a
    step), in pipeline order: every folder after the inputs its ``executor.json`` recorded (run-relative
    folder names, as ``ovpipe.inputs`` resolved them when it ran). Among folders whose inputs are all
    listed, the one that first ran earliest comes first (then by name): a topological sort, so
    ``assign`` follows ``embed-images`` and ``ingest`` whatever their names. Inputs that are not step
    folders of this run (external parts) are ignored; a cycle (hand-made folders) is broken at its
    earliest folder."""
    import heapq

    run_dir = Path(run_dir)
    folders = sorted(p.parent for p in [*run_dir.glob("*/executor.json"), *run_dir.glob("*/*/executor.json")])
    label = {str(d.relative_to(run_dir)): d for d in folders}
    key = {name: (_first_start(d), name) for name, d in label.items()}
    needs: dict[str, set[str]] = {}
    for name, d in label.items():
        try:
            inputs = json.loads((d / "executor.json").read_text()).get("inputs") or {}
        except (OSError, ValueError, AttributeError):
            inputs = {}
        needs[name] = {str(k).strip("/") for k in inputs if str(k).strip("/") in label and str(k).strip("/") != name}
    users: dict[str, list[str]] = {name: [] for name in label}
    for name, ins in needs.items():
        for k in ins:
            users[k].append(name)
    waiting = {name: len(ins) for name, ins in needs.items()}
    ready = [key[n] for n, w in waiting.items() if w == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while len(order) < len(label):
        if not ready:     # a cycle: start it at its earliest folder
            heapq.heappush(ready, min(key[n] for n, w in waiting.items() if w > 0))
        _, name = heapq.heappop(ready)
        if waiting[name] < 0:
            continue
        waiting[name] = -1
        order.append(name)
        for u in users[name]:
            if waiting[u] > 0:
                waiting[u] -= 1
                if waiting[u] == 0:
                    heapq.heappush(ready, key[u])
    return [label[n] for n in order]


def print_status(run_dir: Path, out=None, slurm_lines=None) -> int:
    """``ovpipe status RUN``: one line per step in pipeline order (``pipeline_order``), then each running / failed / stale rank; a map → reduce →
    apply step adds its reduce and apply lines (a reduce-first step: its line counts the apply ranks, and
    a ``reduce first`` line follows), and a Slurm step the chain of its jobs. A finished step whose
    inputs changed since it ran (``stale_inputs``) shows ``stale`` in the ``final`` column, with why.
    Exit code 1 when a rank (or the reduce) failed or is stale (killed), or a job of its Slurm chain failed
    or was cancelled, else 0 (running or pending is no error). ``slurm_lines(sdir) -> (lines, failed)``
    describes a step's Slurm chain (default: the job ids only, ``slurm_chain``)."""
    out = out or sys.stdout
    run_dir = Path(run_dir)
    steps = pipeline_order(run_dir)
    if not steps:
        print(f"{run_dir}: no steps run yet", file=out)
        return 0
    rc = 0
    width = max(16, *(len(str(sdir.relative_to(run_dir))) for sdir in steps))
    # "killed": ranks started and neither done, failed nor alive; "stale" is the final column's word for a step
    # whose inputs changed since it ran (two different things, so two words)
    print(f"{'step':<{width}} {'done':>6} {'running':>7} {'failed':>6} {'killed':>6} {'pending':>7}  final", file=out)
    seen: dict = {}
    for sdir in steps:
        st = step_status(sdir)
        label = str(sdir.relative_to(run_dir))
        stale = stale_inputs(run_dir, label, seen)
        final = "stale" if stale and st["finalized"] else "yes" if st["finalized"] else "no"
        print(f"{_rank_counts_line(label, st, width)}  {final}", file=out)
        reduce_first = "map" not in st["order"]
        lines, bad = _rank_detail_lines(st, "apply rank" if reduce_first else "rank")
        lines += [f"    stale: {why}; rerun with --overwrite" for why in stale]
        progress = _progress_line(sdir)
        if progress:
            lines.insert(0, progress)
        if reduce_first:     # reduce → apply (the line above)
            red = st["phases"]["reduce"]
            lines.append(f"{'  └ reduce first':<{width}} {red:>6}")
            bad = bad or red in ("failed", "stale")
        elif "phases" in st:   # map (the line above) → reduce → apply
            red = st["phases"]["reduce"]
            lines.append(f"{'  ├ reduce':<{width}} {red:>6}")
            apply_lines, apply_bad = _rank_detail_lines(st["phases"]["apply"], "apply rank")
            lines += [_rank_counts_line("  └ apply", st["phases"]["apply"], width), *apply_lines]
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
    loss = f" (loss {p['loss']:.3f})" if isinstance(p.get("loss"), (int, float)) else ""
    return f"    at step {p.get('step')}/{p.get('steps')}{loss}"
