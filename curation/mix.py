"""``mix``: several ingested sources → a seeded draw to target proportions (the ``mixed`` manifest).

This is how the instruction set of stage 2 is assembled: the 22M instruct conversations and
FineVision are ingested (one or more ``ingest`` step folders, e.g. ``ingest-instruct``), then
``mix`` draws ``size`` samples whose shares per category (``by: category``) or per source
(``by: source``) are the configured ``proportions``. ``lengths``/``pack`` consume the result like
``balanced`` (``pack: copies_from: mixed``): ``copies`` is how many times a sample enters packing.

Which rows. Every row of the inputs' ``samples`` manifests with ``status = ok`` is one candidate;
other statuses never enter. A ``sample_id`` that occurs in two sources (or two input steps) is two
candidates: rows are independent samples. A row's group is its ``category`` (or ``source``); a null
group value is the group ``"(none)"``.

Targets. Weights: a group named in ``proportions`` has weight ``p_g``; a group not named shares
``rest`` (default 0: left out) in proportion to its available rows, so ``rest`` keeps the unnamed
groups' natural mix. Weights are normalised over the groups found (so ``proportions`` need not sum
to 1; a ``rest`` with no unnamed group is unused), and the integer targets are the largest-remainder
rounding of ``size · p_g``::

    n_g = ⌊size·p_g⌋ + [g among the (size − Σ⌊size·p_g⌋) largest remainders (ties by group name)]
    Σ_g n_g = size exactly

(proportions are read as the decimals written, ``Fraction("0.3")``, so ``600 × 0.3`` is 180, not
179.99…). A group named in ``proportions`` that has no ok row is an error at task time listing the
groups found with their row counts — a misspelt category must not silently become 0.

The draw. Each row gets a seeded key ``k = splitmix64(u64(sample_id) ⊕ splitmix64(seed ⊕ MIX_SALT))``
(the hash convention of ``balance`` and ``pack``; the salt keeps a mix independent of a balance or
pack draw made with the same seed). Rows of a group are ranked by (k, source, category) — rows
that tie on all three are the same output row, so their order is immaterial. With ``a_g`` ok rows:

* ``replacement: true`` — systematic sampling: every row gets ``⌊n_g / a_g⌋`` copies and the
  ``n_g mod a_g`` rows of smallest key one more. Targets are hit exactly, every row's copies are
  within one of the expectation ``n_g / a_g``, and as many distinct rows as possible are used
  (min(n_g, a_g)). A seeded multinomial would have the same expectation but repeat some rows
  while dropping others by chance (at n_g = a_g it leaves out 1/e ≈ 37% of the rows) — unique
  instruction data is what stage 2 is short of, so that variance buys nothing.
* ``replacement: false`` — the ``n_g`` rows of smallest key, once each (a seeded uniform draw
  without replacement). If ``n_g > a_g`` all ``a_g`` rows are taken and the shortfall
  ``n_g − a_g`` is logged, counted in stats (``shortfall``, ``info.shortfall_by_group``) and shown
  in the report; it is never filled from other groups.

(With ``n_g ≤ a_g`` both rules draw the same rows.) ``mixed`` holds one row per drawn
(sample_id, source, category) with ``copies ≥ 1``; undrawn rows are not written (anti-join
``samples`` to see them).

Scale. A task never holds the corpus: the global part — per group the row count and the key
cutoff (the ``r_g``-th smallest key, ``r_g = n_g mod a_g``) — is found by streaming only
``sample_id, source, category, status`` of the input parts in batches (Arrow dataset scan with
the status filter pushed down): pass 1 builds per-group row counts and a 2^14-bucket histogram of
the keys' top bits; pass 2 collects only the rows in each group's cutoff bucket (≈ a_g / 16384
rows) and sorts them. Memory is O(groups × 16K + batch), whatever the corpus size. Every rank
computes this same small plan (two scans of four columns), then applies it to its share: the rows
whose ``sample_id`` lies in the rank's slice of the 64-bit hash space, so all rows of one sample
are in one task and parts concatenated in rank order are in ``sample_id`` order. The merged
manifest is therefore byte-identical for any task count, and deterministic for a seed.

``finalize`` writes ``RUN/<step>/report.md`` (per group: available rows, share before, asked
share, target, drawn rows, copies, share after, shortfall) and ``proportions.png`` (shares before
vs after, per group).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Iterator, Literal

import numpy as np

from manifests.io import BATCH_ROWS
from ovpipe.config import check_range, check_step_folder
from ovpipe.step import Step, TaskContext

MIX_SALT = int.from_bytes(b"ovmix\x00\x00\x00", "big")  # separates mix keys from balance/pack keys
U64 = (1 << 64) - 1
KEY_BITS = 14                       # histogram buckets per group: 2^14 (128 KiB of counts per group)
NULL_GROUP = "(none)"
SCAN_COLUMNS = ("sample_id", "source", "category", "status")


@dataclass
class MixConfig:
    size: int                                               # copies to draw in all (Σ_g n_g)
    proportions: dict[str, float] = field(default_factory=dict)  # group → weight (normalised)
    inputs: list[str] = field(default_factory=lambda: ["ingest"])  # ingest step folders (their `samples`)
    by: Literal["category", "source"] = "category"  # the column the target proportions name
    rest: float = 0.0                                       # weight shared by groups not in proportions
    replacement: bool = True  # draw with replacement (a small group may repeat to reach its share)
    seed: int = 0  # the seeded draw

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"size must be > 0, got {self.size}")
        if not self.inputs or any(not isinstance(s, str) or not s.strip() for s in self.inputs):
            raise ValueError(f"inputs: give at least one ingest step folder name (e.g. ['ingest']), "
                             f"got {self.inputs!r}")
        if len(set(self.inputs)) != len(self.inputs):
            raise ValueError(f"inputs: a step folder is named twice: {self.inputs!r}")
        for s in self.inputs:
            check_step_folder("inputs", s)
        check_range(self, "seed", 0, 2**64 - 1)
        for g, p in self.proportions.items():
            if not math.isfinite(p) or p < 0:
                raise ValueError(f"proportions.{g}: must be a finite number >= 0, got {p!r}")
        if not math.isfinite(self.rest) or self.rest < 0:
            raise ValueError(f"rest: must be a finite number >= 0, got {self.rest!r}")
        if sum(self.proportions.values()) + self.rest <= 0:
            raise ValueError("proportions: give at least one proportion > 0 (e.g. {counting: 0.3, text: 0.1}), "
                             f"or rest > 0; got proportions={self.proportions!r}, rest={self.rest!r}")


@dataclass
class GroupPlan:
    """What the draw does to one group."""

    group: str
    available: int          # ok rows
    share: float            # normalised weight p_g
    target: int             # n_g
    base: int               # copies every row of the group gets
    extra: int              # rows (smallest keys) that get one copy more

    @property
    def copies(self) -> int:
        return self.base * self.available + self.extra

    @property
    def shortfall(self) -> int:
        return self.target - self.copies


def plan_mix(available: dict[str, int], cfg: MixConfig) -> list[GroupPlan]:
    """Per-group targets and copy rule from the groups' ok-row counts (pure; see the module doc)."""
    missing = sorted(g for g in cfg.proportions if available.get(g, 0) == 0)
    if missing:
        found = ", ".join(f"{g!r}: {n}" for g, n in sorted(available.items())) or "none"
        raise ValueError(f"mix.proportions: {cfg.by} group(s) {missing} have no ok rows in inputs "
                         f"{cfg.inputs}; groups found (ok rows): {{{found}}}")
    groups = sorted(g for g, n in available.items() if n > 0)
    unnamed = sum(available[g] for g in groups if g not in cfg.proportions)
    weight = {g: (Fraction(repr(cfg.proportions[g])) if g in cfg.proportions
                  else Fraction(repr(cfg.rest)) * Fraction(available[g], unnamed)) for g in groups}
    total = sum(weight.values(), Fraction(0))
    if total == 0:
        raise ValueError(f"mix: nothing to draw — every group found has weight 0 "
                         f"(groups: {groups}, proportions: {cfg.proportions}, rest: {cfg.rest})")
    exact = {g: cfg.size * w / total for g, w in weight.items()}
    target = {g: math.floor(x) for g, x in exact.items()}
    left = cfg.size - sum(target.values())
    for g in sorted(groups, key=lambda g: (-(exact[g] - target[g]), g))[:left]:
        target[g] += 1
    plans = []
    for g in groups:
        a, n = available[g], target[g]
        if cfg.replacement:
            base, extra = divmod(n, a)
        else:
            base, extra = (1, 0) if n >= a else (0, n)
        plans.append(GroupPlan(g, a, float(weight[g] / total), n, base, extra))
    return plans


