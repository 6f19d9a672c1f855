"""Collectives staged through host memory (``pretrain.trainer.host_collectives``), the path that lets several
ranks share one CUDA card over gloo. On this CPU machine ``stage_host=True`` stages CPU tensors as copies, so
every wrapper (copies in and out, deferred receives, coalescing, AVG) runs here; each result must equal what
the collective means, and the counter must show the host copies happened."""
import multiprocessing as mp
import os
import socket
import sys

import pytest


def _worker(rank: int, port: int, q) -> None:
    try:
        os.environ.update(OMP_NUM_THREADS="1")
        import torch
        import torch.distributed as dist

        from pretrain.trainer import host_collectives as hc

        hc.apply(stage_host=True)
        import megatron.core.distributed.param_and_grad_buffer as pgb
        import megatron.core.tensor_parallel.mappings as mappings

        # the names megatron bound at import now reach the staged functions
        assert pgb.dist_all_gather_func is hc._WRAPPERS["all_gather_into_tensor"]
        assert pgb.dist_reduce_scatter_func is hc._WRAPPERS["reduce_scatter_tensor"]
        assert pgb._coalescing_manager is hc._coalescing_manager
        assert mappings.dist_all_gather_func is hc._WRAPPERS["all_gather_into_tensor"]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        r = float(rank)
        out = {}

        t = torch.tensor([1.0 + r, 10.0])
        dist.all_reduce(t)
        out["all_reduce"] = t.tolist()
        t = torch.tensor([1.0 + r, 10.0])
        h = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
        h.wait()
        out["all_reduce_avg"] = t.tolist()
        # an integer AVG is the sum divided with truncation toward zero (NCCL's integer ncclAvg); a bool one is refused
        t = torch.tensor([3 + rank, -3 - rank], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        out["all_reduce_avg_int"] = (t.tolist(), str(t.dtype))
        try:
            dist.all_reduce(torch.tensor([True]), op=dist.ReduceOp.AVG)
            out["avg_bool"] = "ran"
        except ValueError as e:
            out["avg_bool"] = str(e)
        t = torch.tensor([5.0 + r])
        dist.broadcast(t, src=1)
        out["broadcast"] = t.tolist()
        t = torch.tensor([2.0 + r])
        dist.reduce(t, dst=0)
        out["reduce_on_0"] = t.tolist() if rank == 0 else None
        lst = [torch.zeros(2) for _ in range(2)]
        dist.all_gather(lst, torch.tensor([r, r + 0.5]))
        out["all_gather"] = [x.tolist() for x in lst]
        big = torch.zeros(4)
        torch.distributed.all_gather_into_tensor(big, torch.tensor([r, r + 0.5]))
        out["all_gather_into_tensor"] = big.tolist()
        small = torch.zeros(2)
        dist.reduce_scatter_tensor(small, torch.arange(4, dtype=torch.float32) * (1 + r))
        out["reduce_scatter_tensor"] = small.tolist()
        small = torch.zeros(2)
        dist.reduce_scatter_tensor(small, torch.arange(4, dtype=torch.float32) * (1 + r), op=dist.ReduceOp.AVG)
        out["reduce_scatter_avg"] = small.tolist()
        a2a = torch.zeros(2)
        dist.all_to_all_single(a2a, torch.tensor([10 * r, 10 * r + 1]))
        out["all_to_all_single"] = a2a.tolist()
        # megatron's DDP: bucket collectives issued async inside the coalescing manager, waited on its handle
        bufs = [torch.full((3,), 1.0 + r), torch.full((2,), 2.0 * (1 + r))]
        shards = [torch.zeros(3), torch.zeros(1)]
        with pgb._coalescing_manager(None, async_ops=True) as cm:
            pgb.dist_reduce_scatter_func(shards[1], bufs[1], async_op=True)
            dist.all_reduce(bufs[0], async_op=True)
        cm.wait()
        out["coalesced"] = [bufs[0].tolist(), shards[1].tolist()]
        # pipeline point-to-point: megatron's batch_isend_irecv of P2POps, and plain isend / irecv
        peer = 1 - rank
        got = torch.zeros(2, requires_grad=True)        # as megatron's receive buffers are
        ops = [dist.P2POp(dist.irecv, got, peer), dist.P2POp(dist.isend, torch.tensor([r, 7.0]), peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        out["batch_p2p"] = got.detach().tolist()
        got = torch.zeros(1)
        if rank == 0:
            dist.isend(torch.tensor([42.0]), 1).wait()
            dist.recv(got, 1)
        else:
            w = dist.irecv(got, 0)
            w.wait()
            dist.send(got + 1, 0)
        out["send_recv"] = got.tolist()
        out["staged_calls"] = hc.STAGED["calls"]
        out["describe"] = hc.describe()
        dist.destroy_process_group()
        q.put((rank, out))
    except BaseException as e:                                  # the parent reports it
        import traceback

        q.put((rank, {"error": "".join(traceback.format_exception(e))}))


@pytest.mark.skipif(sys.platform != "linux", reason="gloo on loopback")
def test_every_staged_collective_means_what_it_says():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for r in (0, 1):
        assert "error" not in res[r], res[r]["error"]
    for r in (0, 1):
        o = res[r]
        assert o["all_reduce"] == [3.0, 20.0]
        assert o["all_reduce_avg"] == [1.5, 10.0]
        assert o["all_reduce_avg_int"] == ([3, -3], "torch.int64")          # 7 / 2 and -7 / 2, truncated
        assert "bool" in o["avg_bool"]
        assert o["broadcast"] == [6.0]
        assert o["all_gather"] == [[0.0, 0.5], [1.0, 1.5]]
        assert o["all_gather_into_tensor"] == [0.0, 0.5, 1.0, 1.5]
        # sum over ranks of arange(4) * (1 + r) = arange(4) * 3, rank r keeps its half
        assert o["reduce_scatter_tensor"] == [3.0 * (2 * r), 3.0 * (2 * r + 1)]
        assert o["reduce_scatter_avg"] == [1.5 * (2 * r), 1.5 * (2 * r + 1)]
        assert o["all_to_all_single"] == [float(r), 10.0 + r]
        assert o["coalesced"] == [[3.0] * 3, [6.0]]
        assert o["batch_p2p"] == [float(1 - r), 7.0]
        assert o["staged_calls"] > 15                 # every call above went through host copies
        assert "staged through host memory" in o["describe"]
    assert res[0]["reduce_on_0"] == [5.0]
    assert res[1]["send_recv"] == [42.0] and res[0]["send_recv"] == [43.0]

