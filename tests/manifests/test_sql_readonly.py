"""`ovpipe sql` is read-only and confined to the run folder.

Each attack below worked before: COPY wrote anywhere (and over manifests), read_text/read_csv/glob read
any file, ATTACH made databases, INSTALL/LOAD tried extensions. Two layers stop them: only read statements
are accepted (check_read_only), and the connection itself is locked to the run folder (lock_down).
"""
from __future__ import annotations

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from manifests.catalog import ReadOnlyError, check_read_only, connect, views
from manifests.io import write_part
from ovpipe.cli import main


def _lengths_rows(ids):
    return [{"sample_id": s, "source": "x", "text_tokens": 3, "image_tokens": 4, "total_tokens": 7,
             "target_tokens": 3, "turns_kept": 1, "images": 0, "vit_sq": 0, "status": "ok", "error": None} for s in ids]


@pytest.fixture
def run(tmp_path):
    """RUN with lengths (two parts) and balanced; OUT is a sibling "run2" (shares RUN's name as a prefix)."""
    run = tmp_path / "run"
    write_part(_lengths_rows(["a", "b"]), run / "lengths" / "lengths" / "part-00000.parquet", "lengths")
    write_part(_lengths_rows(["c"]), run / "lengths" / "lengths" / "part-00001.parquet", "lengths")
    write_part([{"sample_id": s, "weight": 1.0, "copies": n} for s, n in [("a", 2), ("b", 1), ("c", 3)]],
               run / "balance" / "balanced" / "part-00000.parquet", "balanced")
    (run / "lengths" / "notes.txt").write_text("inside the run\n")
    out = tmp_path / "run2"
    out.mkdir()
    (out / "secret.txt").write_text("TOP-SECRET\n")
    (out / "secret.csv").write_text("k,v\nTOP-SECRET,1\n")
    pq.write_table(pa.table({"k": ["TOP-SECRET"]}), out / "secret.parquet")
    return run


def _snapshot(run):
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _sql(run, query, capsys, fmt="json"):
    rc = main(["sql", str(run), query, "--format", fmt])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _assert_refused(rc, out, err, *expect):
    assert rc == 2, (out, err)
    assert err.startswith("ovpipe sql: ") and err.count("\n") == 1, err    # one line, no traceback
    assert "Traceback" not in err and "TOP-SECRET" not in out + err
    for e in expect:
        assert e in err, err


def test_selects_joins_describe_show_explain_still_work(run, capsys):
    rc, out, err = _sql(run, "SELECT l.sample_id, b.copies FROM lengths l JOIN balanced b USING (sample_id) "
                             "ORDER BY 1", capsys)
    assert rc == 0, err
    assert out.splitlines() == ['{"sample_id": "a", "copies": 2}', '{"sample_id": "b", "copies": 1}',
                                '{"sample_id": "c", "copies": 3}']
    assert _sql(run, "SELECT 1 AS x; SELECT sum(total_tokens) AS n FROM lengths", capsys)[1] == '{"n": 21}\n'
    rc, out, _ = _sql(run, "DESCRIBE lengths", capsys)
    assert rc == 0 and '"column_name": "total_tokens"' in out
    rc, out, _ = _sql(run, "SHOW TABLES", capsys)
    assert rc == 0 and '"name": "balanced"' in out and '"name": "lengths"' in out
    assert _sql(run, "EXPLAIN SELECT * FROM lengths", capsys)[0] == 0
    assert _sql(run, "EXPLAIN ANALYZE SELECT count(*) FROM lengths", capsys)[0] == 0
    rc, out, _ = _sql(run, "SELECT count(*) FROM lengths", capsys, fmt="table")
    assert rc == 0 and "3" in out
    # reading files inside the run folder directly is allowed
    rc, out, _ = _sql(run, f"SELECT content FROM read_text('{run}/lengths/notes.txt')", capsys)
    assert rc == 0 and "inside the run" in out


def test_views_work_through_a_symlinked_run_dir(run, tmp_path, capsys):
    link = tmp_path / "link"
    link.symlink_to(run)
    rc, out, err = _sql(link, "SELECT count(*) AS n FROM lengths", capsys)
    assert (rc, out) == (0, '{"n": 3}\n'), err


