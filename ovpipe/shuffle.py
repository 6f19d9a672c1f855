"""An external sort by a hash id, in bounded memory: the shuffle of a map → reduce → apply step
(``ovpipe/mapreduce.py``) whose output parts must be contiguous id ranges, and the merge of sorted parts
that finds the first occurrence of every id (deduplication).

The key is an xxh3-64 hex digest (``sample_id``, ``prompt_id``): uniform, so its first ``BUCKET_HEX`` hex
digits cut the id space into ``N_BUCKETS`` balanced buckets with no sampling.

- **map** (``SpillWriter``): a rank's rows become Arrow tables every ``CONVERT_ROWS`` and, every
  ``SPILL_BYTES``, one sorted **spill run** (``<dir>/map-{rank}-{run}.parquet``: a stable sort by the
  manifest's ``SORT_KEYS``, row groups of ``SPILL_GROUP_ROWS``); it counts its rows per bucket — the
  rank's partial. Memory: one run.
- **reduce** (``bucket_cuts``): the summed bucket counts cut into ``world_size`` ranges of ≈ equal rows.
- **apply** (``merge_runs``): rank r merges its bucket range of every run (``spill_files``) into
  canonical order, a sub-range of ≈ ``MERGE_BYTES`` decoded rows at a time, reading only the row groups
  whose footer min/max overlaps it. Memory: one sub-range, and a partial row group of each of at most
  ``MERGE_FAN_IN`` runs (more runs are merged first in groups into larger runs, a level at a time).
- **first occurrences** (``FirstOccurrence``): over a stream in key order, which rows repeat an earlier
  row's key, and where that first row came from — the state carries across batches, so the answer does
  not depend on how the stream is cut.
- **sorted parts** (``merge_sorted``): the rows of parts that are each sorted by the key, merged into
  (key, part, row) order a row group per part at a time, at most ``MERGE_FAN_IN`` parts at once (more are
  merged first in groups, a level at a time) — to find duplicates over a step's whole output without
  holding its ids.

Ties between equal keys keep the order the rows were read (map rank, run, row), so the merged result
is the same for any task count, spill size or batch size (``tests/curation/test_ingest_shuffle.py``).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

CONVERT_ROWS = 8192        # rows a map rank holds as Python dicts before making them an Arrow table
SPILL_BYTES = 256 << 20    # Arrow bytes a map rank holds before writing them, sorted, as one spill run
SPILL_GROUP_ROWS = 1024    # rows per row group of a spill run: an apply rank's id range prunes the rest
MERGE_BYTES = 128 << 20    # decoded bytes an apply rank merges at once (a sub-range of its buckets)
BUCKET_HEX = 4             # a bucket is the first 4 hex digits of the key (top 16 bits of the xxh3)
MERGE_FAN_IN = 64          # sorted runs merged at once: a merge holds a row group or batch of each
N_BUCKETS = 16 ** BUCKET_HEX


# ------------------------------------------------------------------------------------------ map

def spill_path(directory: Path, rank: int, run: int) -> Path:
    """Map rank ``rank``'s ``run``-th spill: names sort in (rank, run) order = the order rows were read."""
    return Path(directory) / f"map-{rank:05d}-{run:05d}.parquet"


