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
for any task count. Every rank computes the global counts (numpy ``bincount``: seconds at 10M
samples) and writes its slice of ``balanced``; rank 0 writes ``concept_counts`` with
``count_after = Σ_i copies_i · [c ∈ topK(i)]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from ovpipe.config import check_range
from ovpipe.step import Step, TaskContext, slice_bounds


@dataclass
class BalanceConfig:
    method: Literal["inverse_frequency", "metaclip"] = "inverse_frequency"
    target_size: int | None = None        # default: the input size
    replacement: bool = True
    alpha: float = 1.0                    # inverse_frequency exponent
    t: float | None = None                # metaclip threshold; solved from target_size if None
    count_top: int | None = None          # concepts per image that count (default: all K)
    seed: int = 0

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


def uniform_draws(sample_ids, seed: int) -> np.ndarray:
    from packing.binpack import hex_ids_to_u64, splitmix64

    u = splitmix64(hex_ids_to_u64(sample_ids) ^ splitmix64(np.uint64(seed)))
    return (u >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def concept_counts(concepts: np.ndarray, n_concepts: int) -> np.ndarray:
    return np.bincount(concepts.ravel(), minlength=n_concepts).astype(np.int64)


def metaclip_probs(concepts: np.ndarray, counts: np.ndarray, t: float) -> np.ndarray:
    p_c = np.minimum(1.0, t / np.maximum(counts, 1))
    return 1.0 - np.prod(1.0 - p_c[concepts], axis=1)


def solve_t(concepts: np.ndarray, counts: np.ndarray, target: float) -> float:
    """Bisection on t (Σ_i P_i(t) is increasing in t)."""
    lo, hi = 0.0, float(counts.max()) if len(counts) else 1.0
    if metaclip_probs(concepts, counts, hi).sum() <= target:
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        if metaclip_probs(concepts, counts, mid).sum() < target:
            lo = mid
        else:
            hi = mid
    return hi


def inverse_frequency_weights(concepts: np.ndarray, counts: np.ndarray, alpha: float) -> np.ndarray:
    return (np.maximum(counts, 1).astype(np.float64) ** -alpha)[concepts].mean(axis=1)


def scale_to_target(w: np.ndarray, target: float) -> np.ndarray:
    """p = min(1, s·w) with Σ p = target (s by bisection)."""
    if target >= len(w):
        return np.ones_like(w)
    lo, hi = 0.0, 1.0 / max(w[w > 0].min(), 1e-300)
    for _ in range(100):
        mid = (lo + hi) / 2
        if np.minimum(1.0, mid * w).sum() < target:
            lo = mid
        else:
            hi = mid
    return np.minimum(1.0, hi * w)


def balance(concepts: np.ndarray, u: np.ndarray, n_concepts: int, cfg: BalanceConfig):
    """(weight, copies, counts_before, counts_after, info) for all samples."""
    n = len(concepts)
    target = cfg.target_size or n
    counts = concept_counts(concepts, n_concepts)
    info = {}
    if cfg.method == "metaclip":
        t = cfg.t if cfg.t is not None else solve_t(concepts, counts, target if not cfg.replacement else n / 2)
        info["t"] = t
        prob = metaclip_probs(concepts, counts, t)
    else:
        prob = inverse_frequency_weights(concepts, counts, cfg.alpha)
    if cfg.replacement:
        lam = target * prob / prob.sum() if prob.sum() > 0 else np.zeros(n)
        base = np.floor(lam)
        copies = (base + (u < lam - base)).astype(np.int64)
        weight = lam
    else:
        p = prob if (cfg.method == "metaclip" and cfg.t is not None) else scale_to_target(prob, target)
        copies = (u < p).astype(np.int64)
        weight = p
    after = np.bincount(np.repeat(concepts, copies, axis=0).ravel(), minlength=n_concepts).astype(np.int64)
    return weight, copies, counts, after, info


def run(cfg: BalanceConfig, task: TaskContext) -> None:
    import pyarrow as pa

    from manifests import read_manifest

    a = task.read_input("assignments", columns=["sample_id", "concept_ids"])
    sid = a.column("sample_id").combine_chunks()
    lists = a.column("concept_ids").combine_chunks()
    k = (len(lists.values) // len(lists)) if len(lists) else 1
    concepts = lists.values.to_numpy().astype(np.int64).reshape(len(lists), k)
    if cfg.count_top:
        concepts = concepts[:, : cfg.count_top]
    ct = read_manifest(task.run_dir, "concepts", columns=["concept_id", "text"])
    n_concepts = int(max(ct.column("concept_id").to_numpy().max() + 1, concepts.max(initial=-1) + 1))
    u = uniform_draws(sid, cfg.seed)
    with task.stats.timer("balance"):
        weight, copies, before, after, info = balance(concepts, u, n_concepts, cfg)
    lo, hi = slice_bounds(len(sid), task.rank, task.world_size)
    task.write_part("balanced", pa.table({"sample_id": sid.slice(lo, hi - lo),
                                          "weight": pa.array(weight[lo:hi]),
                                          "copies": pa.array(copies[lo:hi].astype(np.int32))}))
    task.stats.inc("samples", hi - lo)
    task.stats.inc("copies", int(copies[lo:hi].sum()))
    task.stats.inc("dropped", int((copies[lo:hi] == 0).sum()))
    if task.rank == 0:
        task.stats.info.update({k2: float(v) for k2, v in info.items()})
        text = dict(zip(ct.column("concept_id").to_pylist(), ct.column("text").to_pylist()))
        task.write_part("concept_counts", {"concept_id": np.arange(n_concepts, dtype=np.int32),
                                           "text": [text.get(c) for c in range(n_concepts)],
                                           "count_before": before, "count_after": after})


STEP = Step("balance", BalanceConfig, run, inputs=("assignments", "concepts"),
            outputs=("balanced", "concept_counts"),
            description="concept frequencies + inverse-frequency / MetaCLIP resampling")
