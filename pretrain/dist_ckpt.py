"""Model and optimizer checkpoints through megatron-core ``dist_checkpointing`` (reshardable: a
checkpoint saved at one TP/PP/CP/DP layout loads at any other).

One checkpoint (megatron's ``torch_dist`` format): the LLM's ``sharded_state_dict()`` (TP-sharded
tensors, global layer numbers), the RICE-ViT and projector tensors as replicated ``ShardedTensor``s
(written once, by the rank with replica id 0), and the megatron optimizer's ``sharded_state_dict``
(Adam moments sharded like their parameters, plus the common step), then ``step.json``, written last.
``save`` writes one into ``<root>/iter_<step>/`` atomically (``pretrain.checkpoint``: temp folder,
fsync, rename, ``latest`` pointer, the last ``keep`` kept); every ``load_*`` takes either such a root
(its newest complete checkpoint) or one checkpoint folder.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch


# The distributed optimizer's state is saved in its canonical per-parameter form (gathered over DP
# at save, sliced per rank at load), so a checkpoint reshards over TP/PP/DP. megatron-core 0.19's
# default ('fully_sharded_model_space') writes flattened ShardedTensors its own save rejects: every
# GPU checkpoint failed before this (found on the first GPU run, bench/results/gpu_h200.md).
# Saving, ``distrib_optim_fully_reshardable_mem_efficient`` gathers each bucket's state over DP with
# gloo to DP rank 0 only (one bucket at a time), instead of all-gathering full fp32 buffers on every
# rank with NCCL; megatron reads both layouts back the same way, so load keeps the default.
OPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
OPT_SAVE_METADATA = {**OPT_METADATA, "distrib_optim_fully_reshardable_mem_efficient": True}


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


def save(root: Path, model, opt, step: int, keep: int = 2, data: dict | None = None) -> Path:
    """``opt``: a megatron optimizer (its sharded state is saved with the model) or None. Writes
    ``root/iter_<step>/`` atomically and keeps the newest ``keep``; returns that folder. ``data``:
    the loader's state (``pretrain.train``: packs consumed), kept in ``step.json``."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from pretrain import checkpoint

    root = Path(root)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        checkpoint.begin(root, step)
    if dist.is_initialized():
        dist.barrier()
    model_sd = model_sharded_state_dict(model)
    sd = {"model": model_sd}
    if opt is not None:
        sd["optimizer"] = opt.sharded_state_dict(model_sd, metadata=OPT_SAVE_METADATA)
    dist_checkpointing.save(sd, str(checkpoint.tmp_path(root, step)))
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        checkpoint.commit(root, step, keep, {"data": data} if data else None)
    if dist.is_initialized():
        dist.barrier()
    return root / checkpoint.iter_name(step)


def data_state(path: Path) -> dict | None:
    """The loader state saved with the checkpoint (a root or a folder; None: an older checkpoint
    without one)."""
    from pretrain import checkpoint

    return json.loads((checkpoint.resolve(path) / "step.json").read_text()).get("data")


def is_complete(path: Path) -> bool:
    """``path`` is a complete checkpoint, or a root holding one."""
    from pretrain import checkpoint

    return checkpoint.newest(Path(path), log=None) is not None


def step_of(path: Path) -> int:
    from pretrain import checkpoint

    return json.loads((checkpoint.resolve(path) / "step.json").read_text())["step"]


def readable(path: Path) -> bool:
    """Megatron's ``metadata.json`` and torch DCP's tensor index (``.metadata``) both read back: a
    cheap check before resuming from the checkpoint (no tensor is read)."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return bool(dist_checkpointing.check_is_distributed_checkpoint(str(path))) and bool(
            FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    except Exception:
        return False


def load_model(path: Path, model) -> int:
    """Load the weights in place (any layout); returns the saved step."""
    from megatron.core import dist_checkpointing

    from pretrain import checkpoint

    path = checkpoint.resolve(path)
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

    from pretrain import checkpoint

    path = checkpoint.resolve(path)
    for o in getattr(opt, "chained_optimizers", [opt]):
        # megatron's DistributedOptimizer describes its Adam state only once it exists; a fresh one
        # (no step taken) gets zero-valued state first, replaced in place by the load
        init = getattr(o, "_init_optimizer_states_with_dummy_values", None)
        if init is not None and not o.optimizer.state:
            init()
    sd = {"optimizer": opt.sharded_state_dict(model_sharded_state_dict(model), is_loading=True,
                                              metadata=OPT_METADATA)}
    loaded = dist_checkpointing.load(sd, str(path))["optimizer"]
    with adam_step_per_parameter(opt):
        opt.load_state_dict(loaded)


@contextlib.contextmanager
def adam_step_per_parameter(opt):
    """Give torch Adam's per-parameter ``step`` back while megatron's DistributedOptimizer loads.

    Without Transformer Engine or Apex, megatron-core 0.19.2 uses ``torch.optim.AdamW``, which keeps
    ``state[p]["step"]`` as a tensor per parameter. ``DistributedOptimizer.load_state_dict`` puts the
    saved step (kept in the param groups) back into the inner state as *one* tensor shared by every
    parameter; then ``load_parameter_state_from_fully_reshardable`` drops the ``"step"`` key from
    the tensors it hands to ``_set_main_param_and_optimizer_states``, which copies every tensor of
    the inner state and so asks for ``tensors["step"]``: ``KeyError: 'step'``. We shadow that method
    on the instance for the load (megatron's files stay as they are): it is handed the parameter's
    own step, a fresh tensor of the saved value, so each parameter again counts its steps alone
    (a shared tensor would be advanced once per parameter by ``step_t += 1``, skewing Adam's bias
    correction). The TE/Apex optimizers keep the step in the param groups, have no ``"step"`` state,
    and pass through unchanged. See docs/pretrain.md (Exact resume)."""
    patched = []
    for o in getattr(opt, "chained_optimizers", [opt]):
        setter = getattr(type(o), "_set_main_param_and_optimizer_states", None)
        if setter is None or not hasattr(o, "model_param_group_index_map"):
            continue

        def with_step(model_param, tensors, _o=o, _setter=setter):
            gi, go = _o.model_param_group_index_map[model_param]
            main = _o.optimizer.param_groups[gi]["params"][go]
            state = _o.optimizer.state.get(main, {})
            if isinstance(state.get("step"), torch.Tensor) and "step" not in tensors:
                state["step"] = state["step"].detach().clone()
                tensors = {**tensors, "step": state["step"]}
            _setter(_o, model_param, tensors)

        o._set_main_param_and_optimizer_states = with_step
        patched.append(o)
    try:
        yield
    finally:
        for o in patched:
            del o._set_main_param_and_optimizer_states


def load_state_dict(path: Path, recipe: str) -> dict:
    """The full (TP=1) state dict of a saved stage, for export and inspection (needs megatron's
    parallel state initialised, e.g. ``pretrain.trainer.build.setup_distributed(1)``). Always megatron's
    local layer spec, on GPU too: its parameter names are the ones ``pretrain.hf`` maps, and its
    ``sharded_state_dict_keys_map`` reads checkpoints a Transformer Engine run saved."""
    from pretrain.recipes import RECIPES
    from pretrain.vlm import VLM

    model = VLM(RECIPES[recipe], image_pad_id=0, tp=1, backend="sdpa")
    load_model(path, model)
    return model.state_dict()
