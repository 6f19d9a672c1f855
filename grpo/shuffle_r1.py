"""Shuffle-R1 (Zhu et al., arXiv 2508.05612): reshape a GRPO batch so that the update learns from its most
contrastive rollouts, as the paper's Algorithm 1 defines it.

**Pairwise Trajectory Sampling (PTS, §4.1).** A prompt's group of 2N rollouts is sorted by advantage and paired
max with min, second-highest with second-lowest, …: N pairs, the j-th of contrast a₍ⱼ₎ − a₍₂ₙ₋ⱼ₊₁₎, which falls
with j. PTS keeps the first ⌊α·N⌋ pairs of every group. The paper's configuration: 512 prompts × 16 rollouts,
α = 0.5, so 4 pairs a prompt and |B| = 2,048 pairs (4,096 rollouts) kept of 8,192 generated — the paper widens
the rollout pool to 16 so that the update still sees 8 rollouts a prompt.

**Advantage-based Batch Shuffle (ABS, §4.2).** Over the kept pairs B, pair p weighs w_p = |A₁| + |A₂| and is
drawn with probability w_p / Σw. ABS draws S sub-samplings of T *distinct* pairs each (without replacement
within a sub-sampling, independently across them), S × T = |B| (Algorithm 1, line 13): S = 8, T = 256 at the
paper's sizes. The reshaped batch is the S sub-samplings one after another, |B| pairs: exactly what PTS kept in
number, with informative pairs drawn several times and flat ones rarely. Nothing is padded or tiled to another
size; a |B| that S does not divide is a configuration error. The draw is Efraimidis–Spirakis (a pair's key is
u^(1/w), the T largest keys win), which is sequential sampling without replacement ∝ w; pairs of weight 0 come
after every weighted one, in random order, so a sub-sampling with fewer than T weighted pairs is completed
uniformly from the rest (the limit w → 0⁺; numpy's ``choice`` raises there).

**The ablations of the paper's Tab. 5** (``VARIANTS``): ``pts_only`` (the kept pairs once, no shuffle),
``unbiased_shuffle`` (ABS with uniform weights), ``static_reorder`` (the kept pairs once, sorted by weight,
most contrastive first: the priority without the resampling), and the full ``shuffle_r1``. Without PTS
(``pts=False``) every pair of the max–min pairing is kept (α = 1), so ``abs`` alone resamples the whole batch.

**In TRL** (``make_reshaper``): the callable is the ``grpo`` step's Hook 1. It runs on TRL's generation-batch
dict — the whole buffer that TRL later splits into ``steps_per_generation`` mini-batches, the paper's B — and
selects the same rows from every tensor key (pixel values per image grid, with TRL's own
``split_pixel_values_by_grid``/``unsplit_pixel_values_by_grid``), recomputes ``num_items_in_batch`` over the
rows kept, and writes what it did to ``trainer.reshape_stats``. When the row order carries the method (ABS's
sub-samplings, the static reorder) its ``ordered`` attribute is true: the trainer then splits the rows into
mini-batches in order instead of shuffling them first (TRL's ``shuffle_sequence_dict`` would scatter a
sub-sampling's distinct pairs over every mini-batch and turn the static reorder back into PTS alone).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from grpo.symptoms import loss_mask, nonzero_grad_rollout_share, small_advantage_share, token_utilization

# the paper's Tab. 5 rows: the full method and its ablations, as keyword sets of ``make_reshaper``
VARIANTS: dict[str, dict] = {
    "shuffle_r1": dict(pts=True, abs=True, weights="advantage", static=False),
    "pts_only": dict(pts=True, abs=False, weights="advantage", static=False),
    "unbiased_shuffle": dict(pts=True, abs=True, weights="uniform", static=False),
    "static_reorder": dict(pts=True, abs=True, weights="advantage", static=True),
}
WEIGHTS = ("advantage", "uniform")


def pairs_kept_per_group(group_size: int, alpha: float, pts: bool = True) -> int:
    """⌊α·N⌋ for a group of 2N rollouts (N with PTS off)."""
    return math.floor(alpha * (group_size // 2) + 1e-9) if pts else group_size // 2


def pairwise_trajectory_sampling(advantages, alpha: float = 0.5, pts: bool = True) -> np.ndarray:
    """PTS over a batch of groups. ``advantages``: ``[G, 2N]`` (or ``[2N]``, one group).

    Returns ``[G, K, 2]`` rollout indices within each group, K = ⌊α·N⌋: pair j is the j-th highest advantage with
    the j-th lowest, most contrastive first. Ties keep TRL's rollout order (a stable sort)."""
    a = np.asarray(advantages, dtype=np.float64)
    a = a[None] if a.ndim == 1 else a
    n = a.shape[1]
    if n % 2:
        raise ValueError(f"PTS pairs the rollouts of a group: num_generations={n} is odd")
    K = pairs_kept_per_group(n, alpha, pts)
    order = np.argsort(-a, axis=1, kind="stable")            # highest first
    return np.stack([order[:, :K], order[:, ::-1][:, :K]], axis=-1)


