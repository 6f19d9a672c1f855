"""The one place for the fuzz tests' hypothesis strategies, and the settings profiles they run under.

Profiles (chosen by the environment variable HYPOTHESIS_PROFILE, default "ci"):
- "ci": `make test` — derandomized (a fixed seed: the same examples on every run), few examples per test,
  no example database, so the whole fuzz suite stays within ~30 s on a 2-core machine.
- "long": the bench (`python -m bench fuzz --examples N` sets max_examples itself); random, no deadline.

Every strategy here draws *bad* inputs on purpose: a vector row that is zero, NaN, ±inf, subnormal or
duplicated; a caption that is null, a number or a huge string; a tar member that is missing or cut short.
"""
from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

settings.register_profile(
    "ci", derandomize=True, max_examples=25, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
settings.register_profile(
    "long", max_examples=2_000, deadline=None, database=None,
    suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# What a vector row can be: a real direction, or one of the values that break a norm, a dot product or a
# faiss search. "dup" repeats an earlier row exactly (identical vectors, however many).
ROW_KINDS = ("normal", "zero", "nan", "inf", "-inf", "partial_nan", "tiny", "huge", "dup")


@st.composite
def vector_rows(draw, dim: int = 8, min_rows: int = 1, max_rows: int = 40,
                kinds: tuple[str, ...] = ROW_KINDS, dtype=np.float32) -> tuple[np.ndarray, list[str]]:
    """(vectors [n, dim] of `dtype`, the kind of each row). Rows of every kind in ROW_KINDS, in any order."""
    n = draw(st.integers(min_rows, max_rows))
    row_kinds = draw(st.lists(st.sampled_from(kinds), min_size=n, max_size=n))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    out = np.empty((n, dim), dtype=np.float64)
    for i, kind in enumerate(row_kinds):
        if kind == "dup" and i > 0:
            out[i] = out[draw(st.integers(0, i - 1))]
            continue
        if kind == "dup":
            row_kinds[i] = kind = "normal"
        v = rng.standard_normal(dim)
        if kind == "zero":
            v[:] = 0.0
        elif kind == "nan":
            v[:] = np.nan
        elif kind == "inf":
            v[rng.integers(dim)] = np.inf
        elif kind == "-inf":
            v[rng.integers(dim)] = -np.inf
        elif kind == "partial_nan":
            v[rng.integers(dim)] = np.nan
        elif kind == "tiny":
            v *= float(np.finfo(dtype).tiny)
        elif kind == "huge":
            v *= float(np.finfo(dtype).max) / 4
        out[i] = v
    with np.errstate(over="ignore", invalid="ignore"):
        return out.astype(dtype), row_kinds


def float_vectors(dim: int = 8, min_rows: int = 1, max_rows: int = 40,
                  kinds: tuple[str, ...] = ROW_KINDS, dtype=np.float32):
    """Only the [n, dim] array of `vector_rows`."""
    return vector_rows(dim, min_rows, max_rows, kinds, dtype).map(lambda pair: pair[0])


def is_bad_row(v: np.ndarray) -> bool:
    """A row no cosine can be computed from: a non-finite value, or a zero norm."""
    v64 = np.asarray(v, dtype=np.float64)
    return not np.isfinite(v64).all() or not np.linalg.norm(v64) > 0
