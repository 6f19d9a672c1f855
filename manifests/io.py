"""Atomic, schema-checked Parquet parts, merged manifest reads, the one streaming reader and the DuckDB
connection every step's out-of-core work uses.

Layout: ``RUN/<step>/<kind>/part-{rank:05d}.parquet``. Writers go through ``write_part`` / ``PartWriter``
(``atomic_write``: a temp name in the same folder, renamed when whole), so a killed task leaves either a
whole part or none. Parquet settings are fixed (zstd, one row group per 1M rows, no pandas metadata) so
the same table always gives the same bytes. ``read_manifest`` reads a manifest whole in canonical order;
``iter_parts`` streams any row range of a list of parts, one row group decoded at a time
(``docs/foundation.md``, "The streaming reader"); ``duckdb_session`` is DuckDB under a memory limit,
spilling to a folder of its own.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from manifests.schemas import SORT_KEYS, ManifestSchemaError, schema_for

PARQUET_OPTS = dict(compression="zstd", row_group_size=1 << 20, write_statistics=True)
# Kinds whose rows are large get smaller row groups: a streamed reader (``iter_parts``) holds one row
# group, and a ``PartWriter`` filling one about twice that (the buffer and its compressed copy); 1M rollouts
# of a few KB of response each, 1M captions of up to 256 new tokens (≈ 1 KB), or 1M RL prompts with their
# images inline would be gigabytes to hundreds of gigabytes. Rollouts: 1,024 responses of an 8K-token
# chain of thought (≈ 32 KB) are 32 MB.
ROW_GROUP_ROWS = {"rollouts": 1024, "captions": 1 << 14, "rl_prompts": 512}


def temp_path(path: str | os.PathLike) -> Path:
    """The temp name a file is written under before its rename: ``.tmp-{pid}-{name}`` in the same folder
    (same filesystem, so the rename is atomic; ``runfolder.cleanup.clean_temp_files`` knows the pattern)."""
    path = Path(path)
    return path.with_name(f".tmp-{os.getpid()}-{path.name}")


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[Path]:
    """``with atomic_write(path) as tmp: <write tmp>``: ``path`` appears whole (``os.replace``) when the block
    ends, or not at all — a block that raises removes its temp file. Every file ovpipe writes goes through it
    (parts, partials, reduced artifacts, stats, markers, shards), so a killed task never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def as_manifest_table(data, kind: str) -> pa.Table:
    """``data`` (a table, a record batch, a mapping of columns or a list of rows) as a table of manifest ``kind``'s schema, or
    ``ManifestSchemaError`` naming the column."""
    schema = schema_for(kind)
    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    if isinstance(data, pa.Table):
        table = data
    elif isinstance(data, Mapping):
        table = pa.table({f.name: pa.array(data[f.name], type=f.type) for f in schema}, schema=schema)
    elif isinstance(data, Sequence):  # list of row dicts
        table = pa.Table.from_pylist(list(data), schema=schema)
    else:
        raise TypeError(f"cannot write {type(data).__name__} as manifest {kind!r}")
    missing = [f.name for f in schema if f.name not in table.column_names]
    extra = [n for n in table.column_names if n not in schema.names]
    if missing or extra:
        raise ManifestSchemaError(
            f"manifest {kind!r}: missing columns {missing}, unexpected columns {extra}")
    table = table.select(schema.names)
    try:
        return table.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise ManifestSchemaError(f"manifest {kind!r}: {e}") from e


def write_table(table: pa.Table, path: str | os.PathLike, row_group_rows: int | None = None) -> Path:
    """Write ``table`` to ``path`` atomically (temp file + rename); ``row_group_rows``: smaller row
    groups than ``PARQUET_OPTS``' (a spill file read back by key range)."""
    path = Path(path)
    table = table.replace_schema_metadata(None)
    opts = dict(PARQUET_OPTS, row_group_size=row_group_rows) if row_group_rows else PARQUET_OPTS
    with atomic_write(path) as tmp:
        pq.write_table(table, tmp, **opts)
    return path


