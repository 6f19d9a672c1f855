"""`ingest` is map → reduce → apply. Map ranks spill their rows as sorted runs with per-bucket
counts; the reduce cuts the id space into balanced ranges; each apply rank merges its range of every
run, a sub-range at a time, and marks duplicates as the rows stream. So the `samples`
parts are contiguous id ranges — canonical as they lie, no downstream task sorts the corpus — and the
merged manifest is the same bytes for any task count, spill size or batch size."""
import io
import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import ovpipe.mapreduce
import ovpipe.shuffle as shuffle_mod
from curation.ingest import _DuplicateMarker
from ovpipe.shuffle import N_BUCKETS, SpillWriter
from manifests import read_manifest
from manifests.io import manifest_files, parts_in_canonical_order, write_table
from ovpipe.cli import main

HF_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def _png(seed: int) -> bytes:
    b = io.BytesIO()
    Image.new("RGB", (8 + seed % 5, 6 + seed % 3), (seed % 251, (seed * 7) % 251, (seed * 13) % 251)).save(b, "PNG")
    return b.getvalue()


def _corpus(root, n_files=4, rows=60):
    """Caption Parquet files in row groups of 9 (units split over ranks). Every 5th row of every file
    is the same in all files (image + caption: the same sample_id, a duplicate across files and ranks);
    file 1 repeats one of its own rows under another key; one row has an empty caption."""
    files = []
    for f in range(n_files):
        imgs, caps = [], []
        for i in range(rows):
            if i % 5 == 0:
                imgs.append(_png(i)), caps.append(f"caption {i}")
            else:
                imgs.append(_png(1000 * f + i)), caps.append(f"caption {f}-{i}")
        if f == 1:
            imgs[7], caps[7] = imgs[3], caps[3]
            caps[11] = ""
        p = root / f"src{f}" / "train.parquet"
        p.parent.mkdir(parents=True)
        pq.write_table(pa.table({"image": pa.array([{"bytes": b, "path": None} for b in imgs], HF_IMAGE),
                                 "caption": caps}), p, row_group_size=9)
        files.append(p)
    return files


def _ingest(run, files, tasks):
    assert main(["ingest", "--set", f"inputs={json.dumps([str(p) for p in files])}", "--run-dir", str(run),
                 "--tasks", str(tasks), "--workers", "1", "--quiet"]) == 0


def _bytes(run, tmp_path, kind="samples"):
    out = tmp_path / f"{run.name}-{kind}.parquet"
    write_table(read_manifest(run, kind), out)
    return out.read_bytes()


def test_id_range_parts_same_bytes_for_any_split(tmp_path, monkeypatch):
    files = _corpus(tmp_path / "data")
    _ingest(tmp_path / "ref", files, 1)                       # default spill runs and batches
    ref = _bytes(tmp_path / "ref", tmp_path)
    monkeypatch.setattr(shuffle_mod, "CONVERT_ROWS", 7)        # a run every 7 rows: many runs per map rank
    monkeypatch.setattr(shuffle_mod, "SPILL_BYTES", 1)
    monkeypatch.setattr(shuffle_mod, "SPILL_GROUP_ROWS", 3)    # many row groups per run (pruned by range)
    monkeypatch.setattr(shuffle_mod, "MERGE_BYTES", 4000)      # many sub-ranges per apply rank
    monkeypatch.setattr(ovpipe.mapreduce, "BATCH_ROWS", 4)    # duplicate runs cut by batch boundaries
    for tasks in (1, 3, 8):
        run = tmp_path / f"t{tasks}"
        _ingest(run, files, tasks)
        assert _bytes(run, tmp_path) == ref, tasks
        assert _bytes(run, tmp_path, "shards") == _bytes(tmp_path / "ref", tmp_path, "shards")
        parts = manifest_files(run, "samples")
        assert len(parts) == tasks and parts_in_canonical_order(parts, "samples")
        cuts = np.load(run / "ingest" / "reduced" / "ranges.npz")["cuts"]
        assert cuts[0] == 0 and cuts[-1] == N_BUCKETS and np.all(np.diff(cuts) >= 0)
        sizes = []
        for r, p in enumerate(parts):                         # part r holds exactly the ids of its range
            ids = pq.read_table(p, columns=["sample_id"]).column(0).to_pylist()
            sizes.append(len(ids))
            assert all(cuts[r] <= int(s[:4], 16) < cuts[r + 1] for s in ids)
        assert max(sizes) - min(sizes) <= 0.5 * 240 / tasks + 4, sizes       # balanced by rows
        assert not (run / "ingest" / "shuffle").exists()      # finalize removed the spill runs
        stats = json.loads((run / "ingest" / "stats.json").read_text())["counters"]
        assert stats["duplicates"] == stats["status/duplicate"] == 3 * 12 + 1
        assert stats["samples"] == 240 and stats["status/empty_caption"] == 1
        # sub-ranges read only the row groups that overlap them (footer min/max), not every run whole
        assert stats["merge_subranges"] >= 3 * tasks
        assert 240 <= stats["merge_rows_read"] < 0.5 * stats["merge_subranges"] * 240
    rows = read_manifest(tmp_path / "ref", "samples").to_pylist()
    dups = {(r["shard"].split("/")[-2], r["key"]): r["error"] for r in rows if r["status"] == "duplicate"}
    # the first occurrence in (source, shard, key) order stays: src0's row, or the lower key in src1
    assert all(src != "src0" for src, _ in dups)
    assert dups[("src2", "000000005")] == "duplicate of train.parquet/000000005"
    assert dups[("src1", "000000007")] == "duplicate of train.parquet/000000003"


