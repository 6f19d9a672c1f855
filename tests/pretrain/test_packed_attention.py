"""The LLM on packed (THD) batches: samples never see each other, positions restart per sample."""
import torch

from pretrain.attention import block_causal_mask


def test_block_causal_mask():
    m = block_causal_mask(torch.tensor([0, 2, 5]), 5)
    want = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]).bool()
    assert torch.equal(m, want)


def test_packed_forward_equals_separate_forwards(megatron_single):
    from pretrain.model import LLM_SIZES, build_llm, packed_seq_params

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
    from pretrain.model import LLM_SIZES, build_llm, packed_seq_params

    model = build_llm(LLM_SIZES["tiny"], backend="sdpa")
    tokens = torch.randint(0, 512, (1, 12))
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None]
    labels = torch.randint(0, 512, (1, 12))
    loss = model(tokens, pos, attention_mask=None, labels=labels,
                 packed_seq_params=packed_seq_params(torch.tensor([0, 7, 12]), 7))
    loss.mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
