"""DuckDB over a run folder: one view per manifest kind found, canned reports from .sql files."""
from __future__ import annotations

from pathlib import Path

from manifests.io import find_manifest_dirs

QUERIES_DIR = Path(__file__).with_name("queries")


def connect(run_dir: str | Path, database: str = ":memory:"):
    """A DuckDB connection with a view named after every manifest kind in ``run_dir``."""
    import duckdb

    con = duckdb.connect(database)
    for kind, dirs in find_manifest_dirs(run_dir).items():
        globs = ", ".join(f"'{(d / 'part-*.parquet').as_posix()}'" for d in dirs)
        con.execute(f"CREATE VIEW {kind} AS SELECT * FROM read_parquet([{globs}], union_by_name=true)")
    return con


def views(con) -> list[str]:
    return [r[0] for r in con.execute(
        "SELECT view_name FROM duckdb_views() WHERE NOT internal ORDER BY 1").fetchall()]


def canned_queries() -> list[Path]:
    """Report queries: ``queries/<NN>_<kind>_<title>.sql``; a query runs when its kind's view exists."""
    return sorted(QUERIES_DIR.glob("*.sql"))


def query_kind(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("-- requires:"), f"{path} must start with '-- requires: <view>[, <view>]'"
    return first.split(":", 1)[1].strip()


def run_report(run_dir: str | Path) -> list[tuple[str, object]]:
    """Run every canned query whose views exist; returns (title, duckdb relation result)."""
    con = connect(run_dir)
    have = set(views(con))
    out = []
    for q in canned_queries():
        needed = {v.strip() for v in query_kind(q).split(",")}
        if needed <= have:
            title = q.stem.split("_", 1)[1].replace("_", " ")
            out.append((title, con.sql(q.read_text())))
    return out
