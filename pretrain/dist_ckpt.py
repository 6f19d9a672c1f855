"""Model and optimizer checkpoints through megatron-core ``dist_checkpointing`` (reshardable: a
checkpoint saved at one TP/PP/CP/DP layout loads at any other).

Layout of ``<stage>/dist_ckpt/`` (megatron's ``torch_dist`` format): the LLM's ``sharded_state_dict()``
(TP-sharded tensors, global layer numbers), the RICE-ViT and projector tensors as replicated
``ShardedTensor``s (written once, by the rank with replica id 0), and the megatron optimizer's
``sharded_state_dict`` (Adam moments sharded like their parameters, plus the common step), then
``step.json``, written last: a folder without it is an interrupted save and is ignored.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


# The distributed optimizer's state is saved in its canonical per-parameter form (gathered over DP
# at save, sliced per rank at load), so a checkpoint reshards over TP/PP/DP. megatron-core 0.19's
# default ('fully_sharded_model_space') writes flattened ShardedTensors its own save rejects: every
# GPU checkpoint failed before this (found on the first GPU run, bench/results/gpu_h200.md).
OPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


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
            # the Parameter itself (not .data): the optimizer maps its state to params by identity
            sd[key] = ShardedTensor.from_rank_offsets(key, t, replica_id=replica)
    return sd


def save(path: Path, model, opt, step: int) -> None:
    """``opt``: a megatron optimizer (its sharded state is saved with the model) or None."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    path = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and path.exists():
        shutil.rmtree(path)                       # a checkpoint folder is rewritten whole
    if dist.is_initialized():
        dist.barrier()
    path.mkdir(parents=True, exist_ok=True)
    model_sd = model_sharded_state_dict(model)
    sd = {"model": model_sd}
    if opt is not None:
        sd["optimizer"] = opt.sharded_state_dict(model_sd, metadata=OPT_METADATA)
    dist_checkpointing.save(sd, str(path))
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        (path / "step.json").write_text(json.dumps({"step": step}))
    if dist.is_initialized():
        dist.barrier()


def is_complete(path: Path) -> bool:
    return (Path(path) / "step.json").exists()


def load_model(path: Path, model) -> int:
    """Load the weights in place (any layout); returns the saved step."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": model_sharded_state_dict(model)}, str(path))["model"]
    state = {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise KeyError(f"checkpoint {path} does not match the model: missing {missing[:5]}, "
                       f"unexpected {unexpected[:5]}")
    return json.loads((Path(path) / "step.json").read_text())["step"]


def load_optimizer(path: Path, model, opt) -> None:
    """The megatron optimizer's state, resharded to this rank's parameters."""
    from megatron.core import dist_checkpointing

    for o in getattr(opt, "chained_optimizers", [opt]):
        # megatron's DistributedOptimizer describes its Adam state only once it exists; a fresh one
        # (no step taken) gets zero-valued state first, replaced in place by the load
        init = getattr(o, "_init_optimizer_states_with_dummy_values", None)
        if init is not None and not o.optimizer.state:
            init()
    sd = {"optimizer": opt.sharded_state_dict(model_sharded_state_dict(model), is_loading=True,
                                              metadata=OPT_METADATA)}
    opt.load_state_dict(dist_checkpointing.load(sd, str(path))["optimizer"])


def load_state_dict(path: Path, recipe: str) -> dict:
    """The full (TP=1) state dict of a saved stage, for export and inspection (needs megatron's
    parallel state initialised, e.g. ``pretrain.train.setup_distributed(1)``). Always megatron's
    local layer spec, on GPU too: its parameter names are the ones ``pretrain.hf`` maps, and its
    ``sharded_state_dict_keys_map`` reads checkpoints a Transformer Engine run saved."""
    from pretrain.recipes import RECIPES
    from pretrain.vlm import VLM

    model = VLM(RECIPES[recipe], image_pad_id=0, tp=1, backend="sdpa")
    load_model(path, model)
    return model.state_dict()