def advantage_batch_shuffle(weights, S: int, rng: np.random.Generator, static: bool = False) -> np.ndarray:
    """ABS over P pairs of weight ``weights``: ``[S, T]`` pair indices, T = P / S, distinct within each row,
    each row drawn ∝ weight without replacement (Efraimidis–Spirakis keys). ``static``: the P pairs once, sorted
    by weight (descending, stable), cut into S rows — the paper's static-reorder ablation."""
    w = np.asarray(weights, dtype=np.float64)
    P = len(w)
    if S < 1 or P % S:
        raise ValueError(f"ABS draws S sub-samplings of T pairs with S × T = the {P} kept pairs: "
                         f"shuffle_r1.S={S} does not divide {P}")
    T = P // S
    if static:
        return np.argsort(-w, kind="stable").reshape(S, T)
    u = 1.0 - rng.random((S, P))                             # (0, 1]: log is finite
    weighted = w > 0
    key = np.full((S, P), -np.inf)
    key[:, weighted] = np.log(u[:, weighted]) / w[weighted]  # log(u^(1/w)); larger wins
    # primary key descending; zero-weight pairs (key −inf) after all others, ordered by u (uniformly at random)
    return np.lexsort((-u, -key), axis=-1)[:, :T]


def reshape_indices(advantages, group_size: int, alpha: float = 0.5, S: int = 8, weights: str = "advantage",
                    pts: bool = True, abs: bool = True, static: bool = False,  # noqa: A002 (the paper's name)
                    rng: np.random.Generator | None = None) -> tuple[np.ndarray, dict]:
    """Rollout indices of the reshaped batch, pair members next to each other, and what was kept.

    ``advantages``: ``[B]`` with B = G groups × ``group_size`` rollouts, groups contiguous (TRL's order).
    Returns ``(idx, info)``: ``idx`` has 2·P entries, P = G·⌊α·N⌋ the kept pairs — S sub-samplings of T pairs
    when ``abs``, else each kept pair once in batch order."""
    if weights not in WEIGHTS:
        raise ValueError(f"shuffle_r1.weights={weights!r}: one of {WEIGHTS}")
    a = np.asarray(advantages, dtype=np.float64).reshape(-1)
    if group_size < 2 or len(a) % group_size:
        raise ValueError(f"the batch has {len(a)} rollouts, not whole groups of num_generations={group_size} "
                         f"(a group split across processes? per-process rows must be a multiple of it)")
    G = len(a) // group_size
    K = pairs_kept_per_group(group_size, alpha, pts)
    if K < 1:
        raise ValueError(f"shuffle_r1.alpha={alpha} keeps ⌊α·N⌋ = 0 of the N = {group_size // 2} pairs a group")
    within = pairwise_trajectory_sampling(a.reshape(G, group_size), alpha, pts)
    pairs = (within + (np.arange(G) * group_size)[:, None, None]).reshape(-1, 2)      # [P, 2] batch indices
    P = len(pairs)
    if abs or static:
        w = np.abs(a[pairs]).sum(axis=1) if weights == "advantage" else np.ones(P)
        pick = advantage_batch_shuffle(w, S, rng if rng is not None else np.random.default_rng(0), static)
        T = pick.shape[1]
        pick = pick.reshape(-1)
    else:
        pick, T = np.arange(P), P
    info = {"pairs_kept": P, "S": P // T, "T": T,
            "distinct_pair_share": len(np.unique(pick)) / P}
    return pairs[pick].reshape(-1), info


