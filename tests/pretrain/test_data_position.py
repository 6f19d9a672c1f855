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


def _balanced_pack_step(run: Path, n: int, dp: int, ga: int) -> None:
    """A pack step of ``n`` one-sample text packs (pack ``i`` is ``i + 1`` tokens long), written as `pack`
    writes it — shards in pack_id order, its config (balanced for DP ``dp`` × ``ga`` micro-batches) and
    executor record — and no manifest (the loader then counts the shards' entries)."""
    import dataclasses
    import json

    import numpy as np

    from ovpipe.config import load_config
    from packing.pack import PackConfig
    from packing.shards import write_shard

    d = run / "pack"
    (d / "data").mkdir(parents=True)
    cfg = load_config(PackConfig, {"balance_dp": dp, "balance_grad_accum": ga})
    (d / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    (d / "executor.json").write_text(json.dumps({"step": "pack"}))
    entries = [{"pack_id": i, "sample_ids": [f"{i:016x}"], "lengths": [i + 1], "offsets": [0], "seq_len": 64,
                "ids": np.arange(i + 1), "mask": np.ones(i + 1), "images": [], "exts": [], "grids": [],
                "image_counts": [0]} for i in range(n)]
    for j in range(0, n, 8):
        write_shard(d / "data" / f"pack-{j // 8:06d}.tar", entries[j:j + 8])


def test_every_epoch_reads_whole_balanced_groups_and_a_resume_in_epoch_2_is_exact(tmp_path):
    """ovpipe issue 67: packs balanced for DP 3 × 2 (groups of G = 6), n = 23 (n mod G = 5). Every step of epochs
    1–3 of the loader's stream is one whole group of pack_id order, or a carried group of the
    5 leftover packs — the old stream, pack_id order replayed, made epoch 2's first step packs 18–22 and 0. A
    resume in the middle of epoch 2 gives each rank exactly the micro-batches the uninterrupted run read next."""
    from packing.compute_balance import epoch_start, stream_packs
    from pretrain.data import iter_batches

    n, G, dp = 23, 6, 3
    _balanced_pack_step(tmp_path, n, dp, 2)

    def read(start_pack=0, rank=0, world=1):
        return [b.pack_ids[0] for b in iter_batches(tmp_path, "pack", 1, epochs=3, rank=rank, world=world,
                                                    start_pack=start_pack)]

    stream = read()
    assert stream == stream_packs(n, G, 0, len(stream)).tolist()
    assert len(stream) == int(epoch_start(3, n, G)) * G
    for s in range(len(stream) // G):
        step = stream[s * G:(s + 1) * G]
        assert step == list(range(step[0], step[0] + G)) and step[0] % G == 0 or min(step) >= n // G * G, (s, step)
    epoch2 = int(epoch_start(1, n, G)) * G
    assert stream[epoch2:epoch2 + G] == [0, 1, 2, 3, 4, 5]
    assert sorted(stream[:int(epoch_start(2, n, G)) * G]) == sorted([*range(18), *range(18), *[18, 19, 20, 21, 22, 18]])
    start = epoch2 + 2 * G                                       # killed after epoch 2's second step
    assert [read(start, r, dp) for r in range(dp)] == [stream[start + r::dp] for r in range(dp)]
