"""Manifests: one Arrow schema per manifest kind, atomic Parquet parts, DuckDB views.

Every step writes its outputs as ``RUN/<step>/<kind>/part-{rank:05d}.parquet``. A part is
written to ``.tmp-…`` and renamed when whole, so a reader never sees half a file. Readers
validate the schema and name the file and column that disagree.

This package imports pyarrow (and DuckDB lazily) only — never torch.
"""
from manifests.schemas import SCHEMAS, SORT_KEYS, schema_for, ManifestSchemaError
from manifests.io import (
    write_part,
    write_table,
    read_part,
    read_manifest,
    manifest_files,
    find_manifest_dirs,
)

__all__ = [
    "SCHEMAS",
    "SORT_KEYS",
    "schema_for",
    "ManifestSchemaError",
    "write_part",
    "write_table",
    "read_part",
    "read_manifest",
    "manifest_files",
    "find_manifest_dirs",
]
