"""``select``: keep the prompts with latent capability — solvable with enough attempts, rarely on
the first.

Per prompt (over its accuracy rewards; ``format`` rows are not correctness): ``n`` rollouts,
``c`` correct, ``pass@1 = c/n``, unbiased ``pass@k`` for the configured k (``rl_select.passk``),
``pass@N = pass@n``, ``gap = pass@N − pass@1``, mean reward (a configured k > n is reported
as pass@n); ``pass_at_k`` is a typed ``MAP<int32, double>`` (``WHERE pass_at_k[4] >= 0.5`` in
``ovpipe sql``). A prompt with no scored rollout (``n = 0``) has NULL rates and a NULL map, never 0,
so ``avg(pass_at_1)`` in SQL counts only what was measured. Rules (``rule``):

* ``gap`` (default): keep iff pass@N ≥ ``min_pass_at_n`` (0.5), pass@1 ≤ ``max_pass_at_1`` (0.7)
  and gap ≥ ``min_gap`` (0.2); otherwise ``too_hard`` / ``too_easy`` / ``no_gap``, checked in
  that order;
* ``mean_band`` (the published code): keep iff ``low < mean reward < high`` (0, 0.6).

A prompt whose source is in ``held_out_sources`` is ``held_out`` whatever its rates: measured like the
others (its pass@k is in the table), never kept, so it never reaches ``export`` or a trainer — the
prompts of the same skills on which a trained policy's pass@1 shows whether what it learned carries over.

A prompt with any reward ``timeout``/``error`` (or none at all) is dropped as ``error``; a
``bad_response`` (unparseable answer) is an ordinary incorrect rollout, and so is a ``timeout``
with ``timeouts_as_incorrect: true`` (a response built to stall the verifier then costs only itself).
Split of the kept prompts (``split_rule``):

* ``pass_at_1`` (default): pass@1 ≥ ``cot_below_pass_at_1`` (0.25) → ``stage1-answer-only`` (the
  model already answers it directly now and then), else ``stage2-cot`` (it needs reasoning);
* ``prompt_type``: answer-only rollouts show a gap → stage 1, else stage 2;
* ``category``: categories in ``cot_categories`` → stage 2, the rest → stage 1.

Vectorised with polars: 10M rollouts in seconds (``bench/bench_rl.py``). Reduce → apply
(``docs/scale.md``), so no task holds the corpus:

* reduce first (``cut_ranges``; no map: which prompts a rank owns depends on the sorted union of every
  input's prompt ids, computed once): DuckDB under ``OVPIPE_REDUCE_MEMORY`` (1GB, spilling) counts the prompts —
  non-duplicate ``rl_prompts`` ∪ every prompt with a non-format reward — and streams their ids in
  order, keeping the first and last prompt_id of each apply rank's ``slice_bounds`` slice
  (``reduced/ranges.npz``); a NULL prompt_id is an error;
* apply (``select_range``): only the ``rewards`` / ``rollouts`` / ``rl_prompts`` rows of its range
  (``prompt_id BETWEEN``, row groups outside it skipped by their statistics), in ``read_manifest``'s
  order, through ``selection_table`` — per prompt, so the parts are byte-identical to the
  whole-corpus computation for any task count; memory: the range's rows;
* finalize: the report — counts kept/dropped per source and category and ``pass1_vs_passn.png``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from ovpipe.config import check_step_folder
from ovpipe.inputs import Input
from ovpipe.step import Stats, Step, TaskContext, slice_bounds


@dataclass
class SelectConfig:
    rollouts_step: str = "rollout"  # the rollout step folder (its rewards are the score step's)
    # the score step folder read; "": every folder holding rewards (a re-selection after grpo names its own)
    rewards_step: str = ""
    # gap: keep Pass@N - Pass@1 >= min_gap; mean_band: keep a mean reward inside the band
    rule: Literal["gap", "mean_band"] = "gap"
    min_pass_at_n: float = 0.5  # gap rule: the fewest Pass@N kept
    max_pass_at_1: float = 0.7  # gap rule: the most Pass@1 kept
    min_gap: float = 0.2  # gap rule: the smallest Pass@N - Pass@1 kept
    band_low: float = 0.0  # mean_band rule: a mean reward at or below it is too_hard
    band_high: float = 0.6  # mean_band rule: a mean reward at or above it is too_easy
    ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])  # the k of the pass@k columns
    # how kept prompts split into the answer-only and chain-of-thought stages
    split_rule: Literal["pass_at_1", "prompt_type", "category"] = "pass_at_1"
    cot_below_pass_at_1: float = 0.25  # split pass_at_1: below this pass@1, a chain-of-thought prompt
    # split category: these categories go to the chain-of-thought stage
    cot_categories: list[str] = field(default_factory=list)
    held_out_sources: list[str] = field(default_factory=list)   # measured, never kept (reason `held_out`)
    timeouts_as_incorrect: bool = False   # True: a reward timeout is a wrong rollout, not an `error` prompt

    def __post_init__(self):
        for name in ("min_pass_at_n", "max_pass_at_1", "min_gap", "band_low", "band_high", "cot_below_pass_at_1"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if any(k < 1 for k in self.ks):
            raise ValueError(f"ks must be >= 1, got {self.ks}")
        check_step_folder("rollouts_step", self.rollouts_step)
        if self.rewards_step:
            check_step_folder("rewards_step", self.rewards_step)


def aggregate(rewards, rollouts=None, timeouts_as_incorrect: bool = False):
    """polars DataFrame per prompt: n, c, errors, mean_reward (+ answer-only n/c when rollouts given)."""
    import polars as pl

    r = pl.from_arrow(rewards).filter(pl.col("reward_type") != "format")
    if rollouts is not None:
        r = r.join(pl.from_arrow(rollouts).select("prompt_id", "rollout_idx", "prompt_type"),
                   on=["prompt_id", "rollout_idx"], how="left")
    else:
        r = r.with_columns(pl.lit(None, pl.Utf8).alias("prompt_type"))
    counted = ["ok", "bad_response"] + (["timeout"] if timeouts_as_incorrect else [])
    ok = pl.col("status").is_in(counted)   # an unparseable (or, if asked, too slow) response is a wrong answer
    ao = pl.col("prompt_type") == "answer_only"
    return r.group_by("prompt_id").agg(
        n=ok.sum().cast(pl.Int64),
        c=(ok & pl.col("correct")).sum().cast(pl.Int64),
        errors=(~ok).sum().cast(pl.Int64),
        mean_reward=pl.col("reward").filter(ok).mean(),
        n_ao=(ok & ao).sum().cast(pl.Int64),
        c_ao=(ok & ao & pl.col("correct")).sum().cast(pl.Int64),
    ).sort("prompt_id")


def decide(n, c, errors, mean, n_ao, c_ao, categories, cfg: SelectConfig, sources=None) -> dict:
    from rl_select.passk import pass_at_k

    n = np.asarray(n)
    c = np.asarray(c)
    valid = n > 0                 # n = 0: nothing was scored, every rate is undefined (NaN here, NULL in the manifest)
    nn = np.maximum(n, 1)
    p1 = np.where(valid, c / nn, np.nan)
    pn = np.where(valid, pass_at_k(nn, np.minimum(c, nn), nn), np.nan)
    gap = pn - p1
    mean = np.where(valid, np.asarray(mean, dtype=np.float64), np.nan)
    reason = np.full(len(n), "kept", dtype=object)
    if cfg.rule == "gap":
        reason[gap < cfg.min_gap] = "no_gap"
        reason[p1 > cfg.max_pass_at_1] = "too_easy"
        reason[pn < cfg.min_pass_at_n] = "too_hard"
    else:
        reason[mean >= cfg.band_high] = "too_easy"
        reason[mean <= cfg.band_low] = "too_hard"
    if cfg.held_out_sources and sources is not None:
        reason[np.isin(np.asarray(sources, dtype=object), cfg.held_out_sources)] = "held_out"
    reason[(np.asarray(errors) > 0) | ~valid] = "error"
    kept = reason == "kept"
    if cfg.split_rule == "pass_at_1":
        cot = p1 < cfg.cot_below_pass_at_1
    elif cfg.split_rule == "prompt_type":
        n_ao = np.asarray(n_ao)
        c_ao = np.asarray(c_ao)
        ao_gap = (c_ao > 0) & (c_ao < n_ao)
        cot = ~ao_gap
    else:
        cot = np.isin(np.asarray(categories, dtype=object), cfg.cot_categories)
    split = np.where(kept, np.where(cot, "stage2-cot", "stage1-answer-only"), None)
    passk = {}
    for k in cfg.ks:
        kk = np.minimum(k, nn)
        passk[k] = np.where(valid, pass_at_k(nn, np.minimum(c, nn), kk), np.nan)
    return {"valid": valid, "pass_at_1": p1, "pass_at_n": pn, "gap": gap, "mean_reward": mean, "reason": reason, "kept": kept,
            "split": split, "passk": passk}


def pass_at_k_map(passk: dict, undefined: np.ndarray):
    """``{k: pass@k}`` per prompt as an Arrow ``MAP<int32, double>`` (``pass_at_k[4]`` in DuckDB);
    NULL where nothing was scored."""
    import pyarrow as pa

    ks = sorted(passk)
    n = len(undefined)
    offsets = pa.array(np.arange(n + 1, dtype=np.int32) * len(ks), pa.int32())
    keys = pa.array(np.tile(np.asarray(ks, dtype=np.int32), n), pa.int32())
    items = pa.array(np.stack([passk[k] for k in ks], axis=1).ravel() if ks else np.zeros(0), pa.float64())
    return pa.MapArray.from_arrays(offsets, keys, items, type=pa.map_(pa.int32(), pa.float64()),
                                   mask=pa.array(undefined, pa.bool_()))


def selection_table(rewards, rollouts, prompts, cfg: SelectConfig, stats: Stats | None = None):
    """(``selection`` table in prompt_id order, ``{reason: prompts}``) of whole prompts' rows: ``rewards``
    (+ ``rollouts`` for ``split_rule: prompt_type``) in file order and ``rl_prompts`` (prompt_id, source,
    category, status) in canonical order. Per prompt only — the rows of a prompt_id range give that
    range of the whole corpus's table."""
    import polars as pl
    import pyarrow as pa

    stats = stats or Stats()
    with stats.timer("aggregate"):
        agg = aggregate(rewards, rollouts, cfg.timeouts_as_incorrect)
    meta = (pl.from_arrow(prompts).filter(pl.col("status") != "duplicate").drop("status")
            .unique("prompt_id", keep="first", maintain_order=True))
    # prompts that never got a reward (bad rows, no rollouts) are reported too, as errors
    df = meta.join(agg, on="prompt_id", how="full", coalesce=True).sort("prompt_id")
    missing = df["n"].is_null().to_numpy()
    col = lambda name: df[name].fill_null(0).to_numpy()  # noqa: E731
    with stats.timer("decide"):
        d = decide(col("n"), col("c"), np.where(missing, 1, col("errors")),
                   df["mean_reward"].fill_null(np.nan).to_numpy(), col("n_ao"), col("c_ao"),
                   df["category"].to_list() if cfg.split_rule == "category" else [None] * df.height, cfg,
                   df["source"].to_list())
    reasons, counts = np.unique(d["reason"].astype(str), return_counts=True)
    undefined = ~d["valid"]
    rate = lambda a: pa.array(a, pa.float64(), mask=undefined)  # noqa: E731
    return pa.table({
        "prompt_id": df["prompt_id"].to_arrow().cast(pa.string()),
        "source": df["source"].to_arrow().cast(pa.string()),
        "category": df["category"].to_arrow().cast(pa.string()),
        "n": pa.array(col("n"), pa.int32()),
        "correct": pa.array(col("c"), pa.int32()),
        "pass_at_1": rate(d["pass_at_1"]), "pass_at_n": rate(d["pass_at_n"]), "gap": rate(d["gap"]),
        "mean_reward": rate(d["mean_reward"]),
        "pass_at_k": pass_at_k_map(d["passk"], undefined),
        "kept": pa.array(d["kept"].astype(bool)), "reason": pa.array(d["reason"].astype(str), pa.string()),
        "split": pa.array(list(d["split"]), pa.string()),
    }), {str(r): int(c) for r, c in zip(reasons, counts)}