class SpillWriter:
    """A map rank's rows of manifest ``kind``, made Arrow tables every ``CONVERT_ROWS`` and written every
    ``SPILL_BYTES`` as a sorted run (stable sort by ``SORT_KEYS[kind]``, row groups of ``SPILL_GROUP_ROWS``),
    with the rank's per-bucket row counts (``buckets``) and its number of runs (``runs``): memory one run.
    Opening it removes the runs an earlier try of the same rank left (a rerun rank starts from scratch)."""

    def __init__(self, directory: Path, rank: int, kind: str, convert_rows: int | None = None,
                 group_rows: int | None = None):
        import numpy as np

        from manifests.schemas import SORT_KEYS

        self.directory, self.rank, self.kind, self.key = Path(directory), rank, kind, SORT_KEYS[kind][0]
        # fewer rows for large rows (images inline): what the writer holds as dicts, and what a merge of
        # the runs holds per run (a row group)
        self.convert_rows, self.group_rows = convert_rows or CONVERT_ROWS, group_rows or SPILL_GROUP_ROWS
        self.rows, self.tables, self.nbytes, self.runs = [], [], 0, 0
        self.buckets = np.zeros(N_BUCKETS, np.int64)
        self.directory.mkdir(parents=True, exist_ok=True)
        for old in [*self.directory.glob(f"map-{rank:05d}-*.parquet"), *self.directory.glob(f".tmp-*-map-{rank:05d}-*")]:
            old.unlink()

    def add(self, row: dict) -> None:
        sid = row[self.key]
        if len(sid) != 16 or sid.strip("0123456789abcdef"):
            raise ValueError(f"{self.key} {sid!r} is not an xxh3-64 hex digest")
        self.buckets[int(sid[:BUCKET_HEX], 16)] += 1
        self.rows.append(row)
        if len(self.rows) >= self.convert_rows:
            self._convert()
            if self.nbytes >= SPILL_BYTES:
                self.flush()

    def _convert(self) -> None:
        from manifests.io import as_manifest_table

        if self.rows:
            t = as_manifest_table(self.rows, self.kind)
            self.tables.append(t)
            self.nbytes += t.nbytes
            self.rows = []

    def flush(self) -> None:
        import pyarrow as pa

        from manifests.io import write_table
        from manifests.schemas import SORT_KEYS

        self._convert()
        if not self.tables:
            return
        t = pa.concat_tables(self.tables).sort_by([(k, "ascending") for k in SORT_KEYS[self.kind]])
        self.tables, self.nbytes = [], 0
        write_table(t, spill_path(self.directory, self.rank, self.runs), row_group_rows=self.group_rows)
        self.runs += 1


# --------------------------------------------------------------------------------------- reduce

def bucket_cuts(counts, world_size: int) -> list[int]:
    """``world_size`` contiguous bucket ranges balanced by rows (``slice_bounds`` of the row count, at
    bucket granularity): apply rank r owns buckets ``[cuts[r], cuts[r+1])``."""
    import numpy as np

    from ovpipe.mapreduce import slice_bounds

    below = np.concatenate([[0], np.cumsum(counts)])          # rows in buckets < b
    n = int(below[-1])
    return [int(np.searchsorted(below, slice_bounds(n, r, world_size)[0], side="left"))
            for r in range(world_size)] + [N_BUCKETS]


def spill_files(directory: Path, runs) -> list[Path]:
    """Every map rank's spill runs (``runs[r]`` of rank r), in (rank, run) order; a missing one is an
    error that says why: the step's finalize removes the shuffle once every apply rank is done (as a
    MapReduce job drops its map outputs), so redoing a rank of a finished step means redoing the step."""
    directory = Path(directory)
    files = [spill_path(directory, m, j) for m in range(len(runs)) for j in range(int(runs[m]))]
    gone = [f for f in files if not f.exists()]
    if gone:
        raise FileNotFoundError(
            f"{gone[0]} (and {len(gone) - 1} more): spill runs of the shuffle are missing — the step had finished "
            f"and its finalize removed them; to redo part of a finished {directory.parent.name}, remove "
            f"{directory.parent} and rerun the step")
    return files


# ---------------------------------------------------------------------------------------- apply

def _bucket_hex(b: int) -> str | None:
    return None if b >= N_BUCKETS else f"{b:0{BUCKET_HEX}x}"


def merge_prefix(tag: str = "") -> str:
    """The name prefix of a merge level's temp folder; ``tag`` (a task's rank, ``05d``) lets the rank's
    next try remove what a killed try left (``ovpipe.runfolder.cleanup.clean_temp_files``)."""
    return f".merge-{tag}-" if tag else ".merge-"


