"""Model checkpoints through megatron-core ``dist_checkpointing`` (reshardable across TP sizes).

Layout of ``<stage>/dist_ckpt/``: the sharded model (megatron's ``torch_dist`` format: the LLM's
``sharded_state_dict()`` with TP-sharded tensors, plus the RICE-ViT and projector tensors as
replicated ``ShardedTensor``s written once, by the rank with replica id 0), ``optim/rank_{r:05d}.pt``
(the torch AdamW state of that rank's parameters — per rank, so it resumes only at the same TP size)
and ``step.json``, written last: a folder without it is an interrupted save and is ignored.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch


def model_sharded_state_dict(model) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedTensor

    sd = dict(model.llm.sharded_state_dict(prefix="llm."))
    replica = (0, ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(with_context_parallel=True))
    for part in ("vision", "projector"):          # plain torch modules, replicated; first PP stage only
        if getattr(model, part, None) is None:
            continue
        for k, t in getattr(model, part).state_dict(keep_vars=True).items():
            key = f"{part}.{k}"
            sd[key] = ShardedTensor.from_rank_offsets(key, t.data if isinstance(t, torch.nn.Parameter) else t,
                                                      replica_id=replica)
    return sd


def save(path: Path, model, opt, step: int) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    path = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and path.exists():
        shutil.rmtree(path)                       # a checkpoint folder is rewritten whole
    if dist.is_initialized():
        dist.barrier()
    path.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model_sharded_state_dict(model), str(path))
    (path / "optim").mkdir(exist_ok=True)
    tmp = path / "optim" / f"rank_{rank:05d}.pt.tmp"
    torch.save(opt.state_dict(), tmp)
    os.replace(tmp, path / "optim" / f"rank_{rank:05d}.pt")
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        (path / "step.json").write_text(json.dumps({"step": step}))
    if dist.is_initialized():
        dist.barrier()


def is_complete(path: Path) -> bool:
    return (Path(path) / "step.json").exists()


def load_model(path: Path, model) -> int:
    """Load the weights in place (any TP size); returns the saved step."""
    from megatron.core import dist_checkpointing

    sd = model_sharded_state_dict(model)
    loaded = dist_checkpointing.load(sd, str(path))
    state = {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise KeyError(f"checkpoint {path} does not match the model: missing {missing[:5]}, "
                       f"unexpected {unexpected[:5]}")
    return json.loads((Path(path) / "step.json").read_text())["step"]


def load_optimizer(path: Path, opt) -> None:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    opt.load_state_dict(torch.load(Path(path) / "optim" / f"rank_{rank:05d}.pt", weights_only=False))


def load_state_dict(path: Path, recipe: str) -> dict:
    """The full (TP=1) state dict of a saved stage, for export and inspection (needs megatron's
    parallel state initialised, e.g. ``pretrain.train.setup_distributed(1)``)."""
    from pretrain.recipes import RECIPES
    from pretrain.vlm import VLM

    model = VLM(RECIPES[recipe], image_pad_id=0, tp=1, backend="sdpa" if not torch.cuda.is_available() else "auto")
    load_model(path, model)
    return model.state_dict()
