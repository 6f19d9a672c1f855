"""Unbiased pass@k (Chen et al., 2021): with n samples of which c are correct,

    pass@k = 1 − C(n − c, k) / C(n, k)       (= 1 when n − c < k)

computed stably as a product, never as factorials or log-gamma differences:

    C(n−c, k) / C(n, k) = ∏_{i<k} (1 − c/(n−i)) = ∏_{i<c} (1 − k/(n−i))

whichever of the two has fewer factors (min(c, k) of them), summed as ``log1p`` terms and turned back
with ``−expm1`` so pass@k near 0 keeps its relative precision. Rows are sorted by factor count so the
loop touches each factor once: the cost is Σ min(c, k) vector elements (10M rollouts in under a
second). Agreement with exact ``math.comb`` fractions is ~1e-16 up to n = 4096 (tested to 1e-12 there;
the log-gamma form we had first drifted to 1.3e-11 at n = 4096).
"""
from __future__ import annotations

import numpy as np


def pass_at_k(n, c, k) -> np.ndarray:
    n = np.asarray(n, dtype=np.int64)
    c = np.asarray(c, dtype=np.int64)
    n, c, k = np.broadcast_arrays(n, c, np.asarray(k, dtype=np.int64))
    shape = n.shape
    n, c, k = n.ravel(), c.ravel(), k.ravel()
    if np.any(c > n) or np.any(c < 0):
        raise ValueError("need 0 <= c <= n")
    if np.any(k > n) or np.any(k < 1):
        raise ValueError("need 1 <= k <= n")
    certain = n - c < k                                 # every draw of k contains a correct one
    m = np.where(certain, 0, np.minimum(c, k))          # number of factors
    x = np.where(k <= c, c, k).astype(np.float64)       # the numerator of each factor 1 − x/(n−i)
    order = np.argsort(-m, kind="stable")
    ms, xs, ns = m[order], x[order], n[order].astype(np.float64)
    active = np.searchsorted(-ms, -np.arange(int(ms[0]) if ms.size else 0), side="left")  # #rows with m > i
    log_ratio = np.zeros(ms.size)
    for i, j in enumerate(active):
        log_ratio[:j] += np.log1p(-xs[:j] / (ns[:j] - i))
    out = np.empty(ms.size)
    out[order] = 0.0 - np.expm1(log_ratio)            # 0.0 − (−0.0): a pass@k of zero is +0.0, never −0.0
    out[certain] = 1.0
    return out.reshape(shape)
