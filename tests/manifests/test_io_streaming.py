"""Streaming reads and writes of manifest parts: ``iter_manifest`` is ``read_manifest(...).slice`` in
bounded batches (parts already in canonical order streamed as they lie, others sorted by DuckDB), and
``PartWriter`` fed batch by batch writes the bytes ``write_part`` writes."""
import numpy as np
import pyarrow as pa
import pytest

from manifests import ManifestSchemaError, schema_for
from manifests.io import PartWriter, iter_manifest, manifest_num_rows, read_manifest, write_part, write_table


def _rows(ids):
    return {"sample_id": ids, "file": ["f"] * len(ids), "row": list(range(len(ids))), "status": ["ok"] * len(ids),
            "error": [None] * len(ids)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    rng = np.random.default_rng(0)
    ids = sorted(f"{x:016x}" for x in rng.integers(0, 2**63, 5000))
    for r, (a, b) in enumerate([(0, 1000), (1000, 3500), (3500, 5000)]):   # contiguous slices: canonical as is
        write_part(_rows(ids[a:b]), d / "ordered" / "image_embeddings" / f"part-{r:05d}.parquet", "image_embeddings")
    perm = rng.permutation(5000)                                             # interleaved: needs a sort
    for r in range(3):
        write_part(_rows([ids[i] for i in perm[r::3]]), d / "mixed" / "image_embeddings" / f"part-{r:05d}.parquet",
                   "image_embeddings")
    return d


@pytest.mark.parametrize("step", ["ordered", "mixed"])
@pytest.mark.parametrize("lo,hi,batch", [(0, 5000, 333), (17, 4000, 1000), (999, 1001, 7), (4999, 5000, 10),
                                         (10, 10, 5), (4000, 9000, 4096)])
def test_iter_manifest_is_the_canonical_slice_in_bounded_batches(run, step, lo, hi, batch):
    ref = read_manifest(run, "image_embeddings", step=step)
    assert manifest_num_rows(run, "image_embeddings", step=step) == ref.num_rows
    batches = list(iter_manifest(run, "image_embeddings", step=step, lo=lo, hi=hi, batch_rows=batch))
    assert all(0 < b.num_rows <= batch for b in batches)
    got = pa.Table.from_batches(batches, schema=ref.schema)
    assert got.equals(ref.slice(lo, min(hi, 5000) - lo))
    sub = ref.select(["row", "sample_id"])
    cols = list(iter_manifest(run, "image_embeddings", step=step, columns=["row", "sample_id"], lo=lo, hi=hi))
    assert pa.Table.from_batches(cols, schema=sub.schema).equals(sub.slice(lo, min(hi, 5000) - lo))


def test_iter_manifest_refuses_an_unsorted_part(tmp_path):
    ids = [f"{x:016x}" for x in (5, 3, 9)]
    write_table(pa.table(_rows(ids)).cast(schema_for("image_embeddings")),
                tmp_path / "s" / "image_embeddings" / "part-00000.parquet")
    with pytest.raises(ManifestSchemaError, match="not in sample_id order"):
        list(iter_manifest(tmp_path, "image_embeddings"))


@pytest.mark.parametrize("n", [0, 10, 1000, 2500])
def test_part_writer_writes_the_bytes_of_write_part(run, tmp_path, monkeypatch, n):
    import manifests.io as io

    monkeypatch.setitem(io.PARQUET_OPTS, "row_group_size", 1000)   # several row groups at test size
    t = read_manifest(run, "image_embeddings", step="ordered").slice(0, n)
    write_part(t, tmp_path / "a.parquet", "image_embeddings")
    with PartWriter(tmp_path / "b.parquet", "image_embeddings") as w:
        for s in range(0, n, 333):
            w.write(t.slice(s, min(333, n - s)))
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()


def test_part_writer_leaves_nothing_when_the_task_fails(tmp_path):
    with pytest.raises(RuntimeError):
        with PartWriter(tmp_path / "p.parquet", "image_embeddings") as w:
            w.write(_rows(["00"]))
            raise RuntimeError("task died")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ManifestSchemaError):
        PartWriter(tmp_path / "p.parquet", "image_embeddings").write(pa.table({"sample_id": ["a"]}))


def test_part_writer_with_small_row_groups_keeps_the_rows(tmp_path):
    """``row_group_rows`` (an apply phase's flat memory): same rows as ``write_part``, smaller groups."""
    import pyarrow.parquet as pq

    from manifests.io import PartWriter, read_part, write_part

    n = 1000
    data = {"sample_id": [f"{i:016x}" for i in range(n)], "concept_ids": [[i % 7, i % 11] for i in range(n)],
            "scores": [[0.5, 0.25] for _ in range(n)]}
    ref = write_part(data, tmp_path / "ref.parquet", "assignments")
    with PartWriter(tmp_path / "small.parquet", "assignments", row_group_rows=128) as w:
        for lo in range(0, n, 300):
            w.write({k: v[lo:lo + 300] for k, v in data.items()})
    md = pq.ParquetFile(tmp_path / "small.parquet").metadata
    assert md.num_row_groups == 8 and max(md.row_group(g).num_rows for g in range(8)) == 128
    assert read_part(tmp_path / "small.parquet", "assignments").equals(read_part(ref, "assignments"))