@dataclass(frozen=True)
class ShuffleR1Config:
    """``shuffle_r1:`` of the ``grpo`` step's config. ``variant`` names a Tab. 5 row and sets pts/abs/weights/
    static; the paper's values are the defaults (α = 0.5, S = 8)."""
    variant: str = "shuffle_r1"
    alpha: float = 0.5
    S: int = 8
    seed: int | None = None          # None: the step's seed

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"shuffle_r1.variant={self.variant!r}: one of {sorted(VARIANTS)}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"shuffle_r1.alpha={self.alpha}: the kept share of pairs, in (0, 1]")
        if self.S < 1:
            raise ValueError(f"shuffle_r1.S={self.S}: the number of ABS sub-samplings, at least 1")

    def pairs_per_group(self, num_generations: int) -> int:
        K = pairs_kept_per_group(num_generations, self.alpha, VARIANTS[self.variant]["pts"])
        if K < 1:
            raise ValueError(f"shuffle_r1.alpha={self.alpha} keeps 0 pairs of num_generations={num_generations}")
        return K

    def check_sizes(self, num_generations: int, prompts_per_generation: int, steps_per_generation: int) -> int:
        """Fail at load, naming the fields, when TRL's sizes cannot hold the paper's batch; returns the rows
        the update sees per generation batch (2·P)."""
        v = VARIANTS[self.variant]
        if num_generations % 2:
            raise ValueError(f"shuffle_r1 pairs rollouts: num_generations={num_generations} must be even")
        K = self.pairs_per_group(num_generations)
        P = prompts_per_generation * K
        if (v["abs"] or v["static"]) and P % self.S:
            raise ValueError(f"shuffle_r1.S={self.S} must divide the {P} kept pairs "
                             f"({prompts_per_generation} prompts × {K} pairs)")
        if (2 * P) % steps_per_generation:
            raise ValueError(f"the {2 * P} kept rollouts do not split into steps_per_generation="
                             f"{steps_per_generation} mini-batches")
        return 2 * P

    def reshaper(self, seed: int = 0) -> BatchReshaper:
        """The Hook-1 callable; ``seed`` is the step's, used when the config gives none."""
        return make_reshaper(alpha=self.alpha, S=self.S, seed=seed if self.seed is None else self.seed,
                             **VARIANTS[self.variant])


def select_rows(batch: dict, idx: np.ndarray) -> dict:
    """``batch`` with rows ``idx`` of every per-rollout key, in that order. Pixel values go per sample through
    TRL's split/unsplit by image grid; 0-d tensors (``num_items_in_batch``) and None pass through unchanged."""
    import torch

    B = len(batch["advantages"])
    images = batch.get("pixel_values") is not None
    if images:   # TRL's helpers know each model family's image layout; trl is imported only for batches with images
        from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid
    split = split_pixel_values_by_grid(batch) if images else batch
    out: dict = {}
    for k, v in split.items():
        if v is None or (torch.is_tensor(v) and v.ndim == 0):
            out[k] = v
        elif torch.is_tensor(v) and v.shape[0] == B:
            out[k] = v[torch.as_tensor(idx, device=v.device)]
        elif isinstance(v, (list, tuple)) and len(v) == B:
            out[k] = [v[i] for i in idx.tolist()]
        else:
            n = v.shape[0] if torch.is_tensor(v) else len(v) if isinstance(v, (list, tuple)) else type(v).__name__
            raise ValueError(f"batch[{k!r}] has {n} rows, the batch {B}: a key that is neither per rollout nor "
                             f"split per sample by TRL's split_pixel_values_by_grid")
    return unsplit_pixel_values_by_grid(out) if images else out


class BatchReshaper:
    """Hook 1 of the ``grpo`` step: ``batch = reshaper(batch, trainer)`` on TRL's generation batch."""

    def __init__(self, alpha: float, S: int, weights: str, pts: bool, abs: bool, static: bool,  # noqa: A002
                 seed: int):
        if weights not in WEIGHTS:
            raise ValueError(f"shuffle_r1.weights={weights!r}: one of {WEIGHTS}")
        self.alpha, self.S, self.weights, self.pts, self.abs, self.static, self.seed = \
            alpha, S, weights, pts, abs, static, seed
        self.ordered = bool(abs or static)
        self._calls = 0

    def __repr__(self) -> str:
        return (f"BatchReshaper(alpha={self.alpha}, S={self.S}, weights={self.weights!r}, pts={self.pts}, "
                f"abs={self.abs}, static={self.static}, seed={self.seed})")

    def __call__(self, batch: dict, trainer=None) -> dict:
        t0 = time.perf_counter()
        group_size = trainer.num_generations
        spg = trainer.args.steps_per_generation
        # a fresh stream per generation batch, keyed by the optimizer step (a resumed run draws what the first
        # run drew) and the process (each rank reshapes its own groups)
        state = getattr(trainer, "state", None)
        step = getattr(state, "global_step", None)
        step = self._calls if step is None else step
        self._calls += 1
        rank = getattr(getattr(trainer, "accelerator", None), "process_index", 0)
        rng = np.random.default_rng([self.seed, step, rank])
        adv = batch["advantages"]
        check_whole_groups(batch, group_size, rank)
        idx, info = reshape_indices(adv.detach().float().cpu().numpy(), group_size, self.alpha, self.S,
                                    self.weights, self.pts, self.abs, self.static, rng)
        if len(idx) % spg:
            raise ValueError(f"the reshaped batch has {len(idx)} rows, which steps_per_generation={spg} does not "
                             f"divide (ShuffleR1Config.check_sizes says which field to change)")
        mask_in = loss_mask(batch)
        out = select_rows(batch, idx)
        if out.get("num_items_in_batch") is not None:
            # TRL's DAPO-style loss divides by the tokens of the whole buffer, summed over processes
            local = loss_mask(out).sum()
            acc = getattr(trainer, "accelerator", None)
            total = acc.gather(local).sum() if acc is not None else local
            out["num_items_in_batch"] = total.to(batch["num_items_in_batch"].dtype)
        trainer.reshape_stats = whole_buffer_stats(adv, mask_in, out["advantages"], loss_mask(out), info,
                                                   getattr(trainer, "accelerator", None))
        trainer.reshape_stats["time_s"] = time.perf_counter() - t0
        return out


