"""What each page shows, as plain dicts for its template: one function per page, every figure from a DuckDB
aggregate over the run's views (``viewer.catalog.RunCatalog``), never a whole manifest.
"""
from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np

from viewer import charts
from packing.compute_balance import balanced_group, epoch_start, stream_index_sql
from viewer.catalog import RunCatalog, pretrain_stages
from viewer.files import check_path

CURVE_POINTS = 2000         # ranks kept per head-to-tail curve (all of the first 200, then evenly spaced)
PER_PAGE = 50


def _curve(cat: RunCatalog, column: str) -> list[tuple[int, int]]:
    n = cat.one("SELECT count(*) AS n FROM concept_counts")["n"]
    every = max(1, n // CURVE_POINTS)
    rows = cat.rows(f"SELECT rn, c FROM (SELECT row_number() OVER (ORDER BY {column} DESC, concept_id) AS rn, "
                    f"{column} AS c FROM concept_counts) WHERE c > 0 AND (rn <= 200 OR rn % ? = 0 OR rn = ?) "
                    f"ORDER BY rn", [every, n])
    return [(r["rn"], r["c"]) for r in rows]


def concepts(cat: RunCatalog, show: int = 25) -> dict:
    if not cat.has("concept_counts"):
        return {"missing": "concept_counts (run `ovpipe balance`)"}
    head = cat.rows("SELECT concept_id, text, count_before, count_after FROM concept_counts "
                    "ORDER BY count_before DESC, concept_id LIMIT ?", [show])
    tail = cat.rows("SELECT concept_id, text, count_before, count_after FROM concept_counts WHERE count_before > 0 "
                    "ORDER BY count_before, concept_id LIMIT ?", [show])
    totals = cat.one("SELECT count(*) AS concepts, sum(count_before) AS before, sum(count_after) AS after, "
                     "count(*) FILTER (WHERE count_before = 0) AS unused FROM concept_counts")
    return {"chart": charts.head_tail(_curve(cat, "count_before"), _curve(cat, "count_after")),
            "head": head, "tail": tail, "totals": totals}


def concept(cat: RunCatalog, concept_id: int, show: int = 24) -> dict:
    """One concept: the samples whose top-1 concept it is, kept (copies > 0) beside dropped (copies = 0)."""
    info = (cat.one("SELECT concept_id, text, count_before, count_after FROM concept_counts WHERE concept_id = ?",
                    [concept_id]) if cat.has("concept_counts") else None) or {"concept_id": concept_id}
    out = {"info": info, "kept": [], "dropped": []}
    if not cat.has("assignments"):
        return out
    copies = "b.copies" if cat.has("balanced") else "NULL"
    join = "LEFT JOIN balanced b USING (sample_id)" if cat.has("balanced") else ""
    for side, cond in (("kept", f"coalesce({copies}, 1) > 0"), ("dropped", f"{copies} = 0")):
        out[side] = cat.rows(f"SELECT a.sample_id, a.scores[1] AS score, {copies} AS copies FROM assignments a "
                             f"{join} WHERE a.concept_ids[1] = ? AND {cond} ORDER BY a.scores[1] DESC, a.sample_id "
                             f"LIMIT ?", [concept_id, show])
        out[side + "_n"] = cat.one(f"SELECT count(*) AS n FROM assignments a {join} WHERE a.concept_ids[1] = ? "
                                   f"AND {cond}", [concept_id])["n"]
    return out


def _seq_len(run_dir: Path, step: str) -> int | None:
    try:
        return int(json.loads((run_dir / step / "config.json").read_text())["seq_len"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class LayoutTooLarge(ValueError):
    """A ``/packs`` layout whose one step holds more packs than the page shows."""


def packs(cat: RunCatalog, step: str | None, page: int, layout: dict | None = None,
          max_step_packs: int = 16384) -> dict:
    steps = sorted(cat.pack_dirs)
    if not steps:
        return {"missing": "packs (run `ovpipe pack`)", "steps": []}
    step = step if step in cat.pack_dirs else steps[0]
    glob = (cat.pack_dirs[step] / "part-*.parquet").as_posix().replace("'", "''")
    src = f"read_parquet('{glob}')"
    seq_len = _seq_len(cat.run_dir, step)
    denom = seq_len or cat.one(f"SELECT max(total_tokens) AS m FROM {src}")["m"] or 1
    hist = cat.rows(f"SELECT floor(total_tokens * 50.0 / ?) / 50 AS bin, count(*) AS n FROM {src} GROUP BY 1 ORDER BY 1",
                    [denom])
    summary = cat.one(f"SELECT count(*) AS packs, sum(len(sample_ids)) AS samples, avg(total_tokens) / ? AS fill "
                      f"FROM {src}", [denom])
    has_cost = "cost" in {r["column_name"] for r in cat.rows(f"DESCRIBE SELECT * FROM {src}")}
    cost = "cost" if has_cost else "NULL::DOUBLE AS cost"
    rows = cat.rows(f"SELECT pack_id, len(sample_ids) AS samples, total_tokens, {cost}, shard FROM {src} "
                    f"ORDER BY pack_id LIMIT ? OFFSET ?", [PER_PAGE, page * PER_PAGE])
    return {"steps": steps, "step": step, "seq_len": seq_len, "summary": summary, "rows": rows, "page": page,
            "ranks": step_ranks(cat, step, src, layout or {}, max_step_packs) if has_cost else None,
            "pages": -(-summary["packs"] // PER_PAGE),
            "chart": charts.bars(f"Fill of the packs of {step}", {"packs": [(r["bin"], r["n"]) for r in hist]},
                                 "fill (total tokens / seq_len)", "packs")}


def step_ranks(cat: RunCatalog, step: str, src: str, layout: dict, max_step_packs: int = 16384) -> dict:
    """One training step's DP ranks side by side: the packs each rank reads at that step and their summed cost,
    under a layout (``dp``, ``mb`` packs a micro-batch, ``ga`` micro-batches a step; default: the one the pack
    step balanced for, else DP 8 × 1), and the straggler loss under it over the run's steps: the packs the run's
    pretrain stages read of the step's balanced stream, every epoch they reach (one epoch at least;
    ``packing.compute_balance.run_straggler_loss``'s figure). DuckDB computes both: Python reads back the one
    step's packs and one row of totals, never the manifest's cost column (an 85M-sample run has millions of
    packs)."""
    try:
        cfg = json.loads((cat.run_dir / step / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    dp = int(layout.get("dp") or cfg.get("balance_dp") or 8)
    mb = int(layout.get("mb") or cfg.get("balance_micro_batch") or 1)
    ga = int(layout.get("ga") or cfg.get("balance_grad_accum") or 1)
    G = dp * mb * ga
    if G > max_step_packs:
        raise LayoutTooLarge(f"dp × mb × ga = {dp} × {mb} × {ga} = {G}: the page shows a step of at most "
                             f"{max_step_packs} packs")
    info = cat.one(f"SELECT count(*) AS n, count(*) FILTER (WHERE cost IS NULL) AS unknown, min(pack_id) AS lo, "
                   f"max(pack_id) AS hi FROM {src}")
    n = info["n"]
    group = balanced_group(cfg)
    # the steps of the run: the packs its pretrain stages read of this step's stream, and one epoch at least
    epoch = int(epoch_start(1, n, group)) * group if n else 0
    read = max((s["steps"] * s["gbs"] for s in pretrain_stages(cat.run_dir) if s["data"] == step), default=0)
    seen, from_stages = max(read, epoch), read > epoch
    n_steps = seen // G
    at = min(int(layout.get("at") or 0), max(n_steps - 1, 0))
    # a pack's place in pack_id order is pack_id itself when the ids are 0..n-1, as the pack step writes them,
    # else a window over the ids; a stream position q reads the pack at place stream_packs(q) (every epoch's
    # whole balanced groups, then the carried leftover: packing.compute_balance, Epochs)
    pos = (f"SELECT pack_id, pack_id AS p, cost FROM {src}" if (info["lo"], info["hi"]) == (0, n - 1) else
           f"SELECT pack_id, row_number() OVER (ORDER BY pack_id) - 1 AS p, cost FROM {src}")
    stream = (lambda a, b: f"SELECT q, x.pack_id, x.cost FROM range({a}, {b}) t(q) "
                         f"JOIN ({pos}) x ON x.p = {stream_index_sql('q', max(n, 1), group)}")
    shown = cat.rows(f"SELECT pack_id, cost, (q % ?) // ? % ? AS rank FROM ({stream(at * G, (at + 1) * G)}) ORDER BY q",
                     [G, mb, dp]) if n_steps else []
    ranks = [{"rank": r, "packs": [], "cost": 0.0} for r in range(dp)]
    for row in shown:
        r = ranks[row["rank"]]
        r["packs"].append(row["pack_id"])
        r["cost"] += np.nan if row["cost"] is None else row["cost"]
    mean = float(np.mean([r["cost"] for r in ranks])) if ranks else 0.0
    loss = None
    if n_steps and not info["unknown"]:         # a pack without a cost: the figure is undefined
        got = cat.one(f"WITH s AS (SELECT q // ? AS step, (q % ?) // ? % ? AS rank, cost "
                      f"FROM ({stream(0, n_steps * G)})), "
                      f"r AS (SELECT step, rank, sum(cost) AS c FROM s GROUP BY 1, 2), "
                      f"t AS (SELECT step, max(c) AS top, avg(c) AS mean FROM r GROUP BY 1) "
                      f"SELECT avg(top / mean - 1) FILTER (WHERE mean > 0) AS loss FROM t",
                      [G, G, mb, dp])
        loss = float(got["loss"]) if got["loss"] is not None else 0.0
    return {"dp": dp, "mb": mb, "ga": ga, "at": at, "steps": n_steps, "epochs": n_steps * G / n if n else 0.0,
            "from_stages": from_stages, "ranks": ranks, "mean": mean,
            "balanced_for": (cfg.get("balance_dp"), cfg.get("balance_micro_batch"), cfg.get("balance_grad_accum"))
            if cfg.get("balance_dp") else None, "loss": loss,
            "slowest": max((r["cost"] for r in ranks), default=0.0) / mean - 1 if mean > 0 else None,
            "chart": charts.bars(f"Step {at + 1}: each DP rank's cost", {"cost": [(r["rank"], r["cost"]) for r in ranks]},
                                 "DP rank", "cost")}


def _pack_members(shard: Path, pack_id: int) -> dict:
    """The ``.json`` and ``.mask.npy`` members of one pack's tar entry (read in place, nothing extracted)."""
    prefix = f"{int(pack_id):012d}."
    got = {}
    with tarfile.open(shard) as tf:
        for m in tf:
            if m.name.startswith(prefix) and m.name[len(prefix):] in ("json", "mask.npy"):
                got[m.name[len(prefix):]] = tf.extractfile(m).read()
                if len(got) == 2:
                    break
    return got


def _runs(mask: np.ndarray) -> list[tuple[int, int, int]]:
    """Run-length segments ``(start, length, value)`` of a 0/1 mask."""
    if not len(mask):
        return []
    cut = np.flatnonzero(np.diff(mask)) + 1
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [len(mask)]])
    return [(int(s), int(e - s), int(mask[s])) for s, e in zip(starts, ends)]


def pack(cat: RunCatalog, step: str, pack_id: int, roots: list[Path]) -> dict | None:
    """One pack: its sub-samples in sequence order with text and image tokens (``lengths``), the loss mask as
    runs (from the pack's entry in its shard), and where each sample starts."""
    if step not in cat.pack_dirs:
        return None
    glob = (cat.pack_dirs[step] / "part-*.parquet").as_posix().replace("'", "''")
    row = cat.one(f"SELECT * FROM read_parquet('{glob}') WHERE pack_id = ?", [pack_id])
    if row is None:
        return None
    seq_len = _seq_len(cat.run_dir, step) or row["total_tokens"]
    by_id = {}
    if cat.has("lengths"):
        by_id = {r["sample_id"]: r for r in cat.rows(
            "SELECT sample_id, any_value(text_tokens) AS text_tokens, any_value(image_tokens) AS image_tokens, "
            "any_value(target_tokens) AS target_tokens FROM lengths WHERE list_contains(?, sample_id) GROUP BY 1",
            [list(row["sample_ids"])])}
    mask_runs, loss_tokens = [], None
    shard = cat.run_dir / step / "data" / (row["shard"] or "")
    if row["shard"] and shard.is_file():
        members = _pack_members(check_path(shard, roots), pack_id)
        if "mask.npy" in members:
            mask = np.load(io.BytesIO(members["mask.npy"]), allow_pickle=False).astype(np.uint8)
            mask_runs, loss_tokens = _runs(mask), int(mask.sum())
    samples = []
    for sid, off, n in zip(row["sample_ids"], row["offsets"], row["lengths"]):
        ln = by_id.get(sid, {})
        samples.append({"sample_id": sid, "offset": off, "length": n, "text_tokens": ln.get("text_tokens"),
                        "image_tokens": ln.get("image_tokens"), "target_tokens": ln.get("target_tokens")})
    return {"step": step, "row": row, "seq_len": seq_len, "samples": samples, "mask_runs": mask_runs,
            "loss_tokens": loss_tokens}


def training(cat: RunCatalog) -> dict:
    out = {"grpo": grpo_training(cat)}
    if not cat.has("train_metrics"):
        return {**out, "missing": "train_metrics (run `ovpipe pretrain`)"}
    rows = cat.rows("SELECT stage, step, loss, lr, mfu, CASE WHEN step_s > 0 THEN data_wait_s / step_s END AS wait "
                    "FROM train_metrics ORDER BY stage, step")
    stages = sorted({r["stage"] for r in rows}, key=lambda s: float(s) if s.replace(".", "").isdigit() else 1e9)

    def series(col):
        return {f"stage {s}": ([r["step"] for r in rows if r["stage"] == s], [r[col] for r in rows if r["stage"] == s])
                for s in stages}

    summary = cat.rows("SELECT stage, count(*) AS steps, min(loss) AS min_loss, arg_max(loss, step) AS last_loss, "
                       "avg(mfu) AS mfu, sum(data_wait_s) / nullif(sum(step_s), 0) AS wait, sum(packs) AS packs "
                       "FROM train_metrics GROUP BY stage ORDER BY stage")
    return {**out, "summary": summary, "charts": [
        charts.lines("Loss", series("loss"), "step", "loss"),
        charts.lines("Learning rate", series("lr"), "step", "lr"),
        charts.lines("MFU", series("mfu"), "step", "MFU"),
        charts.lines("Data-wait share of the step", series("wait"), "step", "data wait / step time")]}


def grpo_training(cat: RunCatalog) -> dict | None:
    """The RL stage's curves (``grpo_metrics``), one line per grpo step folder and stage; None without it."""
    if not cat.has("grpo_metrics"):
        return None
    rows = cat.rows("SELECT folder, stage, step, reward_mean, zero_std_group_share, token_utilization, "
                    "completion_len_mean, step_time_s FROM grpo_metrics ORDER BY folder, stage, step")
    keys = sorted({(r["folder"], r["stage"]) for r in rows})

    def series(col):
        return {f"{f} {s}": ([r["step"] for r in rows if (r["folder"], r["stage"]) == (f, s)],
                             [r[col] for r in rows if (r["folder"], r["stage"]) == (f, s)]) for f, s in keys}

    summary = cat.rows("SELECT folder, stage, count(*) AS steps, arg_min(reward_mean, step) AS first_reward, "
                       "arg_max(reward_mean, step) AS last_reward, avg(zero_std_group_share) AS zero_std, "
                       "avg(token_utilization) AS util, avg(step_time_s) AS step_s FROM grpo_metrics "
                       "GROUP BY ALL ORDER BY folder, stage")
    return {"summary": summary, "charts": [
        charts.lines("GRPO reward (mean of the step's rollouts)", series("reward_mean"), "step", "reward"),
        charts.lines("Groups with zero reward spread", series("zero_std_group_share"), "step", "share"),
        charts.lines("Token utilization", series("token_utilization"), "step", "share"),
        charts.lines("Completion length", series("completion_len_mean"), "step", "tokens"),
        charts.lines("Step time", series("step_time_s"), "step", "s")]}


def rl(cat: RunCatalog, page: int) -> dict:
    if not cat.has("selection"):
        return {"missing": "selection (run `ovpipe select`)"}
    hist = cat.rows("SELECT CASE WHEN kept THEN 'kept' ELSE 'dropped' END AS side, floor(pass_at_1 * 20) / 20 AS bin, "
                    "count(*) AS n FROM selection WHERE pass_at_1 IS NOT NULL GROUP BY 1, 2 ORDER BY 2")
    gaps = cat.rows("SELECT CASE WHEN kept THEN 'kept' ELSE 'dropped' END AS side, floor(gap * 20) / 20 AS bin, "
                    "count(*) AS n FROM selection WHERE gap IS NOT NULL GROUP BY 1, 2 ORDER BY 2")
    reasons = cat.rows("SELECT reason, count(*) AS n FROM selection GROUP BY 1 ORDER BY 2 DESC, 1")
    rows = cat.rows("SELECT prompt_id, source, n, correct, pass_at_1, pass_at_n, gap, kept, reason FROM selection "
                    "ORDER BY prompt_id LIMIT ? OFFSET ?", [PER_PAGE, page * PER_PAGE])
    total = cat.one("SELECT count(*) AS n FROM selection")["n"]

    def split(pts):
        return {side: [(r["bin"], r["n"]) for r in pts if r["side"] == side] for side in ("kept", "dropped")}

    return {"reasons": reasons, "rows": rows, "page": page, "pages": -(-total // PER_PAGE), "total": total,
            "charts": [charts.bars("Pass rate (Pass@1) per prompt", split(hist), "Pass@1", "prompts"),
                       charts.bars("Pass@N − Pass@1 gap per prompt", split(gaps), "gap", "prompts")]}


def prompt(cat: RunCatalog, prompt_id: str) -> dict | None:
    p = (cat.one("SELECT prompt_id, source, category, question, len(images) AS n_images, ground_truth, answer_type, "
                 "status, error FROM rl_prompts WHERE prompt_id = ? LIMIT 1", [prompt_id])
         if cat.has("rl_prompts") else None)
    sel = cat.one("SELECT * FROM selection WHERE prompt_id = ?", [prompt_id]) if cat.has("selection") else None
    if p is None and sel is None:
        return None
    rollouts = []
    if cat.has("rollouts"):
        rew = ("LEFT JOIN rewards w ON w.prompt_id = r.prompt_id AND w.rollout_idx = r.rollout_idx"
               if cat.has("rewards") else "")
        cols = "w.reward, w.correct, w.reward_type, w.status" if rew else "NULL AS reward, NULL AS correct, " \
                                                                           "NULL AS reward_type, NULL AS status"
        rollouts = cat.rows(f"SELECT r.rollout_idx, r.prompt_type, r.backend, r.response, r.tokens, {cols} "
                            f"FROM rollouts r {rew} WHERE r.prompt_id = ? ORDER BY r.backend, r.prompt_type, "
                            f"r.rollout_idx", [prompt_id])
    return {"prompt": p, "selection": sel, "rollouts": rollouts}


def prompt_image(cat: RunCatalog, prompt_id: str, index: int) -> bytes | None:
    if not cat.has("rl_prompts"):
        return None
    row = cat.one("SELECT images[?] AS img FROM rl_prompts WHERE prompt_id = ? LIMIT 1", [index + 1, prompt_id])
    return row["img"] if row and row["img"] is not None else None