def test_iter_parts_decodes_one_row_group_at_a_time(tmp_path):
    """A share of many row groups streams in the memory of about one row group, not of the share: the
    peak of Arrow's allocations over the whole iteration stays near one row group's decoded size."""
    from manifests.io import iter_parts

    n, group = 60_000, 2_000
    rng = np.random.default_rng(0)
    ids = sorted(f"{x:016x}" for x in rng.integers(0, 2**63, n))
    t = pa.table(_rows(ids)).cast(schema_for("image_embeddings"))
    part = write_table(t, tmp_path / "s" / "image_embeddings" / "part-00000.parquet", row_group_rows=group)
    one_group = t.slice(0, group).nbytes
    for order in ("canonical", "files"):
        base, peak, rows = pa.total_allocated_bytes(), 0, 0
        for b in iter_parts([part], "image_embeddings", lo=1_000, hi=n - 1_000, order=order, batch_rows=500):
            rows += b.num_rows
            peak = max(peak, pa.total_allocated_bytes() - base)
            del b
        assert rows == n - 2_000
        assert peak < 4 * one_group < t.nbytes / 5, (order, peak, one_group, t.nbytes)


def test_iter_parts_folders_concatenates_each_folder_in_canonical_order(run):
    """``order="folders"``: each folder's parts in canonical order (sorted by DuckDB where they do not lie
    so), the folders one after the other in the given order."""
    from manifests.io import iter_parts, manifest_files

    files = manifest_files(run, "image_embeddings", "mixed") + manifest_files(run, "image_embeddings", "ordered")
    whole = pa.concat_tables([read_manifest(run, "image_embeddings", step=s) for s in ("mixed", "ordered")])
    for lo, hi in [(0, 10_000), (4_990, 5_020), (6_000, 7_000)]:
        got = list(iter_parts(files, "image_embeddings", lo=lo, hi=hi, order="folders", batch_rows=256))
        assert all(0 < b.num_rows <= 256 for b in got)
        assert pa.Table.from_batches(got, schema=whole.schema).equals(whole.slice(lo, min(hi, 10_000) - lo))


def test_iter_parts_files_order_is_each_row_once_as_it_lies(run):
    """``order="files"`` (a map's share, partials are sums): the ranks' shares are the parts' rows in file
    order, each once, balanced — without any order check or sort."""
    import pyarrow.parquet as pq

    from manifests.io import iter_parts, manifest_files
    from ovpipe.mapreduce import slice_bounds

    files = manifest_files(run, "image_embeddings", "mixed")
    as_they_lie = pa.concat_tables([pq.read_table(f) for f in files]).select(["sample_id", "row"])
    for world in (1, 3, 8):
        shares = [pa.Table.from_batches(list(iter_parts(files, "image_embeddings", ["sample_id", "row"],
                                                        *slice_bounds(5000, r, world), order="files",
                                                        batch_rows=100)), schema=as_they_lie.schema)
                  for r in range(world)]
        assert pa.concat_tables(shares).equals(as_they_lie)
        assert max(s.num_rows for s in shares) - min(s.num_rows for s in shares) <= 1


def test_iter_parts_checks_the_schema_from_the_footer(tmp_path):
    from manifests.io import iter_parts

    bad = tmp_path / "p.parquet"
    write_table(pa.table({"sample_id": ["a"], "file": ["f"], "row": pa.array([1], pa.int64())}), bad)
    with pytest.raises(ManifestSchemaError, match="column 'row' has type int64"):
        next(iter_parts([bad], "image_embeddings", ["sample_id"]))


def test_rollouts_parts_have_row_groups_a_reader_can_hold(tmp_path):
    """A streamed reader holds a row group: rollouts (long responses) are written in groups of 1,024 rows,
    by write_part and PartWriter alike, with the same bytes."""
    import pyarrow.parquet as pq

    n = 2_500
    rows = {"prompt_id": [f"{i // 8:08d}" for i in range(n)], "rollout_idx": [i % 8 for i in range(n)],
            "prompt_type": ["answer_only"] * n, "response": ["<answer>1</answer>"] * n, "tokens": [4] * n,
            "backend": ["file"] * n, "model": ["m"] * n, "sampling": ["{}"] * n}
    a = write_part(rows, tmp_path / "a.parquet", "rollouts")
    with PartWriter(tmp_path / "b.parquet", "rollouts") as w:
        t = pa.table(rows)
        for lo in range(0, n, 700):
            w.write(t.slice(lo, 700))
    md = pq.ParquetFile(a).metadata
    assert [md.row_group(i).num_rows for i in range(md.num_row_groups)] == [1024, 1024, n - 2048]
    assert a.read_bytes() == (tmp_path / "b.parquet").read_bytes()


def test_read_manifest_reads_only_the_asked_columns(tmp_path):
    """A reader of a few light columns does not decode the heavy ones: the errors column here holds
    1 MB of text per part that ``columns=["sample_id", "row"]`` never allocates."""
    import pyarrow.parquet as pq

    heavy = "x" * 1000
    for r in range(4):
        rows = _rows([f"{r:04x}{i:012x}" for i in range(1000)])
        rows["error"] = [heavy + str(i) for i in range(1000)]          # distinct: no dictionary shrinks it
        write_part(rows, tmp_path / "s" / "image_embeddings" / f"part-{r:05d}.parquet", "image_embeddings")
    base = pa.total_allocated_bytes()
    light = read_manifest(tmp_path, "image_embeddings", columns=["sample_id", "row"])
    light_bytes = pa.total_allocated_bytes() - base
    assert light.column_names == ["sample_id", "row"] and light.num_rows == 4000
    whole = read_manifest(tmp_path, "image_embeddings")
    assert light.equals(whole.select(["sample_id", "row"]))
    assert light_bytes < 0.1 * whole.nbytes, (light_bytes, whole.nbytes)
    # the schema is still checked, from the footer, whatever columns are read
    pq.write_table(pa.table({"sample_id": ["a"], "row": [1]}), tmp_path / "s" / "image_embeddings" / "part-00009.parquet")
    with pytest.raises(ManifestSchemaError, match="part-00009.*'file' missing"):
        read_manifest(tmp_path, "image_embeddings", columns=["sample_id"])
