"""The trainer's build part: the process groups and the VLM of this rank (its DDP wrapper and optimizer:
``pretrain.trainer.optimizer``).

- ``setup_distributed``: the process group (nccl on GPU, gloo on CPU, host-staged gloo where ranks share a
  GPU: ``collectives_path``, from the ranks' device UUIDs exchanged over the rendezvous store) and megatron's
  TP/PP/CP/DP groups.
- ``build_model``: the VLM for this rank's PP stage and TP shard, its recompute mode, on the device, in
  the training dtype.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from pretrain.trainer.config import MODES


COLLECTIVES = ("nccl", "gloo", "host")
CHOSEN: dict = {}       # this process's collectives path and why (setup_distributed; stage.json, the log)


def device_uuid(index: int | None = None) -> str:
    """The UUID of CUDA device ``index`` (None: the current one): what names a GPU whatever a process's
    ``CUDA_VISIBLE_DEVICES`` or Slurm's binding calls it (device 0 of every task bound to one GPU is another
    card in each)."""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).uuid)


def device_uuids(store, rank: int, world: int, uuid: str) -> list[str]:
    """Every rank's device UUID, in rank order: each rank publishes its own on the rendezvous ``store`` and
    waits for the others' (keys under ``ovpipe/device/<restart>/``, so a restarted torchrun job reading its
    agent's store never sees the previous attempt's)."""
    from datetime import timedelta

    prefix = f"ovpipe/device/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    store.set(f"{prefix}{rank}", uuid)
    keys = [f"{prefix}{r}" for r in range(world)]
    store.wait(keys, timedelta(seconds=600))
    return [store.get(k).decode() for k in keys]


def collectives_path(cuda: bool, store=None, rank: int = 0, world: int = 1, uuid: str | None = None):
    """``(path, why)``: how this process's collectives travel — ``nccl`` (each rank its own GPU), ``gloo``
    (CPU), or ``host`` (gloo, staged through host memory: ``pretrain.trainer.host_collectives``) — and the
    reason, for the stage's log and ``stage.json``.

    On CUDA the ranks exchange their device UUIDs (``uuid``: this rank's, ``device_uuid``) over the rendezvous
    ``store`` and choose ``host`` where two of them hold the same card (NCCL refuses two ranks on one device),
    else ``nccl``. Every rank sees the same list, so every rank chooses alike; the count of devices a process
    sees plays no part (a site that binds one GPU per task shows each process one device, on a node of eight
    separate cards). ``OVPIPE_COLLECTIVES`` overrides: ``host`` also on a CPU machine (it stages CPU tensors,
    to test the staging), ``nccl`` refused where ranks share a card."""
    asked = os.environ.get("OVPIPE_COLLECTIVES", "")
    if asked and asked not in COLLECTIVES:
        raise ValueError(f"OVPIPE_COLLECTIVES must be one of {COLLECTIVES} (or unset), got {asked!r}")
    if not cuda:
        if asked == "nccl":
            raise ValueError("OVPIPE_COLLECTIVES=nccl needs CUDA, which this machine lacks")
        return ("host", "OVPIPE_COLLECTIVES=host (CPU tensors staged too)") if asked == "host" \
            else ("gloo", "no CUDA device")
    if asked in ("host", "gloo"):
        return asked, f"OVPIPE_COLLECTIVES={asked}"
    uuids = device_uuids(store, rank, world, uuid) if world > 1 else [uuid]
    cards = len(set(uuids))
    if cards < world:
        if asked == "nccl":
            raise ValueError(f"OVPIPE_COLLECTIVES=nccl: {world} ranks share {cards} GPU(s) (by device UUID), and "
                             "NCCL refuses two ranks on one device")
        return "host", f"{world} ranks share {cards} GPU(s) (by device UUID): NCCL refuses two ranks on one device"
    return "nccl", f"each of the {world} rank(s) has a GPU of its own (by device UUID)"


def setup_distributed(tp: int = 1, pp: int = 1, cp: int = 1) -> dict:
    """Process group (nccl on GPU, gloo on CPU, gloo staged through the host where ranks share a GPU:
    ``collectives_path``, decided over the rendezvous store before the group exists, recorded in ``CHOSEN``)
    and megatron's TP/PP/CP/DP groups; returns the sizes."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if not cuda:
        from pretrain.trainer.cpu_compat import apply

        apply()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        uuid = device_uuid() if cuda else None
        if "RANK" in os.environ:                  # torchrun / srun: its rendezvous variables
            # the store init_process_group would make from them, made here so the ranks can compare devices
            store, rank, world = next(dist.rendezvous("env://"))
            path, why = collectives_path(cuda, store, rank, world, uuid)
            init = {"store": dist.PrefixStore("default_pg", store), "rank": rank, "world_size": world}
        else:                                     # one process on its own: a private loopback store
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            path, why = collectives_path(cuda, uuid=uuid)
            init = {"init_method": f"tcp://127.0.0.1:{port}", "rank": 0, "world_size": 1}
        if path == "host":
            from pretrain.trainer import host_collectives

            host_collectives.apply(stage_host=not cuda)
        CHOSEN.update(path=path, why=why)
        dist.init_process_group("nccl" if path == "nccl" else "gloo", **init)
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     context_parallel_size=cp)
    sizes = {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
             "cp": ps.get_context_parallel_world_size(), "dp": ps.get_data_parallel_world_size()}
    if (sizes["tp"], sizes["pp"], sizes["cp"]) != (tp, pp, cp):
        raise RuntimeError(f"megatron's parallel state is already set up as {sizes}, not tp={tp} pp={pp} cp={cp}")
    return sizes


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def image_pad_id(run_dir: Path, tokenizer: str | None) -> int:
    """The ``<|image_pad|>`` id of the stage's tokenizer, read from its folder (``llava_ov.tokens``): the one
    fact of the tokenizer the model needs."""
    from llava_ov.tokens import image_pad_id as read

    return read(tokenizer or str(Path(run_dir) / "tokenizer"))


