"""CPU accommodations for megatron-core — the one place that says what is replaced on a CPU, and why.

**Scope.** ``apply()`` is called by ``pretrain.trainer.build.setup_distributed`` only in a process that has no
CUDA device (``torch.cuda.is_available()`` is False), and refuses to run in one that has: a GPU run never
sees any of it, and its kernels, streams, RNG and optimizer are megatron's own. Within a CPU process it holds
until the process ends (megatron keeps references to the RNG tracker and the clip function it was given, so
undoing the patches mid-process would leave half a CPU setup behind).

megatron-core assumes CUDA in a few places that a CPU run (this machine, CI, laptops) reaches:

1. ``torch.cuda.current_device()`` is passed as ``device=`` in rotary embeddings, linear layers and
   attention buffers. With no GPU we make it return ``torch.device("cpu")``.
2. The model-parallel RNG tracker (``get_cuda_rng_tracker().fork()``, around weight init and
   dropout) saves/restores CUDA RNG states. We install a tracker with the same interface that forks
   the CPU generator instead (``torch.random.fork_rng``), seeded per name like megatron's.

3. ``dist_checkpointing``'s filesystem writer calls ``torch.cuda.synchronize()`` before staging
   tensors (``filesystem_async.preload_tensors``). Without a GPU there is nothing to wait for: a no-op.
4. The pipeline schedules (``total_num_tokens = torch.zeros(..., device="cuda")``), the optimizer
   (``_scale``, ``found_inf``) and the grad-norm code create small tensors with a literal
   ``device="cuda"``, and the tied output layer of the last pipeline stage is moved with
   ``weight.data.cuda()`` before its first all-reduce. A ``TorchFunctionMode`` (``CUDAToCPU``)
   rewrites that keyword to the CPU for factory calls and makes ``.cuda()`` a no-op; it is entered
   once, for the process, by ``apply()``.
5. The DDP grad buffers ask ``torch.cuda.current_stream()`` for a stream to wait on (CUDA-graph
   replay events): a stream object whose waits are no-ops.
6. ``clip_grad_by_total_norm_fp32`` asserts ``grad.type() == "torch.cuda.FloatTensor"`` before
   scaling; the CPU replacement does the same scaling (``max_norm / (norm + 1e-6)`` when below 1)
   with ``torch._foreach_mul_``. The norm itself is still megatron's (reduced over the model-
   parallel groups).

7. megatron's optimizers sort the parameters by ``param.type()`` and accept only the CUDA names
   (``torch.cuda.FloatTensor``, ``torch.cuda.BFloat16Tensor``): the distributed optimizer as it builds
   its shards, the mixed-precision optimizer as it builds its fp32 copies. ``tensor.type()`` with no
   argument answers with the CUDA name of the tensor's dtype (the same ``CUDAToCPU`` mode); a
   conversion (``tensor.type(torch.float16)``) is untouched. Nothing else in megatron-core asks.

With these, megatron-core's own DDP, optimizers (the distributed optimizer with its overlapped
parameter all-gather, as on a GPU; bf16 with fp32 main weights) and 1F1B pipeline schedule run on
gloo, so PP/DP/CP parity is tested on the CPU with the production optimizer. ``apply()`` is
idempotent and refuses to run when CUDA is available, so the GPU path is never patched.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False


class CPURNGTracker:
    """Drop-in for megatron's CudaRNGStatesTracker on the CPU generator."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    def reset(self) -> None:
        self.states, self.seeds = {}, set()

    def get_states(self):
        return dict(self.states)

    def set_states(self, states) -> None:
        self.states = dict(states)

    def is_initialized(self) -> bool:
        return bool(self.states)

    def add(self, name: str, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.states[name] = g.get_state()
        self.seeds.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states:
            self.add(name, 1234 + len(self.states))
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.states[name])
            try:
                yield
            finally:
                self.states[name] = torch.get_rng_state()


class CUDAToCPU(TorchFunctionMode):
    """Factory calls with ``device="cuda"`` (or ``cuda:N``) get the CPU instead, and
    ``tensor.cuda()`` is the tensor itself (4); ``tensor.type()`` names the CUDA type of its dtype (7)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:      # (7)
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        d = kwargs.get("device")
        if d is not None and (d == "cuda" or (isinstance(d, str) and d.startswith("cuda:"))
                              or (isinstance(d, torch.device) and d.type == "cuda")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


class _NoStream:
    """(5) ``torch.cuda.current_stream()`` stand-in: nothing runs asynchronously on a CPU."""

    def wait_event(self, *_a) -> None:
        pass

    def wait_stream(self, *_a) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _clip_grads_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """(6) megatron's fp32 clip without its CUDA type assertion."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    coeff = max_norm / (float(total_norm) + 1.0e-6)
    if grads and coeff < 1.0:
        torch._foreach_mul_(grads, coeff)


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("pretrain.trainer.cpu_compat is for machines without CUDA; the GPU path is never patched")
    torch.cuda.current_device = lambda: torch.device("cpu")  # (1)
    from megatron.core.tensor_parallel import random as mc_random

    tracker = CPURNGTracker()
    mc_random._CUDA_RNG_STATE_TRACKER = tracker                # (2)
    mc_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mc_random.get_cuda_rng_tracker = lambda *a, **k: tracker
    import megatron.core.tensor_parallel as tp

    tp.get_cuda_rng_tracker = mc_random.get_cuda_rng_tracker
    for mod in ("megatron.core.tensor_parallel.layers", "megatron.core.transformer.transformer_block",
                "megatron.core.transformer.attention", "megatron.core.transformer.transformer_layer"):
        m = __import__(mod, fromlist=["x"])
        if hasattr(m, "get_cuda_rng_tracker"):
            m.get_cuda_rng_tracker = mc_random.get_cuda_rng_tracker
    torch.cuda.synchronize = lambda *a, **k: None               # (3)
    CUDAToCPU().__enter__()                                     # (4), for the whole process
    torch.cuda.current_stream = lambda *a, **k: _NoStream()     # (5)
    from megatron.core.optimizer import optimizer as mc_optimizer

    mc_optimizer.clip_grad_by_total_norm_fp32 = _clip_grads_cpu  # (6)
    _APPLIED = True
