"""One rank of a stage-1.5 run of the tiny recipe whose collectives are counted (``test_comm_bytes.py``).

Every collective and point-to-point call of ``torch.distributed`` — in its namespace, in ``distributed_c10d``
and under the names megatron-core binds at import (``param_and_grad_buffer.dist_all_gather_func``, …) — is
wrapped to record the bytes of the whole tensor handed to it (an all-gather's or reduce-scatter's unsharded
buffer, an all-reduce's tensor, a send's or receive's tensor) and its process group. After the run the calls
of each optimizer step are sorted by megatron's groups into the plan's kinds (``pretrain.plan.comm_bytes``):
``tp``, ``cp``, ``pp`` (point-to-point and the embedding group), ``dp_grad`` (reduce-scatter / all-reduce
over a data-parallel group), ``dp_param`` (all-gather over one). Calls of at most 8 elements (the loss and
token counts, the gradient norm, the step's metrics, the pipeline's shape messages) are scalars, as the plan
leaves them out.

    torchrun --nproc-per-node N comm_count_child.py RUN OUT.json [--tp 2] [--cp 2] [--pp 2] [--sequence-parallel]

Writes ``OUT.json.<rank>``: per step, the bytes by kind, the micro-batch's token count, the rank's
coordinates, the sum of its parameters before and after the checkpoint save that follows the steps, and its
DDP buffers' size against its trained parameters' (megatron pads each parameter's start and each bucket; the
plan counts parameters)."""
import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

CALLS: list = []          # (op, group, bytes, elements) of every call since the last step boundary
INSIDE: list = []         # the counted call under way (a collective never nests in another)

# op: (the argument holding the whole tensor, its position)
WHOLE = {"all_reduce": ("tensor", 0), "broadcast": ("tensor", 0), "reduce": ("tensor", 0),
         "all_gather": ("tensor_list", 0), "all_gather_into_tensor": ("output_tensor", 0),
         "_all_gather_base": ("output_tensor", 0), "reduce_scatter_tensor": ("input", 1),
         "_reduce_scatter_base": ("input", 1), "all_to_all_single": ("input", 1),
         "send": ("tensor", 0), "recv": ("tensor", 0), "isend": ("tensor", 0), "irecv": ("tensor", 0)}
P2P = ("send", "recv", "isend", "irecv")


def _counted(name, orig):
    import inspect

    sig = inspect.signature(orig)

    def run(*args, **kwargs):
        if INSIDE:       # the same call again: torch dispatches all_reduce through the CPU's TorchFunctionMode
            return orig(*args, **kwargs)          # (cpu_compat), which calls the module's name, this wrapper
        a = sig.bind(*args, **kwargs).arguments
        t = a[WHOLE[name][0]]
        ts = t if isinstance(t, (list, tuple)) else [t]
        CALLS.append((name, a.get("group"), sum(x.numel() * x.element_size() for x in ts),
                      sum(x.numel() for x in ts)))
        INSIDE.append(name)
        try:
            return orig(*args, **kwargs)
        finally:
            INSIDE.pop()

    run.__name__ = run.__qualname__ = name
    return run


def wrap() -> None:
    """The counting wrappers in place of the originals wherever a module already holds them (as
    ``host_collectives.apply`` sweeps for its staged ones)."""
    import megatron.core.distributed.param_and_grad_buffer  # noqa: F401  (they bind names at import)
    import megatron.core.tensor_parallel.mappings  # noqa: F401

    orig = {n: getattr(c10d, n) for n in WHOLE if hasattr(c10d, n)}
    wrappers = {n: _counted(n, f) for n, f in orig.items()}
    by_id = {id(f): n for n, f in orig.items()}
    for mod in list(sys.modules.values()):
        name = getattr(mod, "__name__", "")
        if not (name in ("torch.distributed", c10d.__name__) or name.startswith(("megatron.", "pretrain."))):
            continue
        for attr, val in list(vars(mod).items()):
            hit = by_id.get(id(val))
            if hit is not None and val is orig[hit]:
                setattr(mod, attr, wrappers[hit])