def check_whole_groups(batch: dict, group_size: int, rank: int = 0) -> None:
    """Every block of ``group_size`` rows of this process's buffer is one prompt's rollouts (identical prompt ids).

    PTS pairs within a group, so it is only right on whole groups. In TRL 1.16 each process's buffer is the
    contiguous slice ``[rank·L, (rank+1)·L)`` of the generation batch (``RepeatSampler`` yields a prompt's
    ``num_generations`` rollouts one after another, accelerate hands process r the r-th ``L``-row batch, and
    ``_generate_and_score_completions`` takes the same slice back after the gathered advantages): the groups are
    whole on every process exactly when ``num_generations`` divides L = ``batch_size`` / ranks, which the step
    checks at load (``GRPOStepConfig.check_world``). This is the same rule read off the batch itself, so a layout
    that ever split a group (another sampler, another TRL) fails here instead of pairing two prompts' rollouts."""
    ids = batch.get("prompt_ids")
    if ids is None or len(ids) % group_size:
        return                                        # reshape_indices names a row count that is not whole groups
    g = ids.reshape(len(ids) // group_size, group_size, -1)
    same = (g == g[:, :1]).all()
    mask = batch.get("prompt_mask")
    if mask is not None:
        m = mask.reshape(len(mask) // group_size, group_size, -1)
        same = same & (m == m[:, :1]).all()
    if not bool(same):
        raise ValueError(f"process {rank}'s generation buffer has rows {group_size} apart that are not one prompt's "
                         f"num_generations={group_size} rollouts: a group is split across processes, and PTS pairs "
                         f"within whole groups (batch_size / ranks must be a multiple of num_generations)")


def whole_buffer_stats(adv_in, mask_in, adv_out, mask_out, info: dict, accelerator=None) -> dict[str, float]:
    """``reshape_stats`` over the whole generation batch: each process reshapes its own groups, so the counts
    behind every figure (rows, pairs, distinct pairs drawn, rollouts with |A| < 0.1 and with A ≠ 0, tokens and
    tokens carrying gradient — ``grpo.symptoms``' definitions, as shares times their totals) are summed over the
    processes before the shares are taken: the metrics rank 0 writes are the batch's, not its own slice's."""
    import torch

    def counts(adv, mask):
        n = float(len(adv))
        tokens = float(mask.detach().double().sum())
        return [n, small_advantage_share(adv) * n, nonzero_grad_rollout_share(adv) * n,
                token_utilization(adv, mask) * tokens, tokens]

    P = float(info["pairs_kept"])
    local = counts(adv_in, mask_in) + counts(adv_out, mask_out) + [P, float(info["distinct_pair_share"]) * P, 1.0]
    v = torch.tensor(local, dtype=torch.float64, device=adv_in.device)
    if accelerator is not None:
        v = accelerator.gather(v[None]).reshape(-1, len(local)).sum(dim=0)
    r_in, small_in, nz_in, tnz_in, t_in, r_out, small_out, nz_out, tnz_out, t_out, pairs, distinct, procs = v.tolist()

    def share(a, b):
        return a / b if b else 0.0

    S = float(info["S"])
    return {"rows_in": r_in, "rows_out": r_out, "pairs_kept": pairs, "S": S, "T": pairs / S, "processes": procs,
            "distinct_pair_share": share(distinct, pairs),
            "small_advantage_share_in": share(small_in, r_in), "small_advantage_share": share(small_out, r_out),
            "nonzero_grad_rollout_share_in": share(nz_in, r_in), "nonzero_grad_rollout_share": share(nz_out, r_out),
            "token_utilization_in": share(tnz_in, t_in), "token_utilization": share(tnz_out, t_out)}


def make_reshaper(alpha: float = 0.5, S: int = 8, weights: str = "advantage", pts: bool = True,
                  abs: bool = True, static: bool = False, seed: int = 0) -> BatchReshaper:  # noqa: A002
    """The Hook-1 callable. Defaults: Shuffle-R1 as the paper runs it (α = 0.5, S = 8, advantage weights).
    ``weights="uniform"``: the unbiased shuffle; ``abs=False``: PTS only; ``static=True``: the static reorder."""
    return BatchReshaper(alpha, S, weights, pts, abs, static, seed)

