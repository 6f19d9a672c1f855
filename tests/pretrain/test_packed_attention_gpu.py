"""Packed attention on the GPU (``varlen_attn`` in half precision, with the keywords this torch
has) against one SDPA per sample in fp32 — forward and gradients — for the LLM's causal GQA shape
and the tower's full attention; and the feature detection over the signatures torch 2.10–2.14 had."""
import pytest
import torch
import torch.nn.functional as F

from pretrain.model.attention import packed_attention, varlen_call, varlen_features


def _per_sample(q, k, v, bounds, causal):
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        outs.append(F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                   v[a:b].transpose(0, 1), is_causal=causal,
                                                   enable_gqa=q.shape[1] != k.shape[1]).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.gpu
@pytest.mark.parametrize("causal,heads,groups", [(True, 8, 2), (False, 4, 4)])
def test_varlen_matches_per_sample_sdpa(causal, heads, groups):
    torch.manual_seed(0)
    bounds = [0, 37, 38, 300, 301, 777]
    t, d = bounds[-1], 64
    dev = torch.device("cuda")
    q32, k32, v32 = (torch.randn(t, n, d, device=dev) for n in (heads, groups, groups))
    g = torch.randn(t, heads, d, device=dev)
    cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
    leaves = [x.to(torch.bfloat16).requires_grad_() for x in (q32, k32, v32)]
    got = packed_attention(*leaves, cu, max(b - a for a, b in zip(bounds[:-1], bounds[1:])), causal=causal)
    got.backward(g.to(torch.bfloat16))
    ref_leaves = [x.clone().requires_grad_() for x in (q32, k32, v32)]
    want = _per_sample(*ref_leaves, bounds, causal)
    want.backward(g)
    assert (got.float() - want).abs().max().item() < 2e-2
    for a, b in zip(leaves, ref_leaves):
        assert (a.grad.float() - b.grad).abs().max().item() < 5e-2 * max(1.0, b.grad.abs().max().item())


def _fake(name_args):
    """A function with one of torch's historical ``varlen_attn`` signatures that records its call."""
    calls = []

    def fn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kw):
        calls.append((key.shape, kw))
        return query

    import inspect

    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
              for n in ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k")]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in name_args]
    fn.__signature__ = inspect.Signature(params)
    return fn, calls


@pytest.mark.parametrize("names,want", [
    (["is_causal", "return_aux", "scale"], {"usable": True, "window": False, "is_causal": True, "gqa": False}),   # 2.10
    (["return_aux", "scale", "window_size"], {"usable": True, "window": True, "is_causal": False, "gqa": False}),  # 2.11
    (["return_aux", "scale", "window_size", "enable_gqa"], {"usable": True, "window": True, "is_causal": False,
                                                           "gqa": True}),                                         # 2.14
    (["return_aux", "scale"], {"usable": False, "window": False, "is_causal": False, "gqa": False}),
])
def test_varlen_feature_detection_and_call(names, want):
    fn, calls = _fake(names)
    feats = varlen_features(fn)
    assert feats == want
    if not feats["usable"]:
        return
    q, k = torch.zeros(10, 8, 4), torch.zeros(10, 2, 4)
    varlen_call(q, k, k, torch.tensor([0, 10]), 10, True, feats=feats, fn=fn)
    shape, kw = calls[-1]
    if feats["gqa"]:
        assert shape[1] == 2 and kw["enable_gqa"] is True
    else:
        assert shape[1] == 8 and "enable_gqa" not in kw        # key/value repeated to the query heads
    assert kw.get("window_size", (-1, 0)) == (-1, 0) and kw.get("is_causal", True) is True
    varlen_call(q, k, k, torch.tensor([0, 10]), 10, False, feats=feats, fn=fn)
    assert calls[-1][1].get("window_size", (-1, -1)) == (-1, -1) and calls[-1][1].get("is_causal", False) is False


def test_no_varlen_falls_back(monkeypatch):
    """Without a usable ``varlen_attn`` the per-sample result comes from SDPA (here on the CPU)."""
    import pretrain.model.attention as A

    monkeypatch.setitem(A.VARLEN, "usable", False)
    torch.manual_seed(0)
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    got = packed_attention(q, k, v, torch.tensor([0, 4, 9]), 5)
    assert torch.allclose(got, _per_sample(q, k, v, [0, 4, 9], True), atol=1e-6)