def merge_runs(files: list[Path], kind: str, buckets, lo_b: int, hi_b: int, stats=None,
               batch_rows: int = 65536, work_dir: Path | None = None, tag: str = "") -> Iterator:
    """The rows of the sorted runs ``files`` of manifest ``kind`` whose bucket is in ``[lo_b, hi_b)``, in
    canonical order (``SORT_KEYS``, ties by file then row: a stable sort of the runs concatenated in
    order), as record batches (``_merge_range``). Memory: one sub-range plus a partial row group per run,
    so at most ``MERGE_FAN_IN`` runs are merged at once: more are first merged, over the same bucket range,
    in consecutive groups of ``MERGE_FAN_IN`` into sorted runs under ``work_dir`` (a ``.merge-*`` folder,
    by default beside ``files[0]``; removed at the end), and those in turn, a level at a time. A group's
    run keeps its rows' order, ties by (file, row), and the groups follow the files' order, so the stable
    sort of the next level gives the one-level order. ``stats`` counts ``merge_subranges`` and
    ``merge_rows_read`` of the last level and ``merge_level_runs``, the runs written by the levels below."""
    from manifests.io import PartWriter

    def write_group(group: list[Path], path: Path, g: int, depth: int) -> Path:
        with PartWriter(path, kind, SPILL_GROUP_ROWS) as out:
            for b in _merge_range(group, kind, buckets, lo_b, hi_b, None, batch_rows):
                out.write(b)
        if stats is not None:
            stats.inc("merge_level_runs")
        return out.path

    files = [Path(f) for f in files]
    if lo_b >= hi_b:
        yield from _merge_range(files, kind, buckets, lo_b, hi_b, stats, batch_rows)
        return
    with _merge_levels(files, write_group, work_dir, tag) as (level, _):
        yield from _merge_range(level, kind, buckets, lo_b, hi_b, stats, batch_rows)


@contextlib.contextmanager
def _merge_levels(files: list[Path], write_group, work_dir: Path | None, tag: str):
    """``(runs, depth)``: ``files`` as they are when at most ``MERGE_FAN_IN``, else merged a level at a
    time — ``write_group(group, path, g, depth)`` merges the consecutive ``MERGE_FAN_IN`` runs from index
    ``g`` into the run at ``path`` — until at most ``MERGE_FAN_IN`` remain (``depth``: the levels written).
    The levels live in a ``.merge-*`` folder under ``work_dir`` (by default beside ``files[0]``); a level's
    runs are removed once the next is written, and the folder when the block ends."""
    import shutil
    import tempfile

    if len(files) <= MERGE_FAN_IN:
        yield files, 0
        return
    work = Path(tempfile.mkdtemp(prefix=merge_prefix(tag), dir=work_dir or files[0].parent))
    try:
        level, depth = files, 0
        while len(level) > MERGE_FAN_IN:
            runs = [write_group(level[g:g + MERGE_FAN_IN], work / f"level{depth}-{g // MERGE_FAN_IN:05d}.parquet",
                                g, depth) for g in range(0, len(level), MERGE_FAN_IN)]
            if depth:
                for f in level:
                    f.unlink()
            level, depth = runs, depth + 1
        yield level, depth
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _merge_range(files: list[Path], kind: str, buckets, lo_b: int, hi_b: int, stats, batch_rows: int) -> Iterator:
    """``merge_runs`` over at most ``MERGE_FAN_IN`` runs. The range is cut into sub-ranges of whole buckets
    holding about ``MERGE_BYTES`` of decoded rows (from ``buckets``, the global counts, and the runs' bytes
    per row); for each, every run's row groups whose [min, max] key overlaps it (footer statistics, read
    once) are read, filtered to the sub-range, concatenated in run order and stably sorted. Memory: one
    sub-range, plus at most a partial row group per run at each end."""
    import bisect

    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from manifests.schemas import SORT_KEYS

    if not files or lo_b >= hi_b:
        return
    key = SORT_KEYS[kind][0]
    index, nbytes, nrows = [], 0, 0
    for f in files:
        md = pq.ParquetFile(f).metadata
        col = md.schema.to_arrow_schema().get_field_index(key)
        mins, maxs, groups = [], [], []
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            nbytes, nrows = nbytes + rg.total_byte_size, nrows + rg.num_rows
            if rg.num_rows:
                st = rg.column(col).statistics
                mins.append(st.min)
                maxs.append(st.max)
                groups.append(g)
        index.append((f, mins, maxs, groups))
    per_chunk = max(1, int(MERGE_BYTES / max(nbytes / max(nrows, 1), 1)))
    keys = [(k, "ascending") for k in SORT_KEYS[kind]]
    cum = np.concatenate([[0], np.cumsum(buckets[lo_b:hi_b])])
    a = 0
    while a < hi_b - lo_b:
        b = max(int(np.searchsorted(cum, cum[a] + per_chunk, side="right")) - 1, a + 1)   # whole buckets
        lo, hi = _bucket_hex(lo_b + a), _bucket_hex(lo_b + b)
        tables, read = [], 0
        for f, mins, maxs, groups in index:
            g0 = bisect.bisect_left(maxs, lo)                    # first group reaching the sub-range
            g1 = bisect.bisect_left(mins, hi) if hi is not None else len(mins)   # groups starting before its end
            if g0 >= g1:
                continue
            t = pq.ParquetFile(f).read_row_groups(groups[g0:g1], use_threads=False)
            read += t.num_rows
            ids = t.column(key)
            keep = pc.greater_equal(ids, lo) if hi is None else pc.and_(pc.greater_equal(ids, lo), pc.less(ids, hi))
            tables.append(t.filter(keep))
        if stats is not None:
            stats.inc("merge_subranges")
            stats.inc("merge_rows_read", read)      # rows decoded: the sub-range's + the partial row groups
        if tables:
            t = pa.concat_tables(tables)
            del tables
            if t.num_rows:
                yield from t.sort_by(keys).to_batches(max_chunksize=batch_rows)
            del t
        a = b


