"""DuckDB over a run folder: one view per manifest kind found, canned reports from .sql files.

``ovpipe sql`` and ``ovpipe report`` use ``connect(run_dir, lock=True)`` and ``run_sql``: the connection
can read only inside the run folder, cannot load extensions or change its settings, and accepts only
SELECT / EXPLAIN / DESCRIBE / SHOW statements (a console over a run must not rewrite its manifests).
"""
from __future__ import annotations

import re
from pathlib import Path

from manifests.io import find_manifest_dirs

QUERIES_DIR = Path(__file__).with_name("queries")

# DuckDB parses DESCRIBE, SHOW and SUMMARIZE as SELECT statements, so these two types cover all four.
READ_STATEMENT_TYPES = ("SELECT", "EXPLAIN")
# EXPLAIN ANALYZE runs its statement: ``EXPLAIN ANALYZE COPY (...) TO 'RUN/step/samples/part-0.parquet'``
# would overwrite a manifest (COPY into the run folder passes allowed_directories), so the statement
# behind EXPLAIN must itself be a SELECT. A form this does not recognise fails to parse and is refused.
_EXPLAIN_PREFIX = re.compile(r"^(?:\s|--[^\n]*\n|/\*.*?\*/)*EXPLAIN\s*(?:ANALY[SZ]E\b|\([^()]*\))?",
                            re.IGNORECASE | re.DOTALL)


class ReadOnlyError(ValueError):
    """A statement that ``ovpipe sql`` refuses to run (anything but a read)."""


