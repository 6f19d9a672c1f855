"""Atomic, schema-checked Parquet parts and merged manifest reads.

Layout: ``RUN/<step>/<kind>/part-{rank:05d}.parquet``. Writers go through
``write_part`` (temp name in the same folder + ``os.replace``), so a killed task leaves
either a whole part or none. Parquet settings are fixed (zstd, one row group per 1M rows,
no pandas metadata) so the same table always gives the same bytes.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from manifests.schemas import SORT_KEYS, ManifestSchemaError, schema_for

PARQUET_OPTS = dict(compression="zstd", row_group_size=1 << 20, write_statistics=True)


def _as_table(data, kind: str) -> pa.Table:
    schema = schema_for(kind)
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


def write_table(table: pa.Table, path: str | os.PathLike) -> Path:
    """Write ``table`` to ``path`` atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    table = table.replace_schema_metadata(None)
    pq.write_table(table, tmp, **PARQUET_OPTS)
    os.replace(tmp, path)
    return path


def write_part(data, path: str | os.PathLike, kind: str, sort: bool = False) -> Path:
    """Validate ``data`` against ``kind``'s schema and write it atomically to ``path``."""
    table = _as_table(data, kind)
    if sort and table.num_rows:
        table = table.sort_by([(k, "ascending") for k in SORT_KEYS[kind]])
    return write_table(table, path)


def read_part(path: str | os.PathLike, kind: str) -> pa.Table:
    """Read one part and check it against ``kind``'s schema, naming file and column on error."""
    path = Path(path)
    table = pq.read_table(path)
    expected = schema_for(kind)
    for field in expected:
        if field.name not in table.column_names:
            raise ManifestSchemaError(f"{path}: column {field.name!r} missing (manifest {kind!r})")
        got = table.schema.field(field.name).type
        if got != field.type:
            raise ManifestSchemaError(
                f"{path}: column {field.name!r} has type {got}, manifest {kind!r} expects {field.type}")
    return table.select(expected.names)


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


def manifest_files(run_dir: str | os.PathLike, kind: str, step: str | None = None) -> list[Path]:
    run_dir = Path(run_dir)
    pattern = f"{step}/{kind}/part-*.parquet" if step else f"*/{kind}/part-*.parquet"
    files = sorted(run_dir.glob(pattern))
    if not files:
        where = f"{run_dir}/{step or '*'}/{kind}/"
        raise FileNotFoundError(
            f"no {kind!r} manifest parts under {where} — did you run the step that writes it?")
    return files


def read_manifest(run_dir: str | os.PathLike, kind: str, step: str | None = None,
                  columns: list[str] | None = None, sort: bool = True) -> pa.Table:
    """All parts of one manifest kind in a run folder, concatenated and (by default) in
    canonical order, so the result does not depend on how many tasks wrote it."""
    files = manifest_files(run_dir, kind, step)
    tables = [read_part(f, kind) for f in files]
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    if sort and table.num_rows:
        table = table.sort_by([(k, "ascending") for k in SORT_KEYS[kind]])
    if columns is not None:
        table = table.select(columns)
    return table
