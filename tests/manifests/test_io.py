import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from manifests import ManifestSchemaError, read_manifest, read_part, write_part
from manifests.catalog import connect, views


def _lengths_rows(ids):
    return [{"sample_id": s, "source": "x", "text_tokens": 3, "image_tokens": 4, "total_tokens": 7,
             "status": "ok", "error": None} for s in ids]


def test_write_part_is_atomic_and_sorted(tmp_path):
    path = tmp_path / "pack" / "lengths" / "part-00000.parquet"
    write_part(_lengths_rows(["b", "a", "c"]), path, "lengths", sort=True)
    assert path.exists()
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp")]
    t = read_part(path, "lengths")
    assert t.column("sample_id").to_pylist() == ["a", "b", "c"]


def test_write_part_rejects_missing_and_extra_columns(tmp_path):
    rows = _lengths_rows(["a"])
    del rows[0]["status"]
    with pytest.raises(ManifestSchemaError, match="status"):
        write_part(pa.Table.from_pylist(rows), tmp_path / "x.parquet", "lengths")
    rows = _lengths_rows(["a"])
    rows[0]["surprise"] = 1
    with pytest.raises(ManifestSchemaError, match="surprise"):
        write_part(pa.Table.from_pylist(rows), tmp_path / "x.parquet", "lengths")


def test_read_part_names_file_and_column(tmp_path):
    bad = pa.table({"sample_id": ["a"], "source": ["x"], "text_tokens": ["three"], "image_tokens": [1],
                    "total_tokens": [1], "status": ["ok"], "error": [None]})
    path = tmp_path / "s" / "lengths" / "part-00000.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(bad, path)
    with pytest.raises(ManifestSchemaError) as e:
        read_part(path, "lengths")
    assert str(path) in str(e.value) and "text_tokens" in str(e.value)


def test_read_manifest_is_order_independent_of_parts(tmp_path):
    write_part(_lengths_rows(["d", "a"]), tmp_path / "lengths" / "lengths" / "part-00000.parquet", "lengths")
    write_part(_lengths_rows(["c", "b"]), tmp_path / "lengths" / "lengths" / "part-00001.parquet", "lengths")
    t = read_manifest(tmp_path, "lengths")
    assert t.column("sample_id").to_pylist() == ["a", "b", "c", "d"]
    with pytest.raises(FileNotFoundError, match="did you run"):
        read_manifest(tmp_path, "packs")


def test_duckdb_views_one_per_manifest(tmp_path):
    write_part(_lengths_rows(["a", "b"]), tmp_path / "lengths" / "lengths" / "part-00000.parquet", "lengths")
    con = connect(tmp_path)
    assert views(con) == ["lengths"]
    assert con.execute("SELECT count(*), sum(total_tokens) FROM lengths").fetchone() == (2, 14)


def test_same_table_same_bytes(tmp_path):
    a = write_part(_lengths_rows(["x", "y"]), tmp_path / "a.parquet", "lengths")
    b = write_part(_lengths_rows(["x", "y"]), tmp_path / "b.parquet", "lengths")
    assert a.read_bytes() == b.read_bytes()
