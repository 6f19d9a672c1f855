"""``lengths`` reads only its rank's slice of the samples manifests (row counts from the footers, the
slice's row groups streamed), and the slices over several ``samples_steps`` are exactly the rows the
whole concatenation would give each rank — so outputs stay identical for any task count."""
import shutil

import pyarrow as pa
import pytest

from manifests.io import read_manifest
from ovpipe.step import TaskContext, slice_bounds
from packing.lengths import iter_slice_batches, read_samples


@pytest.mark.parametrize("world", [1, 3, 4, 7])
def test_streamed_slices_equal_the_whole_concatenation_sliced(ingested_run, tmp_path, world):
    run = tmp_path / "run"
    shutil.copytree(ingested_run / "ingest", run / "ingest")
    shutil.copytree(ingested_run / "ingest", run / "ingest-b")       # a second samples step, same rows
    steps, cols = ["ingest", "ingest-b"], ["sample_id", "status", "n_images"]
    whole = read_samples(TaskContext("lengths", 0, 1, run), steps, cols)           # one rank: the whole
    assert whole.equals(pa.concat_tables([read_manifest(run, "samples", step, cols) for step in steps]))
    got = []
    for rank in range(world):
        task = TaskContext("lengths", rank, world, run)
        lo, hi = slice_bounds(whole.num_rows, rank, world)
        batches = list(iter_slice_batches(task, steps, cols, batch_rows=97))
        assert all(b.num_rows <= 97 for b in batches)
        part = pa.Table.from_batches(batches, schema=whole.schema)
        assert part.equals(whole.slice(lo, hi - lo))
        assert read_samples(task, steps, cols).equals(part)
        got.append(part)
    assert pa.concat_tables(got).equals(whole)


def test_a_missing_samples_step_is_named(ingested_run, tmp_path):
    shutil.copytree(ingested_run / "ingest", tmp_path / "ingest")
    with pytest.raises(FileNotFoundError, match="samples_steps names 'nope'"):
        list(iter_slice_batches(TaskContext("lengths", 0, 2, tmp_path), ["ingest", "nope"], ["sample_id"]))