# ---------------------------------------------------------------- the step: map → reduce → apply

def _inputs(cfg: SelectConfig, task: TaskContext) -> dict[str, list[str]]:
    """The parts select reads (``read_manifest``'s files, in its order), their schemas checked from the footers."""
    import pyarrow.parquet as pq

    from manifests.io import check_part_schema

    files = {"rewards": task.input_files("rewards"), "rl_prompts": task.input_files("rl_prompts")}
    if cfg.split_rule == "prompt_type":      # the only rule that needs each rollout's template
        files["rollouts"] = task.input_files("rollouts")
    for kind, paths in files.items():
        for f in paths:
            check_part_schema(f, pq.read_schema(f), kind)
    return {kind: [str(f) for f in paths] for kind, paths in files.items()}



# every prompt of the selection: the non-duplicate rl_prompts and every prompt with a non-format reward
KEYS = ("SELECT prompt_id FROM read_parquet($rl_prompts) WHERE status <> 'duplicate' "
        "UNION SELECT prompt_id FROM read_parquet($rewards) WHERE reward_type <> 'format'")


def cut_ranges(cfg: SelectConfig, task: TaskContext) -> None:
    """Reduce: count the prompts (``KEYS``) and stream them in prompt_id order through DuckDB (a sort
    that spills past its memory limit), keeping only the first and last prompt_id of each apply rank's
    ``slice_bounds`` slice. Writes ``reduced/ranges.npz``: ``ids`` (JSON: ``first`` and ``last`` id per
    rank) and ``rows`` per rank."""
    from ovpipe.mapreduce import BATCH_ROWS

    files = _inputs(cfg, task)
    params = {"rl_prompts": files["rl_prompts"], "rewards": files["rewards"]}
    w = task.world_size
    with task.duckdb() as con, task.stats.timer("ranges"):
        for kind in params:
            nulls = con.sql("SELECT count(*) FROM read_parquet($f) WHERE prompt_id IS NULL",
                            params={"f": params[kind]}).fetchall()[0][0]
            if nulls:
                where = sorted({str(Path(f).parent) for f in params[kind]})
                raise ValueError(f"{kind}: {nulls} rows with a NULL prompt_id under {where} — every row needs its "
                                 f"prompt's id")
        n = con.sql(f"SELECT count(*) FROM ({KEYS})", params=params).fetchall()[0][0]
        bounds = [slice_bounds(n, r, w) for r in range(w)]
        want = np.array(sorted({p for lo, hi in bounds if hi > lo for p in (lo, hi - 1)}), np.int64)
        at, pos = {}, 0
        for batch in con.sql(f"{KEYS} ORDER BY prompt_id", params=params).to_arrow_reader(BATCH_ROWS):
            ids = batch.column(0)
            for p in want[(want >= pos) & (want < pos + len(ids))]:
                at[int(p)] = ids[int(p) - pos].as_py()
            pos += len(ids)
    if pos != n:
        raise RuntimeError(f"select reduce: {pos} prompts streamed, {n} counted — an input changed under the reduce")
    task.stats.info["prompts"] = n
    ids = {"first": [at.get(lo, "") for lo, _ in bounds], "last": [at.get(hi - 1, "") for _, hi in bounds]}
    # the ids as UTF-8 JSON bytes: a numpy str array would drop an id's trailing NULs
    task.write_reduced("ranges", ids=np.frombuffer(json.dumps(ids).encode(), np.uint8),
                       rows=np.array([hi - lo for lo, hi in bounds], np.int64))


