"""One summary line per finished step, from its merged counters (``stats.json``): the figures a user
checks first — rows ok and bad for the steps that give rows a status, the step's own key counts
(packs and the bin lower bound, concepts, copies, rollouts, kept prompts) — then the task count, the
wall time and the step folder. The full counters stay in ``stats.json`` (``ovpipe status``)."""
from __future__ import annotations

import json
from pathlib import Path

# Per step (by its registered name): the counters worth a place on the line, in order, with labels.
KEY_COUNTERS: dict[str, tuple[tuple[str, str], ...]] = {
    "ingest": (("samples", "samples"), ("duplicates", "duplicates"), ("files", "files")),
    "embed-images": (("embedded", "embedded"),),
    "embed-concepts": (("concepts", "concepts"), ("empty_concepts", "empty")),
    "assign": (("images", "images"),),
    "index": (("images", "images indexed"), ("in_map", "on the map")),
    "balance": (("samples", "samples"), ("copies", "copies"), ("dropped", "dropped")),
    "mix": (("target", "target"), ("copies", "copies"), ("shortfall", "shortfall")),
    "recaption": (("captions", "captions"),),
    "lengths": (("samples", "samples"),),
    "pack": (("items", "samples"), ("bins", "packs"), ("lower_bound", "lower bound"), ("tokens", "tokens")),
    "pack-official": (("packs_written", "packs"), ("official_tokens", "official tokens"), ("official_fill", "fill")),
    "import-packs": (("packs_written", "packs"),),
    "rl-ingest": (("duplicates", "duplicates"),),
    "rollout": (("prompts", "prompts"), ("rollouts", "rollouts")),
    "score": (("rollouts", "rollouts"),),
    "select": (("pass1_zero", "pass@1 = 0"), ("pass1_between", "in (0, 1)"), ("pass1_one", "= 1")),
    "export": (("exported", "exported"),),
    "pretrain": (("steps", "steps"), ("packs", "packs"), ("samples", "samples")),
}


def _num(v: float) -> str:
    return f"{int(v):,}" if float(v).is_integer() else f"{v:.4g}"


def key_figures(step: str, counters: dict) -> str:
    parts = [f"{label} {_num(counters[k])}" for k, label in KEY_COUNTERS.get(step, ()) if k in counters]
    status = {k.split("/")[-1]: v for k, v in counters.items() if k.startswith("status/")}
    if status:
        bad = {s: v for s, v in status.items() if s != "ok" and v}
        part = f"ok {_num(status.get('ok', 0))}, other {_num(sum(bad.values()))}"
        if bad:
            top = sorted(bad.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
            part += " (" + ", ".join(f"{s} {_num(v)}" for s, v in top) + (", …" if len(bad) > 3 else "") + ")"
        parts.append(part)
    reasons = {k.split("/", 1)[1]: v for k, v in counters.items() if k.startswith("reason/")}
    if reasons:
        parts.append(", ".join(f"{r} {_num(v)}" for r, v in sorted(reasons.items())))
    if not parts:        # a step with no entry: its first few counters
        parts = [f"{k} {_num(v)}" for k, v in sorted(counters.items())[:4]]
    return "; ".join(parts)


def step_line(name: str, step: str, counters: dict, tasks: int, seconds: float | None, where) -> str:
    took = f", {seconds:.1f} s" if seconds is not None else ""
    return f"{name}: {key_figures(step, counters)} — {tasks} task(s){took} → {where}"


STAGES = (("curation", "curation."), ("packing", "packing."), ("rl", "rl_select."))


def step_folders(run_dir, depth: int = 3):
    """Every finished step folder under ``run_dir`` (nested run folders such as ``RUN/gym/<game>`` too),
    as (folder, executor.json)."""
    run_dir = Path(run_dir)
    for d in range(1, depth + 1):
        for meta in sorted(run_dir.glob("*/" * d + "executor.json")):
            if (meta.parent / "stats.json").exists():
                yield meta.parent, json.loads(meta.read_text())


def stage_metrics(path) -> list[dict]:
    """A pretrain stage's ``metrics.jsonl``, one record per step in step order: the last one written for a
    step, so a step replayed after a resume counts once."""
    path = Path(path)
    last = {}
    for ln in (path.read_text().splitlines() if path.exists() else []):
        if ln.strip():
            m = json.loads(ln)
            last[m["step"]] = m
    return [last[s] for s in sorted(last)]


def _pretrain_lines(run_dir) -> list[str]:
    lines = []
    for m in sorted(Path(run_dir).glob("pretrain/stage-*/metrics.jsonl")):
        rows = stage_metrics(m)
        if rows:
            stage = m.parent.name.removeprefix("stage-")
            lines.append(f"stage {stage}: {len(rows)} steps, loss {rows[0]['loss']:.3f} → {rows[-1]['loss']:.3f}, "
                         f"{sum(r.get('samples', 0) for r in rows):,} samples")
    exports = sorted(p.parent for p in Path(run_dir).glob("pretrain/*/ovpipe_export.json"))
    lines += [f"exported: {e}" for e in exports]
    return lines


def run_summary(run_dir) -> str:
    """The end of ``make demo``: per stage, the steps that ran with their key figures, the pretraining
    losses first → last, and where the run folder is."""
    from ovpipe.registry import all_steps

    modules = all_steps()
    run_dir = Path(run_dir)
    by_stage: dict[str, list[str]] = {s: [] for s, _ in STAGES}
    by_stage["other"] = []
    for folder, meta in step_folders(run_dir):
        counters = json.loads((folder / "stats.json").read_text()).get("counters", {})
        module = modules.get(meta.get("step", ""), "")
        stage = next((s for s, prefix in STAGES if module.startswith(prefix)), "other")
        label = str(folder.relative_to(run_dir))
        by_stage[stage].append(f"{label}: {key_figures(meta.get('step', ''), counters)}")
    by_stage["pretrain"] = _pretrain_lines(run_dir)
    out = [f"ovpipe summary of {run_dir}"]
    for stage in ("curation", "packing", "pretrain", "rl", "other"):
        if by_stage.get(stage):
            out.append(f"  {stage}")
            out += [f"    {ln}" for ln in by_stage[stage]]
    out.append(f"run folder: {run_dir}   (query it: ovpipe sql {run_dir} \"SELECT ...\"; ovpipe report {run_dir})")
    return "\n".join(out)
