"""``balance``: global concept frequencies, then resampling that lifts the long tail.

Counts. Every image contributes to each of its top-``count_top`` concepts::

    count_c = |{ i : c ∈ topK(i) }|            (a reduce over all ranks' ``assignments``)

Two rules, chosen by ``method``:

* ``inverse_frequency`` (the LLaVA-OneVision-1.5 recipe: images are re-weighted by the inverse
  frequency of their concepts): ``w_i = (1/K) Σ_{c∈topK(i)} count_c^(−α)``.
  With replacement, ``λ_i = N_target · w_i / Σ_j w_j`` expected copies; without replacement,
  keep probability ``p_i = min(1, s · w_i)`` with ``s`` solved so ``Σ p_i = N_target``.
* ``metaclip`` (MetaCLIP's curation): per concept ``p_c = min(1, t / count_c)``; an image is kept
  with ``P_i = 1 − Π_{c∈topK(i)} (1 − p_c)``. Head concepts (count > t) are sub-sampled to ≈ t,
  tail concepts kept whole. ``t`` is given, or solved by bisection so ``Σ P_i = N_target``.
  With replacement, ``λ_i = N_target · P_i / Σ_j P_j`` (if ``t`` is not given it is solved so
  that ``Σ P_i`` is half the corpus: head concepts capped, then scaled to the target).

Draws are per sample and seeded: ``u_i = splitmix64(sample_id ⊕ seed) / 2⁶⁴``. Without
replacement a sample is kept iff ``u_i < p_i``; with replacement ``copies_i = ⌊λ_i⌋ + [u_i < λ_i − ⌊λ_i⌋]``
(unbiased stochastic rounding). No draw depends on another sample, so the result is the same
for any task count.

Map → reduce → apply (``docs/scale.md``): no task holds the corpus.

* map (``count_concepts``): rank r streams its share of ``assignments.concept_ids`` and writes its
  ``bincount`` (V int64) — memory one batch + V counts.
* reduce (``reduce_counts``): sums the bincounts into ``count_before`` and solves the global
  scalars: ``Σ_i prob_i`` (the λ normaliser), MetaCLIP's ``t`` and the without-replacement scale
  ``s``. Those are sums over samples in canonical order; they are computed by streaming
  ``concept_ids`` in canonical order once into a temp int32 file and summing it chunk by chunk in
  numpy's own pairwise order (``ovpipe.mapreduce.pairwise_sum``), so every float is bit-identical
  to a ``prob.sum()`` over the whole vector — memory one chunk + V counts. Writes
  ``reduced/balance.npz`` (counts, n, K, Σ, t, s).
* apply (``apply_weights``): rank r streams its canonical slice, computes weight and copies per
  sample from the artifact, writes its ``balanced`` part batch by batch and a partial
  ``count_after`` bincount.
* finalize: ``concept_counts`` (count_before from the reduce, count_after = Σ of the apply ranks'
  bincounts = ``Σ_i copies_i · [c ∈ topK(i)]``).

With ``dedup_step`` / ``alignment_step`` (declared inputs), the rows those steps mark ``near_duplicate``,
``low_alignment`` or ``bad_vector`` are skipped: they count for no concept and enter no sum, and their
``balanced`` row has weight 0 and no copy. Each phase then reads its rows of ``assignments`` through a DuckDB anti-join
(``_kept_rows``) under the task's memory limit instead of the plain stream.

``balance()`` is the same computation on in-memory arrays (tests, bench).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Literal

import numpy as np

from ovpipe.config import HASHED_UNLESS_DEFAULT, check_range, check_step_folder
from ovpipe.inputs import Input
from ovpipe.step import Step, TaskContext


@dataclass
class BalanceConfig:
    # inverse_frequency weights, or MetaCLIP's balancing (cap each concept at t matches)
    method: Literal["inverse_frequency", "metaclip"] = "inverse_frequency"
    target_size: int | None = None        # default: the input size
    replacement: bool = True  # draw with replacement (a rare concept's samples may repeat)
    alpha: float = 1.0                    # inverse_frequency exponent
    t: float | None = None                # metaclip threshold; solved from target_size if None
    count_top: int | None = None          # concepts per image that count (default: all K)
    seed: int = 0  # the seeded draw
    # a dedup step folder: its near_duplicate rows get no copy and no count; an align step folder: its
    # low_alignment rows likewise. Out of the config hash while empty: earlier balance runs keep their hash.
    dedup_step: str = field(default="", metadata=HASHED_UNLESS_DEFAULT)
    # the align step folder whose low_alignment samples are skipped; "": none
    alignment_step: str = field(default="", metadata=HASHED_UNLESS_DEFAULT)

    @property
    def skipping(self) -> bool:
        return bool(self.dedup_step or self.alignment_step)

    def __post_init__(self):
        if self.target_size is not None and self.target_size < 1:
            raise ValueError(f"target_size must be >= 1, got {self.target_size}")
        if self.alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")
        if self.t is not None and self.t <= 0:
            raise ValueError(f"t must be > 0, got {self.t}")
        check_range(self, "alpha", 0, lo_open=True)
        check_range(self, "t", 0, lo_open=True)
        check_range(self, "count_top", 1)
        check_range(self, "seed", 0, 2**64 - 1)
        for name in ("dedup_step", "alignment_step"):
            if getattr(self, name):
                check_step_folder(name, getattr(self, name))


def uniform_draws(sample_ids, seed: int) -> np.ndarray:
    from manifests.ids import hex_ids_to_u64, splitmix64

    u = splitmix64(hex_ids_to_u64(sample_ids) ^ splitmix64(np.uint64(seed)))
    return (u >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def concept_counts(concepts: np.ndarray, n_concepts: int) -> np.ndarray:
    return np.bincount(concepts.ravel(), minlength=n_concepts).astype(np.int64)


def metaclip_probs(concepts: np.ndarray, counts: np.ndarray, t: float) -> np.ndarray:
    p_c = np.minimum(1.0, t / np.maximum(counts, 1))
    return 1.0 - np.prod(1.0 - p_c[concepts], axis=1)


def solve_t(concepts: np.ndarray, counts: np.ndarray, target: float) -> float:
    """Bisection on t (Σ_i P_i(t) is increasing in t)."""
    return _solve_t(lambda t: metaclip_probs(concepts, counts, t).sum(), counts, target)


def _solve_t(total: Callable[[float], float], counts: np.ndarray, target: float) -> float:
    lo, hi = 0.0, float(counts.max()) if len(counts) else 1.0
    if total(hi) <= target:
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        if total(mid) < target:
            lo = mid
        else:
            hi = mid
    return hi


def inverse_frequency_weights(concepts: np.ndarray, counts: np.ndarray, alpha: float) -> np.ndarray:
    return (np.maximum(counts, 1).astype(np.float64) ** -alpha)[concepts].mean(axis=1)


def _solve_scale(total: Callable[[float], float], w_min: float, target: float) -> float:
    lo, hi = 0.0, 1.0 / max(w_min, 1e-300)
    for _ in range(100):
        mid = (lo + hi) / 2
        if total(mid) < target:
            lo = mid
        else:
            hi = mid
    return hi


@dataclass
class Solution:
    """The global scalars of a balance, from the counts and (where needed) sums over every sample."""

    target: float
    t: float | None = None          # metaclip threshold used
    total: float | None = None      # Σ_i prob_i (with replacement)
    scale: float | None = None      # s of p = min(1, s·prob) (without replacement); None: p = prob or ones


def solve(n: int, counts: np.ndarray, cfg: "BalanceConfig", rows: Callable[[int, int], np.ndarray],
          sum_of: Callable[[Callable[[np.ndarray], np.ndarray]], float],
          min_of: Callable[[Callable[[np.ndarray], np.ndarray]], float]) -> Solution:
    """The global scalars of ``balance``: ``sum_of(f)`` is ``f(concepts).sum()`` over every sample in
    canonical order (numpy's summation order), ``min_of(f)`` its minimum over values > 0."""
    sol = Solution(target=cfg.target_size or n)
    if cfg.method == "metaclip":
        sol.t = cfg.t if cfg.t is not None else _solve_t(
            lambda t: sum_of(lambda c: metaclip_probs(c, counts, t)), counts,
            sol.target if not cfg.replacement else n / 2)
    prob = sample_probs(counts, cfg, sol.t)
    if cfg.replacement:
        sol.total = sum_of(prob)
    elif not (cfg.method == "metaclip" and cfg.t is not None) and sol.target < n:
        sol.scale = _solve_scale(lambda m: sum_of(lambda c: np.minimum(1.0, m * prob(c))), min_of(prob), sol.target)
    return sol


def sample_probs(counts: np.ndarray, cfg: "BalanceConfig", t: float | None) -> Callable[[np.ndarray], np.ndarray]:
    """concepts (rows, K) → prob per row: MetaCLIP's P_i or the inverse-frequency weight w_i."""
    if cfg.method == "metaclip":
        return lambda c: metaclip_probs(c, counts, t)
    return lambda c: inverse_frequency_weights(c, counts, cfg.alpha)


def draw(concepts: np.ndarray, u: np.ndarray, counts: np.ndarray, n: int, cfg: "BalanceConfig",
         sol: Solution) -> tuple[np.ndarray, np.ndarray]:
    """(weight, copies) of some samples, given the global solution — row by row, so a slice gives
    the rows the whole corpus would."""
    prob = sample_probs(counts, cfg, sol.t)(concepts)
    if cfg.replacement:
        lam = sol.target * prob / sol.total if sol.total > 0 else np.zeros(len(prob))
        base = np.floor(lam)
        return lam, (base + (u < lam - base)).astype(np.int64)
    if cfg.method == "metaclip" and cfg.t is not None:
        p = prob
    elif sol.scale is None:       # target ≥ n: keep everything
        p = np.ones_like(prob)
    else:
        p = np.minimum(1.0, sol.scale * prob)
    return p, (u < p).astype(np.int64)


def balance(concepts: np.ndarray, u: np.ndarray, n_concepts: int, cfg: BalanceConfig):
    """(weight, copies, counts_before, counts_after, info) for all samples, in memory."""
    n = len(concepts)
    counts = concept_counts(concepts, n_concepts)
    sol = solve(n, counts, cfg, None, lambda f: f(concepts).sum(), lambda f: float((v := f(concepts))[v > 0].min()))
    weight, copies = draw(concepts, u, counts, n, cfg, sol)
    after = np.bincount(np.repeat(concepts, copies, axis=0).ravel(), minlength=n_concepts).astype(np.int64)
    return weight, copies, counts, after, ({"t": sol.t} if sol.t is not None else {})


# ---------------------------------------------------------------------------------- the step

def _concepts(lists, count_top: int | None) -> np.ndarray:
    """A list<int32> column → (rows, K) int64, cut to the first ``count_top``."""
    import pyarrow as pa

    if isinstance(lists, pa.ChunkedArray):
        lists = lists.combine_chunks()
    flat = lists.flatten().to_numpy().astype(np.int64)
    k = (len(flat) // len(lists)) if len(lists) else 1
    if len(flat) != k * len(lists):
        raise ValueError(f"assignments.concept_ids: rows hold different numbers of concepts ({len(flat)} ids "
                         f"in {len(lists)} rows); assign writes K per row")
    c = flat.reshape(len(lists), k)
    return c[:, :count_top] if count_top else c


def count_concepts(cfg: BalanceConfig, task: TaskContext) -> None:
    """Map: this rank's share of ``assignments`` → its concept bincount."""
    counts = np.zeros(0, np.int64)
    n, k = 0, 0
    batches = (_kept_rows(task, cfg, *_slice(task)) if cfg.skipping
               else task.iter_input_share("assignments", ["concept_ids"]))
    with task.stats.timer("count"):
        for batch in batches:
            c = _concepts(batch.column("concept_ids"), cfg.count_top)
            if not len(c):
                continue
            if k and c.shape[1] != k:
                raise ValueError(f"assignments.concept_ids: {c.shape[1]} concepts per row here, {k} before")
            k = c.shape[1]
            b = np.bincount(c.ravel())
            if len(b) > len(counts):
                counts = np.pad(counts, (0, len(b) - len(counts)))
            counts[:len(b)] += b
            n += len(c)
    task.write_partial("counts", counts=counts, n=np.array([n]), k=np.array([k]))


def reduce_counts(cfg: BalanceConfig, task: TaskContext) -> None:
    """Reduce: Σ bincounts → count_before; the global scalars (``solve``) by streaming the concept ids in
    canonical order through a temp file; ``reduced/balance.npz``."""
    counts = np.zeros(0, np.int64)
    n, k = 0, 0
    for part in task.iter_partials("counts"):
        c = part["counts"]
        if len(c) > len(counts):
            counts = np.pad(counts, (0, len(c) - len(counts)))
        counts[:len(c)] += c
        n += int(part["n"][0])
        if int(part["k"][0]):
            if k and int(part["k"][0]) != k:
                raise ValueError(f"assignments.concept_ids: map ranks saw {k} and {int(part['k'][0])} concepts per row")
            k = int(part["k"][0])
    ct = task.read_input("concepts", columns=["concept_id"])
    n_concepts = int(max(ct.column("concept_id").to_numpy().max() + 1, len(counts)))
    counts = np.pad(counts, (0, n_concepts - len(counts)))
    with task.stats.timer("solve"):
        with _CanonicalConcepts(task, cfg, n, k) as rows:
            sol = solve(n, counts, cfg, rows.read, rows.sum_of, rows.min_of)
    if sol.t is not None:
        task.stats.info["t"] = float(sol.t)
    nan = float("nan")
    task.write_reduced("balance", counts=counts, n=np.array([n]), k=np.array([k]),
                       target=np.array([sol.target], np.float64),
                       t=np.array([nan if sol.t is None else sol.t]),
                       total=np.array([nan if sol.total is None else sol.total]),
                       scale=np.array([nan if sol.scale is None else sol.scale]))


class _CanonicalConcepts:
    """The (n, K) concept ids in canonical order, written once to a temp int32 file under
    ``reduced/`` (streamed from ``iter_manifest``) and read back a chunk at a time — only when the
    solution needs a sum over samples; removed when done."""

    CHUNK = 1 << 18       # rows read per chunk (× K int32)

    def __init__(self, task: TaskContext, cfg: BalanceConfig, n: int, k: int):
        self.task, self.cfg, self.count_top, self.n, self.k = task, cfg, cfg.count_top, n, k
        self.path = task.reduced_path(f".tmp-{os.getpid()}-concepts.i32")
        self._written = False

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rows = 0
        with open(self.path, "wb") as f:
            batches = (_kept_rows(self.task, self.cfg) if self.cfg.skipping
                       else self.task.iter_input_canonical("assignments", ["concept_ids"]))
            for batch in batches:
                c = _concepts(batch.column("concept_ids"), self.count_top)
                f.write(np.ascontiguousarray(c, dtype=np.int32).tobytes())
                rows += len(c)
        if rows != self.n:
            raise RuntimeError(f"assignments changed under the reduce: {rows} rows now, {self.n} when counted")
        self._written = True

    def read(self, lo: int, hi: int) -> np.ndarray:
        if not self._written:
            self._write()
        k = max(self.k, 1)
        with open(self.path, "rb") as f:
            f.seek(lo * k * 4)
            a = np.fromfile(f, dtype=np.int32, count=(hi - lo) * k)
        return a.astype(np.int64).reshape(hi - lo, k)

    def sum_of(self, f: Callable[[np.ndarray], np.ndarray]) -> float:
        from ovpipe.mapreduce import pairwise_sum

        return pairwise_sum(self.n, lambda lo, hi: f(self.read(lo, hi)))

    def min_of(self, f: Callable[[np.ndarray], np.ndarray]) -> float:
        best = np.inf
        for lo in range(0, self.n, self.CHUNK):
            v = f(self.read(lo, min(lo + self.CHUNK, self.n)))
            v = v[v > 0]
            if len(v):
                best = min(best, float(v.min()))
        if not np.isfinite(best):
            raise ValueError("balance: every sample has weight 0; nothing to scale to target_size")
        return best

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.path.unlink(missing_ok=True)


def _slice(task: TaskContext) -> tuple[int, int]:
    from ovpipe.mapreduce import slice_bounds

    return slice_bounds(task.input_num_rows("assignments"), task.rank, task.world_size)


# bad_vector: an image vector that is NaN, inf or not of unit length; its concepts were assigned from it too.
SKIP_STATUS = {"dedup": ("near_duplicate", "bad_vector"), "alignment": ("low_alignment", "bad_vector")}


def _kept_rows(task: TaskContext, cfg: BalanceConfig, lo: int = 0, hi: int | None = None, with_skipped: bool = False):
    """Rows [lo, hi) of ``assignments`` in canonical order, less those its declared ``dedup`` / ``alignment``
    inputs mark (``SKIP_STATUS``) — or, ``with_skipped``, all of them with a ``skipped`` column. A DuckDB
    anti-join under the task's memory limit, streamed a batch at a time."""
    from ovpipe.mapreduce import BATCH_ROWS

    def files(kind):
        return "[" + ", ".join("'" + str(f).replace("'", "''") + "'" for f in task.input_files(kind)) + "]"

    marks = " UNION ".join(f"SELECT sample_id FROM read_parquet({files(kind)}) WHERE status IN "
                           f"({', '.join(repr(s) for s in statuses)})"
                           for kind, statuses in SKIP_STATUS.items() if getattr(cfg, f"{kind}_step"))
    n = task.input_num_rows("assignments")
    hi = n if hi is None else hi
    sql = (f"SELECT a.sample_id, a.concept_ids, m.sample_id IS NOT NULL AS skipped "
           f"FROM read_parquet({files('assignments')}) a LEFT JOIN (SELECT DISTINCT sample_id FROM ({marks})) m "
           f"USING (sample_id) ORDER BY a.sample_id LIMIT {hi - lo} OFFSET {lo}")
    if not with_skipped:
        sql = f"SELECT sample_id, concept_ids FROM ({sql}) WHERE NOT skipped ORDER BY sample_id"
    with task.duckdb() as con:
        yield from con.sql(sql).to_arrow_reader(BATCH_ROWS)


def _solution(r: dict) -> Solution:
    def opt(x):
        v = float(x[0])
        return None if np.isnan(v) else v

    return Solution(target=float(r["target"][0]), t=opt(r["t"]), total=opt(r["total"]), scale=opt(r["scale"]))


def apply_weights(cfg: BalanceConfig, task: TaskContext) -> None:
    """Apply: this rank's canonical slice → its ``balanced`` part (weight, copies) and a count_after bincount."""
    import pyarrow as pa

    from ovpipe.mapreduce import BATCH_ROWS

    r = task.read_reduced("balance")
    counts, n, sol = r["counts"], int(r["n"][0]), _solution(r)
    after = np.zeros(len(counts), np.int64)
    with task.stats.timer("balance"), task.part_writer("balanced", row_group_rows=BATCH_ROWS) as out:
        batches = (_kept_rows(task, cfg, *_slice(task), with_skipped=True) if cfg.skipping
                   else task.iter_input_slice("assignments", ["sample_id", "concept_ids"]))
        for batch in batches:
            sid = batch.column("sample_id")
            c = _concepts(batch.column("concept_ids"), cfg.count_top)
            weight, copies = draw(c, uniform_draws(sid, cfg.seed), counts, n, cfg, sol)
            if cfg.skipping:          # a near_duplicate / low_alignment / bad_vector row: no weight, no copy
                skipped = batch.column("skipped").to_numpy(zero_copy_only=False)
                weight, copies = np.where(skipped, 0.0, weight), np.where(skipped, 0, copies)
                task.stats.inc("skipped", int(skipped.sum()))
            after += np.bincount(np.repeat(c, copies, axis=0).ravel(), minlength=len(counts)).astype(np.int64)
            out.write(pa.table({"sample_id": sid, "weight": pa.array(weight),
                                "copies": pa.array(copies.astype(np.int32))}))
            task.stats.inc("samples", len(c))
            task.stats.inc("copies", int(copies.sum()))
            task.stats.inc("dropped", int((copies == 0).sum()))
    task.write_partial("after", after=after)


def write_concept_counts(cfg: BalanceConfig, task: TaskContext) -> None:
    """Finalize: ``concept_counts`` (before: the reduce's counts; after: Σ of the apply ranks' bincounts)."""
    counts = task.read_reduced("balance")["counts"]
    after = np.zeros(len(counts), np.int64)
    for part in task.iter_partials("after"):
        after += part["after"]
    n_concepts = len(counts)
    ct = task.read_input("concepts", columns=["concept_id", "text"])
    text = dict(zip(ct.column("concept_id").to_pylist(), ct.column("text").to_pylist()))
    task.write_part("concept_counts", {"concept_id": np.arange(n_concepts, dtype=np.int32),
                                       "text": [text.get(c) for c in range(n_concepts)],
                                       "count_before": counts, "count_after": after})


STEP = Step("balance", BalanceConfig, count_concepts,
            inputs={"assignments": None, "concepts": None,
                    "dedup": Input("dedup_step", when=lambda c: bool(c.dedup_step)),
                    "alignment": Input("alignment_step", when=lambda c: bool(c.alignment_step))},
            outputs=("balanced", "concept_counts"), reduce=reduce_counts, apply=apply_weights,
            finalize=write_concept_counts,
            description="concept frequencies + inverse-frequency / MetaCLIP resampling")
