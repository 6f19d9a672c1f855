"""The LLM on packed (THD) batches: samples never see each other, positions restart per sample."""
import torch

from pretrain.model.attention import block_causal_mask, packed_causal_attention


def test_block_causal_mask():
    m = block_causal_mask(torch.tensor([0, 2, 5]), 5)
    want = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]).bool()
    assert torch.equal(m, want)


def test_per_sample_attention_equals_the_block_causal_mask():
    """The linear-memory path (one causal SDPA per sample, GQA without repeating key/value) gives
    what the dense block-diagonal mask gives — forward and gradients — including an empty sample
    and tokens past the last boundary (they belong to the last sample)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 5, 12, 14])
    t, heads, groups, d = 17, 4, 2, 8
    q = torch.randn(t, heads, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(t, groups, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(t, groups, d, dtype=torch.float64, requires_grad=True)
    got = packed_causal_attention(q, k, v, cu)
    rep = heads // groups
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                                          v.repeat_interleave(rep, 1).transpose(0, 1),
                                          attn_mask=block_causal_mask(cu, t)).transpose(0, 1)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-12)
    g = torch.randn_like(got)
    ga = torch.autograd.grad(got, (q, k, v), g)
    gb = torch.autograd.grad(want, (q, k, v), g)
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(ga, gb))


def test_packed_forward_equals_separate_forwards(megatron_single):
    from pretrain.model.llm import LLM_SIZES, build_llm, packed_seq_params

    torch.manual_seed(0)
    model = build_llm(LLM_SIZES["tiny"], backend="sdpa").eval()
    a = torch.randint(0, 512, (7,))
    b = torch.randint(0, 512, (5,))
    with torch.no_grad():
        la = model(a[None], torch.arange(7)[None], attention_mask=None)
        lb = model(b[None], torch.arange(5)[None], attention_mask=None)
        tokens = torch.cat([a, b])[None]
        pos = torch.cat([torch.arange(7), torch.arange(5)])[None]
        psp = packed_seq_params(torch.tensor([0, 7, 12]), 7)
        lp = model(tokens, pos, attention_mask=None, packed_seq_params=psp)
    assert torch.allclose(lp[0, :7], la[0], atol=1e-5)
    assert torch.allclose(lp[0, 7:], lb[0], atol=1e-5)


def test_gradients_flow_on_cpu(megatron_single):
    from pretrain.model.llm import LLM_SIZES, build_llm, packed_seq_params

    model = build_llm(LLM_SIZES["tiny"], backend="sdpa")
    tokens = torch.randint(0, 512, (1, 12))
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None]
    labels = torch.randint(0, 512, (1, 12))
    loss = model(tokens, pos, attention_mask=None, labels=labels,
                 packed_seq_params=packed_seq_params(torch.tensor([0, 7, 12]), 7))
    loss.mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