# ------------------------------------------------------------------------------ first occurrences

class FirstOccurrence:
    """Over a stream of batches in ``key`` order (the state carries across batches): which rows repeat an
    earlier row's key, and the ``origin`` columns of that earlier, first row."""

    def __init__(self, key: str, origin: tuple[str, ...] = ()):
        self.key, self.origin = key, tuple(origin)
        self.prev, self.first = None, None

    def repeats(self, batch) -> list[tuple | None] | None:
        """None when no row of ``batch`` repeats a key; else per row None (a first occurrence) or the
        first occurrence's ``origin`` values (a tuple, ``()`` without ``origin``)."""
        import pyarrow.compute as pc

        ids = batch.column(self.key)
        n = batch.num_rows
        if n == 0:
            return None
        if not ((self.prev is not None and ids[0].as_py() == self.prev)
                or (n > 1 and pc.any(pc.equal(ids.slice(1), ids.slice(0, n - 1))).as_py())):
            self.prev = ids[n - 1].as_py()
            self.first = tuple(batch.column(c)[n - 1].as_py() for c in self.origin)
            return None
        keys = ids.to_pylist()
        origin = [batch.column(c).to_pylist() for c in self.origin]
        out: list[tuple | None] = []
        for i in range(n):
            if keys[i] != self.prev:
                self.prev, self.first = keys[i], tuple(o[i] for o in origin)
                out.append(None)
            else:
                out.append(self.first)
        return out


# ----------------------------------------------------------------------------------- sorted parts

def merge_sorted(files: list[Path], key: str, columns: list[str], batch_rows: int = 65536,
                 work_dir: Path | None = None, tag: str = "") -> Iterator:
    """The rows of ``files`` — Parquet parts each sorted by ``key`` — merged into (key, file, row) order, as
    tables of ``columns`` plus ``_file`` (the index in ``files``) and ``_row`` (the row in that file). A
    k-way merge a batch at a time (``_kway``). Memory: per merged file, the row group being read
    (pyarrow fetches a column chunk whole) of ``columns`` and a batch or two — so at most ``MERGE_FAN_IN``
    files are merged at once: more are first merged in consecutive groups of ``MERGE_FAN_IN`` into sorted
    runs under ``work_dir`` (a ``.merge-*`` folder, by default beside ``files[0]``; removed at the end),
    each row carrying its original ``_file`` and ``_row``, and those runs merged in turn, a level at a
    time. The order is the same: ties are broken by the carried (file, row). A file whose rows are not in
    ``key`` order is an error naming it (the merge would be wrong, not slow)."""
    read = columns if key in columns else [key, *columns]

    def write_group(group: list[Path], path: Path, g: int, depth: int) -> Path:
        # a level's runs carry their rows' original (_file, _row); the first level makes them
        return _write_run(path, _kway(group, key, read, read, batch_rows, carried=depth > 0, first=g), batch_rows)

    with _merge_levels([Path(f) for f in files], write_group, work_dir, tag) as (level, depth):
        yield from _kway(level, key, read, columns, batch_rows, carried=depth > 0)