def write_part(data, path: str | os.PathLike, kind: str, sort: bool = False) -> Path:
    """Validate ``data`` against ``kind``'s schema and write it atomically to ``path``."""
    table = as_manifest_table(data, kind)
    if sort and table.num_rows:
        table = table.sort_by([(k, "ascending") for k in SORT_KEYS[kind]])
    return write_table(table, path, ROW_GROUP_ROWS.get(kind))


def read_part(path: str | os.PathLike, kind: str, columns: Sequence[str] | None = None) -> pa.Table:
    """Read one part (only ``columns``, in that order, when given) after checking its footer's schema
    against ``kind``'s, naming file and column on error."""
    path = Path(path)
    check_part_schema(path, pq.read_schema(path), kind)
    names = schema_for(kind).names if columns is None else list(columns)
    return pq.read_table(path, columns=names).select(names)


def find_manifest_dirs(run_dir: str | os.PathLike) -> dict[str, list[Path]]:
    """All ``RUN/<step>/<kind>/`` folders holding parts, grouped by kind."""
    from manifests.schemas import SCHEMAS

    found: dict[str, list[Path]] = {}
    run_dir = Path(run_dir)
    for kind in SCHEMAS:
        dirs = sorted(d for d in run_dir.glob(f"*/{kind}") if d.is_dir() and any(d.glob("part-*.parquet")))
        if dirs:
            found[kind] = dirs
    return found


def manifest_files(run_dir: str | os.PathLike, kind: str, step: str | Sequence[str] | None = None) -> list[Path]:
    """The parts of ``kind`` under ``RUN/<step>/<kind>/`` — ``step`` one folder, a list of folders (every
    one must hold parts), or None (every folder of the run) — in path order."""
    run_dir = Path(run_dir)
    if step is None or isinstance(step, str):
        pattern = f"{step}/{kind}/part-*.parquet" if step else f"*/{kind}/part-*.parquet"
        files = sorted(run_dir.glob(pattern))
        if not files:
            where = f"{run_dir}/{step or '*'}/{kind}/"
            raise FileNotFoundError(
                f"no {kind!r} manifest parts under {where} — did you run the step that writes it?")
        return files
    if not step:
        raise FileNotFoundError(f"no {kind!r} manifest parts under {run_dir}/*/{kind}/ — "
                                f"did you run the step that writes it?")
    return sorted(f for s in step for f in manifest_files(run_dir, kind, s))


def read_manifest(run_dir: str | os.PathLike, kind: str, step: str | Sequence[str] | None = None,
                  columns: list[str] | None = None, sort: bool = True) -> pa.Table:
    """All parts of one manifest kind in a run folder, concatenated and (by default) in
    canonical order, so the result does not depend on how many tasks wrote it."""
    files = manifest_files(run_dir, kind, step)
    # only the asked columns (and the sort keys) are read: a manifest's heavy columns (inline images,
    # responses) cost nothing to a reader that does not use them
    need = None if columns is None else list(dict.fromkeys([*columns, *(SORT_KEYS[kind] if sort else ())]))
    tables = [read_part(f, kind, need) for f in files]
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    if sort and table.num_rows:
        table = table.sort_by([(k, "ascending") for k in SORT_KEYS[kind]])
    if columns is not None:
        table = table.select(columns)
    return table


# ------------------------------------------------------------------------------------- streaming
# A task reads its slice and writes its part in bounded Arrow record batches, so its memory does not
# grow with the corpus: ``iter_parts`` is the one streaming reader (``read_manifest(...).slice(lo, hi - lo)``
# as a stream of batches, one row group decoded at a time), ``PartWriter`` is ``write_part`` fed batch
# by batch (same bytes).

BATCH_ROWS = 65_536                           # rows per streamed batch
READ_ORDERS = ("canonical", "folders", "files")


def check_part_schema(path: Path, schema: pa.Schema, kind: str) -> None:
    """A part's schema (``pq.read_schema``: the footer only) against manifest ``kind``'s: every column
    present with its type, or ``ManifestSchemaError`` naming the file and the column."""
    for field in schema_for(kind):
        if field.name not in schema.names:
            raise ManifestSchemaError(f"{path}: column {field.name!r} missing (manifest {kind!r})")
        got = schema.field(field.name).type
        if got != field.type:
            raise ManifestSchemaError(
                f"{path}: column {field.name!r} has type {got}, manifest {kind!r} expects {field.type}")


