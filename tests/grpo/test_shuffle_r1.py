import numpy as np

from grpo.shuffle_r1 import advantage_batch_shuffle, pairwise_trajectory_sampling, reshape_batch, symptoms


def test_pts_pairs_max_with_min():
    a = np.array([0.1, 2.0, -1.5, 0.0, 1.0, -0.5, 0.3, -2.0])
    pairs = pairwise_trajectory_sampling(a, alpha=1.0)
    assert pairs[0] == (1, 7) and pairs[1] == (4, 2) and len(pairs) == 4
    assert pairwise_trajectory_sampling(a, alpha=0.5) == pairs[:2]


def test_abs_sizes_distinct_and_weighting():
    w = np.array([0.0, 1.0, 1.0, 8.0] * 8)
    pick = advantage_batch_shuffle(w, S=8, seed=0)
    assert len(pick) == len(w)
    T = -(-len(w) // 8)
    for s in range(8):
        chunk = pick[s * T:(s + 1) * T]
        assert len(set(chunk.tolist())) == len(chunk)       # distinct within a sub-sampling
    assert not np.isin(pick, np.flatnonzero(w == 0)).any()  # zero-weight pairs never drawn
    counts = np.bincount(pick, minlength=len(w))
    assert counts[w == 8].mean() > counts[w == 1].mean()


def test_zero_total_weight_does_not_crash():
    pick = advantage_batch_shuffle(np.zeros(10), S=4, seed=1)
    assert len(pick) == 10


def test_reshape_reduces_collapse_and_silence():
    rng = np.random.default_rng(0)
    adv, gid = [], []
    for g in range(32):
        n = 8
        a = np.zeros(n) if g % 2 else rng.normal(0, 1, n)   # half the groups are flat
        adv += list(a)
        gid += [g] * n
    adv, gid = np.array(adv), np.array(gid)
    idx = reshape_batch(adv, gid, alpha=0.5, S=8, seed=0)
    assert len(idx) == len(adv)
    before, after = symptoms(adv), symptoms(adv[idx])
    assert after["advantage_collapsing"] < before["advantage_collapsing"]
    assert after["nonzero_gradient_share"] > before["nonzero_gradient_share"]