@pytest.mark.parametrize("query, words", [
    ("COPY (SELECT 1) TO '{out}/copied.csv'", ["not COPY"]),
    ("COPY lengths TO '{run}/lengths/lengths/part-00000.parquet' (FORMAT parquet)", ["not COPY"]),
    ("COPY lengths TO '{run}/lengths/lengths/part-00002.parquet' (FORMAT parquet)", ["not COPY"]),
    ("CREATE TABLE t AS SELECT * FROM lengths", ["not CREATE"]),
    ("CREATE VIEW v AS SELECT * FROM read_text('{out}/secret.txt')", ["not CREATE"]),
    ("INSERT INTO lengths SELECT * FROM lengths", ["not INSERT"]),
    ("DROP VIEW lengths", ["not DROP"]),
    ("ATTACH '{out}/new.duckdb' AS x", ["not ATTACH"]),
    ("INSTALL httpfs", ["not LOAD"]),
    ("LOAD httpfs", ["not LOAD"]),
    ("SET enable_external_access = true", ["not SET"]),
    ("PRAGMA enable_profiling", ["not PRAGMA"]),
    ("SELECT 1; COPY (SELECT 1) TO '{out}/copied.csv'", ["not COPY"]),
    ("SELECT count(*) FROM lengths; DROP VIEW lengths; SELECT 1", ["not DROP"]),
    ("EXPLAIN ANALYZE COPY lengths TO '{run}/lengths/lengths/part-00000.parquet' (FORMAT parquet)",
     ["EXPLAIN is allowed only of a SELECT"]),
    ("EXPLAIN (ANALYZE) CREATE TABLE t AS SELECT 1", ["EXPLAIN is allowed only of a SELECT"]),
])
def test_writes_and_settings_are_refused_and_change_nothing(run, capsys, query, words):
    before = _snapshot(run)
    out_dir = run.parent / "run2"
    rc, out, err = _sql(run, query.format(run=run, out=out_dir), capsys)
    _assert_refused(rc, out, err, *words)
    assert _snapshot(run) == before
    assert sorted(p.name for p in out_dir.iterdir()) == ["secret.csv", "secret.parquet", "secret.txt"]
    # the view survived (DROP VIEW was refused) and reads the same rows
    assert _sql(run, "SELECT count(*) AS n FROM lengths", capsys)[1] == '{"n": 3}\n'


@pytest.mark.parametrize("query", [
    "SELECT content FROM read_text('{out}/secret.txt')",
    "SELECT content FROM read_text('{run}/../run2/secret.txt')",    # .. does not escape the run folder
    "SELECT content FROM read_text('/etc/passwd')",
    "SELECT * FROM read_csv('{out}/secret.csv')",
    "SELECT * FROM '{out}/secret.csv'",
    "SELECT * FROM read_parquet('{out}/secret.parquet')",
    "SELECT * FROM glob('/root/**')",
    "SELECT * FROM glob('{out}/*')",
    "DESCRIBE SELECT * FROM read_text('{out}/secret.txt')",
    "SELECT count(*) FROM lengths; SELECT content FROM read_text('{out}/secret.txt')",
])
def test_selects_cannot_read_outside_the_run_folder(run, capsys, query):
    rc, out, err = _sql(run, query.format(run=run, out=run.parent / "run2"), capsys)
    _assert_refused(rc, out, err, "Permission Error")


def test_connection_is_locked_even_without_the_statement_filter(run):
    """The second layer: a locked connection refuses these itself, whatever statement reaches it."""
    out = run.parent / "run2"
    con = connect(run, lock=True)
    assert views(con) == ["balanced", "lengths"]
    assert con.execute("SELECT count(*) FROM lengths JOIN balanced USING (sample_id)").fetchone() == (3,)
    settings = dict(con.execute("SELECT name, value FROM duckdb_settings() WHERE name IN ('enable_external_access',"
                                " 'lock_configuration', 'autoinstall_known_extensions',"
                                " 'autoload_known_extensions')").fetchall())
    assert settings == {"enable_external_access": "false", "lock_configuration": "true",
                        "autoinstall_known_extensions": "false", "autoload_known_extensions": "false"}
    for sql in ["SET enable_external_access = true", "RESET lock_configuration", "SET lock_configuration = false",
                "SET allowed_directories = ['/']", "SET autoload_known_extensions = true"]:
        with pytest.raises(duckdb.Error, match="locked"):
            con.execute(sql)
    for sql in [f"COPY (SELECT 1) TO '{out}/copied.csv'", f"ATTACH '{out}/new.duckdb' AS x",
                "INSTALL httpfs", "LOAD httpfs", f"SELECT * FROM read_text('{out}/secret.txt')",
                "SELECT * FROM glob('/root/**')"]:
        with pytest.raises(duckdb.PermissionException):
            con.execute(sql)
    assert not (out / "copied.csv").exists() and not (out / "new.duckdb").exists()


def test_check_read_only_types():
    for ok in ["SELECT 1", "FROM (SELECT 1 AS x)", "WITH a AS (SELECT 1) SELECT * FROM a", "DESCRIBE SELECT 1",
               "SHOW TABLES", "EXPLAIN SELECT 1", "explain analyze select 1", "EXPLAIN (FORMAT json) SELECT 1"]:
        check_read_only(ok)
    for bad in ["", ";", "CALL glob('*')", "UPDATE t SET a = 1", "DELETE FROM t", "DETACH x", "USE x",
                "EXPORT DATABASE 'x'", "SET VARIABLE v = 1", "CHECKPOINT", "EXPLAIN INSERT INTO t VALUES (1)"]:
        with pytest.raises(ReadOnlyError):
            check_read_only(bad)


def test_sql_errors_are_one_line_exit_2(run, tmp_path, capsys):
    rc, out, err = _sql(run, "SELEC 1", capsys)
    _assert_refused(rc, out, err, "syntax error")
    rc, out, err = _sql(run, "SELECT nope FROM lengths", capsys)
    _assert_refused(rc, out, err, "nope")
    rc, out, err = _sql(run, "SELECT * FROM samples", capsys)    # no such view in this run
    _assert_refused(rc, out, err, "samples")
    rc, out, err = _sql(tmp_path / "missing", "SELECT 1", capsys)
    _assert_refused(rc, out, err, "does not exist")


def test_report_still_works_on_a_locked_connection(run, capsys):
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "# ovpipe report:" in out and "lengths by status" in out