def manifest_num_rows(run_dir: str | os.PathLike, kind: str, step: str | Sequence[str] | None = None) -> int:
    """Rows of a manifest, from the Parquet footers only."""
    return sum(pq.ParquetFile(f).metadata.num_rows for f in manifest_files(run_dir, kind, step))


def _canonical_by_footers(metas: list, kind: str) -> bool:
    key = SORT_KEYS[kind][0]
    last = None
    for md in metas:
        col = md.schema.to_arrow_schema().get_field_index(key)
        first_in_file = True
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            if rg.num_rows == 0:
                continue
            st = rg.column(col).statistics
            if st is None or not st.has_min_max:
                return False
            # within a part the writer sorted by every key, so an id may continue into the next row group;
            # across parts it must not (a tie would be ordered by the other keys, not by part)
            if last is not None and (not last < st.min if first_in_file else not last <= st.min):
                return False
            last, first_in_file = st.max, False
    return True


def parts_in_canonical_order(files: list[Path], kind: str) -> bool:
    """Whether reading the parts one after another already gives canonical order, judged from the
    footers: the first sort key's min/max per row group must increase from one row group to the next
    (strictly from one part to the next). Within a row group the writer's contract holds (``write_part`` sorts;
    ``embed-images`` keeps its canonical input order); ``iter_parts`` re-checks it as it reads."""
    return _canonical_by_footers([pq.ParquetFile(f).metadata for f in files], kind)


def duckdb_connect(temp_dir: str | os.PathLike, threads: int = 2):
    """A DuckDB connection for out-of-core work over manifests (a sort, a join, a count of the whole
    corpus): at most ``OVPIPE_REDUCE_MEMORY`` (default 1GB) of memory, spilling under ``temp_dir``, and
    ``threads`` threads (a task's share of a node, not all its cores)."""
    import duckdb

    return duckdb.connect(config={"memory_limit": os.environ.get("OVPIPE_REDUCE_MEMORY", "1GB"),
                                  "temp_directory": str(temp_dir), "threads": threads})


@contextlib.contextmanager
def duckdb_session(work_dir: str | os.PathLike, prefix: str = ".duckdb-", threads: int = 2):
    """``duckdb_connect`` spilling to a folder of its own under ``work_dir`` (tasks of one step run side by
    side), closed and removed when the block ends. What every step's DuckDB work goes through
    (``TaskContext.duckdb``)."""
    import shutil
    import tempfile

    Path(work_dir).mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=work_dir)
    con = duckdb_connect(tmp, threads)
    try:
        yield con
    finally:
        con.close()
        shutil.rmtree(tmp, ignore_errors=True)