# ---------------------------------------------------------------------------------------------
# Streaming scans over the input parts (only SCAN_COLUMNS; status filter pushed down).


def input_files(task: TaskContext) -> list[Path]:
    """Every ``samples`` part of the input steps (``inputs``, in that order), after checking the columns
    mix reads."""
    import pyarrow.parquet as pq

    from manifests.schemas import ManifestSchemaError, schema_for

    files: list[Path] = []
    for step in task.input_steps("samples"):
        try:
            files.extend(task.input_files("samples", step))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"mix.inputs: {e}") from None
    want = schema_for("samples")
    for f in files:
        have = pq.read_schema(f)
        for name in SCAN_COLUMNS:
            if name not in have.names or have.field(name).type != want.field(name).type:
                raise ManifestSchemaError(f"{f}: column {name!r} missing or not {want.field(name).type} "
                                          f"(manifest 'samples'); re-run its ingest step")
    return files


def scan(files: list[Path], id_range: tuple[str | None, str | None] = (None, None)) -> Iterator:
    """Record batches of the ok rows' SCAN_COLUMNS, optionally only ``lo <= sample_id < hi``."""
    import pyarrow.dataset as ds

    flt = ds.field("status") == "ok"
    lo, hi = id_range
    if lo is not None:
        flt = flt & (ds.field("sample_id") >= lo)
    if hi is not None:
        flt = flt & (ds.field("sample_id") < hi)
    dataset = ds.dataset([str(f) for f in files], format="parquet")
    for batch in dataset.to_batches(columns=["sample_id", "source", "category"], filter=flt,
                                    batch_size=BATCH_ROWS):   # manifests.io's streamed batch
        if batch.num_rows:
            yield batch


