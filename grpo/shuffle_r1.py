"""Shuffle-R1: reshape a GRPO batch so the gradient comes from informative rollouts.

Pairwise Trajectory Sampling (PTS). In a group of 2N rollouts sorted by advantage, pair the
highest with the lowest, the second-highest with the second-lowest, …; pair ``j`` has the
``j``-th largest contrast. Keep the first ``⌊α·N⌋`` pairs (α = 0.5): the rollouts whose
advantages carry the most signal.

Advantage-based Batch Shuffle (ABS). Over all kept pairs of the batch, pair weight
``w_p = |A_1| + |A_2|`` and sampling probability ``w_p / Σ w``. Draw ``S`` sub-samplings (S = 8),
each of ``T = ⌈P / S⌉`` *distinct* pairs (without replacement, ∝ w), and concatenate them: the
reshuffled batch has the original number of pairs, high-contrast pairs appear several times,
flat ones rarely. A batch whose pairs all have zero weight falls back to uniform sampling.

Symptoms the paper reports, measured before and after (``symptoms``):
* advantage collapsing — share of rollouts with |A| < 0.1;
* rollout silencing — share of rollouts with non-zero gradient (|A| > 1e-8).
"""
from __future__ import annotations

import numpy as np


def pairwise_trajectory_sampling(advantages: np.ndarray, alpha: float = 0.5) -> list[tuple[int, int]]:
    """Pairs (high, low) of rollout indices of one group, most contrastive first."""
    a = np.asarray(advantages, dtype=np.float64)
    order = np.argsort(-a, kind="stable")
    n_pairs = len(a) // 2
    pairs = [(int(order[j]), int(order[-1 - j])) for j in range(n_pairs)]
    keep = max(1, int(alpha * n_pairs)) if n_pairs else 0
    return pairs[:keep]


def advantage_batch_shuffle(pair_weights: np.ndarray, S: int = 8, seed: int = 0) -> np.ndarray:
    """Indices into the pair list: S sub-samplings of T distinct pairs each, concatenated,
    trimmed to the original number of pairs."""
    w = np.asarray(pair_weights, dtype=np.float64)
    P = len(w)
    if P == 0:
        return np.zeros(0, dtype=np.int64)
    T = -(-P // S)
    rng = np.random.default_rng(seed)
    p = w / w.sum() if w.sum() > 0 else np.full(P, 1.0 / P)
    nonzero = int((p > 0).sum())
    out = []
    for _ in range(S):
        t = min(T, nonzero) if nonzero else min(T, P)
        out.append(rng.choice(P, size=t, replace=False, p=p if nonzero >= t else None))
    return np.concatenate(out)[:P]


def reshape_batch(advantages: np.ndarray, group_ids: np.ndarray, alpha: float = 0.5, S: int = 8,
                  seed: int = 0) -> np.ndarray:
    """Rollout indices of the reshaped batch (PTS per group, then ABS over the batch)."""
    advantages = np.asarray(advantages, dtype=np.float64)
    pairs: list[tuple[int, int]] = []
    for g in np.unique(group_ids):
        idx = np.flatnonzero(group_ids == g)
        pairs += [(int(idx[i]), int(idx[j])) for i, j in pairwise_trajectory_sampling(advantages[idx], alpha)]
    if not pairs:
        return np.zeros(0, dtype=np.int64)
    weights = np.array([abs(advantages[i]) + abs(advantages[j]) for i, j in pairs])
    pick = advantage_batch_shuffle(weights, S, seed)
    # the reshaped batch keeps the original number of pairs overall: P_original = rollouts / 2
    target = len(advantages) // 2
    reps = -(-target // max(len(pick), 1))
    pick = np.tile(pick, reps)[:target]
    return np.array([x for k in pick for x in pairs[k]], dtype=np.int64)


def symptoms(advantages: np.ndarray) -> dict:
    a = np.abs(np.asarray(advantages, dtype=np.float64))
    return {"advantage_collapsing": float((a < 0.1).mean()) if len(a) else 0.0,
            "nonzero_gradient_share": float((a > 1e-8).mean()) if len(a) else 0.0}
