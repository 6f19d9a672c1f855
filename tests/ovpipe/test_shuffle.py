"""``ovpipe.shuffle``: the merge of parts each sorted by a key gives (key, part, row) order whatever the
batch size, and first occurrences are found the same way however the stream is cut. (The spill runs,
bucket cuts and range merge are exercised through ``ingest``: ``tests/curation/test_ingest_shuffle.py``.)"""
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ovpipe.shuffle import FirstOccurrence, bucket_cuts, merge_sorted


def _parts(tmp_path, sizes=(7, 0, 12, 1, 9), seed=0):
    """Parts sorted by ``id`` (stable: equal ids keep their written order), ids drawn from a small pool so
    they repeat within and across parts; ``n`` tells the rows apart."""
    rng = np.random.default_rng(seed)
    pool = [f"{x:016x}" for x in rng.integers(0, 2 ** 63, 10)]
    files, rows = [], []
    for k, size in enumerate(sizes):
        ids = sorted(rng.choice(pool, size).tolist())
        f = tmp_path / f"part-{k:05d}.parquet"
        pq.write_table(pa.table({"id": pa.array(ids, pa.string()), "n": pa.array(range(size), pa.int64())}), f,
                       row_group_size=4)
        files.append(f)
        rows += [(s, k, i) for i, s in enumerate(ids)]
    return files, sorted(rows)


@pytest.mark.parametrize("batch_rows", [1, 3, 1000])
def test_merge_sorted_gives_key_part_row_order_for_any_batch_size(tmp_path, batch_rows):
    files, want = _parts(tmp_path)
    got = []
    for t in merge_sorted(files, "id", ["id", "n"], batch_rows=batch_rows):
        assert t.column_names == ["id", "n", "_file", "_row"]
        got += list(zip(*(t.column(c).to_pylist() for c in ("id", "_file", "_row"))))
        assert t.column("n").to_pylist() == t.column("_row").to_pylist()   # the row it says it is
    assert got == want


def test_first_occurrence_is_the_same_however_the_stream_is_cut(tmp_path):
    files, rows = _parts(tmp_path, seed=3)
    seen, want = set(), []
    for s, k, i in rows:
        want.append(None if s in seen else (k, i))
        seen.add(s)
    for batch_rows in (1, 2, 5, 1000):
        f = FirstOccurrence("id", origin=("_file", "_row"))
        got = []
        for t in merge_sorted(files, "id", ["id"], batch_rows=batch_rows):
            rep = f.repeats(t)
            firsts = list(zip(t.column("_file").to_pylist(), t.column("_row").to_pylist()))
            got += firsts if rep is None else [fi if r is None else None for fi, r in zip(firsts, rep)]
        assert got == want, batch_rows


def test_bucket_cuts_balance_rows_at_bucket_granularity():
    counts = np.zeros(16 ** 4, np.int64)
    counts[[3, 10, 10_000, 40_000, 65_535]] = [5, 5, 5, 5, 4]
    cuts = bucket_cuts(counts, 3)
    assert cuts[0] == 0 and cuts[-1] == 16 ** 4 and cuts == sorted(cuts)
    assert [int(counts[a:b].sum()) for a, b in zip(cuts, cuts[1:])] == [10, 10, 4]


def test_merge_sorted_refuses_a_part_out_of_order(tmp_path):
    f = tmp_path / "part-00000.parquet"
    pq.write_table(pa.table({"id": ["00b", "00a"]}), f)
    with pytest.raises(ValueError, match="not in id order"):
        list(merge_sorted([f], "id", ["id"]))


@pytest.mark.parametrize("fan_in", [2, 3])
def test_merge_sorted_past_its_fan_in_gives_the_one_level_order(tmp_path, monkeypatch, fan_in):
    """More parts than ``MERGE_FAN_IN``: merged in levels of sorted runs (``fan_in`` 2: four levels for 11
    parts) — the same rows in the same (key, part, row) order as one merge of them all, with the original
    ``_file`` and ``_row``, and the runs' folder gone at the end."""
    import ovpipe.shuffle as sh

    files, want = _parts(tmp_path, sizes=(7, 0, 12, 1, 9, 5, 5, 3, 0, 8, 6), seed=5)
    one = [t for t in merge_sorted(files, "id", ["n"], batch_rows=4)]
    monkeypatch.setattr(sh, "MERGE_FAN_IN", fan_in)
    work = tmp_path / "work"
    work.mkdir()
    got = pa.concat_tables(list(merge_sorted(files, "id", ["n"], batch_rows=4, work_dir=work)))
    assert got.column_names == ["n", "_file", "_row"]
    assert got.equals(pa.concat_tables(one))
    assert list(zip(got.column("_file").to_pylist(), got.column("_row").to_pylist())) == [(k, i) for _, k, i in want]
    assert list(work.iterdir()) == []
    partial = merge_sorted(files, "id", ["n"], work_dir=work)
    next(partial)
    partial.close()                                  # a consumer that stops early leaves no runs either
    assert list(work.iterdir()) == []
