"""Shuffle-R1 held against the paper (arXiv 2508.05612): its sizes (512 prompts × 16 rollouts, α = 0.5, S = 8,
T = 256), its pairing, its sub-samplings, and the Hook-1 callable on a TRL-shaped generation batch."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grpo.shuffle_r1 import (VARIANTS, ShuffleR1Config, advantage_batch_shuffle, make_reshaper,
                             pairwise_trajectory_sampling, reshape_indices)
from grpo.symptoms import nonzero_grad_rollout_share, small_advantage_share, token_utilization

PROMPTS, ROLLOUTS, ALPHA, S, T = 512, 16, 0.5, 8, 256     # the paper's configuration (§5.1, Algorithm 1)


def grpo_advantages(rng, prompts, n):
    """TRL's GRPO advantages of binary rewards, success rate per prompt ~ Beta(0.4, 0.4): many flat groups."""
    r = (rng.random((prompts, n)) < rng.beta(0.4, 0.4, (prompts, 1))).astype(np.float64)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)


def test_pts_pairs_max_with_min():
    a = np.array([0.1, 2.0, -1.5, 0.0, 1.0, -0.5, 0.3, -2.0])
    pairs = pairwise_trajectory_sampling(a, alpha=1.0)[0].tolist()
    assert pairs == [[1, 7], [4, 2], [6, 5], [0, 3]]              # 2.0/−2.0, 1.0/−1.5, 0.3/−0.5, 0.1/0.0
    assert pairwise_trajectory_sampling(a, alpha=0.5)[0].tolist() == pairs[:2]   # ⌊0.5 · 4⌋ = 2


def test_pts_at_the_paper_sizes_keeps_the_extremes_of_every_group():
    a = np.random.default_rng(0).normal(size=(PROMPTS, ROLLOUTS))
    kept = pairwise_trajectory_sampling(a, ALPHA)
    assert kept.shape == (PROMPTS, 4, 2)                          # 4 pairs a prompt: 2,048 pairs
    ranks = np.argsort(np.argsort(-a, axis=1), axis=1)            # 0 = highest advantage of the group
    kept_ranks = np.sort(np.take_along_axis(ranks, kept.reshape(PROMPTS, -1), axis=1), axis=1)
    assert (kept_ranks == np.array([0, 1, 2, 3, 12, 13, 14, 15])).all()   # the 4 highest and the 4 lowest
    contrast = np.take_along_axis(a, kept[..., 0], axis=1) - np.take_along_axis(a, kept[..., 1], axis=1)
    assert (np.diff(contrast, axis=1) <= 0).all()                 # most contrastive pair first