def select_range(cfg: SelectConfig, task: TaskContext) -> None:
    """Apply: the rewards / rollouts / rl_prompts rows of this rank's prompt_id range only (DuckDB, row
    groups outside the range skipped by their footer statistics), through ``selection_table``; its
    ``selection`` part. Memory: the range's rows, whatever the corpus."""
    r = task.read_reduced("ranges")
    ids = json.loads(r["ids"].tobytes())
    rows, lo, hi = int(r["rows"][task.rank]), ids["first"][task.rank], ids["last"][task.rank]
    files = _inputs(cfg, task)
    bounds = {"lo": lo, "hi": hi} if rows else {}
    where = "prompt_id BETWEEN $lo AND $hi" if rows else "false"

    def scan(con, kind: str, columns: str, also: str = "", order: str = ""):
        # rows in read_manifest's order: by file, then row (a prompt's float rewards are summed in that order)
        return con.sql(f"SELECT {columns} FROM read_parquet($files, filename = true, file_row_number = true) "
                       f"WHERE {where}{also} ORDER BY {order}list_position($files, filename), file_row_number",
                       params={"files": files[kind], **bounds}).to_arrow_table()

    with task.duckdb() as con, task.stats.timer("read"):
        rewards = scan(con, "rewards", "prompt_id, rollout_idx, reward, correct, reward_type, status",
                       also=" AND reward_type <> 'format'")      # aggregate drops them too
        rollouts = scan(con, "rollouts", "prompt_id, rollout_idx, prompt_type") if "rollouts" in files else None
        prompts = scan(con, "rl_prompts", "prompt_id, source, category, status", order="prompt_id, ")
    table, reasons = selection_table(rewards, rollouts, prompts, cfg, task.stats)
    if table.num_rows != rows:
        raise RuntimeError(f"select apply rank {task.rank}: {table.num_rows} prompts in its range {lo!r} … {hi!r}, "
                           f"the reduce counted {rows} — an input changed since the reduce; rerun the step")
    for reason, count in reasons.items():
        task.stats.inc(f"reason/{reason}", count)
    # the spread selection saw (the summary line): prompts never, sometimes and always solved at pass@1
    p1 = table.column("pass_at_1").drop_null().to_numpy()
    task.stats.inc("pass1_zero", int((p1 == 0).sum()))
    task.stats.inc("pass1_between", int(((p1 > 0) & (p1 < 1)).sum()))
    task.stats.inc("pass1_one", int((p1 == 1).sum()))
    task.write_part("selection", table)