def sample_keys(sample_ids, seed: int) -> np.ndarray:
    """The seeded draw key of each row: splitmix64(u64(sample_id) ⊕ splitmix64(seed ⊕ MIX_SALT))."""
    import pyarrow as pa

    from manifests.ids import hex_ids_to_u64, splitmix64

    arr = sample_ids if isinstance(sample_ids, (pa.Array, pa.ChunkedArray)) else pa.array(sample_ids, pa.string())
    return splitmix64(hex_ids_to_u64(arr) ^ splitmix64(np.uint64((seed ^ MIX_SALT) & U64)))


class _Groups:
    """Group name ↔ dense index, grown as batches reveal groups."""

    def __init__(self, by: str):
        self.by, self.index, self.names = by, {}, []

    def codes(self, batch) -> np.ndarray:
        import pyarrow.compute as pc

        enc = pc.dictionary_encode(pc.fill_null(batch.column(self.by), NULL_GROUP))
        lut = np.array([self._id(n) for n in enc.dictionary.to_pylist()], dtype=np.int64)
        return lut[enc.indices.to_numpy(zero_copy_only=False)]

    def _id(self, name: str) -> int:
        if name not in self.index:
            self.index[name] = len(self.names)
            self.names.append(name)
        return self.index[name]


def _texts(batch, column: str, rows: np.ndarray) -> list[str]:
    """``column`` of the given rows as Python strings (null → ""), for exact tie-breaks."""
    import pyarrow.compute as pc

    return pc.fill_null(batch.column(column).take(rows), "").to_pylist()