def _write_run(path: Path, tables, group_rows: int) -> Path:
    """An intermediate run of ``merge_sorted``: the merged tables as they come, in row groups of at most
    ``group_rows`` (the merge batch) — the next level reads a row group whole, per run."""
    import pyarrow.parquet as pq

    writer = None
    try:
        for t in tables:
            if writer is None:
                writer = pq.ParquetWriter(path, t.schema, compression="zstd")
            writer.write_table(t, row_group_size=group_rows)
    finally:
        if writer is not None:
            writer.close()
    return path


def _kway(files: list[Path], key: str, read: list[str], columns: list[str], batch_rows: int, carried: bool,
          first: int = 0) -> Iterator:
    """``merge_sorted`` over at most ``MERGE_FAN_IN`` files: each file's next batch is read, and every
    buffered row whose key is below the smallest last key of the files still open is final (no later row
    can come before it). ``carried``: the files are ``merge_sorted``'s own runs, whose rows already carry
    their original ``_file`` and ``_row``; else those are made here (``_file`` numbered from ``first``)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    cols = [*read, "_file", "_row"] if carried else read
    readers, buffers, rows, last = [], [], [], []
    for f in files:
        readers.append(pq.ParquetFile(f, pre_buffer=False).iter_batches(batch_size=batch_rows, columns=cols,
                                                                         use_threads=False))
        buffers.append(None)
        rows.append(0)
        last.append(None)

    def pull(i: int) -> bool:
        """Append file i's next batch to its buffer; False when the file is done."""
        for batch in readers[i]:
            if batch.num_rows == 0:
                continue
            k = batch.column(key)
            if (last[i] is not None and k[0].as_py() < last[i]) or (
                    batch.num_rows > 1 and pc.any(pc.less(k.slice(1), k.slice(0, batch.num_rows - 1))).as_py()):
                raise ValueError(f"{files[i]}: rows are not in {key} order — merge_sorted needs each part sorted "
                                 f"(manifests.io.write_part(sort=True))")
            last[i] = k[batch.num_rows - 1].as_py()
            t = pa.Table.from_batches([batch])
            if not carried:
                t = t.append_column("_file", pa.array([first + i] * batch.num_rows, pa.int32()))
                t = t.append_column("_row", pa.array(range(rows[i], rows[i] + batch.num_rows), pa.int64()))
            rows[i] += batch.num_rows
            buffers[i] = t if buffers[i] is None else pa.concat_tables([buffers[i], t])
            return True
        readers[i] = None
        return False

    for i in range(len(files)):
        pull(i)
    while True:
        for i in range(len(files)):
            if readers[i] is not None and (buffers[i] is None or buffers[i].num_rows == 0):
                pull(i)
        live = [i for i in range(len(files)) if buffers[i] is not None and buffers[i].num_rows]
        if not live:
            return
        open_ = [i for i in live if readers[i] is not None]
        frontier = min(buffers[i].column(key)[-1].as_py() for i in open_) if open_ else None
        taken = []
        for i in live:
            t = buffers[i]
            n = t.num_rows if frontier is None else int(pc.sum(pc.less(t.column(key), frontier)).as_py() or 0)
            if n:
                taken.append(t.slice(0, n))
                buffers[i] = t.slice(n)
        if not taken:      # every buffered row is at the frontier: read further in the files that end there
            for i in open_:
                if buffers[i].column(key)[-1].as_py() == frontier:
                    pull(i)
            continue
        merged = pa.concat_tables(taken).sort_by([(key, "ascending"), ("_file", "ascending"), ("_row", "ascending")])
        yield merged.select([*columns, "_file", "_row"]).combine_chunks()
