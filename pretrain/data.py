"""Packed shards (``packing.shards``) → THD micro-batches for megatron-core.

A micro-batch is ``micro_batch`` packs concatenated into one THD sequence: megatron sees
``tokens [1, T]`` with ``PackedSeqParams(cu_seqlens)`` over *all samples of all packs*, so
micro-batch > 1 costs nothing special (block-diagonal attention keeps samples apart) — the
published code is stuck at 1 when packing. Labels are the next token *within the same sample*;
the loss mask is the target mask of that next token (caption / assistant turn), 0 on each
sample's last position. Position ids restart at every sample.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch


@dataclass
class PackedBatch:
    tokens: torch.Tensor        # [1, T]
    labels: torch.Tensor        # [1, T]
    loss_mask: torch.Tensor     # [1, T] float
    position_ids: torch.Tensor  # [1, T]
    cu_seqlens: torch.Tensor    # [n_samples + 1] int32
    max_seqlen: int
    n_images: int
    images: list = None          # [3, H, W] float tensors, H = grid_h·14, W = grid_w·14 (CLIP-normalised)
    cp_index: torch.Tensor | None = None   # context parallel: this rank's token positions (pretrain.parallel)


CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def pixels(image_bytes: bytes, grid_h: int, grid_w: int, patch: int = 14) -> torch.Tensor:
    """Decode and resize to the grid ``packing`` counted tokens for (smart_resize), normalise."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(image_bytes)) as im:
        im = im.convert("RGB").resize((grid_w * patch, grid_h * patch), Image.BICUBIC)
        x = torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0).permute(2, 0, 1)
    mean = torch.tensor(CLIP_MEAN)[:, None, None]
    std = torch.tensor(CLIP_STD)[:, None, None]
    return (x - mean) / std


def collate(seqs, with_images: bool = True) -> PackedBatch:
    ids = np.concatenate([s.input_ids for s in seqs]).astype(np.int64)
    mask = np.concatenate([s.loss_mask for s in seqs]).astype(np.float32)
    pos = np.concatenate([s.position_ids for s in seqs]).astype(np.int64)
    lens = np.concatenate([np.diff(s.cu_seqlens) for s in seqs])
    cu = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=cu[1:])
    labels = np.zeros_like(ids)
    labels[:-1] = ids[1:]
    lmask = np.zeros_like(mask)
    lmask[:-1] = mask[1:]
    lmask[cu[1:] - 1] = 0.0   # a sample's last token predicts nothing (the next token is another sample)
    images = [pixels(img, int(g[0]), int(g[1])) for s in seqs for img, g in zip(s.images, s.image_grids)] \
        if with_images else []
    return PackedBatch(torch.from_numpy(ids)[None], torch.from_numpy(labels)[None], torch.from_numpy(lmask)[None],
                       torch.from_numpy(pos)[None], torch.from_numpy(cu).to(torch.int32), int(lens.max()),
                       sum(len(s.images) for s in seqs), images)


def iter_batches(run_dir: str | Path, pack_step: str, micro_batch: int, epochs: int | None = None,
                 rank: int = 0, world: int = 1) -> Iterator[PackedBatch]:
    """Deterministic order: shards sorted, packs in file order, repeated ``epochs`` times (None: forever).
    ``rank`` / ``world``: a data-parallel rank keeps micro-batches ``rank, rank + world, …`` of that
    order and decodes only those."""
    from packing.shards import iter_packed, packed_shards

    shards = packed_shards(run_dir, pack_step)
    e, k = 0, 0
    while epochs is None or e < epochs:
        buf = []
        for sh in shards:
            for seq in iter_packed(sh):
                buf.append(seq)
                if len(buf) == micro_batch:
                    if k % world == rank:
                        yield collate(buf)
                    k += 1
                    buf = []
        e += 1