@dataclass
class Cutoff:
    """Rows of a group ranked before (key, source, category) get one extra copy; of the rows equal
    to it (one output row), ``ties`` do."""

    key: int
    source: str
    category: str
    ties: int


def global_plan(files: list[Path], cfg: MixConfig) -> tuple[_Groups, list[GroupPlan], dict[int, Cutoff]]:
    """Passes 1–2 (see the module doc): group counts → plan → each group's key cutoff."""
    nb, shift = 1 << KEY_BITS, np.uint64(64 - KEY_BITS)
    groups = _Groups(cfg.by)
    hist: list[np.ndarray] = []
    for batch in scan(files):                                   # pass 1: counts + key histograms
        g = groups.codes(batch)
        bucket = (sample_keys(batch.column("sample_id"), cfg.seed) >> shift).astype(np.int64)
        hist.extend(np.zeros(nb, np.int64) for _ in range(len(groups.names) - len(hist)))
        for gi in np.unique(g):
            hist[gi] += np.bincount(bucket[g == gi], minlength=nb)
    available = {name: int(hist[i].sum()) for i, name in enumerate(groups.names)}
    plans = plan_mix(available, cfg)
    by_name = {p.group: p for p in plans}
    # The extra copies go to the `extra` smallest (key, source, category) of the group: find the
    # bucket holding position extra-1 and how many rows lie in earlier buckets.
    want_bucket = np.full(len(groups.names), -1, np.int64)
    before: dict[int, int] = {}
    for gi, name in enumerate(groups.names):
        p = by_name.get(name)
        if p is not None and p.extra > 0:
            cum = np.cumsum(hist[gi])
            b = int(np.searchsorted(cum, p.extra - 1, side="right"))
            want_bucket[gi], before[gi] = b, int(cum[b] - hist[gi][b])
    cutoffs: dict[int, Cutoff] = {}
    if before:
        cands: dict[int, list] = {gi: [] for gi in before}
        for batch in scan(files):                               # pass 2: rows of the cutoff buckets
            g = groups.codes(batch)
            key = sample_keys(batch.column("sample_id"), cfg.seed)
            hit = np.nonzero((key >> shift).astype(np.int64) == want_bucket[g])[0]
            if len(hit):
                src, cat = _texts(batch, "source", hit), _texts(batch, "category", hit)
                for j, i in enumerate(hit.tolist()):
                    cands[int(g[i])].append((int(key[i]), src[j], cat[j]))
        for gi, rows in cands.items():
            rows.sort()
            pos = by_name[groups.names[gi]].extra - 1 - before[gi]
            t = rows[pos]
            less = sum(1 for r in rows if r < t)
            cutoffs[gi] = Cutoff(t[0], t[1], t[2], by_name[groups.names[gi]].extra - before[gi] - less)
    return groups, plans, cutoffs


def rank_id_range(rank: int, world_size: int) -> tuple[str | None, str | None]:
    """The rank's slice [lo, hi) of the 64-bit sample_id space, as hex bounds (None: open)."""
    lo = None if rank == 0 else f"{(rank << 64) // world_size:016x}"
    hi = None if rank == world_size - 1 else f"{((rank + 1) << 64) // world_size:016x}"
    return lo, hi


