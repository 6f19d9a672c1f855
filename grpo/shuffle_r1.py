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
        trainer.reshape_stats = {
            "rows_in": float(len(adv)), "rows_out": float(len(idx)), "pairs_kept": float(info["pairs_kept"]),
            "S": float(info["S"]), "T": float(info["T"]), "distinct_pair_share": float(info["distinct_pair_share"]),
            "small_advantage_share_in": small_advantage_share(adv),
            "small_advantage_share": small_advantage_share(out["advantages"]),
            "nonzero_grad_rollout_share_in": nonzero_grad_rollout_share(adv),
            "nonzero_grad_rollout_share": nonzero_grad_rollout_share(out["advantages"]),
            "token_utilization_in": token_utilization(adv, mask_in),
            "token_utilization": token_utilization(out["advantages"], loss_mask(out)),
            "time_s": time.perf_counter() - t0,
        }
        return out


def make_reshaper(alpha: float = 0.5, S: int = 8, weights: str = "advantage", pts: bool = True,
                  abs: bool = True, static: bool = False, seed: int = 0) -> BatchReshaper:  # noqa: A002
    """The Hook-1 callable. Defaults: Shuffle-R1 as the paper runs it (α = 0.5, S = 8, advantage weights).
    ``weights="uniform"``: the unbiased shuffle; ``abs=False``: PTS only; ``static=True``: the static reorder."""
    return BatchReshaper(alpha, S, weights, pts, abs, static, seed)