def kinds(calls) -> dict:
    """The calls of one step summed by the plan's kinds (and ``scalar`` / ``local`` (a group of one) / ``other``
    for what it leaves out), and how many calls of each kind, op and size (what a mismatch is read from)."""
    from megatron.core import parallel_state as ps

    groups = {}
    for kind, gs in (("dp", [ps.get_data_parallel_group(), ps.get_data_parallel_group(with_context_parallel=True),
                             ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)]),
                     ("pp", [ps.get_pipeline_model_parallel_group(), ps.get_embedding_group()]),
                     ("cp", [ps.get_context_parallel_group()]),
                     ("tp", [ps.get_tensor_model_parallel_group()])):
        for g in gs:
            groups.setdefault(id(g), kind)
    out = {k: 0 for k in ("tp", "cp", "pp", "dp_grad", "dp_param", "scalar", "local", "other")}
    detail = {}
    for op, group, nbytes, numel in calls:
        if numel <= 8:
            kind = "scalar"
        elif op in P2P:
            kind = "pp"
        elif dist.get_world_size(group) == 1:
            kind = "local"          # a group of one moves nothing (megatron calls some collectives anyway)
        else:
            kind = groups.get(id(group), "other")
            if kind == "dp":
                kind = "dp_param" if op.startswith(("all_gather", "_all_gather")) else "dp_grad"
        out[kind] += nbytes
        key = f"{kind} {op} {nbytes}"
        detail[key] = detail.get(key, 0) + 1
    return out, detail


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--steps", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(1)
    wrap()
    from megatron.core import parallel_state as ps

    from pretrain.trainer.config import TrainConfig
    from pretrain.trainer.loop import Trainer

    cfg = TrainConfig(run_dir=Path(a.run_dir), stage="1.5", steps=a.steps, micro_batch=1, grad_accum=1, lr=1e-3,
                      tp=a.tp, cp=a.cp, pp=a.pp, sequence_parallel=a.sequence_parallel, bf16=False,
                      init="scratch", save_every=0)
    trainer = Trainer(cfg, log=lambda *_: None)
    tokens, steps = [], []
    batches = trainer.batches

    def seen():
        for b in batches:
            tokens.append(int(b.tokens.shape[1]))
            yield b

    trainer.batches = seen()
    step = trainer.train_step

    def counted_step(i):
        CALLS.clear()
        rec = step(i)
        counted, detail = kinds(CALLS)
        steps.append({"bytes": counted, "calls": detail, "tokens": tokens[-cfg.grad_accum:]})
        return rec

    def total():
        return float(sum(p.detach().double().sum() for p in trainer.model.parameters()))

    try:                     # the steps alone: a save's collectives (the last step's gather) are no step's
        for i in range(trainer.start, trainer.steps):
            counted_step(i)
        # what a save finds: each replica's parameters before it (the other ranks' shards still waiting for the
        # next forward's all-gather) and after it (gathered for the save)
        before = total()
        trainer._save(trainer.steps)
        after = total()
    finally:
        trainer.close()
    rank = dist.get_rank()
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    buffered = sum(b.grad_data.numel() for b in trainer.ddp.buffers)
    coords = {"params_before_save": before, "params_after_save": after, "trained_elems": trained,
              "buffer_elems": buffered, "tp": a.tp, "cp": a.cp, "pp": a.pp, "dp": trainer.sizes["dp"], "sp": a.sequence_parallel,
              "pp_rank": ps.get_pipeline_model_parallel_rank(), "ddp": {
                  k: getattr(trainer.ddp.ddp_config, k) for k in ("grad_reduce_in_fp32", "use_distributed_optimizer",
                                                                  "overlap_param_gather")}}
    Path(f"{a.out}.{rank}").write_text(json.dumps({"steps": steps, **coords}))
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
