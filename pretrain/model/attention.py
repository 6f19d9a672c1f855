"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` that honours
``PackedSeqParams`` — swapped into megatron-core's layer spec for CPU runs (megatron's local
``DotProductAttention`` asserts ``packed_seq_params is None`` and allocates through a CUDA memory
buffer; Transformer Engine's attention handles THD on GPU).

Packed (``qkv_format == "thd"``): query/key/value are ``[t, heads, dim]`` for all samples of all
packs of the micro-batch concatenated; ``cu_seqlens_q`` marks sample boundaries. Attention is
causal within each sample (``packed_attention``: one ``varlen_attn`` on CUDA in half precision, with
the keywords this torch has — ``varlen_features``; a dense block-diagonal mask or one SDPA per sample
otherwise) — a token attends only to earlier tokens of its own sample — so packing never lets
information cross sample boundaries, and any number of packs can share one micro-batch. The rotary
embedding is applied here too (``rope_theta``, the local spec), from the micro-batch's tables
(``PackedRotaryParams``). Unpacked (``sbhd``): ``[s, b, heads, dim]`` with plain causal attention.

Context parallel (``config.context_parallel_size > 1``, THD only): the local tokens are this CP
rank's two chunks of every sample (``pretrain.model.parallel``); keys/values are all-gathered over the CP
group and the mask is built from global positions, so the result equals CP=1 row for row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule

from pretrain.model.parallel import segment_ids


def block_causal_mask(cu_seqlens: torch.Tensor, total: int, device=None) -> torch.Tensor:
    """Boolean [total, total]: True where attention is allowed."""
    seg = segment_ids(cu_seqlens, total, device)
    same = seg[:, None] == seg[None, :]
    causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
    return same & causal


try:                                    # FlashAttention varlen in PyTorch itself (CUDA, fp16/bf16)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:                     # older torch: the fallbacks below
    varlen_attn = None


def varlen_features(fn=None) -> dict:
    """What this torch's ``varlen_attn`` accepts, read from its signature (it changed across
    2.10–2.14): ``window`` (``window_size=(left, right)``: (-1, 0) causal, (-1, -1) full; 2.11+),
    ``is_causal`` (2.10's flag, before ``window_size``), ``gqa`` (``enable_gqa``: fewer key/value
    heads than query heads; 2.14+). ``usable`` is False when there is no ``varlen_attn`` or it can
    express neither causal nor full attention."""
    import inspect

    fn = varlen_attn if fn is None else fn
    if fn is None:
        return {"usable": False, "window": False, "is_causal": False, "gqa": False}
    params = inspect.signature(fn).parameters
    feats = {"window": "window_size" in params, "is_causal": "is_causal" in params, "gqa": "enable_gqa" in params}
    return {"usable": feats["window"] or feats["is_causal"], **feats}


VARLEN = varlen_features()
# Below this many tokens a CPU (or fp32) micro-batch attends through one SDPA with the dense
# block-diagonal mask (heads × t² booleans): the same number of operators for any number of samples.
# Above it, one SDPA per sample (memory linear in t, a Python loop over the samples).
DENSE_MAX_TOKENS = 4096


def _repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    """[t, groups, d] → [t, groups·rep, d], query head j reading group j // rep (megatron's layout)."""
    t, g, d = x.shape
    return x[:, :, None, :].expand(t, g, rep, d).reshape(t, g * rep, d)