def finalize(cfg: SelectConfig, task: TaskContext) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import polars as pl

    sel = pl.from_arrow(task.read_output("selection").drop(["pass_at_k"]))
    scored = sel.filter(pl.col("n") > 0)
    plt.figure(figsize=(4.8, 4))
    plt.hist2d(scored["pass_at_1"].to_numpy(), scored["pass_at_n"].to_numpy(), bins=[20, 20], range=[[0, 1], [0, 1]],
               cmap="Blues", cmin=1)
    plt.colorbar(label="prompts")
    plt.plot([0, 1], [cfg.min_gap, 1 + cfg.min_gap], "r--", lw=0.8)
    plt.xlabel("Pass@1")
    plt.ylabel("Pass@N")
    plt.tight_layout()
    plt.savefig(task.step_dir / "pass1_vs_passn.png", dpi=110)
    plt.close()
    by = sel.group_by("source", "category", "reason").len().sort("source", "category", "reason")
    splits = sel.filter(pl.col("kept")).group_by("split").len().sort("split")
    lines = [f"{sel.height} prompts, {int(sel['kept'].sum())} kept (rule `{cfg.rule}`).", "",
             "| source | category | reason | prompts |", "| --- | --- | --- | ---: |"]
    lines += [f"| {r['source']} | {r['category']} | {r['reason']} | {r['len']} |" for r in by.to_dicts()]
    lines += ["", "| split | prompts |", "| --- | ---: |"] + [f"| {r['split']} | {r['len']} |" for r in splits.to_dicts()]
    lines += ["", *spread_lines(scored)]
    lines.append("\nPlot: pass1_vs_passn.png")
    (task.step_dir / "report.md").write_text("\n".join(lines) + "\n")