def draw_slice(files: list[Path], cfg: MixConfig, groups: _Groups, plans: list[GroupPlan],
               cutoffs: dict[int, Cutoff], id_range: tuple[str | None, str | None]):
    """Pass 3: copies for the ok rows in ``id_range`` → ``mixed`` table (copies ≥ 1 only)."""
    import pyarrow as pa

    by_name = {p.group: p for p in plans}
    n_groups = len(groups.names)
    base = np.array([by_name[g].base if g in by_name else 0 for g in groups.names], np.int64)
    has_cut = np.zeros(n_groups, bool)
    cut_key = np.zeros(n_groups, np.uint64)
    for gi, c in cutoffs.items():
        has_cut[gi], cut_key[gi] = True, np.uint64(c.key)
    ties_given = dict.fromkeys(cutoffs, 0)
    pieces, scanned = [], 0
    for batch in scan(files, id_range):
        scanned += batch.num_rows
        g = groups.codes(batch)
        if len(groups.names) != n_groups:  # cannot happen unless an input changed between passes
            raise RuntimeError("mix: the inputs changed while the step ran; rerun it")
        key = sample_keys(batch.column("sample_id"), cfg.seed)
        copies = base[g] + (has_cut[g] & (key < cut_key[g]))
        eq = np.nonzero(has_cut[g] & (key == cut_key[g]))[0]
        if len(eq):  # rows sharing the cutoff key (the same sample_id): order by (source, category)
            src, cat = _texts(batch, "source", eq), _texts(batch, "category", eq)
            for j, i in enumerate(eq.tolist()):
                c = cutoffs[int(g[i])]
                if (src[j], cat[j]) < (c.source, c.category):
                    copies[i] += 1
                elif (src[j], cat[j]) == (c.source, c.category) and ties_given[int(g[i])] < c.ties:
                    copies[i] += 1
                    ties_given[int(g[i])] += 1
        keep = np.nonzero(copies > 0)[0]
        if len(keep):
            t = pa.table({"sample_id": batch.column("sample_id"), "source": batch.column("source"),
                          "category": batch.column("category")}).take(pa.array(keep))
            pieces.append(t.append_column("copies", pa.array(copies[keep], pa.int64())))
    schema = pa.schema([("sample_id", pa.string()), ("source", pa.string()), ("category", pa.string()),
                        ("copies", pa.int64())])
    table = pa.concat_tables(pieces) if pieces else schema.empty_table()
    # One output row per (sample_id, source, category): rows of one sample are all in this rank.
    keys = ["sample_id", "source", "category"]
    table = table.group_by(keys).aggregate([("copies", "sum")])
    table = pa.table({**{k: table.column(k) for k in keys},
                      "copies": table.column("copies_sum").cast(pa.int32())})
    return table.sort_by([(k, "ascending") for k in keys]), scanned


def run(cfg: MixConfig, task: TaskContext) -> None:
    files = input_files(task)
    with task.stats.timer("plan"):
        groups, plans, cutoffs = global_plan(files, cfg)
    with task.stats.timer("draw"):
        table, scanned = draw_slice(files, cfg, groups, plans, cutoffs,
                                    rank_id_range(task.rank, task.world_size))
    task.write_part("mixed", table)  # stable sort by sample_id keeps (source, category) order
    task.stats.inc("rows_scanned", scanned)
    task.stats.inc("rows_drawn", table.num_rows)
    task.stats.inc("copies", int(np.asarray(table.column("copies")).sum()) if table.num_rows else 0)
    shortfall = {p.group: p.shortfall for p in plans if p.shortfall}
    task.stats.info["plan"] = [{"group": p.group, "available": p.available, "share": round(p.share, 6),
                                "target": p.target, "copies": p.copies, "shortfall": p.shortfall}
                               for p in plans]
    task.stats.info["shortfall_by_group"] = shortfall
    if task.rank == 0:  # global figures once (merged stats add ranks up)
        task.stats.inc("ok_rows", sum(p.available for p in plans))
        task.stats.inc("target", cfg.size)
        task.stats.inc("shortfall", sum(shortfall.values()))
        for p in plans:
            if p.shortfall:
                task.log.warning("mix: group %r has %d ok rows for a target of %d without replacement; "
                                 "all taken once, shortfall %d", p.group, p.available, p.target, p.shortfall)


# ---------------------------------------------------------------------------------------------
# finalize: the report


