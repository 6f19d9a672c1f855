"""The two symptoms Shuffle-R1 (arXiv 2508.05612) names, measured on one GRPO batch.

* **Advantage collapsing** (§3, Fig. 1): most advantages of a batch sit near zero, so most rollouts push the
  policy hardly at all. Measured as the share of rollouts with ``|A| < 0.1`` (``small_advantage_share``).
* **Rollout silencing** (§3) and the **token utilization rate** (Fig. 5c): the share of rollouts, and of the
  generated tokens, that carry a non-zero gradient. A GRPO rollout's every token is weighted by its advantage,
  so a rollout with ``A = 0`` (a group whose rewards are all equal) contributes no gradient at all; the token
  share weighs each rollout by its completion length (``completion_mask``, times ``tool_mask`` where TRL has
  one: the tokens the loss reads).

The functions take the tensors of TRL's generation-batch dict (``advantages`` ``[B]``, ``completion_mask``
``[B, C]``) or numpy arrays, so the metrics callback calls them on whichever batch it logs: the generated one
(GRPO's) or the reshaped one (what the optimizer sees; a rollout drawn twice counts twice, as its gradient does).
"""
from __future__ import annotations

import numpy as np

# the paper's threshold for a "collapsed" advantage (Fig. 1: the share of |A| < 0.1)
COLLAPSED_BELOW = 0.1
# an advantage at or under this is zero: TRL divides a flat group's zero deviations by std + 1e-4, giving exactly 0
ZERO_BELOW = 1e-8


def _np(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def small_advantage_share(advantages, threshold: float = COLLAPSED_BELOW) -> float:
    """Share of rollouts with ``|A| < threshold`` (advantage collapsing); 0.0 for an empty batch."""
    a = np.abs(_np(advantages)).reshape(-1)
    return float((a < threshold).mean()) if a.size else 0.0


def nonzero_grad_rollout_share(advantages) -> float:
    """Share of rollouts whose advantage is not zero (the complement of rollout silencing)."""
    a = np.abs(_np(advantages)).reshape(-1)
    return float((a > ZERO_BELOW).mean()) if a.size else 0.0


def token_utilization(advantages, completion_mask) -> float:
    """Share of the loss's tokens that carry a non-zero gradient (Fig. 5c): Σ mask over rollouts with A ≠ 0 over
    Σ mask. ``completion_mask`` is ``[B, C]`` (1 on generated tokens the loss reads) or ``[B]`` token counts."""
    a = np.abs(_np(advantages)).reshape(-1)
    m = _np(completion_mask)
    tokens = m.reshape(len(a), -1).sum(axis=1) if m.ndim > 1 else m.reshape(-1)
    total = tokens.sum()
    return float(tokens[a > ZERO_BELOW].sum() / total) if total > 0 else 0.0


def loss_mask(batch: dict):
    """The tokens TRL's loss reads: ``completion_mask``, times ``tool_mask`` when the batch has one."""
    m = batch["completion_mask"]
    return m * batch["tool_mask"] if batch.get("tool_mask") is not None else m


def batch_symptoms(batch: dict) -> dict[str, float]:
    """The three figures over a TRL generation-batch dict (keys ``advantages`` and ``completion_mask``)."""
    adv = batch["advantages"]
    return {"small_advantage_share": small_advantage_share(adv),
            "nonzero_grad_rollout_share": nonzero_grad_rollout_share(adv),
            "token_utilization": token_utilization(adv, loss_mask(batch))}