def param_count(model) -> int:
    """Parameters of the whole model (all TP/PP ranks), each counted once."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    n = sum(p.numel() for p in model.parameters()
            if getattr(p, "tensor_model_parallel", False) or tp_rank == 0)
    t = torch.tensor([float(n)], device=device())
    if dist.is_initialized():
        dist.all_reduce(t, group=ps.get_model_parallel_group())
    return int(t.item())


def recompute_overrides(recompute: str) -> dict:
    """``TransformerConfig`` fields of a recompute mode: ``full`` — every LLM layer's activations
    rebuilt in backward (and every tower layer's); ``selective`` — the core attention and the MLP
    (the widest activations: 2 × 9,728 per token in the 4B) of each layer, in the tower each MLP;
    ``mlp`` — the MLPs only (with flash attention the core attention keeps little beyond its inputs, which
    its checkpoint would keep anyway, so rerunning it costs time and saves almost no memory); ``none`` —
    everything kept."""
    if recompute not in MODES:     # auto is resolved before the model is built (pretrain.trainer.memory)
        raise ValueError(f"recompute must be one of {MODES}, got {recompute!r}")
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]}
    if recompute == "mlp":
        return {"recompute_granularity": "selective", "recompute_modules": ["mlp"]}
    return {}


def build_model(cfg, sizes: dict, dtype: torch.dtype):
    """The VLM for this rank (its PP stage, TP shard) under the resolved ``TrainConfig`` ``cfg``, on the
    device, in the training dtype, with its kernels (``pretrain.model.fused``: ``cfg.kernels`` process-wide,
    megatron's fused SwiGLU in the config)."""
    from pretrain.model import fused
    from pretrain.model.vlm import VLM
    from pretrain.recipes import RECIPES, pipeline_overrides

    recipe, recompute, kernels = cfg.recipe, cfg.recompute, cfg.kernels

    cuda = torch.cuda.is_available()
    fused.set_kernels(kernels)
    overrides = {"pipeline_model_parallel_size": sizes["pp"], "context_parallel_size": sizes["cp"],
                 "calculate_per_token_loss": True, "variable_seq_lengths": sizes["pp"] > 1}
    if sizes["pp"] > 1:   # packed micro-batches differ in length; megatron's config check asks for this dispatcher
        overrides["moe_token_dispatcher_type"] = "alltoall"
    overrides.update(pipeline_overrides(RECIPES[recipe].llm.num_layers, sizes["pp"]))
    overrides.update(recompute_overrides(recompute))
    if kernels == "fused" and cuda:
        overrides["bias_activation_fusion"] = True        # megatron's fused SwiGLU (torch.compile'd)
    model = VLM(RECIPES[recipe], image_pad_id(cfg.run_dir, cfg.tokenizer), tp=sizes["tp"],
                backend="auto" if cuda else "sdpa", sequence_parallel=cfg.sequence_parallel, dtype=dtype, **overrides)
    if getattr(model, "vision", None) is not None:
        from pretrain.trainer.config import vision_recompute_of

        # the tower's activations too, not only the LLM's
        model.vision.recompute = cfg.vision_recompute or vision_recompute_of(recompute)
    model.set_loss_kernel(cfg.loss_kernel)
    if cuda:
        model.cuda()
    model = model.to(dtype)
    if cfg.precision in ("fp8-tensorwise", "fp8-rowwise"):       # the LLM's trained linears (pretrain.model.float8)
        from pretrain.model import float8

        float8.convert(model.llm, cfg.precision)
    return model
