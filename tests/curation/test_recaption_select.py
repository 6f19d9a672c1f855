"""recaption's selection (``slice_rows``) against the reference that holds the whole input in memory: the same
``(ids, rows)`` on every rank and the same rank-0 counters for 1, 2 and 3 tasks, with two samples steps (one in
canonical order with ties inside a part, one whose parts overlap, so it is numbered by the sort), duplicates
within and across steps, rows not ok, rows with 0 or 2 images, ``only_balanced`` and ``limit``; and the
step's parts byte-identical to the ones the reference selection gives."""
import json
import random

import numpy as np
import pyarrow as pa
import pytest

import curation.recaption as rc
from curation.recaption import STEP, RecaptionConfig
from manifests.conversation import IMAGE_ADDRESS, TURN
from manifests.io import parts_in_canonical_order, write_part
from ovpipe.cli import main
from ovpipe.step import TaskContext, slice_bounds


def slice_rows_in_memory(task, cfg):
    """The selection held in memory (every input sample_id of the corpus): the reference the DuckDB one
    must match."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    sids, keeps, n_rows, n_not_ok, n_not_one = [], [], 0, 0, 0
    for step in cfg.samples_steps:           # the light columns only, a row group at a time
        for b in task.iter_input("samples", ["sample_id", "status", "n_images"], step=step):
            ok, one = pc.equal(b.column("status"), "ok"), pc.equal(b.column("n_images"), 1)
            keep = pc.fill_null(pc.and_(ok, one), False)
            n_not_ok += int(pc.sum(pc.not_equal(b.column("status"), "ok")).as_py() or 0)
            n_not_one += int(pc.sum(pc.and_(ok, pc.not_equal(b.column("n_images"), 1))).as_py() or 0)
            sids.append(b.column("sample_id").filter(keep))
            keeps.append(np.flatnonzero(keep.to_numpy(zero_copy_only=False)) + n_rows)
            n_rows += b.num_rows
    if task.rank == 0:
        task.stats.inc("input/samples", n_rows)
        task.stats.inc("input/not_ok", n_not_ok)
        task.stats.inc("input/not_one_image", n_not_one)
    sid = pa.chunked_array(sids, pa.string()).combine_chunks()
    rows = np.concatenate(keeps) if keeps else np.zeros(0, np.int64)
    del sids, keeps
    if cfg.only_balanced:
        b = task.read_input("balanced", step=cfg.balance_step, columns=["sample_id", "copies"])
        b = b.filter(pc.greater(b.column("copies"), 0))
        n = len(sid)
        mask = pc.is_in(sid, value_set=b.column("sample_id").combine_chunks())
        sid, rows = sid.filter(mask), rows[mask.to_numpy(zero_copy_only=False)]
        if task.rank == 0:
            task.stats.inc("input/not_balanced", n - len(sid))
    if len(sid) > 1:           # the same sample ingested twice (same image bytes, same text): caption it once
        order = pc.sort_indices(sid).to_numpy()          # stable: the first occurrence leads its run
        s = pc.take(sid, pa.array(order))
        dup = np.zeros(len(s), bool)
        dup[1:] = pc.equal(s.slice(1), s.slice(0, len(s) - 1)).to_numpy(zero_copy_only=False)
        if dup.any():
            first = np.ones(len(s), bool)
            first[order[dup]] = False
            sid, rows = sid.filter(pa.array(first)), rows[first]
            if task.rank == 0:
                task.stats.inc("input/duplicate_sample_ids", int(dup.sum()))
    if cfg.limit:
        sid, rows = sid.slice(0, cfg.limit), rows[:cfg.limit]
    lo, hi = slice_bounds(len(sid), task.rank, task.world_size)
    mine = sid.slice(lo, hi - lo)
    return mine.take(pc.sort_indices(mine)), rows[lo:hi].copy()



STEPS = ["ingest", "ingest2"]


def _write_samples(path, rows, sort):
    """A samples part of ``rows`` = (sample_id, source, shard, key, status, n_images); the image addresses point
    nowhere (the file backend reads no image)."""
    sid, source, shard, key, status, n_images = (list(c) for c in zip(*rows))
    m = len(rows)
    addr = [[{"file": "/nowhere/x.tar", "container": "tar", "offset": 512 * i, "size": 4096, "column": None,
              "index": -1, "format": "jpeg", "width": 64, "height": 64}] * n for i, n in enumerate(n_images)]
    write_part(pa.table({
        "sample_id": sid, "source": source, "lang": [None] * m, "shard": shard, "key": key,
        "shard_format": ["tar"] * m, "offset": [0] * m, "size": [4096] * m, "image_format": ["jpeg"] * m,
        "width": pa.array([64] * m, pa.int32()), "height": pa.array([64] * m, pa.int32()),
        "caption": ["c"] * m, "category": ["caption"] * m, "n_images": pa.array(n_images, pa.int32()),
        "images": pa.array(addr, pa.list_(IMAGE_ADDRESS)),
        "conversation": pa.array([[{"role": "user", "text": "<image>"}, {"role": "assistant", "text": "c"}]] * m,
                                 pa.list_(TURN)),
        "turns": pa.array([2] * m, pa.int32()),
        "turn_ratings": pa.array([None] * m, pa.map_(pa.string(), pa.list_(pa.int32()))),
        "status": status, "error": pa.array([None] * m, pa.string())}), path, "samples", sort=sort)


def _corpus(run, seed=0):
    """Two samples steps over a pool of 90 ids (the first draws from 60 of them, the second from 45, 15 shared),
    and a ``balanced`` manifest; returns the pool.

    ``ingest``: 150 rows in 3 parts whose ``sample_id`` ranges rise part to part (canonical by the footers, so
    streamed as they lie); an id drawn twice keeps its rows in the order drawn, not by key, inside its part.
    ``ingest2``: 120 rows in 3 sorted parts over overlapping ranges, exact ties (every sort key equal) across
    parts included: not canonical by the footers, so the reader sorts it."""
    rng = random.Random(seed)
    pool = sorted(f"{rng.getrandbits(64):016x}" for _ in range(90))

    def row(sid, k):
        status = "ok" if rng.random() > 0.15 else "corrupt_image"
        n = rng.choices([1, 2, 0], [0.85, 0.1, 0.05])[0]
        return (sid, rng.choice(["a", "b"]), f"shard-{k % 3}.tar", f"k{rng.randrange(5)}", status, n)

    first = sorted((rng.choice(pool[:60]) for _ in range(150)))
    rows = [row(s, i) for i, s in enumerate(first)]
    cuts = [0]
    for want in (50, 100):                           # part boundaries between two ids, never inside a run
        c = want
        while c < len(rows) and rows[c][0] == rows[c - 1][0]:
            c += 1
        cuts.append(c)
    cuts.append(len(rows))
    files = []
    for k in range(3):
        files.append(run / "ingest" / "samples" / f"part-{k:05d}.parquet")
        _write_samples(files[-1], rows[cuts[k]:cuts[k + 1]], sort=False)
    assert parts_in_canonical_order(files, "samples")

    parts = [[row(rng.choice(pool[45:]), i) for i in range(40)] for _ in range(3)]

    def tie(r, flip):              # every sort key equal, status or image count not: which comes first shows
        sid, source, shard, key, status, n = r
        return (sid, source, shard, key, *(("corrupt_image" if status == "ok" else "ok", n) if flip
                                           else (status, 2 if n == 1 else 1)))
    for i in range(0, 12, 2):
        parts[0] += [tie(parts[0][i], True), tie(parts[0][i + 1], False)]   # inside a part
        parts[1] += [tie(parts[0][i], False)]                               # across parts
        parts[2] += [tie(parts[1][i], True)]
    files = []
    for k in range(3):
        files.append(run / "ingest2" / "samples" / f"part-{k:05d}.parquet")
        _write_samples(files[-1], parts[k], sort=True)
    assert not parts_in_canonical_order(files, "samples")

    bal = pool[::2] + [f"{rng.getrandbits(64):016x}" for _ in range(5)]     # ids not ingested too
    write_part(pa.table({"sample_id": bal, "weight": [1.0] * len(bal),
                         "copies": pa.array([rng.choice([0, 1, 2]) for _ in bal], pa.int32())}),
               run / "balance" / "balanced" / "part-00000.parquet", "balanced")
    return pool


@pytest.fixture(scope="module")
def corpus_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("select")
    return run, _corpus(run)


INPUT_COUNTERS = ("input/samples", "input/not_ok", "input/not_one_image", "input/not_balanced",
                  "input/duplicate_sample_ids")


@pytest.mark.parametrize("only_balanced,limit", [(False, 0), (True, 0), (False, 23), (True, 9), (True, 1000)])
@pytest.mark.parametrize("bucket_rows", [3, 1 << 16])
def test_selection_equals_the_in_memory_one(corpus_run, monkeypatch, only_balanced, limit, bucket_rows):
    run, _ = corpus_run
    monkeypatch.setattr(rc, "SELECT_BUCKET_ROWS", bucket_rows)     # 3: every share spans several buckets
    cfg = RecaptionConfig(backend="file", file="x.jsonl", samples_steps=STEPS, only_balanced=only_balanced,
                          limit=limit)
    for world in (1, 2, 3):
        n = 0
        for rank in range(world):
            new, old = (TaskContext.for_step(STEP, cfg, run, rank, world) for _ in range(2))
            ids, rows = rc.slice_rows(new, cfg)
            want_ids, want_rows = slice_rows_in_memory(old, cfg)
            assert ids.type == pa.string() and ids.equals(want_ids), (world, rank)
            assert rows.dtype == np.int64 and np.array_equal(rows, want_rows), (world, rank)
            assert new.stats.to_dict()["counters"] == old.stats.to_dict()["counters"], (world, rank)
            n += len(ids)
        assert n > 0


def test_step_parts_and_stats_equal_the_in_memory_selections(corpus_run, tmp_path, monkeypatch):
    """End to end through the step (file backend, in-process ranks): every captions part and every rank's
    counters are the ones the in-memory selection gives, for 1, 2 and 3 tasks."""
    import shutil

    corpus, pool = corpus_run
    data = tmp_path / "caps.jsonl"
    with open(data, "w") as f:
        f.writelines(json.dumps({"sample_id": s, "lang": "en", "caption": f"a caption of {s} here", "model": "m"})
                     + "\n" for s in pool)

    def step(name, tasks):
        run = tmp_path / name
        for s in (*STEPS, "balance"):
            shutil.copytree(corpus / s, run / s)
        assert main(["recaption", "--set", "backend=file", "--set", f"file={data}", "--set", "chunk_size=4",
                     "--set", f"samples_steps={STEPS}", "--set", "only_balanced=true", "--set", "limit=17",
                     "--set", "prompts={en: Describe.}", "--set", "scripts={en: latin}", "--set", "min_length={en: 3}",
                     "--run-dir", str(run), "--tasks", str(tasks), "--quiet"]) == 0
        out = run / "recaption"
        parts = {p.name: p.read_bytes() for p in sorted((out / "captions").glob("part-*.parquet"))}
        counters = [json.loads((out / "stats" / f"{r:05d}.json").read_text())["counters"] for r in range(tasks)]
        return parts, counters, json.loads((out / "stats.json").read_text())["counters"]

    for tasks in (1, 2, 3):
        got = step(f"duckdb-{tasks}", tasks)
        with monkeypatch.context() as m:
            m.setattr(rc, "slice_rows", slice_rows_in_memory)
            want = step(f"in-memory-{tasks}", tasks)
        assert len(got[0]) == tasks and got == want, tasks
        assert got[2]["samples"] == 17 and got[2]["input/duplicate_sample_ids"] > 0
