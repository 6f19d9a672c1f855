"""An exact data position on resume: the loader's state (packs consumed) is saved with the
checkpoint, and a resumed run consumes exactly the packs the uninterrupted run consumed next."""
import shutil
from pathlib import Path


def _ids(run, **kw):
    from pretrain.train import train
    from pretrain.trainer.config import TrainConfig

    seen = {}
    train(TrainConfig(run_dir=run, recipe="tiny", stage="1.5", lr=3e-3, **kw), log=lambda *_: None,
          on_step=lambda rec, ddp: seen.__setitem__(rec["step"], rec["pack_ids"]))
    return seen


def test_resume_continues_at_the_exact_pack(megatron_single, packed_demo, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(packed_demo, a)
    shutil.copytree(packed_demo, b)
    full = _ids(a, steps=7, micro_batch=2)
    first = _ids(b, steps=7, micro_batch=2, stop_after=3)                       # killed after step 3
    from pretrain.trainer import checkpoint

    root = b / "pretrain" / "stage-1.5" / "dist_ckpt"
    assert checkpoint.step_of(root) == 3
    assert checkpoint.data_state(root) == {"step": "pack", "packs_consumed": 6}
    rest = _ids(b, steps=7, micro_batch=2)
    assert sorted(rest) == [4, 5, 6, 7]
    assert {**first, **rest} == full                                            # steps 1..3 and 4..7
    assert len({i for ids in full.values() for i in ids}) > 1


def test_loader_workers_keep_the_stream_order(packed_demo):
    """Micro-batches come out in stream order whatever the number of worker processes, and
    ``start_pack`` starts the stream at that pack."""
    from pretrain.data import loader

    def ids(workers, start_pack=0, n=6):
        it = iter(loader(packed_demo, "pack", 2, start_pack=start_pack, workers=workers))
        return [next(it).pack_ids for _ in range(n)]

    base = ids(0)
    assert ids(2) == base
    # the workers are forks of a server that imported torch once (pretrain.data.WORKER_PRELOAD), not fresh
    # interpreters that each import it again: the server maps torch's library
    from multiprocessing import forkserver

    server = forkserver._forkserver._forkserver_pid
    assert server and "libtorch_cpu" in Path(f"/proc/{server}/maps").read_text()
    flat = [i for x in base for i in x]
    assert [i for x in ids(0, start_pack=3, n=3) for i in x] == flat[3:9]
