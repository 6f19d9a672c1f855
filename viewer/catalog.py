"""What the viewer reads, through the read-only catalog of ``ovpipe sql`` (``manifests.catalog``).

One DuckDB connection per server, made by ``connect`` and confined by ``lock_down`` exactly as ``ovpipe sql``
does; the only difference is a memory limit and a thread count set in between, so a 1M-row manifest is
scanned in bounded memory. Each request runs on its own cursor of that connection (DuckDB cursors share
the database and its settings, so a request thread never shares a connection object with another).
Every statement passes ``check_read_only`` first.

Every statement also runs under a time limit (``query_timeout`` seconds, 30 by default: a timer calls the
cursor's ``interrupt()``), and ``interrupt_all`` stops every running one at once (the server calls it on
SIGTERM, so a long query never holds a stopping server). A caller that shows what a user typed (the SQL box)
passes ``max_bytes``: the result is read as Arrow batches and refused once it passes that many bytes.

Nothing here loads a manifest into Python: pages ask for one page of rows, an aggregate, or one key.
"""
from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from pathlib import Path

from manifests.catalog import check_read_only, connect, lock_down, step_table, views
from manifests.io import find_manifest_dirs

SAMPLE_FILTERS = ("status", "source", "concept", "copies", "pack")


class QueryStopped(Exception):
    """A statement the viewer stopped: past its time limit, past its result-size cap, or the server stopping."""