def _sql_str(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def connect(run_dir: str | Path, database: str = ":memory:", lock: bool = False):
    """A DuckDB connection with a view named after every manifest kind in ``run_dir``.

    ``lock=True`` confines the connection to ``run_dir`` (see ``lock_down``) once the views exist.
    """
    import duckdb

    # Resolved, so the view paths and allowed_directories agree even when run_dir is a symlink.
    run_dir = Path(run_dir).resolve()
    con = duckdb.connect(database)
    for kind, dirs in find_manifest_dirs(run_dir).items():
        for name, sql in view_sql(kind, dirs):
            con.execute(f"CREATE VIEW {name} AS {sql}")
    steps = step_table(run_dir)
    if steps.num_rows:
        con.register("steps", steps)
    if lock:
        lock_down(con, run_dir)
    return con


def _per_sample(kind: str) -> bool:
    from manifests.schemas import schema_for

    names = schema_for(kind).names
    return "sample_id" in names and "status" in names


def view_sql(kind: str, dirs: list[Path]) -> list[tuple[str, str]]:
    """``[(view, SELECT)]`` of manifest ``kind`` held in the step folders ``dirs``.

    Every view carries ``folder``, the step folder each row came from (``ingest``, ``ingest-llava``, ``pack-align``,
    ``rollout-vlm``): a run holds a kind in several folders, and a figure over all of them adds up different
    steps. The key of a per-sample view (one with ``sample_id`` and ``status``) is ``(folder, sample_id)``: ingest
    keeps a repeated sample's id (the id is its content's xxh3, which the canonical order and every uint64 id
    path rely on) and marks the later copies ``duplicate``; those copies are the view ``sample_duplicates``, and
    the rows later steps carry for them are left out of their views, so a join by ``sample_id`` counts each
    sample once (``docs/foundation.md``)."""
    parts = [f"SELECT *, {_sql_str(d.parent.name)} AS folder FROM read_parquet("
             f"[{_sql_str((d / 'part-*.parquet').as_posix())}], union_by_name=true)" for d in dirs]
    union = " UNION ALL BY NAME ".join(parts)
    if not _per_sample(kind):
        return [(kind, union)]
    out = [(kind, f"SELECT * FROM ({union}) WHERE status IS DISTINCT FROM 'duplicate'")]
    if kind == "samples":
        out.append(("sample_duplicates", f"SELECT * FROM ({union}) WHERE status = 'duplicate'"))
    return out


def step_table(run_dir: str | Path):
    """One row per step folder of the run (``RUN/<step>/`` and one level down, ``pretrain/stage-<S>``): the
    ``steps`` table of ``ovpipe sql``. ``folder``, ``step`` (what ran there), ``tasks``, ``tasks_done`` (map
    ranks with a completion marker), ``finalized``, ``config_hash`` and ``inputs`` (the folders it read, as
    its ``executor.json`` recorded them), read from the files the executors write — so a training stage is a
    row like ``ingest``."""
    import json

    import pyarrow as pa

    run_dir = Path(run_dir)
    rows = []
    for meta in sorted([*run_dir.glob("*/executor.json"), *run_dir.glob("*/*/executor.json")]):
        try:
            m = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
        comp = meta.parent / "completions"
        done = sum(1 for p in comp.iterdir() if p.name.isdigit()) if comp.is_dir() else 0
        rows.append({"folder": meta.parent.relative_to(run_dir).as_posix(), "step": m.get("step"),
                     "tasks": m.get("tasks"), "tasks_done": done, "finalized": (comp / "finalized").exists(),
                     "config_hash": m.get("config_hash"), "inputs": sorted(m.get("inputs") or {})})
    schema = pa.schema([("folder", pa.string()), ("step", pa.string()), ("tasks", pa.int64()),
                        ("tasks_done", pa.int64()), ("finalized", pa.bool_()), ("config_hash", pa.string()),
                        ("inputs", pa.list_(pa.string()))])
    return pa.Table.from_pylist(rows, schema=schema)


def lock_down(con, run_dir: str | Path) -> None:
    """Let ``con`` read files only under ``run_dir``, with no extensions and no further settings changes.

    Views are bound lazily: their ``read_parquet`` globs are checked at query time, against
    allowed_directories, so the views made before this keep working. The order matters: DuckDB refuses
    to change allowed_directories once enable_external_access is false, and lock_configuration must
    come last (it freezes every setting, including itself). allowed_directories also lets COPY write
    into the run folder, which is why ``check_read_only`` is needed as well.
    """
    root = Path(run_dir).resolve().as_posix().rstrip("/") + "/"    # the slash: RUN2/ is not under RUN/
    con.execute(f"SET allowed_directories = [{_sql_str(root)}]")
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    con.execute("SET allow_community_extensions = false")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def check_read_only(query: str) -> None:
    """Raise ``ReadOnlyError`` unless every statement in ``query`` is a SELECT/EXPLAIN/DESCRIBE/SHOW.

    A parse error is raised as DuckDB's ``ParserException``.
    """
    import duckdb

    statements = duckdb.extract_statements(query)
    if not statements:
        raise ReadOnlyError("no SQL statement given")
    for st in statements:
        kind = st.type.name
        if kind not in READ_STATEMENT_TYPES:
            raise ReadOnlyError(f"only SELECT, EXPLAIN, DESCRIBE and SHOW are allowed, not {kind}: "
                                f"{_first_line(st.query)}")
        if kind == "EXPLAIN":
            m = _EXPLAIN_PREFIX.match(st.query)
            inner = duckdb.extract_statements(st.query[m.end():]) if m else []
            if len(inner) != 1 or inner[0].type.name != "SELECT":
                raise ReadOnlyError(f"EXPLAIN is allowed only of a SELECT: {_first_line(st.query)}")


def _first_line(sql: str, width: int = 80) -> str:
    line = " ".join(sql.split())
    return line if len(line) <= width else line[: width - 1] + "…"


def run_sql(run_dir: str | Path, query: str):
    """Run a read-only ``query`` over ``run_dir`` on a locked connection; the result relation (or None).

    Raises ``ReadOnlyError`` for a statement that is not a read, and ``duckdb.Error`` for the rest.
    """
    check_read_only(query)
    return connect(run_dir, lock=True).sql(query)


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
    con = connect(run_dir, lock=True)
    have = set(views(con))
    out = []
    for q in canned_queries():
        needed = {v.strip() for v in query_kind(q).split(",")}
        if needed <= have:
            title = q.stem.split("_", 1)[1].replace("_", " ")
            out.append((title, con.sql(q.read_text())))
    return out
