"""How a rank's collectives travel (``pretrain.trainer.build.collectives_path``): decided from the device UUIDs
the ranks exchange over a real rendezvous store, never from how many devices a process sees. Threads stand in
for the ranks of a node; each claims the device identity a test gives it."""
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pretrain.trainer import build


def _ranks(uuids: list[str], monkeypatch) -> list:
    """``collectives_path`` on every rank at once, rank r on the card named ``uuids[r]`` (read through
    ``device_uuid``, as ``setup_distributed`` reads it); each rank's result, or the error it raised."""
    world = len(uuids)
    mine = threading.local()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)            # one visible device per task
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: type("Props", (), {"uuid": f"GPU-{uuids[mine.rank]}"})())
    master = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timedelta(seconds=30),
                           wait_for_workers=False)
    out = [None] * world

    def rank(r):
        mine.rank = r
        store = master if r == 0 else dist.TCPStore("127.0.0.1", master.port, world, is_master=False,
                                                    timeout=timedelta(seconds=30))
        try:
            out[r] = build.collectives_path(True, store, r, world, build.device_uuid())
        except ValueError as e:
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_one_gpu_per_task_is_nccl_whatever_each_process_sees(monkeypatch):
    """Four tasks bound to a GPU each (every process sees one device, LOCAL_WORLD_SIZE is 4): four cards, NCCL."""
    monkeypatch.delenv("OVPIPE_COLLECTIVES", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    got = _ranks(["a", "b", "c", "d"], monkeypatch)
    assert [p for p, _ in got] == ["nccl"] * 4
    assert "4 rank(s) has a GPU of its own" in got[0][1]


def test_ranks_sharing_a_card_all_stage_through_the_host(monkeypatch):
    """Four ranks on three cards, two of them on one: every rank, those alone on a card too, chooses
    the host path, so the world agrees on one backend."""
    monkeypatch.delenv("OVPIPE_COLLECTIVES", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")         # a count that would have said "nccl"
    got = _ranks(["a", "a", "b", "c"], monkeypatch)
    assert [p for p, _ in got] == ["host"] * 4
    assert "4 ranks share 3 GPU(s)" in got[3][1]


def test_nccl_asked_for_ranks_on_one_card_is_refused_on_every_rank(monkeypatch):
    monkeypatch.setenv("OVPIPE_COLLECTIVES", "nccl")
    got = _ranks(["a", "a"], monkeypatch)
    assert all(isinstance(e, ValueError) and "NCCL refuses two ranks on one device" in str(e) for e in got)


def test_cpu_and_the_override(monkeypatch):
    monkeypatch.delenv("OVPIPE_COLLECTIVES", raising=False)
    assert build.collectives_path(False)[0] == "gloo"
    monkeypatch.setenv("OVPIPE_COLLECTIVES", "host")
    assert build.collectives_path(False)[0] == "host"
    monkeypatch.setenv("OVPIPE_COLLECTIVES", "mpi")
    with pytest.raises(ValueError, match="OVPIPE_COLLECTIVES must be one of"):
        build.collectives_path(False)
