"""lengths + pack on the demo run folder: determinism, copies, shards the loader reads back."""
import json

import numpy as np
import pytest

from manifests import read_manifest
from manifests.io import write_part, write_table
from ovpipe.cli import main


@pytest.fixture(scope="module")
def packed_run(ingested_run, tmp_path_factory):
    import shutil

    run = tmp_path_factory.mktemp("packrun")
    shutil.copytree(ingested_run / "ingest", run / "ingest")
    from packing.tiny_tokenizer import main as build_tok

    assert build_tok(["--out", str(run / "tokenizer"), "--run-dir", str(run)]) == 0
    assert main(["lengths", "--set", f"tokenizer={run / 'tokenizer'}", "--set", "seq_len=1024",
                 "--run-dir", str(run), "--tasks", "2", "--quiet"]) == 0
    assert main(["pack", "--set", "seq_len=1024", "--set", "packs_per_shard=8", "--run-dir", str(run),
                 "--tasks", "2", "--quiet"]) == 0
    return run


def test_lengths_parts_stream_with_write_parts_bytes(packed_run, tmp_path):
    """A lengths slice inside one samples step is written batch by batch (PartWriter), never held whole:
    each part is still exactly the file write_part gives for its rows."""
    from manifests.io import read_part

    parts = sorted((packed_run / "lengths" / "lengths").glob("part-*.parquet"))
    assert len(parts) == 2
    for f in parts:
        again = write_part(read_part(f, "lengths"), tmp_path / f.name, "lengths", sort=True)
        assert again.read_bytes() == f.read_bytes()


def test_lengths_statuses_and_sum(packed_run):
    t = read_manifest(packed_run, "lengths").to_pylist()
    st = {}
    for r in t:
        st[r["status"]] = st.get(r["status"], 0) + 1
    assert st["ok"] == 195 and st["corrupt_image"] == 1 and st["duplicate"] == 1
    for r in t:
        assert r["total_tokens"] == r["text_tokens"] + r["image_tokens"]
        if r["status"] != "ok":
            assert r["total_tokens"] == r["target_tokens"] == 0
        else:  # a caption pair: "<image>Describe the image." → caption + <|im_end|>
            assert 1 < r["target_tokens"] < r["text_tokens"] and r["turns_kept"] == 2


def test_packs_cover_every_sample_once_and_respect_capacity(packed_run):
    lengths = {r["sample_id"]: r["total_tokens"] for r in read_manifest(packed_run, "lengths").to_pylist()
               if r["status"] == "ok"}
    packs = read_manifest(packed_run, "packs").to_pylist()
    seen = [s for p in packs for s in p["sample_ids"]]
    assert sorted(seen) == sorted(lengths)
    assert sum(p["total_tokens"] for p in packs) == sum(lengths.values())
    for p in packs:
        assert p["total_tokens"] <= 1024 and p["total_tokens"] == sum(p["lengths"])
        assert p["lengths"] == [lengths[s] for s in p["sample_ids"]]
        assert p["offsets"] == list(np.cumsum([0] + p["lengths"][:-1]))
    stats = json.loads((packed_run / "pack" / "stats.json").read_text())
    assert stats["counters"]["bins"] == len(packs)
    assert stats["counters"]["bins"] <= stats["counters"]["lower_bound"] + 1
    assert (packed_run / "pack" / "fill_histogram.png").stat().st_size > 1000
    assert "online buffer B=512" in (packed_run / "pack" / "report.md").read_text()


def test_loader_sequence_equals_manifest_for_every_pack(packed_run):
    from packing.shards import iter_packed, packed_shards

    manifest = {p["pack_id"]: p for p in read_manifest(packed_run, "packs").to_pylist()}
    seen = 0
    for shard in packed_shards(packed_run):
        for seq in iter_packed(shard):
            p = manifest[seq.pack_id]
            assert seq.total_tokens == p["total_tokens"]
            assert seq.sample_ids == p["sample_ids"]
            assert seq.cu_seqlens.tolist() == [*p["offsets"], p["total_tokens"]]
            assert (seq.position_ids[seq.cu_seqlens[:-1]] == 0).all()
            assert len(seq.images) == len(seq.sample_ids) == len(seq.image_grids)  # caption pairs: one image each
            assert seq.images_per_sample == [1] * len(seq.sample_ids)
            assert seq.loss_mask.sum() > 0
            # the cost's counts are what the trainer's BatchPrep counts in the entry (packing.cost)
            lens = np.diff(seq.cu_seqlens).astype(np.int64)
            tower = seq.image_grids.prod(axis=1).astype(np.int64) + 1
            assert (p["attn_sq"], p["images"], p["vit_tokens"], p["vit_sq"]) == \
                (int((lens ** 2).sum()), len(seq.images), int(tower.sum()), int((tower ** 2).sum()))
            assert p["cost"] > 0
            seen += 1
    assert seen == len(manifest)


