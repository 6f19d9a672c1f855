"""Group advantages and the decoupled (asynchronous) GRPO loss of the published RL recipe's
AReaL set-up — framework-neutral torch over rollout groups.

Advantages. Rewards are shifted and scaled first (AReaL's ``reward_bias = −0.5``,
``reward_scaling = 10``), then normalised within each group of rollouts of the same prompt::

    r' = (r + bias) · scale,     A_i = (r'_i − mean_g(r')) / (std_g(r') + ε)

(population std; a group whose rewards are all equal gets A = 0 — no NaN, no gradient).

Decoupled PPO loss (Hilton et al.; AReaL). Three policies: θ (being trained), the *proximal*
policy (the weights at the start of this update) and the *behaviour* policy that generated the
tokens, possibly several versions old::

    ratio = exp(log π_θ − log π_prox)
    w     = exp(log π_prox − log π_behave)  if that is ≤ 5, else 0    (behaviour importance weight, no grad)
    ℓ_t   = w · max(−A · ratio, −A · clip(ratio, 1 − 0.2, 1 + 0.28))
    loss  = Σ_t ℓ_t · m_t / Σ_t m_t                          (token mean over non-padding tokens)

no KL term; a sample generated more than η = 4 policy versions ago is rejected (its mask is 0).

The cap is AReaL's ``behav_imp_weight_cap: 5.0`` (inclusionAI/AReaL ``examples/math/gsm8k_grpo.yaml``, with
``use_decoupled_loss: true``) and it *filters*, it does not clamp: AReaL's ``ppo_actor_loss_fn``
(``areal/utils/functional.py``) keeps a token's weight where ``w ≤ cap`` and sets it to 0 elsewhere, the token
staying in the denominator. A token the behaviour policy found 5× less likely than the proximal policy does is
too far off-policy to correct, so it is dropped rather than trained at weight 5. ``behaviour_weights`` is that
rule, shared with ``grpo.trainer`` (partial-mode SortedRL's stale tokens inside ``ovpipe grpo``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GRPOConfig:
    reward_scale: float = 10.0
    reward_bias: float = -0.5
    eps: float = 1e-6
    clip_low: float = 0.2
    clip_high: float = 0.28
    behave_weight_cap: float = 5.0
    max_staleness: int = 4


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, cfg: GRPOConfig = GRPOConfig()) -> torch.Tensor:
    """Per-rollout advantages; ``group_ids`` (int, same length) says which prompt each rollout answers."""
    r = (rewards.double() + cfg.reward_bias) * cfg.reward_scale
    groups, inv = torch.unique(group_ids, return_inverse=True)
    G = len(groups)
    count = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, torch.ones_like(r))
    mean = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, r) / count
    var = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, (r - mean[inv]) ** 2) / count
    adv = (r - mean[inv]) / (var.sqrt()[inv] + cfg.eps)
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def behaviour_weights(logp_prox: torch.Tensor, logp_behave: torch.Tensor, cap: float = GRPOConfig.behave_weight_cap):
    """AReaL's behaviour importance weights ``w = π_prox / π_behave`` per token, 0 where ``w`` exceeds ``cap``
    (see the module docstring). Returns ``(w, capped)``, both detached, ``capped`` the bool mask of dropped tokens."""
    w = torch.exp(logp_prox.detach() - logp_behave.detach())
    capped = w > cap
    return torch.where(capped, torch.zeros_like(w), w), capped


def decoupled_ppo_loss(logp: torch.Tensor, logp_prox: torch.Tensor, logp_behave: torch.Tensor,
                       advantages: torch.Tensor, mask: torch.Tensor, versions: torch.Tensor | None = None,
                       current_version: int | None = None, cfg: GRPOConfig = GRPOConfig()):
    """Token-level loss. Shapes: ``[B, T]`` for log-probs and mask, ``[B]`` (or ``[B, T]``) for
    advantages, ``[B]`` for the policy version each sample was generated with.

    Returns ``(loss, stats)``; stats: clip fraction, mean behaviour weight, rejected samples.
    """
    mask = mask.to(logp.dtype)
    if versions is not None and current_version is not None:
        fresh = (current_version - versions) <= cfg.max_staleness
        mask = mask * fresh.to(mask.dtype).unsqueeze(-1)
        rejected = int((~fresh).sum())
    else:
        rejected = 0
    A = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logp - logp_prox)
    clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
    pg = torch.maximum(-A * ratio, -A * clipped)
    w, capped = behaviour_weights(logp_prox, logp_behave, cfg.behave_weight_cap)
    per_token = w * pg
    denom = mask.sum()
    loss = (per_token * mask).sum() / denom.clamp(min=1)
    with torch.no_grad():
        stats = {"clip_fraction": float(((ratio != clipped).to(mask.dtype) * mask).sum() / denom.clamp(min=1)),
                 "behave_weight_mean": float((w * mask).sum() / denom.clamp(min=1)),
                 "behave_capped_share": float((capped.to(mask.dtype) * mask).sum() / denom.clamp(min=1)),
                 "rejected_stale": rejected, "tokens": int(denom)}
    return loss, stats