class RunCatalog:
    """The run's manifests as DuckDB views (``samples``, ``assignments``, ``packs`` …), read-only."""

    def __init__(self, run_dir: str | Path, memory_limit: str = "1GB", threads: int = 2,
                 query_timeout: float = 30.0):
        self.run_dir = Path(run_dir).resolve()
        self.query_timeout = float(query_timeout)
        self._running: set = set()           # cursors with a statement in flight
        self._lock = threading.Lock()
        self._closing = False
        con = connect(self.run_dir, lock=False)
        con.execute(f"SET memory_limit = '{memory_limit}'")
        con.execute(f"SET threads = {int(threads)}")
        lock_down(con, self.run_dir)
        self.con = con
        self.views = set(views(con)) - {"steps"}     # steps: a table registered on the connection, not a view
        self.pack_dirs = {d.parent.name: d for d in find_manifest_dirs(self.run_dir).get("packs", [])}

    def _group(self, step: str) -> int:
        """The pack step's balanced group (``packing.compute_balance.balanced_group`` of its ``config.json``)."""
        from packing.compute_balance import balanced_group

        try:
            return balanced_group(json.loads((self.run_dir / step / "config.json").read_text()))
        except (OSError, ValueError):
            return 1

    def has(self, *names: str) -> bool:
        return all(n in self.views for n in names)

    def rows(self, sql: str, params=(), steps: bool = False, max_bytes: int | None = None) -> list[dict]:
        """Run one read-only statement on a fresh cursor; rows as dicts. ``steps``: the ``steps`` table of
        ``ovpipe sql`` too (a registered Arrow table lives on its connection, so the cursor gets its own).
        ``QueryStopped`` past ``query_timeout`` seconds, past ``max_bytes`` of result (where given), or once
        ``interrupt_all`` was called."""
        with self._cursor(sql) as cur:
            if steps:
                cur.register("steps", step_table(self.run_dir))
            if max_bytes is not None:       # streamed, so the cap bounds what is held, not only what is shown
                rel = cur.sql(sql, params=list(params) or None)
                return _capped_rows(rel.to_arrow_reader(64), max_bytes) if rel is not None else []
            cur.execute(sql, list(params))
            cols = [d[0] for d in cur.description]
            return [dict(zip(cols, r)) for r in cur.fetchall()]

    def table(self, sql: str):
        """One read-only statement's result as an Arrow table (columns whole, for the map's bodies), under the
        same time limit and interrupt as ``rows``."""
        with self._cursor(sql) as cur:
            return cur.sql(sql).to_arrow_table()

    @contextmanager
    def _cursor(self, sql: str):
        """A fresh cursor for ``sql`` (checked read-only), interrupted past ``query_timeout`` seconds or by
        ``interrupt_all``, either of which becomes ``QueryStopped``."""
        import duckdb

        check_read_only(sql)
        cur = self.con.cursor()
        fired = threading.Event()

        def stop():
            fired.set()
            cur.interrupt()

        timer = threading.Timer(self.query_timeout, stop)
        timer.daemon = True
        with self._lock:
            if self._closing:
                cur.close()
                raise QueryStopped("the viewer is stopping")
            self._running.add(cur)
        timer.start()
        try:
            yield cur
        except (duckdb.InterruptException, OSError) as e:
            # an interrupt while Arrow batches stream surfaces as Arrow's OSError
            if not isinstance(e, duckdb.InterruptException) and not (fired.is_set() or self._closing):
                raise
            if self._closing:
                raise QueryStopped("the viewer is stopping") from None
            raise QueryStopped(f"stopped after {self.query_timeout:g} s, the viewer's time limit for a query "
                               f"(`ovpipe view --query-timeout`): narrow it with a WHERE or a LIMIT") from None
        finally:
            timer.cancel()
            with self._lock:
                self._running.discard(cur)
            cur.close()

    def interrupt_all(self) -> None:
        """Stop every statement in flight and refuse new ones (the server is stopping)."""
        with self._lock:
            self._closing = True
            running = list(self._running)
        for cur in running:
            cur.interrupt()

    def one(self, sql: str, params=()) -> dict | None:
        got = self.rows(sql, params)
        return got[0] if got else None

    # ---------------------------------------------------------------- samples
    def sample_page(self, filters: dict, page: int, per_page: int = 48) -> tuple[list[dict], int]:
        """One page of ``samples`` (ordered by sample_id) matching ``filters`` and the count of all that match.
        Filters: status, source (equal), concept (in the sample's top-K), copies (``balanced.copies``),
        pack (``pack_id`` holding the sample, in any pack step)."""
        where, params = [], []
        if filters.get("status"):
            where.append("s.status = ?")
            params.append(filters["status"])
        if filters.get("source"):
            where.append("s.source = ?")
            params.append(filters["source"])
        if filters.get("concept") not in (None, "") and self.has("assignments"):
            where.append("s.sample_id IN (SELECT sample_id FROM assignments WHERE list_contains(concept_ids, ?))")
            params.append(int(filters["concept"]))
        if filters.get("copies") not in (None, "") and self.has("balanced"):
            where.append("s.sample_id IN (SELECT sample_id FROM balanced WHERE copies = ?)")
            params.append(int(filters["copies"]))
        if filters.get("pack") not in (None, "") and self.has("packs"):
            where.append("s.sample_id IN (SELECT unnest(sample_ids) FROM packs WHERE pack_id = ?)")
            params.append(int(filters["pack"]))
        cond = ("WHERE " + " AND ".join(where)) if where else ""
        total = self.rows(f"SELECT count(*) AS n FROM samples s {cond}", params)[0]["n"]
        rows = self.rows(f"SELECT s.sample_id, s.source, s.status, s.n_images, s.width, s.height FROM samples s "
                         f"{cond} ORDER BY s.sample_id LIMIT ? OFFSET ?", [*params, per_page, page * per_page])
        return rows, total

    def sample_choices(self) -> dict:
        """The values the filters offer: statuses and sources (small, grouped server-side)."""
        return {"status": [r["status"] for r in self.rows("SELECT DISTINCT status FROM samples ORDER BY 1")],
                "source": [r["source"] for r in self.rows("SELECT DISTINCT source FROM samples ORDER BY 1")]}

    def sample(self, sample_id: str) -> dict | None:
        if not self.has("samples"):
            return None
        return self.one("SELECT * FROM samples WHERE sample_id = ? LIMIT 1", [sample_id])

    def image_address(self, sample_id: str, index: int) -> dict | None:
        if not self.has("samples"):
            return None
        row = self.one("SELECT images[?] AS a FROM samples WHERE sample_id = ? LIMIT 1", [index + 1, sample_id])
        return row["a"] if row else None

    def lineage(self, sample_id: str) -> dict:
        """Where one sample went: top-K concepts with scores, balance copies, mix copies, the packs holding it
        (step, pack_id, position, token offset) and the pretrain stage steps that consumed those packs, its
        recaption(s), its lengths."""
        out: dict = {"concepts": [], "copies": None, "mixed": None, "packs": [], "captions": [], "lengths": []}
        if self.has("assignments"):
            text = "c.text" if self.has("concepts") else "NULL"
            join = "LEFT JOIN concepts c ON c.concept_id = u.cid" if self.has("concepts") else ""
            out["concepts"] = self.rows(
                f"SELECT u.cid AS concept_id, u.score, {text} AS text FROM (SELECT unnest(concept_ids) AS cid, "
                f"unnest(scores) AS score FROM assignments WHERE sample_id = ?) u {join} ORDER BY u.score DESC",
                [sample_id])
        if self.has("balanced"):
            row = self.one("SELECT copies, weight FROM balanced WHERE sample_id = ?", [sample_id])
            out["copies"] = row
        if self.has("mixed"):
            out["mixed"] = self.one("SELECT copies FROM mixed WHERE sample_id = ?", [sample_id])
        if self.has("lengths"):
            out["lengths"] = self.rows("SELECT text_tokens, image_tokens, total_tokens, status FROM lengths "
                                       "WHERE sample_id = ? OR source_sample_id = ?", [sample_id, sample_id])
        stages = pretrain_stages(self.run_dir)
        for step, d in sorted(self.pack_dirs.items()):
            glob = (d / "part-*.parquet").as_posix().replace("'", "''")
            for r in self.rows(f"SELECT pack_id, list_position(sample_ids, ?) AS pos, total_tokens FROM "
                               f"read_parquet('{glob}') WHERE list_contains(sample_ids, ?) ORDER BY pack_id",
                               [sample_id, sample_id]):
                n_packs = self.one(f"SELECT count(*) AS n FROM read_parquet('{glob}')")["n"]
                out["packs"].append({"step": step, **r, "consumed": consumed_by(stages, step, r["pack_id"], n_packs,
                                                                                 self._group(step))})
        if self.has("captions"):
            out["captions"] = self.rows("SELECT lang, caption, model, status FROM captions WHERE sample_id = ? "
                                        "ORDER BY lang", [sample_id])
        return out