def iter_parts(files: Sequence[str | os.PathLike], kind: str, columns: list[str] | None = None, lo: int = 0,
               hi: int | None = None, *, order: str = "canonical", batch_rows: int = BATCH_ROWS,
               spill_dir: str | os.PathLike | None = None) -> Iterator[pa.RecordBatch]:
    """Rows ``[lo, hi)`` of the manifest parts ``files`` of ``kind`` as record batches of at most
    ``batch_rows`` rows of ``columns`` (all of the schema's by default). The one streaming reader: every
    step's streamed read comes here (``TaskContext.iter_input``), and a task holds one row group and
    one batch, not its share.

    ``order`` says which row sequence ``[lo, hi)`` indexes:

    * ``canonical``: the rows of all ``files`` in canonical order, as ``read_manifest`` gives them.
      When the footers show the parts already lie in that order (every part of a step that sliced a
      canonical input), they are streamed as they lie and each batch is checked to be in order;
      otherwise DuckDB sorts them under its memory limit, spilling under ``spill_dir`` (ties broken
      by file and row, as a stable sort of the concatenated parts would).
    * ``folders``: each folder's parts in canonical order (as above), the folders concatenated in the
      order ``files`` lists them — ``lengths``' ``samples_steps``.
    * ``files``: the parts' rows as they lie, concatenated in the given order, unchecked — a map whose
      partials are sums, so the order does not matter.

    The row counts come from the footers and only the row groups overlapping ``[lo, hi)`` are read, one at
    a time (pyarrow decodes every row group it is handed at once, so handing it the share would hold the
    share); a batch never spans two row groups, so a task holds one row group and one batch of it. Every
    part's schema is checked from its footer first (``ManifestSchemaError`` naming the file and column)."""
    import itertools

    if order not in READ_ORDERS:
        raise ValueError(f"order must be one of {READ_ORDERS}, got {order!r}")
    files = [Path(f) for f in files]
    schema = schema_for(kind)
    columns = list(columns) if columns is not None else schema.names
    out_schema = pa.schema([schema.field(c) for c in columns])
    metas = []
    for f in files:
        with pq.ParquetFile(f) as pf:
            check_part_schema(f, pf.schema_arrow, kind)
            metas.append(pf.metadata)
    if order == "folders":
        segments = [list(g) for _, g in itertools.groupby(zip(files, metas), key=lambda fm: fm[0].parent)]
    else:
        segments = [list(zip(files, metas))]
    start = 0
    for seg in segments:
        n = sum(md.num_rows for _, md in seg)
        a, b = max(lo - start, 0), min(n if hi is None else hi - start, n)   # this segment's share of [lo, hi)
        start += n
        if a >= b:
            continue
        seg_files, seg_metas = [f for f, _ in seg], [md for _, md in seg]
        if order == "files":
            yield from _iter_as_they_lie(seg_files, seg_metas, kind, columns, out_schema, a, b, batch_rows, None)
        elif _canonical_by_footers(seg_metas, kind):
            key = SORT_KEYS[kind][0]
            yield from _iter_as_they_lie(seg_files, seg_metas, kind, columns, out_schema, a, b, batch_rows, key)
        else:
            yield from _iter_sorted_by_duckdb(seg_files, kind, columns, out_schema, a, b, batch_rows, spill_dir)


def _iter_as_they_lie(files, metas, kind, columns, out_schema, lo, hi, batch_rows, key):
    """Rows ``[lo, hi)`` of the parts concatenated, a row group at a time; ``key``: check each batch and
    the sequence are in that column's order."""
    import pyarrow.compute as pc

    read_cols = columns if key is None or key in columns else [*columns, key]
    last, start = None, 0
    for f, md in zip(files, metas):
        a, b = max(lo - start, 0), min(hi - start, md.num_rows)          # part-relative share of [lo, hi)
        start += md.num_rows
        if a >= b:
            continue
        with pq.ParquetFile(f, metadata=md, pre_buffer=False) as pf:
            for batch, pos in _row_group_batches(pf, md, a, b, read_cols, batch_rows):
                s, e = max(a - pos, 0), min(b - pos, batch.num_rows)
                if e <= s:
                    continue
                batch = batch.slice(s, e - s)
                if key is not None:
                    k = batch.column(key)
                    if (last is not None and pc.less(k[0], last).as_py()) or (
                            len(k) > 1 and pc.any(pc.less(k.slice(1), k.slice(0, len(k) - 1))).as_py()):
                        raise ManifestSchemaError(
                            f"{f}: rows are not in {key} order — a manifest part must be written sorted "
                            f"(manifests.io.write_part) or in its canonical input order")
                    last = k[-1]
                yield pa.RecordBatch.from_arrays([batch.column(c) for c in columns], schema=out_schema)


def _row_group_batches(pf, md, lo: int, hi: int, columns: list[str], batch_rows: int):
    """``(batch, file row of its first row)`` of the row groups overlapping ``[lo, hi)``, one row group
    handed to pyarrow at a time."""
    row = 0
    for g in range(md.num_row_groups):
        m = md.row_group(g).num_rows
        if row + m > lo and row < hi:
            pos = row
            for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[g], columns=columns, use_threads=False):
                yield batch, pos
                pos += batch.num_rows
        row += m


