"""The trainer's optimizer (``pretrain.trainer.optimizer``): torch's ``_foreach`` kernels in place of
megatron's no-Apex fallbacks give megatron's own step."""
import pytest
import torch

from pretrain.trainer import optimizer
from tiny_batches import PAD, tiny_batch  # (tests/pretrain is on sys.path)


def _ddp_cfg():
    from types import SimpleNamespace

    return optimizer.ddp_config(SimpleNamespace(distributed_optimizer=False))


def _tiny_step(patch: bool, monkeypatch):
    """One optimizer step of the tiny recipe through megatron's DDP, ``finalize_model_grads`` (the
    per-token scaling of the gradient buffer) and optimizer (gradient norm + clipping), with megatron's
    no-Apex fallbacks or, with ``patch``, ``optimizer.foreach_optimizer``'s."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.optimizer import clip_grads

    from pretrain.data import BatchPrep
    from pretrain.recipes import RECIPES, STAGES
    from pretrain.model.vlm import VLM

    for mod, name in ((clip_grads, "l2_norm_impl"), (clip_grads, "multi_tensor_scale_tensor_impl"),
                      (param_and_grad_buffer._ParamAndGradBuffer, "scale_gradients")):
        monkeypatch.setattr(mod, name, getattr(mod, name))      # restored after the test
    if patch:
        assert optimizer.foreach_optimizer()
        assert clip_grads.l2_norm_impl is optimizer.foreach_l2_norm
    torch.manual_seed(0)
    r = RECIPES["tiny"]
    model = VLM(r, PAD, backend="sdpa")
    model.set_trainable("all")
    ddp, opt = optimizer.build_optimizer(model, STAGES["1.5"], 1e-3, False, torch.float32, _ddp_cfg())
    b = tiny_batch(3, BatchPrep(r.vit, r.llm.kv_channels, r.llm.rope_theta, PAD), seed=0)
    opt.zero_grad()
    per_tok = ddp(b)
    (per_tok.float() * b.loss_mask).sum().backward()
    n_tok = b.loss_mask.sum().reshape(())
    finalize_model_grads([ddp], num_tokens=n_tok.clone())
    grads = torch.cat([p.main_grad.flatten().clone() for p in model.parameters() if p.requires_grad])
    ok, gn, _ = opt.step()
    params = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    return ok, float(gn), grads, params


def test_foreach_optimizer_fallbacks_give_megatrons_step(megatron_single, monkeypatch):
    """The per-token scaling, gradient norm and clipping through torch's ``_foreach`` kernels give the
    same gradients bit for bit, the same norm (to fp32 rounding of the norm-of-norms) and the same
    updated weights as megatron's own fallbacks (the tiny recipe clips: its norm is above 1)."""
    ok0, gn0, g0, p0 = _tiny_step(False, monkeypatch)
    ok1, gn1, g1, p1 = _tiny_step(True, monkeypatch)
    assert ok0 and ok1 and gn0 > 1.0
    assert torch.equal(g0, g1)
    assert gn1 == pytest.approx(gn0, rel=1e-6)
    torch.testing.assert_close(p1, p0, rtol=1e-6, atol=1e-7)


def test_foreach_scale_tensor_matches_megatrons_fallback():
    from megatron.core.utils import local_multi_tensor_scale

    g = torch.Generator().manual_seed(0)
    src = [torch.randn(n, generator=g) for n in (7, 1000, 3)]
    dst_ref, dst = [torch.empty_like(t) for t in src], [torch.empty_like(t) for t in src]
    local_multi_tensor_scale(0, None, [src, dst_ref], 0.37)
    optimizer.foreach_scale_tensor(0, None, [src, dst], torch.tensor([0.37]))
    assert all(torch.equal(a, b) for a, b in zip(dst, dst_ref))
    inplace = [t.clone() for t in src]
    optimizer.foreach_scale_tensor(0, None, [inplace, inplace], torch.tensor([0.37]))
    assert all(torch.equal(a, b) for a, b in zip(inplace, dst_ref))
    norm, _ = optimizer.foreach_l2_norm(0, None, [src], False)
    assert norm.shape == (1,) and norm.item() == pytest.approx(torch.cat(src).norm().item(), rel=1e-6)


def test_lr_schedule_warms_up_linearly_then_decays_to_min_lr_by_cosine():
    lrs = [optimizer.lr_at(s, 1000, 1e-3, min_lr=1e-5, warmup_frac=0.01) for s in range(1000)]
    assert lrs[:10] == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])
    assert lrs[10] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[505] == pytest.approx((1e-3 + 1e-5) / 2)          # half-way through the decay
    assert optimizer.lr_at(5000, 1000, 1e-3, min_lr=1e-5) == pytest.approx(1e-5)   # held past the end


@pytest.mark.parametrize("stage, decay, beta2", [("1.5", 0.01, 0.95), ("2", 0.0, 0.99)])
def test_the_stages_adam_settings_reach_the_optimizer_with_norms_and_biases_undecayed(megatron_single, stage, decay,
                                                                                      beta2):
    """The recipe's stage settings (the LLaVA-OneVision-1.5 quick-start scripts': weight decay 0.01 and β2
    0.95 in stages 1 and 1.5, no decay and β2 0.99 in stage 2) in megatron's param groups: matrices
    decayed, 1-D parameters (norms, biases) not, as Megatron-LM does."""
    from pretrain.recipes import RECIPES, STAGES
    from pretrain.model.vlm import VLM

    torch.manual_seed(0)
    model = VLM(RECIPES["tiny"], PAD, backend="sdpa")
    model.set_trainable("all")
    _, opt = optimizer.build_optimizer(model, STAGES[stage], 1e-3, False, torch.float32, _ddp_cfg())
    decayed = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert all(g["betas"] == (0.9, beta2) for g in opt.param_groups)
    for name, p in model.named_parameters():
        want = 0.0 if p.ndim == 1 or name.endswith(".bias") else decay
        assert decayed[id(p)] == pytest.approx(want), name
    assert any(v > 0 for v in decayed.values()) == (decay > 0)
