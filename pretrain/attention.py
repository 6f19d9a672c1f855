"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` that honours
``PackedSeqParams`` — swapped into megatron-core's layer spec for CPU runs (megatron's local
``DotProductAttention`` asserts ``packed_seq_params is None`` and allocates through a CUDA memory
buffer; Transformer Engine's attention handles THD on GPU).

Packed (``qkv_format == "thd"``): query/key/value are ``[t, heads, dim]`` for all samples of all
packs of the micro-batch concatenated; ``cu_seqlens_q`` marks sample boundaries. Attention is
causal within each sample (``packed_causal_attention``: varlen FlashAttention on CUDA, one SDPA per
sample otherwise) — a token attends only to earlier tokens of its own sample — so packing never
lets information cross sample boundaries, and any number of packs can share one micro-batch.
Unpacked (``sbhd``): ``[s, b, heads, dim]`` with plain causal attention.
GQA: key/value groups are repeated to the query heads, as megatron does.

Context parallel (``config.context_parallel_size > 1``, THD only): the local tokens are this CP
rank's two chunks of every sample (``pretrain.parallel``); keys/values are all-gathered over the CP
group and the mask is built from global positions, so the result equals CP=1 row for row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from pretrain.parallel import segment_ids


def block_causal_mask(cu_seqlens: torch.Tensor, total: int, device=None) -> torch.Tensor:
    """Boolean [total, total]: True where attention is allowed."""
    seg = segment_ids(cu_seqlens, total, device)
    same = seg[:, None] == seg[None, :]
    causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
    return same & causal


try:                                    # FlashAttention varlen in PyTorch itself (CUDA, fp16/bf16)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:                     # older torch: the per-sample loop below
    varlen_attn = None


def packed_causal_attention(q, k, v, cu_seqlens, dropout_p: float = 0.0, scale: float | None = None):
    """Causal attention within each sample of a packed sequence: ``q`` [t, heads, d], ``k``/``v``
    [t, groups, d] (GQA), ``cu_seqlens`` the sample boundaries (tokens past the last boundary belong
    to the last sample, as in ``segment_ids``). Memory is linear in ``t``: never a [t, t] mask.

    On CUDA in half precision: one ``varlen_attn`` call (FlashAttention over the cumulative
    lengths). Otherwise one ``scaled_dot_product_attention(is_causal=True)`` per sample. The dense
    block-diagonal mask this replaces took heads × t² fp32 scores per layer (8 GiB at t = 8192 with
    32 heads — the 4B recipe's first GPU run ran out of memory there) and kept SDPA on its math path."""
    t = q.shape[0]
    bounds = [int(x) for x in cu_seqlens[:-1]] + [t]
    gqa = q.shape[1] != k.shape[1]
    if varlen_attn is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and not dropout_p:
        cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
        longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, window_size=(-1, 0), enable_gqa=gqa)
    outs = [F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                           is_causal=True, dropout_p=dropout_p, scale=scale,
                                           enable_gqa=gqa).transpose(0, 1)
            for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return torch.cat(outs)


class SDPACoreAttention(MegatronModule):
    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, **kwargs):
        super().__init__(config=config)
        tp = getattr(config, "tensor_model_parallel_size", 1) or 1
        self.heads = config.num_attention_heads // tp
        self.groups = (config.num_query_groups or config.num_attention_heads) // tp
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale
        self.cp = getattr(config, "context_parallel_size", 1) or 1

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        rep = self.heads // self.groups
        p = self.dropout if self.training else 0.0
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # [t, np, hn] (megatron squeezes the batch dim for THD)
            if query.dim() == 4:
                query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
            t = query.shape[0]
            if self.cp == 1:
                return packed_causal_attention(query, key, value, packed_seq_params.cu_seqlens_q, p,
                                               self.softmax_scale).reshape(t, -1)
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
        if rep > 1:
            key = key.repeat_interleave(rep, dim=2)
            value = value.repeat_interleave(rep, dim=2)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _gather_cp(self, key, value, cu_seqlens, device):
        """All CP ranks' keys/values and the mask of local queries over them (global positions)."""
        from megatron.core import parallel_state as ps

        from pretrain.parallel import cp_mask, gather_cp

        group, rank = ps.get_context_parallel_group(), ps.get_context_parallel_rank()
        key, value = gather_cp(key, group), gather_cp(value, group)
        return key, value, cp_mask(cu_seqlens, self.cp, rank).to(device)
