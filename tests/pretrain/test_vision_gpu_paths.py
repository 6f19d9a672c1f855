"""The tower's GPU paths, checked on the CPU: per-image attention equals the dense block-diagonal
mask, layer recompute gives the same gradients, and bf16 runs (the rotary tables, computed in fp32, do
not promote q/k away from v)."""
import torch
import torch.nn.functional as F

from pretrain.model.fused import rotate_half
from pretrain.model.vision import VIT_SIZES, RiceViT


def _images():
    return [torch.randn(3, 56, 56), torch.randn(3, 28, 84), torch.randn(3, 56, 28)]


def test_per_image_attention_equals_the_dense_block_mask():
    torch.manual_seed(0)
    m = RiceViT(VIT_SIZES["tiny"]).double()
    imgs = [x.double() for x in _images()]
    outs, cu = m(imgs)
    captured = {}
    layer = m.encoder.layers[0]
    attn = layer.self_attn

    def dense(x, cos, sin, lens):                      # the old formulation: one SDPA, dense mask
        t = x.shape[0]
        q, k, v = (p(x).view(t, attn.heads, attn.hd) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        c, s_ = cos[:, None, :], sin[:, None, :]
        q, k = q * c + rotate_half(q) * s_, k * c + rotate_half(k) * s_
        seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=seg[:, None] == seg[None, :])
        return attn.out_proj(o.transpose(0, 1).reshape(t, -1))

    orig = attn.forward

    def both(x, cos, sin, lens):
        captured["new"], captured["old"] = orig(x, cos, sin, lens), dense(x, cos, sin, lens)
        return captured["new"]

    attn.forward = both
    m(imgs)
    assert torch.allclose(captured["new"], captured["old"], atol=1e-12)
    assert [int(x) for x in cu] == [0, 17, 30, 39]


def test_recompute_gives_the_same_gradients():
    torch.manual_seed(0)
    m = RiceViT(VIT_SIZES["tiny"]).double()
    imgs = [x.double() for x in _images()]
    grads = []
    for recompute in (False, True):
        m.recompute = recompute
        m.zero_grad()
        outs, _ = m(imgs)
        sum((o ** 2).sum() for o in outs).backward()
        grads.append([p.grad.clone() for p in m.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_bf16_forward():
    torch.manual_seed(0)
    m = RiceViT(VIT_SIZES["tiny"]).to(torch.bfloat16)
    outs, _ = m([x.to(torch.bfloat16) for x in _images()])
    assert all(o.dtype == torch.bfloat16 and torch.isfinite(o.float()).all() for o in outs)
    assert m._angles(4, 4, torch.arange(16)).dtype == torch.float32     # rotary angles never in bf16
