"""The trainer's data part: this rank's micro-batches of the stage's pack step, from the loader's
saved position, prepared on the CPU (``pretrain.data.BatchPrep`` in the DataLoader's workers) and
moved to the device without blocking the host."""
from __future__ import annotations

import dataclasses

import torch


def stage_batches(cfg, recipe, image_pad_id: int, dtype: torch.dtype, sizes: dict, start_pack: int):
    """An endless iterator over this DP rank's micro-batches (every ``dp``-th of the stream) of
    ``cfg.data``, starting at pack ``start_pack`` of the stream (``pretrain.data.loader``)."""
    from megatron.core import parallel_state as ps

    from pretrain.data import BatchPrep, loader

    prep = BatchPrep(recipe.vit, recipe.llm.kv_channels, recipe.llm.rope_theta, image_pad_id, dtype, sizes["tp"],
                     sizes["cp"], ps.get_context_parallel_rank(), cfg.sequence_parallel)
    return iter(loader(cfg.run_dir, cfg.data, cfg.micro_batch, ps.get_data_parallel_rank(), sizes["dp"],
                       start_pack, prep, cfg.loader_workers, pin_memory=torch.cuda.is_available()))


def to_device(b, device):
    mv = (lambda x: None if x is None else x.to(device, non_blocking=True))
    return dataclasses.replace(b, tokens=mv(b.tokens), labels=mv(b.labels), loss_mask=mv(b.loss_mask),
                               position_ids=mv(b.position_ids), cu_seqlens=mv(b.cu_seqlens),
                               cp_index=mv(b.cp_index), images=[mv(x) for x in b.images or []],
                               vision=None if b.vision is None else b.vision.to(device),
                               rotary=None if b.rotary is None else tuple(mv(x) for x in b.rotary))
