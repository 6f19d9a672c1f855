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


# The rows a step's status/* counters count, where they are not the rows its key counters name: score writes a
# reward row per rollout and reward type (the answer's and the format's), so "rollouts 352; ok 528" read as a
# contradiction; "rewards ok 528" does not.
STATUS_ROWS: dict[str, str] = {"score": "rewards"}


def key_figures(step: str, counters: dict) -> str:
    parts = [f"{label} {_num(counters[k])}" for k, label in KEY_COUNTERS.get(step, ()) if k in counters]
    status = {k.split("/")[-1]: v for k, v in counters.items() if k.startswith("status/")}
    if status:
        bad = {s: v for s, v in status.items() if s != "ok" and v}
        rows = f"{STATUS_ROWS[step]} " if step in STATUS_ROWS else ""
        part = f"{rows}ok {_num(status.get('ok', 0))}, other {_num(sum(bad.values()))}"
        if bad:
            top = sorted(bad.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
            part += " (" + ", ".join(f"{s} {_num(v)}" for s, v in top) + (", …" if len(bad) > 3 else "") + ")"
        parts.append(part)
    reasons = {k.split("/", 1)[1]: v for k, v in counters.items() if k.startswith("reason/")}
    if reasons:
        parts.append(", ".join(f"{r} {_num(v)}" for r, v in sorted(reasons.items())))
    if not parts:        # a step with no entry: its first few counters
        parts = [f"{k} {_num(v)}" for k, v in sorted(counters.items())[:4]]
    return "; ".join(parts) or "done"      # a step that counts nothing (a report, an export) still says so


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


def _pass_at_1(folder: Path) -> dict:
    """{prompt_id: (reason, pass_at_1)} of a select step folder's selection parts."""
    import pyarrow.parquet as pq

    out = {}
    for part in sorted((folder / "selection").glob("part-*.parquet")):
        t = pq.read_table(part, columns=["prompt_id", "reason", "pass_at_1"])
        out.update({pid: (r, p) for pid, r, p in zip(*(t.column(c).to_pylist() for c in t.column_names))})
    return out


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def rl_loop_lines(run_dir) -> list[str]:
    """The loop closed: pass@1 before and after ``grpo``, on the prompts it trained and on the held-out ones.

    *Before* is ``select-base`` where the run has it — the start model re-rolled with the seeds the re-selection
    uses — else the selection the prompts came from (the grpo step's ``selection_step``, else the export's, else
    ``select``). That selection is biased upward on the prompts it kept (they were kept *because* their rollouts happened to score: a
    prompt whose 1 of 8 scored by luck regresses to its mean on any re-roll), so a fair before/after compares two
    fresh rollouts with the same seeds. *After* is every other select step folder (a re-selection on the trained
    model's rollouts). Trained = the prompts ``grpo.json`` lists for the splits its stages read; held out = that
    selection's ``held_out`` prompts. Empty without a grpo step."""
    import pyarrow.parquet as pq

    run_dir = Path(run_dir)
    folders = dict((f.name, m) for f, m in step_folders(run_dir, depth=1))
    grpo = next((n for n, m in folders.items() if m.get("step") == "grpo" and (run_dir / n / "stats.json").exists()),
                None)
    if grpo is None:
        return []
    gcfg = json.loads((run_dir / grpo / "config.json").read_text())
    export = gcfg.get("export_step", "export")
    ecfg = json.loads((run_dir / export / "config.json").read_text()) if (run_dir / export / "config.json").exists() \
        else {}
    selected = gcfg.get("selection_step") or ecfg.get("selection_step") or "select"
    before = "select-base" if "select-base" in folders else selected
    afters = [n for n, m in folders.items() if m.get("step") == "select" and n not in (before, selected)
              and (run_dir / n / "stats.json").exists()]
    if before not in folders or not afters:
        return []
    info = json.loads((run_dir / grpo / "grpo.json").read_text()) if (run_dir / grpo / "grpo.json").exists() else {}
    trained = {pid for ids in (info.get("prompts") or {}).values() for pid in ids}
    for split in [] if info.get("prompts") else info.get("splits", []):     # a grpo.json from before `prompts`
        path = run_dir / export / "verl" / f"{split}.parquet"
        if path.exists():
            trained |= {r["prompt_id"] for r in pq.read_table(path, columns=["extra_info"]).column("extra_info")
                        .to_pylist()}
    b = _pass_at_1(run_dir / before)
    sel = _pass_at_1(run_dir / selected) if selected in folders else b
    groups = {"trained": sorted(trained & set(b)),
              "held-out": sorted(pid for pid, (reason, _) in sel.items() if reason == "held_out" and pid in b)}
    lines = []
    for after in afters:
        a = _pass_at_1(run_dir / after)
        for name, ids in groups.items():
            ids = [i for i in ids if i in a]
            if not ids:
                continue
            p0, p1 = _mean(b[i][1] for i in ids), _mean(a[i][1] for i in ids)
            if p0 is None or p1 is None:
                continue
            lines.append(f"{name} prompts ({len(ids)}): pass@1 {p0:.3f} ({before}) → {p1:.3f} ({after}), "
                         f"{100 * (p1 - p0):+.1f} points")
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
        if meta.get("step") == "pretrain":     # the stages are the pretrain lines below (losses), once
            continue
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
    loop = rl_loop_lines(run_dir)
    if loop:
        out.append("  rl loop (grpo, then rollout → score → select on the trained model)")
        out += [f"    {ln}" for ln in loop]
    out.append(f"run folder: {run_dir}   (query it: ovpipe sql {run_dir} \"SELECT ...\"; ovpipe report {run_dir})")
    return "\n".join(out)