def spread_lines(scored) -> list[str]:
    """Per source, how the scored prompts' pass@1 and pass@N spread — at 0, strictly between, at 1 — and
    their means: the prompts selection can keep are the ones between (at pass@1) that some rollout solves."""
    import polars as pl

    cols = ("pass_at_1", "pass_at_n")
    bands = {"zero": lambda c: c == 0, "mid": lambda c: (c > 0) & (c < 1), "one": lambda c: c == 1}
    t = scored.group_by("source").agg(pl.len(), *[f(pl.col(c)).sum().alias(f"{c}:{b}") for c in cols
                                                  for b, f in bands.items()],
                                      *[pl.col(c).mean().alias(f"{c}:mean") for c in cols])
    out = ["| source | prompts | pass@1 = 0 | 0 < pass@1 < 1 | pass@1 = 1 | pass@N = 0 | 0 < pass@N < 1 | pass@N = 1 "
           "| mean pass@1 | mean pass@N |", "| --- " + "| ---: " * 9 + "|"]
    for r in t.sort("source").to_dicts():
        counts = " | ".join(str(r[f"{c}:{b}"]) for c in cols for b in bands)
        out.append(f"| {r['source']} | {r['len']} | {counts} | {r['pass_at_1:mean']:.3f} | {r['pass_at_n:mean']:.3f} |")
    return out


STEP = Step("select", SelectConfig,
            inputs={"rewards": "rewards_step", "rl_prompts": None,
                    # the only split rule that needs each rollout's template
                    "rollouts": Input("rollouts_step", when=lambda c: c.split_rule == "prompt_type")}, outputs=("selection",),
            reduce=cut_ranges, apply=select_range, finalize=finalize,
            description="unbiased pass@k, keep prompts with a Pass@N − Pass@1 gap")