def _capped_rows(reader, max_bytes: int) -> list[dict]:
    """A result's Arrow batches as dicts; ``QueryStopped`` once past ``max_bytes``."""
    import pyarrow as pa

    batches, size = [], 0
    for batch in reader:
        size += batch.nbytes
        if size > max_bytes:
            raise QueryStopped(f"the result passed {max_bytes / 2**20:g} MiB, the viewer's cap on what one query "
                               f"shows: select fewer columns, shorter values or fewer rows")
        batches.append(batch)
    return pa.Table.from_batches(batches).to_pylist() if batches else []


def pretrain_stages(run_dir: Path) -> list[dict]:
    """Each pretrain stage's data plan as its ``stage.json`` records it: the pack step it read, the packs per
    optimizer step (``global_batch``) and its steps."""
    out = []
    for f in sorted(Path(run_dir).glob("pretrain/stage-*/stage.json")):
        try:
            s = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if s.get("data") and s.get("global_batch") and s.get("steps"):
            out.append({"stage": str(s.get("stage", f.parent.name.split("-", 1)[1])), "data": s["data"],
                        "gbs": int(s["global_batch"]), "steps": int(s["steps"])})
    return out


def consumed_by(stages: list[dict], pack_step: str, pack_id: int, n_packs: int, group: int = 1) -> list[dict]:
    """The (stage, step) pairs that trained on pack ``pack_id``: a stage reads its pack step's balanced stream
    (``pretrain.data.iter_batches``: every epoch the whole groups of ``group`` packs in pack_id order, the leftover
    packs carried until they fill one; ``packing.compute_balance.stream_positions``), ``global_batch`` packs per
    step, so a stream position ``q`` of the pack is consumed by step ``q // gbs + 1`` while it is within the
    stage's ``steps · gbs`` packs."""
    from packing.compute_balance import epoch_of, stream_positions

    out = []
    for s in stages:
        if s["data"] != pack_step or n_packs <= 0:
            continue
        seen = s["steps"] * s["gbs"]
        for q in stream_positions(int(pack_id), n_packs, group, seen).tolist():
            out.append({"stage": s["stage"], "step": q // s["gbs"] + 1, "epoch": int(epoch_of(q, n_packs, group))})
    return out
