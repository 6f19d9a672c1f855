"""Splitting a packed THD micro-batch over context-parallel (CP) and sequence-parallel (SP) ranks,
and the CP all-gather the SDPA core attention uses.

**CP layout (load-balanced, as megatron/Transformer Engine expect for THD).** Every sample is padded
at its end to a multiple of ``2·cp`` (padding has no loss, and causal attention means real tokens
never see it), then cut into ``2·cp`` equal chunks; CP rank ``r`` keeps chunks ``r`` and
``2·cp − 1 − r`` of every sample, in sample order. Each rank thus holds the same share of early
(cheap) and late (expensive) causal rows. ``cu_seqlens`` stay the *global* padded boundaries:
megatron's THD rotary embedding divides them by ``cp`` and picks the matching positions
(``_get_thd_freqs_on_this_cp_rank``), and the attention rebuilds global positions from them.

**SP.** The sequence is scattered over the TP ranks after embedding, so its length must divide by
``tp`` (and by ``2·cp·tp`` with CP): a loss-free padding *sample* of the missing length is
appended (its own ``cu_seqlens`` segment, so nothing attends across it).

**CP attention without Transformer Engine** (``pretrain.model.attention``): keys and values are
all-gathered over the CP group (backward: reduce-scatter of their gradients), and each rank
attends its local queries to all keys under the block-diagonal causal mask rebuilt from global
positions — the all-gather flavour of CP (Llama 3's), exact and simple. With TE installed the TE
spec's attention runs megatron's own CP (``cp_comm_type``) on the same layout.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch


def cp_local_index(cu_seqlens, cp: int, rank: int) -> torch.Tensor:
    """Global token positions held by CP ``rank`` (in its local order)."""
    cu = [int(x) for x in cu_seqlens]
    parts = []
    for s, e in zip(cu[:-1], cu[1:]):
        c = (e - s) // (2 * cp)
        parts.append(np.arange(s + rank * c, s + (rank + 1) * c))
        parts.append(np.arange(s + (2 * cp - 1 - rank) * c, s + (2 * cp - rank) * c))
    return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64))


def segment_ids(cu_seqlens, total: int, device=None) -> torch.Tensor:
    """The sample index of every token position of a packed sequence."""
    seg = torch.zeros(total, dtype=torch.long, device=device)
    seg[torch.as_tensor(cu_seqlens[1:-1]).long().to(seg.device)] = 1
    return seg.cumsum(0)


def cp_mask(cu_seqlens, cp: int, rank: int) -> torch.Tensor:
    """Boolean [local, total]: CP ``rank``'s queries × all ranks' gathered keys (rank order), True
    where the block-diagonal causal mask of the whole sequence allows attention."""
    seg = segment_ids(cu_seqlens, int(cu_seqlens[-1]))
    q = cp_local_index(cu_seqlens, cp, rank)
    k = torch.cat([cp_local_index(cu_seqlens, cp, r) for r in range(cp)])
    return (seg[q][:, None] == seg[k][None, :]) & (k[None, :] <= q[:, None])


def pad_samples(b, multiple: int):
    """Pad every sample of the packed batch at its end to a multiple of ``multiple`` tokens."""
    if multiple == 1:
        return b
    cu = b.cu_seqlens.tolist()
    lens = np.diff(cu)
    new_lens = -(-lens // multiple) * multiple
    if (new_lens == lens).all():
        return b
    T = int(new_lens.sum())
    new_cu = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(new_lens, out=new_cu[1:])
    dest = np.concatenate([np.arange(new_cu[i], new_cu[i] + lens[i]) for i in range(len(lens))])
    dest_t = torch.from_numpy(dest)

    def spread(x, fill_pos=False):
        out = torch.zeros(1, T, dtype=x.dtype)
        if fill_pos:      # position ids keep counting inside a sample's padding
            out[0] = torch.from_numpy(np.concatenate([np.arange(n) for n in new_lens])).to(x.dtype)
        out[0, dest_t] = x[0]
        return out

    return dataclasses.replace(b, tokens=spread(b.tokens), labels=spread(b.labels), loss_mask=spread(b.loss_mask),
                               position_ids=spread(b.position_ids, True),
                               cu_seqlens=torch.from_numpy(new_cu).to(b.cu_seqlens.dtype),
                               max_seqlen=int(new_lens.max()))


def pad_total(b, multiple: int):
    """Append one loss-free padding sample so the batch length divides by ``multiple``."""
    n = (-b.tokens.shape[1]) % multiple
    if n == 0:
        return b
    return pad_to(b, b.tokens.shape[1] + n)


def pad_to(b, T: int):
    """Pad a packed batch to ``T`` tokens with one extra, loss-free sample (own ``cu_seqlens`` segment)."""
    n = T - b.tokens.shape[1]
    if n == 0:
        return b
    z = torch.zeros(1, n, dtype=b.tokens.dtype)
    return dataclasses.replace(
        b, tokens=torch.cat([b.tokens, z], 1), labels=torch.cat([b.labels, z], 1),
        loss_mask=torch.cat([b.loss_mask, torch.zeros(1, n, dtype=b.loss_mask.dtype)], 1),
        position_ids=torch.cat([b.position_ids, torch.arange(n, dtype=b.position_ids.dtype)[None]], 1),
        cu_seqlens=torch.cat([b.cu_seqlens, torch.tensor([T], dtype=b.cu_seqlens.dtype)]),
        max_seqlen=max(b.max_seqlen, n))


def shard_batch(b, tp: int = 1, cp: int = 1, cp_rank: int = 0, sequence_parallel: bool = False):
    """The micro-batch as this rank's model sees it: padded for CP/SP, with ``cp_index`` set and
    labels / loss mask cut to this CP rank's tokens (tokens and images stay whole: the first
    pipeline stage embeds everything, then keeps its share)."""
    b = pad_samples(b, 2 * cp if cp > 1 else 1)
    unit = (2 * cp if cp > 1 else 1) * (tp if sequence_parallel else 1)
    b = pad_total(b, unit)
    if cp == 1:
        return dataclasses.replace(b, cp_index=None)
    idx = cp_local_index(b.cu_seqlens, cp, cp_rank)
    return dataclasses.replace(b, labels=b.labels[:, idx], loss_mask=b.loss_mask[:, idx], cp_index=idx)


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group = group
        n = dist.get_world_size(group)
        out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist

        n = dist.get_world_size(ctx.group)
        out = torch.empty((g.shape[0] // n, *g.shape[1:]), dtype=g.dtype, device=g.device)
        dist.reduce_scatter_tensor(out, g.contiguous(), group=ctx.group)
        return out, None


def gather_cp(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherSeq.apply(x, group)