def varlen_call(q, k, v, cu_seqlens, max_seqlen: int, causal: bool, scale=None, feats: dict | None = None, fn=None):
    """One ``varlen_attn`` over all samples, with the keywords this torch has (``varlen_features``):
    key/value heads repeated by hand where ``enable_gqa`` is missing."""
    feats = VARLEN if feats is None else feats
    fn = varlen_attn if fn is None else fn
    kw = {"scale": scale}
    if feats["window"]:
        kw["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kw["is_causal"] = causal
    if q.shape[1] != k.shape[1]:
        if feats["gqa"]:
            kw["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = _repeat_kv(k, rep), _repeat_kv(v, rep)
    return fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kw)


def packed_attention(q, k, v, cu_seqlens, max_seqlen: int | None = None, causal: bool = True,
                     dropout_p: float = 0.0, scale: float | None = None, bounds: list[int] | None = None):
    """Attention within each sample of a packed sequence: ``q`` [t, heads, d], ``k``/``v``
    [t, groups, d] (GQA), ``cu_seqlens`` the sample boundaries on ``q``'s device (tokens past the
    last boundary belong to the last sample, as in ``segment_ids``), ``max_seqlen`` the longest
    sample as a Python int (the loader's; None: read from ``cu_seqlens``, a host sync). ``causal``:
    a token sees the earlier tokens of its sample (the LLM); else all of its sample (the vision tower).

    Paths, none with a host sync or a per-sample loop when ``max_seqlen`` is given:
    CUDA half precision → one ``varlen_attn`` (FlashAttention over the cumulative lengths; memory
    linear in ``t``); otherwise up to ``DENSE_MAX_TOKENS`` tokens → one SDPA with the dense
    block-diagonal mask; beyond → one SDPA per sample (``bounds``: the boundaries as Python ints,
    else read from ``cu_seqlens``)."""
    t = q.shape[0]
    gqa = q.shape[1] != k.shape[1]
    if VARLEN["usable"] and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and not dropout_p:
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        if max_seqlen is None:            # no loader figures (a direct call): read them, one host sync
            bounds = [int(x) for x in cu_seqlens[:-1]] + [t]
            cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
            max_seqlen = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        return varlen_call(q, k, v, cu, int(max_seqlen), causal, scale)
    if t <= DENSE_MAX_TOKENS:
        seg = segment_ids(cu_seqlens, t, q.device)
        mask = seg[:, None] == seg[None, :]
        if causal:
            mask = mask & torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                             dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
        return out.transpose(0, 1)
    bounds = ([int(x) for x in cu_seqlens[:-1]] + [t]) if bounds is None else bounds[:-1] + [t]
    outs = [F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                           is_causal=causal, dropout_p=dropout_p, scale=scale,
                                           enable_gqa=gqa).transpose(0, 1)
            for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return torch.cat(outs)


def packed_causal_attention(q, k, v, cu_seqlens, dropout_p: float = 0.0, scale: float | None = None,
                            max_seqlen: int | None = None):
    """Causal attention within each sample of a packed sequence (``packed_attention``)."""
    return packed_attention(q, k, v, cu_seqlens, max_seqlen, True, dropout_p, scale)


def rope_inv_freq(dim: int, theta: float, device=None) -> torch.Tensor:
    """megatron's ``RotaryEmbedding`` frequencies (fp32), so the tables below equal its own."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


def rotary_tables(position_ids: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [t, dim] (fp32) of every token's own position — megatron's non-interleaved rotary
    (``cat(freqs, freqs)``), for positions that restart at every sample of a pack. Built once per
    micro-batch (by the loader, on the CPU) and shared by all layers."""
    inv = rope_inv_freq(dim, theta, position_ids.device)
    freqs = position_ids.reshape(-1).to(torch.float32)[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def thd_positions(cu_seqlens: torch.Tensor, t: int) -> torch.Tensor:
    """Each token's position inside its sample, from the boundaries alone (on their device)."""
    seg = segment_ids(cu_seqlens, t, cu_seqlens.device)
    return torch.arange(t, device=cu_seqlens.device) - cu_seqlens.long()[seg]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [t, heads, d] rotated by the per-token tables [t, d]: one expression over all tokens,
    as megatron's unfused bshd rotary computes it (tables cast to ``x``'s dtype); one fused kernel on
    CUDA with ``kernels = "fused"`` (``pretrain.model.fused``)."""
    from pretrain.model import fused

    return fused.rotary(x, cos, sin)


@dataclass
class PackedRotaryParams(PackedSeqParams):
    """megatron's ``PackedSeqParams`` plus what the local spec's attention needs per micro-batch:
    the rotary tables of every token (``rotary_tables``; None: built from ``cu_seqlens``) and the
    longest sample as a Python int. megatron hands it down to the core attention untouched."""

    rotary_cos: torch.Tensor | None = None
    rotary_sin: torch.Tensor | None = None


class SDPACoreAttention(MegatronModule):
    """``rope_theta`` (set by ``pretrain.model.layer_spec``): this module also applies the rotary
    embedding (the GPT model is then built without megatron's, whose THD path loops over the
    samples of the pack with host syncs in every layer): from the micro-batch's tables
    (``PackedRotaryParams``), else from the positions ``cu_seqlens`` implies (THD) or 0..s-1 (sbhd,
    as megatron's rotary does)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, rope_theta: float | None = None, **kwargs):
        super().__init__(config=config)
        tp = getattr(config, "tensor_model_parallel_size", 1) or 1
        self.heads = config.num_attention_heads // tp
        self.groups = (config.num_query_groups or config.num_attention_heads) // tp
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale
        self.cp = getattr(config, "context_parallel_size", 1) or 1
        self.rope_theta = rope_theta
        self.rope_dim = config.kv_channels

    def _thd_tables(self, psp, t: int, device):
        cos, sin = getattr(psp, "rotary_cos", None), getattr(psp, "rotary_sin", None)
        if cos is not None:
            return cos.to(device, non_blocking=True), sin.to(device, non_blocking=True)
        cu = psp.cu_seqlens_q.to(device)
        if self.cp == 1:
            pos = thd_positions(cu, t)
        else:                         # this CP rank's tokens of the globally padded samples
            from megatron.core import parallel_state as ps

            from pretrain.model.parallel import cp_local_index

            idx = cp_local_index(psp.cu_seqlens_q.cpu(), self.cp, ps.get_context_parallel_rank()).to(device)
            pos = thd_positions(cu, int(psp.cu_seqlens_q[-1]))[idx]
        return rotary_tables(pos, self.rope_dim, self.rope_theta)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        rep = self.heads // self.groups
        p = self.dropout if self.training else 0.0
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # [t, np, hn] (megatron squeezes the batch dim for THD)
            if query.dim() == 4:
                query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
            t = query.shape[0]
            if self.rope_theta is not None:
                cos, sin = self._thd_tables(packed_seq_params, t, query.device)
                query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
            if self.cp == 1:
                max_len = packed_seq_params.max_seqlen_q
                return packed_causal_attention(query, key, value, packed_seq_params.cu_seqlens_q, p,
                                               self.softmax_scale,
                                               max_len if isinstance(max_len, int) else None).reshape(t, -1)
            # CP: gather the (fewer) key/value groups before repeating them
            key, value, mask = self._gather_cp(key, value, packed_seq_params.cu_seqlens_q, query.device)
            if rep > 1:
                key = key.repeat_interleave(rep, dim=1)
                value = value.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
                                                 attn_mask=mask, dropout_p=p, scale=self.softmax_scale)
            return out.transpose(0, 1).reshape(t, -1)
        if self.cp > 1:
            raise NotImplementedError("context parallel with SDPA attention needs packed (THD) batches")
        # sbhd: [s, b, np, hn]
        s, b = query.shape[:2]
        if self.rope_theta is not None:
            cos, sin = rotary_tables(torch.arange(s, device=query.device), self.rope_dim, self.rope_theta)
            query = apply_rotary(query.reshape(s, -1, query.shape[-1]), cos, sin).view_as(query)
            key = apply_rotary(key.reshape(s, -1, key.shape[-1]), cos, sin).view_as(key)
        if rep > 1:
            key = key.repeat_interleave(rep, dim=2)
            value = value.repeat_interleave(rep, dim=2)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _gather_cp(self, key, value, cu_seqlens, device):
        """All CP ranks' keys/values and the mask of local queries over them (global positions)."""
        from megatron.core import parallel_state as ps

        from pretrain.model.parallel import cp_mask, gather_cp

        group, rank = ps.get_context_parallel_group(), ps.get_context_parallel_rank()
        key, value = gather_cp(key, group), gather_cp(value, group)
        return key, value, cp_mask(cu_seqlens, self.cp, rank).to(device)