def test_merge_past_its_fan_in_gives_the_same_parts(tmp_path, monkeypatch):
    """More spill runs than ``MERGE_FAN_IN`` (a run every 7 rows: 35 runs, merged 3 at a time, so three levels
    of intermediate runs): an apply rank's part has the bytes of the one-level merge, and the intermediate
    runs are gone."""
    files = _corpus(tmp_path / "data")
    monkeypatch.setattr(shuffle_mod, "CONVERT_ROWS", 7)
    monkeypatch.setattr(shuffle_mod, "SPILL_BYTES", 1)
    monkeypatch.setattr(shuffle_mod, "SPILL_GROUP_ROWS", 3)
    monkeypatch.setattr(shuffle_mod, "MERGE_BYTES", 4000)
    # 3 tasks only: the merge levels are per apply rank, and any-task-count identity is the test above's (1 task
    # as well cost 12 CPU-s, mostly unlinking the thousands of spill files these settings make)
    _ingest(tmp_path / "one", files, 3)
    monkeypatch.setattr(shuffle_mod, "MERGE_FAN_IN", 3)
    _ingest(tmp_path / "fan", files, 3)
    parts = lambda r: [p.read_bytes() for p in manifest_files(r, "samples")]  # noqa: E731
    assert parts(tmp_path / "fan") == parts(tmp_path / "one")
    stats = json.loads((tmp_path / "fan" / "ingest" / "stats.json").read_text())["counters"]
    assert stats["merge_level_runs"] >= 12 + 4 + 2       # 35 runs → 12 → 4 → 2 (per apply rank's range)
    assert not (tmp_path / "fan" / "ingest" / "shuffle").exists()


def test_duplicate_marker_is_batch_independent():
    ids = ["00aa", "00aa", "00ab", "00ac", "00ac", "00ac", "00ad"]
    shard = ["a", "b", "a", "a", "a", "c", "a"]
    key = ["1", "1", "2", "3", "3", "4", "5"]
    t = pa.table({"sample_id": ids, "shard": shard, "key": key, "status": ["ok"] * 7,
                  "error": pa.nulls(7, pa.string())})
    whole = _DuplicateMarker().mark(t.to_batches()[0])
    for size in (1, 2, 3):
        m = _DuplicateMarker()
        got = [m.mark(b) for b in t.to_batches(max_chunksize=size)]
        assert pa.Table.from_batches(got).equals(pa.Table.from_batches([whole])), size
        assert m.marked == 3
    assert whole.column("status").to_pylist() == ["ok", "duplicate", "ok", "ok", "duplicate", "duplicate", "ok"]
    err = whole.column("error").to_pylist()
    assert err[1] == "duplicate of a/1" and err[4] == "duplicate of a/3 (an earlier copy with the same key)"
    assert err[5] == "duplicate of a/3"


def test_a_rerun_map_rank_replaces_its_spill_runs(tmp_path, monkeypatch):
    """A map rank that failed after spilling reruns from scratch (its old runs removed, a stale one
    too); the other rank's runs are not redone; the result is the reference's bytes."""
    files = _corpus(tmp_path / "data", n_files=2, rows=30)
    _ingest(tmp_path / "ref", files, 2)
    monkeypatch.setattr(shuffle_mod, "CONVERT_ROWS", 5)
    monkeypatch.setattr(shuffle_mod, "SPILL_BYTES", 1)
    run = tmp_path / "run"
    args = ["ingest", "--set", f"inputs={json.dumps([str(p) for p in files])}", "--run-dir", str(run),
            "--tasks", "2", "--quiet"]
    monkeypatch.setenv("OVPIPE_FAIL_RANKS", "ingest:1")
    assert main(args) == 1
    shuffle = run / "ingest" / "shuffle"
    stale = shuffle / "map-00001-00099.parquet"               # as if a longer earlier try had left it
    (shuffle / "map-00001-00000.parquet").rename(stale)
    before = {p.name: p.stat().st_mtime_ns for p in shuffle.glob("map-00000-*")}
    monkeypatch.setenv("OVPIPE_FAIL_RANKS", "ingest/apply:0")  # stop after the reduce: the runs still there
    assert main(args) == 1
    assert not stale.exists() and (shuffle / "map-00001-00000.parquet").exists()
    assert {p.name: p.stat().st_mtime_ns for p in shuffle.glob("map-00000-*")} == before and len(before) > 1
    monkeypatch.delenv("OVPIPE_FAIL_RANKS")
    assert main(args) == 0
    assert _bytes(run, tmp_path) == _bytes(tmp_path / "ref", tmp_path)
    assert not shuffle.exists()
    # finalize removed the spill runs: redoing an apply rank of the finished step says what to do
    (run / "ingest" / "completions" / "apply-00000").unlink()
    assert main(args) == 1
    assert f"remove {run / 'ingest'} and rerun" in (run / "ingest" / "failures" / "apply-00000").read_text()
    shutil.rmtree(run / "ingest")
    assert main(args) == 0
    assert _bytes(run, tmp_path) == _bytes(tmp_path / "ref", tmp_path)


@pytest.mark.parametrize("bad", ["ABCDEF0123456789", "00ff"])
def test_spill_refuses_an_id_that_is_not_an_xxh3_digest(tmp_path, bad):
    spill = SpillWriter(tmp_path / "shuffle", 0, "samples")
    with pytest.raises(ValueError, match="not an xxh3-64 hex digest"):
        spill.add({"sample_id": bad})
