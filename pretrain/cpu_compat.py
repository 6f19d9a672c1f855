"""CPU accommodations for megatron-core — used only when no CUDA device exists, never on GPU.

megatron-core assumes CUDA in a few places that a CPU run (this machine, CI, laptops) reaches:

1. ``torch.cuda.current_device()`` is passed as ``device=`` in rotary embeddings, linear layers and
   attention buffers. With no GPU we make it return ``torch.device("cpu")``.
2. The model-parallel RNG tracker (``get_cuda_rng_tracker().fork()``, around weight init and
   dropout) saves/restores CUDA RNG states. We install a tracker with the same interface that forks
   the CPU generator instead (``torch.random.fork_rng``), seeded per name like megatron's.

3. ``dist_checkpointing``'s filesystem writer calls ``torch.cuda.synchronize()`` before staging
   tensors (``filesystem_async.preload_tensors``). Without a GPU there is nothing to wait for: a no-op.

``apply()`` is idempotent and refuses to run when CUDA is available, so the GPU path is never
patched. Pipeline schedules have further CUDA assumptions; they
are not used on the CPU path.
"""
from __future__ import annotations

import contextlib

import torch

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


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("pretrain.cpu_compat is for machines without CUDA; the GPU path is never patched")
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
    _APPLIED = True
