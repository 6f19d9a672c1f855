"""Many ranks on one CUDA card: every collective over gloo, staged through host memory.

**Why.** NCCL refuses two ranks on one device ("Duplicate GPU detected"), and the machines this project is
lent have one GPU each. To run TP, PP, CP, SP and DP with the distributed optimizer on CUDA there, the
ranks share the card and their process group is gloo. Gloo runs some collectives on CUDA tensors and lacks
others (reduce-scatter, all-gather into one tensor, point-to-point on device memory), so, rather than mix
two paths, **every** collective whose tensors live on a GPU is staged: the tensors are copied to host
memory, gloo runs the collective there, and the results are copied back into the caller's tensors. One
rule, so a test that passes says exactly which path ran (``stage.json``'s ``collectives``).

**What it cannot show about the NCCL path real nodes use** (``setup_distributed`` picks NCCL whenever each
rank has its own GPU, and never patches anything then): overlap of communication with compute (a staged
collective completes before it returns, even when ``async_op=True``; the handle's ``wait()`` then only
delivers a point-to-point receive), NCCL's own algorithms and bandwidth over NVLink or the network, and
memory per rank (the ranks share one card's memory).

**What is replaced**, in the ``torch.distributed`` namespace and in ``distributed_c10d`` (the functions
megatron-core and this trainer call): ``all_reduce``, ``reduce``, ``broadcast``, ``all_gather``,
``all_gather_into_tensor`` / ``_all_gather_base``, ``reduce_scatter_tensor`` / ``_reduce_scatter_base``,
``all_to_all_single``, ``send`` / ``recv`` / ``isend`` / ``irecv`` and ``batch_isend_irecv``; and
``_coalescing_manager``, whose coalesced form would run the batched collective on the host copies after
they had been copied back, so here each collective inside it runs at once (same results, no batching).
Modules already imported that bound one of them to a name of their own (megatron's
``param_and_grad_buffer`` binds ``dist_all_gather_func = torch.distributed.all_gather_into_tensor`` at
import, ``tensor_parallel.mappings`` the same) get the staged function too. ``ReduceOp.AVG``, which gloo
lacks, runs as a sum divided by the group's size; on an integer tensor the division truncates toward zero,
as NCCL's integer ``ncclAvg`` (its ``SumPostDiv``: the sum, then an integer division) does, and a bool tensor
is refused (``ValueError``: an average of truth values has no integer form).

``apply(stage_host=True)`` stages CPU tensors as well — copies of them — so the staging itself (the copies
in and out, deferred receives, coalescing, AVG) is tested on a CPU machine: a layout run that way must
match the unstaged gloo run exactly (``tests/pretrain/test_host_collectives.py``).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

_APPLIED: str | None = None
_ORIG: dict[str, object] = {}
STAGED = {"calls": 0, "bytes": 0}     # counts for the log and the tests: what went through the host


class _Done:
    """The handle of a collective that already completed (``async_op=True`` callers wait on it)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _Received(_Done):
    """An ``irecv`` into a host buffer: ``wait()`` waits for gloo, then copies into the caller's tensor."""

    def __init__(self, work, host: torch.Tensor, dest: torch.Tensor) -> None:
        self.work, self.host, self.dest, self.done = work, host, dest, False

    def wait(self, timeout=None) -> bool:
        if not self.done:
            self.work.wait()
            with torch.no_grad():      # megatron's receive buffers require grad; the copy is data only
                self.dest.copy_(self.host)
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


def _staged(t) -> bool:
    return isinstance(t, torch.Tensor) and (t.device.type != "cpu" or _APPLIED == "host")


def _host(t: torch.Tensor) -> torch.Tensor:
    STAGED["calls"] += 1
    STAGED["bytes"] += t.numel() * t.element_size()
    return t.detach().to("cpu", copy=True)


def _avg(op, group):
    """gloo has no AVG: a SUM, then the result divided by the group's size (the returned divisor, else None)."""
    if op == dist.ReduceOp.AVG:
        return dist.ReduceOp.SUM, dist.get_world_size(group)
    return op, None


def _check_avg(a: dict, tensors: tuple[str, ...]) -> None:
    """AVG of a bool tensor is refused before any rank sends anything (NCCL has no bool average either)."""
    for k in tensors:
        v = a.get(k)
        for t in (v if isinstance(v, (list, tuple)) else [] if v is None else [v]):
            if isinstance(t, torch.Tensor) and t.dtype == torch.bool:
                raise ValueError(f"ReduceOp.AVG of a bool tensor ({k}): reduce with SUM, MAX or MIN instead")


def _collective(name: str, outputs: tuple[str, ...], inputs: tuple[str, ...]):
    """The staged form of collective ``name``: its arguments bound by the original's own signature, every
    staged tensor in ``outputs`` (tensors or lists of them) replaced by a host buffer and copied back after,
    every one in ``inputs`` by a host copy; run to completion (``async_op`` gets a completed handle, so a
    caller inside ``_coalescing_manager`` finds its results there when the manager's handle is waited on)."""
    import inspect

    sig = []          # the original's signature, read once at the first call (the originals exist after apply)

    def run(*args, **kwargs):
        orig = _ORIG[name]
        if not sig:
            sig.append(inspect.signature(orig))
        a = sig[0].bind(*args, **kwargs).arguments
        async_op = a.pop("async_op", False)
        div = None
        if "op" in a:
            a["op"], div = _avg(a["op"], a.get("group"))
            if div:
                _check_avg(a, outputs + inputs)
        back = []

        def stage(t, out):
            if not _staged(t):
                return t
            h = _host(t) if not out or name in ("all_reduce", "reduce", "broadcast") \
                else torch.empty(t.shape, dtype=t.dtype)
            if out:
                back.append((t, h))
            return h

        for k in outputs + inputs:
            v = a.get(k)
            if isinstance(v, (list, tuple)):
                a[k] = [stage(t, k in outputs) for t in v]
            elif v is not None:
                a[k] = stage(v, k in outputs)
        result = orig(**a)
        with torch.no_grad():
            _deliver(a, outputs, div, back)
        return _Done() if async_op else result

    run.__name__ = run.__qualname__ = name
    return run


