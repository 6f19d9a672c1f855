"""Balanced steps (packing.compute_balance) and pack costs (packing.cost): properties on generated costs."""
import numpy as np
import pytest

from packing.compute_balance import displacement_steps, order, rank_costs, straggler_loss


def costs(n=6000, seed=0):
    rng = np.random.default_rng(seed)
    return rng.lognormal(0.0, 0.25, n) * np.where(rng.random(n) < 0.05, 1.6, 1.0)   # a heavy tail of packs


@pytest.mark.parametrize("method", ["lpt", "kk"])
@pytest.mark.parametrize("dp,mb,ga", [(8, 1, 1), (16, 1, 4), (4, 2, 3)])
def test_order_is_a_permutation_that_cuts_the_straggler_loss(method, dp, mb, ga):
    c = costs()
    p = order(c, dp, mb, ga, window=16, method=method)
    assert np.array_equal(np.sort(p), np.arange(len(c)))
    before, after = straggler_loss(c, dp, mb, ga), straggler_loss(c[p], dp, mb, ga)
    assert after < before / 4
    # every pack stays within one window of the shuffle's place; the partial last step keeps its place
    assert displacement_steps(p, dp, mb, ga) < 16
    G = dp * mb * ga
    tail = len(c) % G
    if tail:
        assert np.array_equal(p[-tail:], np.arange(len(c) - tail, len(c)))
    # each step's ranks: the same packs' total cost as some step of the input window (a permutation per window)
    assert np.isclose(rank_costs(c[p], dp, mb, ga).sum(), rank_costs(c, dp, mb, ga).sum())


def test_order_is_deterministic_and_seeded():
    c = costs()
    a, b = order(c, 8, 1, 2, seed=3), order(c, 8, 1, 2, seed=3)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, order(c, 8, 1, 2, seed=4))
    # the seed changes which step/rank, not how well balanced
    assert straggler_loss(c[order(c, 8, 1, 2, seed=4)], 8, 1, 2) == pytest.approx(straggler_loss(c[a], 8, 1, 2),
                                                                                   rel=0.3)


