"""``pack``'s out-of-core reduce (``packing.solve``) gives exactly the packing of ``binpack.pack`` over
every item in memory — with partitions small enough that lengths are split by key range — for any
task count, with duplicate ids, non-packable rows, ``balanced`` copies and recaptioned samples."""
import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from manifests.io import read_manifest, write_part
from ovpipe.cli import main
from manifests.ids import GOLDEN, hex_ids_to_u64, splitmix64, u64_to_hex
from packing.binpack import bin_layout, online_buffer_bins, pack
from packing.pack import packs_table
from packing.solve import SmallestKeys, partition_of, partition_plan

SEQ = 512


def hexes(u):
    return [f"{int(x):016x}" for x in u]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """6,000 lengths rows in 3 parts that each span the id range (so the canonical read sorts them):
    ~3 % repeated ids (another ingest step's row of the same sample, first row kept), ~5 % non-packable
    rows, a tenth of the samples recaptioned (``source_sample_id`` names another sample), lengths
    concentrated on a few values (so single lengths exceed a partition) plus a long tail; and a
    ``balanced`` manifest with 0–3 copies."""
    rng = np.random.default_rng(7)
    run = tmp_path_factory.mktemp("solve")
    n = 6000
    u = np.unique(rng.integers(0, 2 ** 63, n, dtype=np.int64).astype(np.uint64) * np.uint64(2) + np.uint64(1))
    n = len(u)
    ids = hexes(u)
    L = np.where(rng.random(n) < 0.5, rng.choice([64, 100, 128], n), rng.integers(1, SEQ + 1, n)).astype(np.int32)
    status = np.where(rng.random(n) < 0.05, rng.choice(["too_long", "error", "truncated"], n), "ok")
    src = np.array(ids, dtype=object)
    rec = rng.random(n) < 0.1
    src[rec] = np.array(ids, dtype=object)[rng.integers(0, n, int(rec.sum()))]
    img = rng.integers(0, 3, n).astype(np.int32)             # the cost's counts ride along with each sample
    rows = {"sample_id": ids, "source": ["s"] * n, "text_tokens": L, "image_tokens": (img * 6).astype(np.int32),
            "total_tokens": L, "target_tokens": L // 2, "turns_kept": rng.integers(2, 6, n).astype(np.int32),
            "images": img, "vit_sq": (img * 17 ** 2).astype(np.int64),
            "status": list(status), "error": [None] * n, "source_sample_id": list(src)}
    t = pa.table(rows)
    dup = rng.choice(n, n // 30, replace=False)            # the same ids again, other lengths / statuses
    d = t.take(pa.array(dup))
    d = d.set_column(d.schema.get_field_index("total_tokens"), "total_tokens",
                     pa.array(rng.integers(1, SEQ + 1, len(dup)).astype(np.int32)))
    t = pa.concat_tables([t, d])
    part = rng.integers(0, 3, t.num_rows)
    for p in range(3):
        write_part(t.filter(pa.array(part == p)), run / "lengths" / "lengths" / f"part-{p:05d}.parquet", "lengths",
                   sort=True)
    (run / "lengths" / "config.json").write_text(json.dumps({"tokenizer": "unused", "seq_len": SEQ}))
    copies = rng.integers(0, 4, n).astype(np.int32)
    write_part({"sample_id": ids, "weight": np.ones(n), "copies": copies},
               run / "balance" / "balanced" / "part-00000.parquet", "balanced", sort=True)
    return run


def reference(run, copies_from: str, seed: int):
    """What ``pack`` computed before ``packing.solve``: every item in memory, then ``binpack.pack``."""
    t = read_manifest(run, "lengths", step="lengths")
    t = t.filter(pc.is_in(t.column("status"), value_set=pa.array(["ok", "truncated"])))
    sid = t.column("sample_id").combine_chunks()
    first = np.r_[True, pc.not_equal(sid.slice(1), sid.slice(0, len(sid) - 1)).to_numpy(zero_copy_only=False)]
    t = t.filter(pa.array(first))
    sid = t.column("sample_id").combine_chunks()
    L = t.column("total_tokens").to_numpy().astype(np.int64)
    copies = np.ones(len(L), np.int64)
    if copies_from == "balanced":
        b = read_manifest(run, "balanced")
        pos = pc.index_in(t.column("source_sample_id"), value_set=b.column("sample_id"))
        copies = pc.fill_null(pc.take(b.column("copies"), pos), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    idx = np.repeat(np.arange(len(L)), copies)
    copy_no = np.arange(len(idx)) - np.repeat(np.cumsum(copies) - copies, copies)
    with np.errstate(over="ignore"):
        keys = splitmix64(hex_ids_to_u64(sid)[idx] ^ splitmix64(np.uint64(seed) + copy_no.astype(np.uint64) * GOLDEN))
    P = pack(L[idx], SEQ, keys=keys, seed=seed, refine_passes=2)
    images = {k: t.column(k).to_numpy() for k in ("image_tokens", "images", "vit_sq")}
    return packs_table(sid, L, idx, P, 0, P.n_bins, None, images), L[idx], keys


@pytest.mark.parametrize("copies_from,tasks,part_items", [("none", 1, 300), ("balanced", 3, 300),
                                                          ("balanced", 8, 1 << 22), ("none", 3, 1)])
def test_streamed_solve_equals_in_memory_pack(corpus, tmp_path, monkeypatch, copies_from, tasks, part_items):
    import shutil

    run = tmp_path / "run"
    for d in ("lengths", "balance"):
        shutil.copytree(corpus / d, run / d)
    monkeypatch.setenv("OVPIPE_PACK_PART_ITEMS", str(part_items))
    seed = 11
    assert main(["pack", "--run-dir", str(run), "--tasks", str(tasks), "--quiet", "--set", f"seq_len={SEQ}",
                 "--set", "write_shards=false", "--set", f"copies_from={copies_from}", "--set", f"seed={seed}",
                 "--set", "refine_passes=2", "--set", "report_max_samples=700"]) == 0
    got = read_manifest(run, "packs")
    want, lens, keys = reference(run, copies_from, seed)
    assert got.num_rows == want.num_rows > 0
    assert got.equals(want.cast(got.schema))
    stats = json.loads((run / "pack" / "stats.json").read_text())
    info = stats["info"]
    if part_items < 1000:
        assert info["pack_partitions"] > 10          # lengths split by key range, many partitions
    # the report's figures: histogram-level ones and the online baselines on the first items in key order
    assert info["items"] == len(lens) and info["tokens"] == int(lens.sum())
    assert info["lower_bound"] == -(-int(lens.sum()) // SEQ)
    sub = lens[np.argsort(keys, kind="stable")][:700]
    assert info["online_B64_bins"] == online_buffer_bins(sub, SEQ, 64)
    assert stats["counters"]["items/duplicate_sample_ids"] > 0
    # the apply ranks' slots carry turns and lineage: the same as the lengths rows they came from
    slots = pa.parquet.read_table(run / "pack" / "reduced" / "slots.parquet")
    lrows = read_manifest(run, "lengths", step="lengths")
    first = {}
    for s, k, src, st in zip(*(lrows.column(c).to_pylist() for c in ("sample_id", "turns_kept", "source_sample_id",
                                                                        "status"))):
        if st in ("ok", "truncated"):
            first.setdefault(s, (k, src))
    assert [first[s] for s in slots.column("sample_id").to_pylist()] == \
        list(zip(slots.column("turns_kept").to_pylist(), slots.column("source_sample_id").to_pylist()))


def test_partition_plan_orders_items_by_length_then_key():
    rng = np.random.default_rng(0)
    L = np.r_[np.full(5000, 7), rng.integers(1, 40, 3000)]
    key = rng.integers(0, 2 ** 64 - 1, len(L), dtype=np.uint64)
    counts = np.bincount(L, minlength=41)
    base, bits, n_parts = partition_plan(counts, 700)
    assert bits[7] == 3 and n_parts > 8               # 5,000 items of one length: 8 key ranges
    rec = np.zeros(len(L), [("L", "<u4"), ("key", "<u8")])
    rec["L"], rec["key"] = L, key
    pid = partition_of(rec, base, bits)
    assert pid.min() == 0 and pid.max() == n_parts - 1
    order = np.lexsort((key, L))                      # (L, key) order never goes back a partition
    assert (np.diff(pid[order]) >= 0).all()
    assert np.bincount(pid, minlength=n_parts).max() <= 2 * 700


def test_smallest_keys_and_hex_round_trip():
    rng = np.random.default_rng(1)
    key = rng.integers(0, 50, 10_000).astype(np.uint64)   # many ties: broken by index
    L = rng.integers(1, 100, 10_000)
    sk = SmallestKeys(300)
    for a in range(0, 10_000, 512):
        sk.add(key[a:a + 512], np.arange(a, min(a + 512, 10_000)), L[a:a + 512])
    assert sk.lengths().tolist() == L[np.argsort(key, kind="stable")][:300].tolist()
    u = rng.integers(0, 2 ** 64 - 1, 1000, dtype=np.uint64)
    assert u64_to_hex(u).to_pylist() == hexes(u)
    assert (hex_ids_to_u64(u64_to_hex(u)) == u).all()


def test_bin_layout_is_the_histogram_part_of_pack():
    rng = np.random.default_rng(2)
    L = rng.integers(1, 300, 4000)
    P = pack(L, 512, shuffle_bins=False)
    bin_size, slot_len = bin_layout(np.bincount(L, minlength=513), 512)
    assert (np.diff(P.start) == bin_size).all()
    assert (L[P.item] == slot_len).all()