def finalize(cfg: MixConfig, task: TaskContext) -> None:
    files = input_files(task)
    groups = _Groups(cfg.by)
    counts: dict[int, int] = {}
    for batch in scan(files):  # one streaming count (no keys) for the "before" column
        for gi, n in zip(*np.unique(groups.codes(batch), return_counts=True)):
            counts[int(gi)] = counts.get(int(gi), 0) + int(n)
    plans = plan_mix({groups.names[gi]: n for gi, n in counts.items()}, cfg)
    parts = sorted((task.step_dir / "mixed").glob("part-*.parquet"))
    glob = ", ".join(f"'{p.as_posix()}'" for p in parts)
    drawn = {}
    if parts:
        with task.duckdb() as con:
            drawn = {g: (int(r), int(c)) for g, r, c in con.execute(
                f"SELECT coalesce({cfg.by}, '{NULL_GROUP}') AS g, count(*), sum(copies) "
                f"FROM read_parquet([{glob}]) GROUP BY 1").fetchall()}
    bad = [(p.group, p.copies, drawn.get(p.group, (0, 0))[1]) for p in plans
           if drawn.get(p.group, (0, 0))[1] != p.copies]
    if bad:
        raise RuntimeError(f"mix: drawn copies differ from the plan (group, planned, drawn): {bad}")
    write_report(cfg, task.step_dir, plans, drawn)
    task.stats.info["groups"] = len(plans)
    task.stats.info["copies_drawn"] = sum(c for _, c in drawn.values())


def write_report(cfg: MixConfig, step_dir: Path, plans: list[GroupPlan], drawn: dict[str, tuple[int, int]]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    avail_total = sum(p.available for p in plans) or 1
    copies_total = sum(c for _, c in drawn.values()) or 1
    before = [p.available / avail_total for p in plans]
    after = [drawn.get(p.group, (0, 0))[1] / copies_total for p in plans]
    lines = [f"| {cfg.by} | available rows | share before | asked | target | drawn rows | copies | "
             "share after | shortfall |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p, b, a in zip(plans, before, after):
        rows, copies = drawn.get(p.group, (0, 0))
        lines.append(f"| {p.group} | {p.available} | {b:.4f} | {p.share:.4f} | {p.target} | {rows} | "
                     f"{copies} | {a:.4f} | {p.shortfall or ''} |")
    rows_total = sum(r for r, _ in drawn.values())
    lines.append(f"| **all** | {avail_total if plans else 0} | 1.0000 | 1.0000 | {cfg.size} | {rows_total} | "
                 f"{sum(c for _, c in drawn.values())} | 1.0000 | {sum(p.shortfall for p in plans) or ''} |")
    mode = "with replacement (systematic)" if cfg.replacement else "without replacement"
    head = (f"Mix of inputs {cfg.inputs} by {cfg.by}: size {cfg.size}, {mode}, seed {cfg.seed}"
            + (f", rest {cfg.rest}" if cfg.rest else "") + ".\n")
    short = [p for p in plans if p.shortfall]
    if short:
        head += ("\n**Shortfall**: " + "; ".join(f"{p.group} has {p.available} ok rows for a target of "
                                                  f"{p.target} (short {p.shortfall})" for p in short)
                 + " — all rows taken once; set `replacement: true` to repeat them.\n")
    (step_dir / "report.md").write_text(head + "\n" + "\n".join(lines) + "\n\nPlot: proportions.png\n")

    x = np.arange(len(plans))
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(plans) + 2), 3.8))
    ax.bar(x - 0.2, before, 0.4, label="before (ok rows)", color="#9aa9b8")
    ax.bar(x + 0.2, after, 0.4, label="after (copies)", color="#3b6ea5")
    ax.scatter(x + 0.2, [p.share for p in plans], marker="_", s=300, color="#c0392b", label="asked", zorder=3)
    ax.set_xticks(x, [p.group for p in plans], rotation=30, ha="right")
    ax.set_ylabel("share")
    ax.set_title(f"mix by {cfg.by}: {sum(c for _, c in drawn.values())} of {cfg.size} copies")
    ax.legend()
    fig.tight_layout()
    fig.savefig(step_dir / "proportions.png", dpi=110)
    plt.close(fig)


STEP = Step("mix", MixConfig, run, inputs={"samples": "inputs"}, outputs=("mixed",), finalize=finalize,
            description="seeded draw over ingested sources to target category/source proportions")