def test_rank_layout_matches_the_loaders_round_robin():
    """Position p is micro-batch p // mb, which goes to rank (p // mb) mod dp; a rank runs ga micro-batches a
    step. Cost 1 on the packs of one (step, rank) lands on exactly that cell."""
    dp, mb, ga = 3, 2, 2
    n = dp * mb * ga * 2
    for target_step, target_rank in [(0, 0), (1, 2), (0, 1)]:
        c = np.zeros(n)
        mine = [p for p in range(n) if (p // mb) % dp == target_rank and (p // mb) // dp // ga == target_step]
        c[mine] = 1.0
        rc = rank_costs(c, dp, mb, ga)
        assert rc[target_step, target_rank] == len(mine) == mb * ga and rc.sum() == len(mine)


def test_straggler_loss_is_undefined_without_a_whole_step_and_zero_when_equal():
    assert straggler_loss(np.ones(5), 8) is None
    assert straggler_loss(np.ones(64), 8) == 0.0
    assert straggler_loss(np.r_[2.0, np.ones(7)], 8) == pytest.approx(2 / (9 / 8) - 1)


def test_bad_layout_fails_naming_it():
    with pytest.raises(ValueError, match="method"):
        order(np.ones(8), 2, method="greedy")
    with pytest.raises(ValueError, match="dp"):
        order(np.ones(8), 0)


def test_term_weights_reproduce_the_trainers_flops():
    """packing.cost's dot product with flops.term_weights is model_flops, for any counts, stage and recompute:
    the pack cost and MFU share one accounting."""
    from packing.cost import weights
    from pretrain.recipes import RECIPES, STAGES
    from pretrain.trainer.flops import STAT_TERMS, cost_weights_table, model_flops, term_weights

    rng = np.random.default_rng(0)
    r = RECIPES["llava-ov-1.5-4b"]
    for trainable in ("all", "projector"):
        for recompute in ("none", "full", "selective"):
            for _ in range(3):
                stats = {k: int(v) for k, v in zip(STAT_TERMS, rng.integers(0, 10 ** 6, len(STAT_TERMS)))}
                for hw in (False, True):
                    w = term_weights(r, trainable, recompute, hardware=hw)
                    assert sum(w[k] * stats[k] for k in STAT_TERMS) == pytest.approx(
                        model_flops(r, trainable, stats, recompute)[int(hw)], rel=1e-12)
    # the committed default table is the model's (python -m pretrain.trainer.flops > packing/cost_weights.json)
    assert cost_weights_table() == {k: weights(k) for k in cost_weights_table()}
    assert set(cost_weights_table()) == {f"{n}/{s}" for n in RECIPES for s in STAGES}


def test_pack_cost_grows_with_attention_and_images():
    """Same tokens, more cost: two long samples over many short ones; images over text."""
    from packing.cost import cost_of, pack_stats, weights

    w = weights()
    z2, z16 = np.zeros(2, np.int64), np.zeros(16, np.int64)
    long = cost_of(pack_stats([4096, 4096], z2, z2, z2, [0, 2]), w)[0]
    short = cost_of(pack_stats([512] * 16, z16, z16, z16, [0, 16]), w)[0]
    img = cost_of(pack_stats([512] * 16, [402] * 16, [1] * 16, [(1600 + 1) ** 2] * 16, [0, 16]), w)[0]
    assert long > short and img > short


def test_cost_weights_file_and_bad_spec(tmp_path):
    import json

    from packing.cost import TERMS, weights

    f = tmp_path / "fit.json"
    f.write_text(json.dumps(dict.fromkeys(TERMS, 1e-9)))
    assert weights(str(f)) == dict.fromkeys(TERMS, 1e-9)
    f.write_text(json.dumps({"tokens": 1.0}))
    with pytest.raises(ValueError, match="attn_sq"):
        weights(str(f))
    with pytest.raises(ValueError, match="llava-ov-1.5-4b/1.5"):
        weights("no-such-recipe/9")


def test_pack_config_refuses_a_bad_cost_or_layout_before_any_work():
    from packing.pack import PackConfig

    with pytest.raises(ValueError, match="cost_weights"):
        PackConfig(cost_weights="no-such/1")
    with pytest.raises(ValueError, match="balance_grad_accum"):
        PackConfig(balance_dp=8, balance_grad_accum=0)
    with pytest.raises(ValueError, match="balance_method"):
        PackConfig(balance_method="greedy")


@pytest.mark.parametrize("n,G", [(6000, 8), (6005, 8), (6005, 64), (37, 8), (5, 8), (97, 1)])
def test_the_balanced_stream_reads_whole_groups_every_epoch_and_each_pack_once_an_epoch(n, G):
    """Every step (G consecutive positions) of every epoch is one whole group of ``order``'s epoch — a group of
    pack_id order, or a carried group of the n mod G leftover packs — and after epoch E each grouped pack was
    read exactly E times, each leftover pack E or fewer (it waits in the queue), none more than one apart;
    ``stream_positions`` is ``stream_packs``' inverse."""
    from packing.compute_balance import epoch_start, stream_costs, stream_packs, stream_positions

    whole = n // G * G
    s = stream_packs(n, G, 0, 6 * n + 4 * G)
    for step in s[:len(s) // G * G].reshape(-1, G):
        grouped = step < whole
        assert grouped.all() or not grouped.any()
        if grouped.all():
            assert np.array_equal(step, step[0] + np.arange(G)) and step[0] % G == 0
    for E in range(1, 5):
        read = np.bincount(s[:int(epoch_start(E, n, G)) * G], minlength=n)
        assert (read[:whole] == E).all() and read.max() <= E
        if whole < n:
            assert read[whole:].max() - read[whole:].min() <= 1
    for p in {0, n // 2, whole - 1, n - 1} - {-1}:
        assert np.array_equal(stream_positions(p, n, G, len(s)), np.flatnonzero(s == p))
    # a resume: any window of the stream is the same positions read from its start; its costs, sliced per epoch
    assert np.array_equal(stream_packs(n, G, 2 * n + 3, 3 * G), s[2 * n + 3:2 * n + 3 + 3 * G])
    c = np.arange(n) * 0.5
    assert np.array_equal(stream_costs(c, G, n - 1, 4 * n + 3), c[s[n - 1:5 * n + 2]])


@pytest.mark.parametrize("dp,mb,ga", [(8, 1, 1), (16, 1, 4), (4, 2, 3)])
def test_later_epochs_stay_balanced_when_n_mod_G_is_not_0(dp, mb, ga):
    """ovpipe issue 67: the old stream replayed pack_id order epoch after epoch, so with n mod G ≠ 0 every step from
    epoch 2 on straddled two balanced steps (its loss near the unbalanced order's). The balanced stream keeps
    epoch 2 as balanced as epoch 1 (a carried step of leftover packs at most), and the run's figure
    (``run_straggler_loss``) is the mean over the steps of every epoch it reaches."""
    from packing.compute_balance import epoch_straggler_losses, run_straggler_loss, stream_packs

    G = dp * mb * ga
    c = costs(6000 + G // 2 + 1)
    b = c[order(c, dp, mb, ga, window=16)]
    n = len(b)
    assert n % G
    before, e1 = straggler_loss(c, dp, mb, ga), straggler_loss(b, dp, mb, ga)
    old_epoch2 = straggler_loss(np.tile(b, 2)[n // G * G:][:n // G * G], dp, mb, ga)    # pack_id order replayed
    assert old_epoch2 > before / 4 and old_epoch2 > 3 * e1
    by_epoch = epoch_straggler_losses(b, dp, mb, ga, epochs=3)
    # an epoch that ends with a carried step: one unbalanced step (of duplicated leftovers) among n // G
    assert by_epoch[0] == pytest.approx(e1) and max(by_epoch) - e1 < 3 * before / (n // G)
    steps = 3 * n // G
    explicit = straggler_loss(b[stream_packs(n, G, 0, steps * G)], dp, mb, ga)
    assert run_straggler_loss(b, G, dp, mb, ga, steps, chunk_steps=7) == pytest.approx(explicit, rel=1e-12)
    assert explicit < 2 * e1 and run_straggler_loss(b, G, dp, mb, ga) == pytest.approx(e1)
