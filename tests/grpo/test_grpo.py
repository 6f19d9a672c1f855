import math

import pytest
import torch

from grpo.loss import GRPOConfig, decoupled_ppo_loss, group_advantages


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5])
    g = torch.tensor([0, 0, 0, 0, 1, 1])
    a = group_advantages(r, g)
    s = [(x - 0.5) * 10 for x in (1, 0, 1, 1)]            # scale and bias first
    mu = sum(s) / 4
    sd = math.sqrt(sum((x - mu) ** 2 for x in s) / 4)
    assert a[:4].tolist() == pytest.approx([(x - mu) / (sd + 1e-6) for x in s], rel=1e-6)
    assert a[4:].tolist() == [0.0, 0.0]                    # all-equal group: zero, no NaN
    assert not torch.isnan(a).any()


def test_decoupled_loss_by_hand():
    cfg = GRPOConfig()
    logp = torch.tensor([[math.log(0.5), math.log(0.9)]])
    prox = torch.tensor([[math.log(0.4), math.log(0.5)]])
    behave = torch.tensor([[math.log(0.4), math.log(0.05)]])
    A = torch.tensor([2.0])
    mask = torch.tensor([[1.0, 1.0]])
    loss, stats = decoupled_ppo_loss(logp, prox, behave, A, mask, cfg=cfg)
    # token 1: ratio 1.25 (inside [0.8, 1.28]) → −A·1.25, w = 1
    t1 = -2.0 * 1.25
    # token 2: ratio 1.8 clipped to 1.28; w = 0.5/0.05 = 10 > 5: AReaL drops the token (weight 0), which stays in
    # the denominator
    assert loss.item() == pytest.approx((t1 + 0.0) / 2, rel=1e-6)
    assert stats["clip_fraction"] == pytest.approx(0.5) and stats["behave_capped_share"] == pytest.approx(0.5)
    # under the cap the weight is the ratio itself: behaviour 0.25 → w = 0.5/0.25 = 2
    behave2 = torch.tensor([[math.log(0.4), math.log(0.25)]])
    loss2, stats2 = decoupled_ppo_loss(logp, prox, behave2, A, mask, cfg=cfg)
    assert loss2.item() == pytest.approx((t1 + 2 * max(-2.0 * 1.8, -2.0 * 1.28)) / 2, rel=1e-6)
    assert stats2["behave_weight_mean"] == pytest.approx(1.5) and stats2["behave_capped_share"] == 0


def test_padding_and_staleness_masks():
    logp = torch.zeros(3, 4, requires_grad=True)
    prox = torch.zeros(3, 4)
    A = torch.tensor([1.0, -1.0, 3.0])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.float32)
    versions = torch.tensor([10, 9, 5])   # sample 3 is 5 versions old → rejected (η = 4)
    loss, stats = decoupled_ppo_loss(logp, prox, prox, A, mask, versions, current_version=10)
    assert stats["rejected_stale"] == 1 and stats["tokens"] == 6
    assert loss.item() == pytest.approx((2 * -1.0 + 4 * 1.0) / 6)
    loss.backward()
    assert logp.grad[2].abs().sum() == 0 and logp.grad[0, 2:].abs().sum() == 0


def test_zero_advantage_group_gives_zero_gradient():
    r = torch.ones(4)
    a = group_advantages(r, torch.zeros(4, dtype=torch.long))
    logp = torch.randn(4, 5, requires_grad=True)
    loss, _ = decoupled_ppo_loss(logp, logp.detach(), logp.detach(), a, torch.ones(4, 5))
    loss.backward()
    assert loss.item() == 0.0 and logp.grad.abs().sum() == 0