def _iter_sorted_by_duckdb(files, kind, columns, out_schema, lo, hi, batch_rows, spill_dir):
    import tempfile

    keys = ", ".join(f'"{k}"' for k in SORT_KEYS[kind])
    cols = ", ".join(f'"{c}"' for c in columns)
    paths = [str(f) for f in files]
    order = ", ".join(f"({k}, '{p.replace(chr(39), chr(39) * 2)}')" for k, p in enumerate(paths))
    with duckdb_session(spill_dir or tempfile.gettempdir(), prefix=".duckdb-sort-") as con:
        rel = con.sql(
            f"SELECT {cols} FROM read_parquet($files, filename = true, file_row_number = true) "
            f"JOIN (VALUES {order}) AS o(file_no, path) ON filename = o.path "
            f"ORDER BY {keys}, file_no, file_row_number LIMIT {hi - lo} OFFSET {lo}", params={"files": paths})
        for batch in rel.to_arrow_reader(batch_rows):
            if batch.num_rows:
                yield pa.Table.from_batches([batch]).cast(out_schema).to_batches()[0]


def iter_manifest(run_dir: str | os.PathLike, kind: str, step: str | Sequence[str] | None = None,
                  columns: list[str] | None = None, lo: int = 0, hi: int | None = None,
                  batch_rows: int = BATCH_ROWS) -> Iterator[pa.RecordBatch]:
    """Rows ``[lo, hi)`` of ``read_manifest(run_dir, kind, step, columns)`` (canonical order), streamed:
    ``iter_parts`` over ``manifest_files(run_dir, kind, step)``. For tools and tests; a step reads through
    ``TaskContext.iter_input``."""
    return iter_parts(manifest_files(run_dir, kind, step), kind, columns, lo, hi, batch_rows=batch_rows)


class PartWriter:
    """``write_part`` for a part produced batch by batch: each ``write(data)`` is validated against
    ``kind``'s schema and buffered to whole row groups (``PARQUET_OPTS``), so the file holds the same
    bytes ``write_part`` gives for the concatenated rows. Rows must arrive in canonical order (no sort
    here). Written to a temp name, renamed on a clean ``close``; an exception inside ``with`` removes it.

    ``row_group_rows``: smaller row groups than ``write_part``'s 1M, for an apply phase whose memory
    must stay one batch (the writer, and Parquet's dictionary encoder, hold a row group); the rows, and
    so the merged manifest, are the same, only the file's row-group layout differs.
    """

    def __init__(self, path: str | os.PathLike, kind: str, row_group_rows: int | None = None):
        self.path = Path(path)
        self.kind = kind
        self.group = row_group_rows or ROW_GROUP_ROWS.get(kind) or PARQUET_OPTS["row_group_size"]
        self._atomic = atomic_write(self.path)        # the temp name, renamed by close, removed on failure
        self.tmp = self._atomic.__enter__()
        self._writer: pq.ParquetWriter | None = None
        self._buffer: list[pa.Table] = []
        self._buffered = 0
        self.rows = 0

    def write(self, data) -> None:
        table = as_manifest_table(data, self.kind).replace_schema_metadata(None)
        self._buffer.append(table)
        self._buffered += table.num_rows
        self.rows += table.num_rows
        group = self.group
        while self._buffered >= group:
            whole = pa.concat_tables(self._buffer)
            self._flush(whole.slice(0, group))
            rest = whole.slice(group)
            self._buffer, self._buffered = [rest], rest.num_rows

    def _flush(self, table: pa.Table) -> None:
        if self._writer is None:
            opts = {k: v for k, v in PARQUET_OPTS.items() if k != "row_group_size"}
            self._writer = pq.ParquetWriter(self.tmp, table.schema, **opts)
        self._writer.write_table(table.combine_chunks(), row_group_size=self.group)

    def close(self) -> Path:
        if self._buffered or self._writer is None:   # the tail, or an empty part (schema only)
            tail = pa.concat_tables(self._buffer) if self._buffer else as_manifest_table(
                {f.name: [] for f in schema_for(self.kind)}, self.kind).replace_schema_metadata(None)
            self._flush(tail)
            self._buffer, self._buffered = [], 0
        self._writer.close()
        self._atomic.__exit__(None, None, None)
        return self.path

    def __enter__(self) -> "PartWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            if self._writer is not None:
                self._writer.close()
            self._atomic.__exit__(exc_type, exc, tb)