def pack_outputs(run, out):
    """Everything `pack` writes that must not depend on the task count: the whole `packs` manifest
    (every column, `shard` included) as one Parquet file's bytes, and the sha256 of every tar by name."""
    import hashlib

    from manifests.io import read_manifest as read
    from packing.shards import packed_shards

    write_table(read(run, "packs"), out)
    data = run / "pack" / "data"
    # no temp files left: the tars and the index energon's `prepare` writes beside each
    tars = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in packed_shards(run)}
    assert sorted(p.name for p in data.iterdir()) == sorted([*tars, *(f"{t}.idx" for t in tars)])
    return out.read_bytes(), tars


@pytest.mark.parametrize("tasks", [1, 3, 4])
def test_task_count_does_not_change_packs(packed_run, tmp_path, tasks):
    """Shards are named by their pack range, not by the rank that wrote them, so the `packs.shard`
    column and the tar files are the same bytes at any --tasks."""
    import shutil

    run = tmp_path / f"t{tasks}"
    for d in ("ingest", "lengths"):
        shutil.copytree(packed_run / d, run / d)
    assert main(["pack", "--set", "seq_len=1024", "--set", "packs_per_shard=8", "--run-dir", str(run),
                 "--tasks", str(tasks), "--quiet"]) == 0
    manifest, tars = pack_outputs(run, tmp_path / "packs.parquet")
    ref_manifest, ref_tars = pack_outputs(packed_run, tmp_path / "ref.parquet")  # the fixture: --tasks 2
    assert manifest == ref_manifest
    assert tars == ref_tars
    # shard j holds pack_ids [8j, 8j + 8), named by j, in pack_id order
    packs = read_manifest(run, "packs", columns=["pack_id", "shard"]).to_pylist()
    assert [p["pack_id"] for p in packs] == list(range(len(packs)))
    assert [p["shard"] for p in packs] == [f"pack-{i // 8:06d}.tar" for i in range(len(packs))]
    assert list(tars) == sorted(tars) == [f"pack-{j:06d}.tar" for j in range(-(-len(packs) // 8))]
    assert len(tars) == 3  # 2 ranks at --tasks 2 (the fixture), 1 each at 3, one idle rank at 4
    # the packing is solved once (the reduce), each apply rank writes its pack range from it
    assert json.loads((run / "pack" / "executor.json").read_text())["phases"] == ["reduce", "apply"]
    assert sorted(p.name for p in (run / "pack" / "reduced").iterdir()) == ["bin_load.npy", "bin_start.npy",
                                                                            "slots.parquet", "summary.npz"]
    assert sorted(p.name for p in (run / "pack" / "completions").iterdir() if p.name.startswith("apply-")) == \
        [f"apply-{r:05d}" for r in range(tasks)]
    # a reduce-first step: no map ranks ran (no map marker, no map log)
    assert not any(p.name.isdigit() for p in (run / "pack" / "completions").iterdir())
    assert not list((run / "pack" / "logs").glob("task_*.log"))


def test_shard_bounds_split_over_whole_shards():
    from packing.pack import shard_bounds
    from ovpipe.step import slice_bounds

    for n in (0, 1, 7, 8, 9, 64, 65, 1000):
        for pps in (1, 3, 8, 256):
            for world in (1, 2, 3, 4, 7, 16):
                bounds = [shard_bounds(n, pps, r, world) for r in range(world)]
                assert bounds[0][0] == 0 and bounds[-1][1] == n
                for (lo, hi), (lo2, _) in zip(bounds, bounds[1:]):
                    assert lo <= hi == lo2
                for lo, hi in bounds:
                    assert lo == n or lo % pps == 0  # a rank starts on a shard boundary
                    assert hi == n or hi % pps == 0  # … and ends on one: no shard has two writers
            assert [shard_bounds(n, None, r, 3) for r in range(3)] == [slice_bounds(n, r, 3) for r in range(3)]


def test_packed_shards_sort_by_pack_id(tmp_path):
    from packing.shards import packed_shards

    data = tmp_path / "pack" / "data"
    data.mkdir(parents=True)
    names = ["pack-000002.tar", "pack-000010.tar", "pack-1000000.tar", "pack-000000.tar", "pack-999999.tar"]
    for n in names:
        (data / n).write_bytes(b"")
    assert [p.name for p in packed_shards(tmp_path)] == ["pack-000000.tar", "pack-000002.tar", "pack-000010.tar",
                                                         "pack-999999.tar", "pack-1000000.tar"]
    (data / "pack-00000-00001.tar").write_bytes(b"")  # a rank-named shard of an older ovpipe, resumed
    with pytest.raises(ValueError, match="--overwrite"):
        packed_shards(tmp_path)


def test_balanced_copies_are_honoured(packed_run, tmp_path):
    import shutil

    run = tmp_path / "bal"
    for d in ("ingest", "lengths"):
        shutil.copytree(packed_run / d, run / d)
    ids = [r["sample_id"] for r in read_manifest(run, "lengths").to_pylist() if r["status"] == "ok"]
    copies = {s: i % 3 for i, s in enumerate(ids)}  # 0, 1 or 2 copies
    write_part({"sample_id": ids, "weight": [1.0] * len(ids), "copies": [copies[s] for s in ids]},
               run / "balance" / "balanced" / "part-00000.parquet", "balanced")
    assert main(["pack", "--set", "seq_len=1024", "--set", "copies_from=balanced", "--set", "write_shards=false",
                 "--run-dir", str(run), "--quiet"]) == 0
    seen = {}
    for p in read_manifest(run, "packs").to_pylist():
        for s in p["sample_ids"]:
            seen[s] = seen.get(s, 0) + 1
    assert seen == {s: c for s, c in copies.items() if c}


def test_too_long_and_truncate(packed_run, tmp_path):
    import shutil

    run = tmp_path / "short"
    shutil.copytree(packed_run / "ingest", run / "ingest")
    tok = packed_run / "tokenizer"
    assert main(["lengths", "--set", f"tokenizer={tok}", "--set", "seq_len=128", "--run-dir", str(run), "--quiet"]) == 0
    rows = read_manifest(run, "lengths").to_pylist()
    long = [r for r in rows if r["status"] == "too_long"]
    assert long and all(r["total_tokens"] > 128 for r in long)
    assert all(r["error"] for r in long)
    assert main(["pack", "--set", "seq_len=128", "--set", "write_shards=false", "--run-dir", str(run), "--quiet"]) == 0
    packed = {s for p in read_manifest(run, "packs").to_pylist() for s in p["sample_ids"]}
    assert not packed & {r["sample_id"] for r in long}
    run2 = tmp_path / "trunc"
    shutil.copytree(packed_run / "ingest", run2 / "ingest")
    assert main(["lengths", "--set", f"tokenizer={tok}", "--set", "seq_len=128", "--set", "on_too_long=truncate",
                 "--run-dir", str(run2), "--quiet"]) == 0
    rows2 = {r["sample_id"]: r for r in read_manifest(run2, "lengths").to_pylist()}
    for r in long:  # truncate cuts whole turn pairs only: a caption pair is one pair, so it stays too long
        assert rows2[r["sample_id"]]["status"] == "too_long"
        assert "first turn pair" in rows2[r["sample_id"]]["error"]


BALANCE = ["--set", "balance_dp=3", "--set", "balance_grad_accum=2", "--set", "balance_window=2"]


@pytest.mark.parametrize("tasks", [1, 3])
def test_balanced_order_same_packs_any_task_count_and_the_loader_streams_it(packed_run, tmp_path, tasks,
                                                                           monkeypatch):
    """With balance_dp the packs are the unbalanced run's, in another pack_id order: byte-identical at any
    --tasks; the loader's ranks see the balanced (step, rank) costs; a resume at a step's first pack continues
    with exactly the packs an uninterrupted run reads next."""
    import shutil

    from packing.compute_balance import rank_costs, straggler_loss
    from pretrain.data import iter_batches

    run = tmp_path / f"b{tasks}"
    for d in ("ingest", "lengths"):
        shutil.copytree(packed_run / d, run / d)
    assert main(["pack", "--set", "seq_len=1024", "--set", "packs_per_shard=8", *BALANCE, "--run-dir", str(run),
                 "--tasks", str(tasks), "--quiet"]) == 0
    got, tars = pack_outputs(run, tmp_path / f"b{tasks}.parquet")
    ref = tmp_path / "balanced-ref.parquet"
    if ref.exists():                                       # the other --tasks wrote it
        assert got == ref.read_bytes()
    else:
        ref.write_bytes(got)
    packs = read_manifest(run, "packs").to_pylist()
    plain = read_manifest(packed_run, "packs").to_pylist()
    assert sorted(map(lambda r: tuple(r["sample_ids"]), packs)) == sorted(map(lambda r: tuple(r["sample_ids"]), plain))
    assert [r["pack_id"] for r in packs] != [] and [r["sample_ids"] for r in packs] != [r["sample_ids"] for r in plain]
    cost = np.array([r["cost"] for r in packs])
    info = json.loads((run / "pack" / "stats.json").read_text())["info"]
    assert info["straggler_loss_after"] == pytest.approx(straggler_loss(cost, 3, 1, 2))
    assert info["straggler_loss_after"] < info["straggler_loss_before"] == pytest.approx(
        straggler_loss(np.array([r["cost"] for r in plain]), 3, 1, 2))
    if tasks != 1:
        return
    # what each DP rank's loader yields, a step (2 micro-batches) at a time, over two epochs of the balanced
    # stream (the loader's own stream and rank split; decoding the pixels is left out): epoch 1 carries the
    # costs balanced above, and epoch 2 is as balanced (ovpipe issue 67: the old stream replayed pack_id order, so with
    # n mod 6 ≠ 0 every step of epoch 2 straddled two balanced ones)
    import types

    import pretrain.data
    from packing.compute_balance import epoch_start
    from pretrain.data import plan_data

    monkeypatch.setattr(pretrain.data, "collate", lambda seqs: types.SimpleNamespace(pack_ids=[q.pack_id for q in seqs]))
    by_id = dict(zip((r["pack_id"] for r in packs), cost))
    n, steps = len(packs), int(epoch_start(2, len(packs), 6))              # two epochs' whole steps
    assert n % 6, "the test wants leftover packs"
    seen = np.zeros((steps, 3))
    for rank in range(3):
        ids = [b.pack_ids[0] for b in iter_batches(run, "pack", 1, epochs=2, rank=rank, world=3)]
        assert len(ids) == 2 * steps
        for s in range(steps):
            seen[s, rank] = sum(by_id[i] for i in ids[2 * s:2 * s + 2])
        resumed = [b.pack_ids[0] for b in iter_batches(run, "pack", 1, epochs=2, rank=rank, world=3,
                                                       start_pack=6 * (n // 6 + 1))]    # epoch 2's 2nd step on
        assert resumed == ids[2 * (n // 6 + 1):]
    assert np.allclose(seen[:n // 6], rank_costs(cost, 3, 1, 2))
    loss = lambda rc: float(np.mean(rc.max(axis=1) / rc.mean(axis=1) - 1))      # noqa: E731
    by_epoch = info["straggler_loss_after_by_epoch"]
    assert by_epoch[0] == pytest.approx(loss(seen[:n // 6])) and by_epoch[1] == pytest.approx(loss(seen[n // 6:]))
    assert by_epoch[1] < info["straggler_loss_before"]
    # the stage's data plan says it: the straggler loss of what its ranks read over the run's steps, and the
    # layout the packs were ordered for
    plan = plan_data(run, "pack", 1, 2, 3, steps=steps)
    assert plan.straggler_loss == pytest.approx(loss(seen)) and plan.balanced_for == (3, 1, 2)
    assert "balanced for DP 3 × 2 micro-batches of 1" in plan.describe()
    assert plan_data(packed_run, "pack", 1, 2, 3, steps=1).balanced_for is None
