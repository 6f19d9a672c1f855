import math

import numpy as np
import pytest

from rl_select.passk import pass_at_k


def exact(n, c, k):
    if n - c < k:
        return 1.0
    return 1 - math.comb(n - c, k) / math.comb(n, k)


def test_matches_math_comb_on_a_grid():
    ns, cs, ks, ref = [], [], [], []
    for n in (1, 2, 3, 5, 8, 16, 32, 64, 100, 256):
        for c in range(0, n + 1, max(1, n // 16)):
            for k in sorted({1, 2, 4, 8, 16, 32, n}):
                if k <= n:
                    ns.append(n), cs.append(c), ks.append(k), ref.append(exact(n, c, k))
    got = pass_at_k(ns, cs, ks)
    assert np.max(np.abs(got - np.array(ref))) < 1e-12


@pytest.mark.parametrize("n, c, k, want", [(8, 0, 1, 0.0), (8, 0, 8, 0.0), (8, 8, 1, 1.0), (8, 3, 8, 1.0),
                                           (8, 6, 4, 1.0), (10, 1, 1, 0.1), (4, 1, 2, 0.5)])
def test_edge_cases(n, c, k, want):
    assert abs(float(pass_at_k(n, c, k)) - want) < 1e-12


def test_rejects_bad_arguments():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_large_n_against_exact_fractions():
    from fractions import Fraction

    ns, cs, ks, ref = [], [], [], []
    for n in (512, 1000, 4096):
        for c in sorted({0, 1, 3, n // 100, n // 10, n // 2, n - 40, n - 1, n}):
            for k in sorted({1, 2, 8, 32, n // 2, n}):
                ns.append(n), cs.append(c), ks.append(k)
                ref.append(1.0 if n - c < k else float(1 - Fraction(math.comb(n - c, k), math.comb(n, k))))
    assert np.max(np.abs(pass_at_k(ns, cs, ks) - np.array(ref))) < 1e-12


def test_shapes_and_broadcasting():
    assert pass_at_k(8, 3, 2).shape == ()
    got = pass_at_k(np.full((2, 3), 8), np.array([[0, 1, 2], [6, 7, 8]]), 2)
    assert got.shape == (2, 3) and got[0, 0] == 0.0 and got[1, 2] == 1.0