def _deliver(a: dict, outputs: tuple[str, ...], div, back: list) -> None:
    """AVG's division, then the host results copied into the caller's tensors."""
    if div:
        for k in outputs:
            v = a.get(k)
            for t in (v if isinstance(v, list) else [] if v is None else [v]):
                t.div_(div, rounding_mode=None if t.is_floating_point() or t.is_complex() else "trunc")
    for t, h in back:
        t.copy_(h)


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    # the host copy is taken now, at the post, which is when NCCL may read the buffer too
    t = _host(tensor) if _staged(tensor) else tensor
    return _ORIG["isend"](t, dst=dst, group=group, tag=tag, group_dst=group_dst)


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    if not _staged(tensor):
        return _ORIG["irecv"](tensor, src=src, group=group, tag=tag, group_src=group_src)
    h = torch.empty(tensor.shape, dtype=tensor.dtype)
    return _Received(_ORIG["irecv"](h, src=src, group=group, tag=tag, group_src=group_src), h, tensor)


def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    isend(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst).wait()


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    if not _staged(tensor):
        return _ORIG["recv"](tensor, src=src, group=group, tag=tag, group_src=group_src)
    h = torch.empty(tensor.shape, dtype=tensor.dtype)
    sender = _ORIG["recv"](h, src=src, group=group, tag=tag, group_src=group_src)
    with torch.no_grad():
        tensor.copy_(h)
    return sender


def batch_isend_irecv(p2p_op_list):
    """Each op posted on its own (gloo's send and receive are both non-blocking posts); receives are
    delivered into the caller's tensors at ``wait()``."""
    works = []
    for p in p2p_op_list:
        gp = getattr(p, "group_peer", None)
        if p.op is isend:
            works.append(isend(p.tensor, None if gp is not None else p.peer, p.group, p.tag, group_dst=gp))
        else:
            works.append(irecv(p.tensor, None if gp is not None else p.peer, p.group, p.tag, group_src=gp))
    return works


@contextlib.contextmanager
def _coalescing_manager(group=None, device=None, async_ops=False):
    yield _Done()


_WRAPPERS = {
    "all_reduce": _collective("all_reduce", ("tensor",), ()),
    "reduce": _collective("reduce", ("tensor",), ()),
    "broadcast": _collective("broadcast", ("tensor",), ()),
    "all_gather": _collective("all_gather", ("tensor_list",), ("tensor",)),
    **{n: _collective(n, ("output_tensor", "output"), ("input_tensor", "input"))
       for n in ("all_gather_into_tensor", "_all_gather_base", "reduce_scatter_tensor", "_reduce_scatter_base",
                 "all_to_all_single", "all_gather_single", "reduce_scatter_single") if hasattr(c10d, n)},
    "isend": isend, "irecv": irecv, "send": send, "recv": recv,
    "batch_isend_irecv": batch_isend_irecv, "_coalescing_manager": _coalescing_manager,
}


def apply(stage_host: bool = False) -> None:
    """Stage every collective on GPU tensors through the host (``stage_host``: CPU tensors too, as copies).

    Called by ``setup_distributed`` before the process group exists, when ranks share a card (or
    ``OVPIPE_COLLECTIVES=host``). Idempotent; holds for the process."""
    global _APPLIED
    if _APPLIED:
        return
    import sys

    # megatron's modules that bind a collective to a name of their own at import: loaded now, so the
    # sweep below reaches them (any module imported later binds the staged function itself)
    import megatron.core.distributed.param_and_grad_buffer  # noqa: F401
    import megatron.core.tensor_parallel.mappings  # noqa: F401

    _ORIG.update({name: getattr(c10d, name) for name in _WRAPPERS})
    originals = {id(f): name for name, f in _ORIG.items()}
    for mod in list(sys.modules.values()):
        name = getattr(mod, "__name__", "")
        if not (name == "torch.distributed" or name == c10d.__name__ or name.startswith(("megatron.", "pretrain."))):
            continue
        for attr, val in list(vars(mod).items()):
            hit = originals.get(id(val))
            if hit is not None and val is _ORIG[hit]:
                setattr(mod, attr, _WRAPPERS[hit])
    _APPLIED = "host" if stage_host else "device"


def describe() -> str:
    """The collectives path of this process, as ``stage.json`` records it."""
    if _APPLIED == "host":
        return "gloo, staged through host memory (CPU tensors copied too: the staging tested on a CPU)"
    if _APPLIED == "device":
        return "gloo, staged through host memory (ranks share a GPU)"
    if dist.is_initialized():
        return dist.get_backend()
    return "none (one process)"