def test_reshape_at_the_paper_sizes_is_s_subsamplings_of_t_distinct_kept_pairs():
    adv = grpo_advantages(np.random.default_rng(1), PROMPTS, ROLLOUTS)
    idx, info = reshape_indices(adv, ROLLOUTS, ALPHA, S, rng=np.random.default_rng(2))
    assert info == {"pairs_kept": 2048, "S": 8, "T": 256, "distinct_pair_share": info["distinct_pair_share"]}
    # exactly |B| = S × T = 2,048 pairs: not the 4,096 pairs (rollouts / 2) of a batch padded or tiled to size
    assert idx.shape == (2 * S * T,)
    subs = idx.reshape(S, T, 2)
    kept = {tuple(p) for p in (pairwise_trajectory_sampling(adv.reshape(PROMPTS, ROLLOUTS), ALPHA)
                               + (np.arange(PROMPTS) * ROLLOUTS)[:, None, None]).reshape(-1, 2).tolist()}
    for s in range(S):
        pairs = [tuple(p) for p in subs[s].tolist()]
        assert len(set(pairs)) == T                                # distinct within a sub-sampling
        assert set(pairs) <= kept                                  # only pairs PTS kept, members side by side
    assert len({subs[s].tobytes() for s in range(S)}) == S         # no sub-sampling is a copy of another
    assert not np.array_equal(idx[: len(idx) // 2], idx[len(idx) // 2:])   # not a tile of its first half
    # informative pairs come back, flat ones are left out: fewer distinct pairs than drawn
    assert 0.3 < info["distinct_pair_share"] < 1.0


def test_abs_draws_each_pair_in_proportion_to_its_weight():
    # T = 1: each sub-sampling is one draw, so a pair's frequency is its probability w / Σw exactly
    w = np.array([0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 8.0])
    rng = np.random.default_rng(3)
    draws = np.concatenate([advantage_batch_shuffle(w, S=8, rng=rng).reshape(-1) for _ in range(3000)])
    freq = np.bincount(draws, minlength=len(w)) / len(draws)
    np.testing.assert_allclose(freq, w / w.sum(), atol=0.01)
    assert freq[0] == 0.0


def test_abs_completes_a_subsampling_with_zero_weight_pairs_uniformly():
    # 3 weighted pairs, T = 4: each sub-sampling holds all 3 and one of the 13 flat pairs, each flat one alike
    w = np.zeros(16)
    w[[2, 7, 11]] = [0.5, 1.0, 2.0]
    rng = np.random.default_rng(4)
    rows = np.concatenate([advantage_batch_shuffle(w, S=4, rng=rng) for _ in range(1000)])
    assert all({2, 7, 11} < set(r) for r in rows.tolist())
    flat = rows[~np.isin(rows, [2, 7, 11])]
    counts = np.bincount(flat, minlength=16)[np.setdiff1d(np.arange(16), [2, 7, 11])]
    assert counts.min() > 0.7 * counts.mean()
    assert (advantage_batch_shuffle(np.zeros(8), S=2, rng=rng).shape == (2, 4))   # all flat: uniform


def test_static_reorder_is_each_pair_once_most_contrastive_first():
    w = np.array([0.5, 3.0, 0.0, 2.0, 1.0, 3.0])
    out = advantage_batch_shuffle(w, S=2, rng=np.random.default_rng(0), static=True)
    assert out.tolist() == [[1, 5, 3], [4, 0, 2]]


@pytest.mark.parametrize("bad, field", [(dict(S=7), "shuffle_r1.S"), (dict(alpha=0.1), "shuffle_r1.alpha"),
                                        (dict(weights="softmax"), "shuffle_r1.weights")])
def test_sizes_the_paper_cannot_hold_are_refused_naming_the_field(bad, field):
    adv = np.random.default_rng(0).normal(size=4 * 8)
    kw = dict(alpha=0.5, S=8) | bad
    with pytest.raises(ValueError, match=field):
        reshape_indices(adv, 8, rng=np.random.default_rng(0), **kw)
    with pytest.raises(ValueError, match="num_generations=7"):
        reshape_indices(np.zeros(14), 7)


def test_config_checks_trl_sizes_at_load():
    assert ShuffleR1Config().check_sizes(ROLLOUTS, PROMPTS, steps_per_generation=16) == 4096
    with pytest.raises(ValueError, match="shuffle_r1.S=3 must divide the 2048 kept pairs"):
        ShuffleR1Config(S=3).check_sizes(ROLLOUTS, PROMPTS, 16)
    with pytest.raises(ValueError, match="steps_per_generation=3"):
        ShuffleR1Config().check_sizes(ROLLOUTS, PROMPTS, 3)
    with pytest.raises(ValueError, match="shuffle_r1.variant"):
        ShuffleR1Config(variant="shuffle")
    assert ShuffleR1Config(variant="pts_only", S=3).check_sizes(ROLLOUTS, PROMPTS, 16) == 4096   # no ABS: no S


def test_symptoms_by_hand():
    adv = torch.tensor([0.0, 0.05, -0.5, 2.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    assert small_advantage_share(adv) == 0.5
    assert nonzero_grad_rollout_share(adv) == 0.75
    assert token_utilization(adv, mask) == pytest.approx(7 / 10)   # (1 + 4 + 2) of 10 tokens
    assert small_advantage_share([]) == 0.0 and token_utilization(adv, torch.zeros(4, 2)) == 0.0


def test_shuffle_r1_lifts_both_symptoms_on_a_realistic_batch():
    adv = grpo_advantages(np.random.default_rng(5), 64, 16)
    idx, _ = reshape_indices(adv, 16, 0.5, 8, rng=np.random.default_rng(0))
    assert small_advantage_share(adv[idx]) < 0.5 * small_advantage_share(adv)
    assert nonzero_grad_rollout_share(adv[idx]) > nonzero_grad_rollout_share(adv)


# --- the Hook-1 callable on a hand-built TRL generation batch -------------------------------------------------

def trl_batch(prompts=4, n=16, seed=0, images=False):
    """The dict `_generate_and_score_completions` returns for a Qwen-VL-style model: rollouts of a prompt
    contiguous, `pixel_values` flat over images ([Σ t·h·w, D]) with `image_grid_thw` per image and `num_images`
    per rollout. Every key encodes its source row so alignment can be read back."""
    rng = np.random.default_rng(seed)
    B, C = prompts * n, 6
    rows = torch.arange(B)
    lengths = torch.as_tensor(rng.integers(1, C + 1, B))
    completion_mask = (torch.arange(C)[None] < lengths[:, None]).int()
    num_images = [int(i // n) % 3 for i in range(B)]                 # prompt 0: no image, 1: one, 2: two, …
    grids, pix = [], []
    for r in range(B):
        for k in range(num_images[r]):
            g = torch.tensor([1, 2, 1 + (r + k) % 3])              # images of different sizes
            grids.append(g)
            pix.append(torch.full((int(g.prod()), 4), float(r)) + k / 10)
    batch = {
        "prompt_ids": (rows // n)[:, None].repeat(1, 5), "prompt_mask": torch.ones(B, 5, dtype=torch.int),
        "completion_ids": rows[:, None].repeat(1, C), "completion_mask": completion_mask,
        "advantages": torch.as_tensor(grpo_advantages(rng, prompts, n), dtype=torch.float32),
        "old_per_token_logps": -rows[:, None].float().repeat(1, C),
        "num_items_in_batch": completion_mask.sum(),
    }
    if images:
        batch |= {"pixel_values": torch.cat(pix), "image_grid_thw": torch.stack(grids), "num_images": num_images}
    return batch


def fake_trainer(n=16, spg=4, step=0):
    return SimpleNamespace(num_generations=n, args=SimpleNamespace(steps_per_generation=spg),
                           state=SimpleNamespace(global_step=step), accelerator=None)


def assert_aligned(batch, out, trainer):
    src = out["completion_ids"][:, 0]                               # the source row of every output row
    assert len(src) == 32 and len(src) % trainer.args.steps_per_generation == 0   # 4 prompts × 4 pairs × 2
    assert (out["prompt_ids"][:, 0] == src // 16).all()
    assert (out["advantages"] == batch["advantages"][src]).all()
    assert (out["completion_mask"] == batch["completion_mask"][src]).all()
    assert (out["old_per_token_logps"][:, 0] == -src.float()).all()
    assert out["num_items_in_batch"] == batch["completion_mask"][src].sum()
    pairs = src.reshape(-1, 2)
    assert (pairs[:, 0] // 16 == pairs[:, 1] // 16).all()           # a pair is one prompt's two rollouts
    stats = trainer.reshape_stats
    assert stats["rows_in"] == 64 and stats["rows_out"] == 32 and stats["pairs_kept"] == 16
    assert all(isinstance(v, float) for v in stats.values())
    assert stats["small_advantage_share"] <= stats["small_advantage_share_in"]
    return src


def test_reshaper_keeps_rows_aligned_across_keys():
    batch, trainer = trl_batch(), fake_trainer()
    assert_aligned(batch, make_reshaper(alpha=0.5, S=8, seed=0)(batch, trainer), trainer)


def test_reshaper_selects_pixel_values_per_image_grid():
    from trl.trainer.utils import split_pixel_values_by_grid, split_tensor_dict

    batch, trainer = trl_batch(images=True), fake_trainer()
    out = make_reshaper(alpha=0.5, S=8, seed=0)(batch, trainer)
    src = assert_aligned(batch, out, trainer)
    assert out["num_images"] == [batch["num_images"][i] for i in src.tolist()]
    per_row = split_pixel_values_by_grid(out)                       # TRL reads the pixels back per rollout
    for j, r in enumerate(src.tolist()):
        assert len(per_row["image_grid_thw"][j]) == batch["num_images"][r]
        if batch["num_images"][r]:
            assert (per_row["pixel_values"][j].floor() == r).all()
    assert len(split_tensor_dict(per_row, 4)) == 4                  # and splits it into its mini-batches


def test_reshaper_variants_differ_as_the_paper_defines_them():
    batch = trl_batch(seed=1)
    runs = {v: make_reshaper(S=8, **VARIANTS[v])(batch, fake_trainer())["completion_ids"][:, 0]
            for v in VARIANTS}
    once = sorted(runs["pts_only"].tolist())
    assert len(set(once)) == 32                                     # PTS only: each kept rollout once
    assert sorted(runs["static_reorder"].tolist()) == once          # the same rollouts, reordered
    w = batch["advantages"].abs()[runs["static_reorder"]].reshape(-1, 2).sum(1)
    assert (w[:-1] >= w[1:]).all()                                  # by pair weight, descending
    assert make_reshaper(**VARIANTS["pts_only"]).ordered is False and make_reshaper().ordered is True
    assert set(runs["shuffle_r1"].tolist()) <= set(once)            # ABS resamples only the kept pairs


def test_reshaper_is_deterministic_per_step_and_refuses_bad_splits():
    batch = trl_batch()
    r = make_reshaper(seed=7)
    a = r(batch, fake_trainer(step=3))["completion_ids"][:, 0]
    assert torch.equal(a, make_reshaper(seed=7)(batch, fake_trainer(step=3))["completion_ids"][:, 0])
    assert not torch.equal(a, r(batch, fake_trainer(step=4))["completion_ids"][:, 0])
    with pytest.raises(ValueError, match="steps_per_generation=3"):
        r(batch, fake_trainer(spg=3))


def test_reshaper_refuses_a_buffer_whose_groups_are_split_across_processes():
    """A process slice that starts mid-group (rows 16 apart are no longer one prompt's) is refused, naming the
    rule, instead of pairing two prompts' rollouts; the whole-group buffer passes."""
    batch = trl_batch()
    batch.pop("num_items_in_batch")
    shifted = {k: torch.roll(v, 8, dims=0) for k, v in batch.items()}
    with pytest.raises(ValueError, match="split across processes.*multiple of num_generations"):
        make_reshaper()(shifted, fake_trainer())
    make_reshaper()(batch, fake_trainer())


def test_reshape_stats_sum_the_processes_before_taking_shares():
    """At 2 ranks each reshapes its own groups; the stats rank 0 writes are the whole batch's: rows and pairs
    summed, the symptoms over both ranks' rollouts (what one process would compute on the concatenation)."""
    class Acc:
        def __init__(self, rank, others=()):
            self.process_index, self.others, self.seen = rank, list(others), None

        def gather(self, t):
            self.seen = t
            return torch.cat([t, *self.others]) if self.process_index == 0 else torch.cat([*self.others, t])

    b0, b1 = trl_batch(seed=0), trl_batch(seed=1)
    for b in (b0, b1):
        b.pop("num_items_in_batch")
    t1 = fake_trainer()
    t1.accelerator = Acc(1)
    out1 = make_reshaper(seed=0)(b1, t1)
    t0 = fake_trainer()
    t0.accelerator = Acc(0, [t1.accelerator.seen])
    out0 = make_reshaper(seed=0)(b0, t0)
    st = t0.reshape_stats
    assert (st["rows_in"], st["rows_out"], st["pairs_kept"], st["T"], st["processes"]) == (128, 64, 32, 4, 2)
    cat = {k: torch.cat([out0[k], out1[k]]) for k in ("advantages", "completion_mask")}
    a_in = torch.cat([b0["advantages"], b1["advantages"]])
    assert st["small_advantage_share_in"] == pytest.approx(small_advantage_share(a_in))
    assert st["small_advantage_share"] == pytest.approx(small_advantage_share(cat["advantages"]))
    assert st["nonzero_grad_rollout_share"] == pytest.approx(nonzero_grad_rollout_share(cat["advantages"]))
    assert st["token_utilization"] == pytest.approx(token_utilization(cat["advantages"], cat["completion_mask"]))
    m_in = torch.cat([b0["completion_mask"], b1["completion_mask"]])
    assert st["token_utilization_in"] == pytest.approx(token_utilization(a_in, m_in))
    # rank 0 alone (no accelerator) reports its own slice only
    t_alone = fake_trainer()
    make_reshaper(seed=0)(b0, t_alone)
    assert t_alone.reshape_stats["rows_in"] == 64 and t_alone.reshape_stats["processes"] == 1


def test_verl_reshaper_loads_by_file_path_beside_numpy_alone(tmp_path):
    """What verl's driver has: numpy (and verl's torch), not ovpipe. The verl reshaper loads from its file path
    (``load_extern_object``'s way) in an interpreter that cannot import ovpipe, and imports nothing of ovpipe's
    training stack: the selection it runs is ``grpo.shuffle_r1``'s, found beside the file."""
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "grpo" / "shuffle_r1_verl.py"
    heavy = ["torch", "trl", "transformers", "ovpipe", "pyarrow", "rl_select", "manifests", "datasets"]
    code = (f"import sys; sys.path.append({str(Path(np.__file__).parents[1])!r}); import importlib.util as u; "
            f"assert u.find_spec('grpo') is None and u.find_spec('ovpipe') is None; "
            f"spec = u.spec_from_file_location('verl_reshaper', {str(path)!r}); m = u.module_from_spec(spec); "
            f"spec.loader.exec_module(m); print(callable(m.reshape_dataproto), m.reshape_indices.__module__, "
            f"sorted({{k.split('.')[0] for k in sys.modules}} & {set(heavy)!r}))")
    # -S: no site-packages processing, so the editable install of this checkout is not on the path
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", "grpo.shuffle_r1", "[]"]
