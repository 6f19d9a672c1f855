"""Search by meaning over the ``index`` step's outputs: "more like this", text queries through the embed step's
own CLIP text tower, a concept's neighbourhood, and the map's points and regions.

``EmbeddingIndex`` is loaded once per server, on the first request that needs it: the faiss index
(``data/index.faiss``), the uint64 sample id of each index position (``data/ids.npy``, ascending) and where each
position's vector lies (``data/rows.npy`` + the shard list of ``index.json``; the fp16 ``.npy`` shards are
memory-mapped, never loaded). A query vector is a sample's own stored vector, a concept's, or a text's; the
index's fp16 codes (``flat``, ``ivf``) score the exact cosine each neighbour is shown with; IVF-PQ's codes are
approximate, so it proposes ``RERANK × k`` candidates that their stored vectors re-rank. Query time at 100K, 1M
and 3M × 1024 rows: ``bench/results/bench_index.txt``.

Everything a request names is checked before use: a sample id is 16 hex digits, ``k`` ≤ ``MAX_K``, a text is at
most ``MAX_QUERY_CHARS`` characters (a longer one is refused with a message saying the cap), a map region is
numbers only (``region_sql`` writes them into SQL itself, as floats), a colour is one of ``COLOURS``.
"""
from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from viewer.catalog import RunCatalog
from viewer.files import check_path

MAX_K = 100
RERANK = 4                     # candidates asked of the index per neighbour shown, re-ranked by exact cosine
MAX_QUERY_CHARS = 200          # a CLIP text tower reads 77 tokens; a longer query is refused, not cut silently
CACHED_QUERIES = 256           # text queries whose vectors are kept (4 KB each at d = 1024), most recent first
MAX_LASSO_POINTS = 256         # a lasso's outline is thinned to this many vertices before it becomes SQL
# a box's or lasso's coordinates: far beyond any map layout's, and small enough that every difference of two
# stays a finite double (1e308 - -1e308 is inf, which no SQL literal can say)
MAX_COORD = 1e12
GROUPS_PER_PAGE = 20           # duplicate groups a /duplicates page lists
MAX_LABELS = 20                # a categorical colour shows its 20 most frequent values; the rest are "other"
SAMPLE_ID = re.compile(r"[0-9a-f]{16}")


class QueryError(ValueError):
    """A request the pages refuse with a message (400)."""


def _u64(sample_id: str) -> np.uint64:
    if not SAMPLE_ID.fullmatch(sample_id or ""):
        raise QueryError(f"{sample_id!r}: a sample id is 16 hex digits")
    return np.uint64(int(sample_id, 16))


class EmbeddingIndex:
    """The index step's folder (``step_dir``) opened for queries; ``roots``: where the vector shards may be."""

    def __init__(self, run_dir: Path, step_dir: Path, roots: list[Path]):
        import faiss

        self.run_dir, self.step_dir = Path(run_dir), Path(step_dir)
        # One thread a query: requests run side by side on the server's threads, and OpenMP's spin-waits on a
        # busy machine cost more than a second thread gains (10K × 256 flat: 1 ms on one thread, 51 ms on two,
        # load average 21 on the 2-core machine).
        faiss.omp_set_num_threads(1)
        self.meta = json.loads((self.step_dir / "data" / "index.json").read_text())
        self.index = faiss.read_index(str(check_path(self.step_dir / "data" / "index.faiss", roots)))
        self.ids = np.load(self.step_dir / "data" / "ids.npy", mmap_mode="r")
        self.rows = np.load(self.step_dir / "data" / "rows.npy", mmap_mode="r")
        self.shards = [np.load(check_path(self.run_dir / f, roots), mmap_mode="r") for f in self.meta["shards"]]
        self._clip = None
        self._texts: OrderedDict[str, np.ndarray] = OrderedDict()     # recent text queries' vectors
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.ids)

    def position(self, sample_id: str) -> int | None:
        u = _u64(sample_id)
        p = int(np.searchsorted(self.ids, u))
        return p if p < len(self.ids) and self.ids[p] == u else None

    def vectors(self, positions) -> np.ndarray:
        """The stored (fp16) vectors of index ``positions``, as fp32 unit rows."""
        positions = np.asarray(positions, np.int64)
        out = np.empty((len(positions), self.meta["dim"]), np.float32)
        for j, p in enumerate(positions.tolist()):
            r = self.rows[p]
            out[j] = self.shards[int(r["shard"])][int(r["row"])]
        return out

    def search(self, q: np.ndarray, k: int, exclude: int | None = None) -> list[tuple[str, float]]:
        """The ``k`` nearest rows to unit vector ``q`` (sample id, exact cosine), nearest first."""
        if not 1 <= k <= MAX_K:
            raise QueryError(f"k={k}: between 1 and {MAX_K}")
        q = np.ascontiguousarray(q, np.float32).reshape(1, -1)
        if q.shape[1] != self.meta["dim"]:
            raise QueryError(f"a {q.shape[1]}-wide query vector against an index of {self.meta['dim']}")
        # fp16 codes (flat, ivf) are the stored vectors themselves: the index's scores are their exact cosines.
        # IVF-PQ's are approximate, so its candidates are re-ranked by their stored vectors — a random read each
        # from the shards, most of a query where they are not in the page cache (97 reads: 0.12 s on this disk).
        exact = self.meta["kind"] in ("flat", "ivf")
        score, cand = self.index.search(q, min(len(self), (1 if exact else RERANK) * k + 1))
        keep = (cand[0] >= 0) & (cand[0] != (-1 if exclude is None else exclude))
        cand = cand[0][keep]
        cos = score[0][keep] if exact else self.vectors(cand) @ q[0]
        order = np.lexsort((cand, -cos))[:k]
        return [(f"{int(self.ids[cand[i]]):016x}", float(cos[i])) for i in order]

    def like(self, sample_id: str, k: int) -> list[tuple[str, float]]:
        p = self.position(sample_id)
        if p is None:
            raise QueryError(f"sample {sample_id} has no vector in the index (not embedded, or not status ok)")
        return self.search(self.vectors([p])[0], k, exclude=p)

    def text_vector(self, text: str) -> np.ndarray:
        """``text`` through the embed step's own CLIP text tower (loaded on the first text query), trimmed to its
        tokens and in bf16 where the CPU has it (``curation.clip.embed_query``); the last ``CACHED_QUERIES``
        texts' vectors are kept, so paging or re-sorting a result asks the tower nothing."""
        text = (text or "").strip()
        if not text:
            raise QueryError("an empty query")
        if len(text) > MAX_QUERY_CHARS:
            raise QueryError(f"the query has {len(text)} characters; the cap is {MAX_QUERY_CHARS} "
                             f"(the text tower reads its first 77 tokens)")
        from curation.clip import embed_query

        with self._lock:
            v = self._texts.pop(text, None)
            if v is None:
                if self._clip is None:
                    self._clip = _load_text_tower(self.run_dir, self.step_dir)
                v = embed_query(*self._clip, text)
                v.flags.writeable = False
            self._texts[text] = v                        # most recent last; the oldest goes past the cap
            if len(self._texts) > CACHED_QUERIES:
                self._texts.popitem(last=False)
            return v


def _load_text_tower(run_dir: Path, step_dir: Path):
    """(text tower, tokenizer) of the embed step the index was built from (its ``config.json``)."""
    from curation.clip import load_text_tower
    from ovpipe.inputs import upstream_config

    import torch

    # One thread, as for faiss above: on the loaded 2-core machine a second thread's spin-waits cost more than it
    # gains — ViT-H-14's tower, 77 tokens: 2.1 s on one thread, 9.1 s on two at load average 10.
    torch.set_num_threads(1)
    cfg = json.loads((step_dir / "config.json").read_text())
    _, ecfg = upstream_config(run_dir, cfg.get("embeddings_step", "embed-images"))
    return load_text_tower(ecfg.model, ecfg.pretrained)


def find_index(cat: RunCatalog) -> Path | None:
    """The step folder holding ``embedding_map`` and ``data/index.faiss`` (the first, by name), if any."""
    from manifests.io import find_manifest_dirs

    for d in sorted(find_manifest_dirs(cat.run_dir).get("embedding_map", [])):
        if (d.parent / "data" / "index.faiss").is_file():
            return d.parent
    return None


# ---------------------------------------------------------------------------------- neighbours, with their fate

def describe(cat: RunCatalog, hits: list[tuple[str, float]], of: str | None = None) -> list[dict]:
    """Each hit with its sample status, dedup status and ``duplicate_of``, balance copies, and — given ``of`` —
    whether dedup put the two in one group (one is the other's ``duplicate_of``, or both share one)."""
    if not hits:
        return []
    ids = [h[0] for h in hits]
    cols, joins = ["NULL AS status"], []
    if cat.has("samples"):
        cols, joins = ["s.status AS status"], ["LEFT JOIN samples s USING (sample_id)"]
    if cat.has("dedup"):
        cols += ["d.status AS dedup", "d.duplicate_of", "d.similarity AS marked_at"]
        joins.append("LEFT JOIN dedup d USING (sample_id)")
    if cat.has("balanced"):
        cols.append("b.copies")
        joins.append("LEFT JOIN balanced b USING (sample_id)")
    rows = {r["sample_id"]: r for r in cat.rows(
        f"SELECT q.sample_id, {', '.join(cols)} FROM (SELECT unnest(?) AS sample_id) q {' '.join(joins)}", [ids])}
    root = None
    if of is not None and cat.has("dedup"):
        me = cat.one("SELECT duplicate_of FROM dedup WHERE sample_id = ?", [of])
        root = (me or {}).get("duplicate_of") or of
    out = []
    for rank, (sid, cos) in enumerate(hits, 1):
        r = rows.get(sid, {})
        grouped = None
        if root is not None:
            grouped = sid == root or r.get("duplicate_of") == root
        out.append({"rank": rank, "sample_id": sid, "cosine": cos, "status": r.get("status"),
                    "dedup": r.get("dedup"), "duplicate_of": r.get("duplicate_of"), "marked_at": r.get("marked_at"),
                    "copies": r.get("copies"), "grouped": grouped})
    return out


def concept_vector(cat: RunCatalog, concept_id: int, roots: list[Path]) -> tuple[dict, np.ndarray] | None:
    """(the concept's row, its text vector from embed-concepts' shard), or None."""
    if not cat.has("concepts"):
        return None
    row = cat.one("SELECT concept_id, text, file, row FROM concepts WHERE concept_id = ? LIMIT 1", [concept_id])
    if row is None or row["file"] is None or row["row"] is None or row["row"] < 0:
        return None
    a = np.load(check_path(cat.run_dir / row["file"], roots), mmap_mode="r")
    v = np.asarray(a[row["row"]], np.float32)
    return row, v / max(float(np.linalg.norm(v)), 1e-12)


# ------------------------------------------------------------------------------------------------ the map

def _one_per_sample(kind: str, columns: str, prefer: str = "status = 'duplicate'") -> str:
    """``(SELECT DISTINCT ON (sample_id) sample_id, columns FROM kind ...)``: one row per sample id, so a join
    from the map keeps one row per point — a manifest may hold an id twice (an ingest duplicate's rows carried
    downstream, two step folders of one kind); the row ordered first by ``prefer`` (false first) wins."""
    return (f"(SELECT DISTINCT ON (sample_id) sample_id, {columns} FROM {kind} "
            f"ORDER BY sample_id, {prefer})")


def colours(cat: RunCatalog) -> dict[str, tuple[str, str, str]]:
    """Colour name → (SQL value over ``embedding_map m`` and its joins, the join, kind): what this run has. Every
    join is one row per sample id (``_one_per_sample``), so each colour array has one entry per point."""
    out = {"cluster": ("m.cluster", "", "number")}
    if cat.has("samples"):
        out["source"] = ("s.source", "LEFT JOIN " + _one_per_sample("samples", "source, status") + " s USING (sample_id)",
                         "category")
    if cat.has("dedup"):
        out["near duplicate"] = ("d.status", "LEFT JOIN " + _one_per_sample("dedup", "status") + " d USING (sample_id)",
                                 "category")
    if cat.has("alignment"):
        out["alignment score"] = ("al.score", "LEFT JOIN " + _one_per_sample("alignment", "score, status")
                                  + " al USING (sample_id)", "number")
    if cat.has("balanced"):
        out["kept by balance"] = ("CASE WHEN b.copies IS NULL THEN 'not balanced' WHEN b.copies > 0 THEN 'kept' "
                                  "ELSE 'dropped' END", "LEFT JOIN " + _one_per_sample("balanced", "copies", "copies DESC")
                                  + " b USING (sample_id)", "category")
    if cat.has("assignments"):
        text = "coalesce(c.text, CAST(a.concept_ids[1] AS VARCHAR))" if cat.has("concepts") else \
            "CAST(a.concept_ids[1] AS VARCHAR)"
        join = "LEFT JOIN " + _one_per_sample("assignments", "concept_ids", "concept_ids[1]") + " a USING (sample_id)" + (
            " LEFT JOIN (SELECT DISTINCT ON (concept_id) concept_id, text FROM concepts ORDER BY concept_id) c "
            "ON c.concept_id = a.concept_ids[1]" if cat.has("concepts") else "")
        out["concept"] = (text, join, "category")
    fate = [("d.status", "dedup"), ("al.status", "alignment")]
    have = [(e, v) for e, v in fate if cat.has(v)]
    if have:
        joins = " ".join(out[{"dedup": "near duplicate", "alignment": "alignment score"}[v]][1] for _, v in have)
        out["status"] = ("coalesce(" + ", ".join(f"nullif({e}, 'ok')" for e, _ in have) + ", m.status)", joins,
                         "category")
    return out


def _body(head: dict, *arrays: np.ndarray) -> bytes:
    """A little-endian uint32 header length, the JSON ``head`` padded to 4 bytes, then the arrays' raw bytes."""
    js = json.dumps(head).encode()
    js += b" " * (-len(js) % 4)
    return len(js).to_bytes(4, "little") + js + b"".join(a.tobytes() for a in arrays)


def map_layout(cat: RunCatalog) -> tuple[bytes, np.ndarray]:
    """The map's points (``in_map`` rows, by index position) as one binary body the page hands to WebGL as is —
    head ``{n, x: [min, max], y: [min, max]}``, then x, y interleaved (float32 × 2n, one vertex buffer; 8 MB at
    1M points) — and each point's index position (uint32 × n), which the server keeps to resolve a clicked point."""
    t = cat.table("SELECT x, y, position FROM embedding_map WHERE in_map ORDER BY position")
    n = t.num_rows
    xy = np.empty((n, 2), np.float32)
    head: dict = {"n": n}
    for j, c in enumerate(("x", "y")):
        xy[:, j] = t.column(c).to_numpy(zero_copy_only=False)
        v = xy[:, j][np.isfinite(xy[:, j])]
        head[c] = [float(v.min()), float(v.max())] if len(v) else [0.0, 1.0]
    return _body(head, xy), np.asarray(t.column("position").to_numpy(zero_copy_only=False), np.uint32)


def map_colours(cat: RunCatalog, colour: str) -> bytes:
    """One colour of the map's points, in ``map_layout``'s order, as a uint8 code a point: head ``{n, kind, colour}``
    and, for a category, its ``labels`` (the ``MAX_LABELS`` most frequent, then "other"; NULL is "∅") with their
    ``counts``, the code being the label's place; for a number, its ``range``, the code the value's place in it
    in 255 steps (0–254) and 255 for NULL (``nulls`` of them)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = colours(cat)
    if colour not in table:
        raise QueryError(f"colour {colour!r}: one of {sorted(table)}")
    expr, join, kind = table[colour]
    v = cat.table(f"SELECT {expr} AS v FROM embedding_map m {join} WHERE m.in_map ORDER BY m.position"
                   ).column("v")
    head: dict = {"n": len(v), "kind": kind, "colour": colour}
    if kind == "category":
        v = pc.fill_null(v.cast("string"), "∅")
        counts = pc.value_counts(v).to_pylist()
        counts.sort(key=lambda c: (-c["counts"], c["values"]))
        labels = [c["values"] for c in counts[:MAX_LABELS]]
        codes = np.asarray(pc.index_in(v, value_set=pa.array(labels, pa.string()))
                           .fill_null(len(labels)).to_numpy(zero_copy_only=False), np.uint8)
        head["counts"] = [c["counts"] for c in counts[:MAX_LABELS]]
        if len(counts) > MAX_LABELS:
            labels.append("other")
            head["counts"].append(sum(c["counts"] for c in counts[MAX_LABELS:]))
        head["labels"] = labels
    else:
        vals = np.asarray(v.cast("float64").to_numpy(zero_copy_only=False), np.float64)
        ok = np.isfinite(vals)
        lo, hi = (float(vals[ok].min()), float(vals[ok].max())) if ok.any() else (0.0, 1.0)
        head["range"], head["nulls"] = [lo, hi], int(len(vals) - ok.sum())
        codes = np.full(len(vals), 255, np.uint8)
        codes[ok] = np.rint((vals[ok] - lo) / (hi - lo or 1.0) * 254).astype(np.uint8)
    return _body(head, codes)


def _num(s: str, what: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise QueryError(f"{what}: {s!r} is not a number") from None
    if not math.isfinite(v):
        raise QueryError(f"{what}: {s!r} is not a finite number")
    if abs(v) > MAX_COORD:
        raise QueryError(f"{what}: {s[:40]!r} is outside ±{MAX_COORD:g}")
    return v


def region_sql(box: str | None = None, lasso: str | None = None) -> str:
    """The rows whose map place lies in a box ``x0,x1,y0,y1`` or a lasso ``x,y;x,y;…`` as one SELECT of their
    sample ids (a point-in-polygon test by ray crossing, one term per edge), written from parsed numbers only."""
    if box:
        parts = box.split(",")
        if len(parts) != 4:
            raise QueryError("box: x0,x1,y0,y1")
        x0, x1, y0, y1 = (_num(p, "box") for p in parts)
        return (f"SELECT sample_id FROM embedding_map WHERE x BETWEEN {min(x0, x1)!r} AND {max(x0, x1)!r} "
                f"AND y BETWEEN {min(y0, y1)!r} AND {max(y0, y1)!r}")
    if lasso:
        pts = [p.split(",") for p in lasso.split(";") if p]
        if len(pts) < 3 or any(len(p) != 2 for p in pts):
            raise QueryError("lasso: at least three points x,y;x,y;…")
        pts = [(_num(x, "lasso"), _num(y, "lasso")) for x, y in pts]
        if len(pts) > MAX_LASSO_POINTS:
            pts = [pts[int(i)] for i in np.linspace(0, len(pts) - 1, MAX_LASSO_POINTS)]
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        terms = []
        for (xi, yi), (xj, yj) in zip(pts, pts[1:] + pts[:1]):
            if yi == yj:
                continue
            # the edge's x at the point's y, divided in the query: a near-flat edge's slope would overflow here
            terms.append(f"CASE WHEN ((y > {yi!r}) <> (y > {yj!r})) AND "
                         f"(x < {xi!r} + {xj - xi!r} * (y - {yi!r}) / {yj - yi!r}) THEN 1 ELSE 0 END")
        crossing = " + ".join(terms) or "0"
        return (f"SELECT sample_id FROM embedding_map WHERE x BETWEEN {min(xs)!r} AND {max(xs)!r} "
                f"AND y BETWEEN {min(ys)!r} AND {max(ys)!r} AND ({crossing}) % 2 = 1")
    raise QueryError("give a box=x0,x1,y0,y1 or a lasso=x,y;x,y;…")


def region_samples(cat: RunCatalog, region: str, limit: int = 48) -> tuple[str, list[dict], int]:
    """(the samples grid's filter as SQL, the first ``limit`` samples in the region, how many there are)."""
    sql = (f"SELECT s.sample_id, s.source, s.status FROM samples s\nWHERE s.sample_id IN ({region})\n"
           f"ORDER BY s.sample_id")
    total = cat.one(f"SELECT count(*) AS n FROM ({region})")["n"]
    rows = cat.rows(f"{sql} LIMIT {int(limit)}") if cat.has("samples") else []
    return sql, rows, total


# ------------------------------------------------------------------------------------------ duplicate groups

def duplicate_groups(cat: RunCatalog, sort: str, page: int, per_page: int = GROUPS_PER_PAGE) -> dict:
    """Dedup's groups — a kept image and every row whose ``duplicate_of`` it is, with the cosine each was marked
    at — largest (``sort=size``) or tightest (``sort=cosine``) first; and what other ε values remove."""
    if not cat.has("dedup"):
        return {"missing": "dedup (run `ovpipe dedup`)"}
    order = {"size": "n DESC, kept", "cosine": "top DESC, kept", "id": "kept"}.get(sort)
    if order is None:
        raise QueryError(f"sort={sort!r}: one of size, cosine, id")
    groups = cat.rows(
        "SELECT duplicate_of AS kept, count(*) AS n, max(similarity) AS top, "
        "list({'sample_id': sample_id, 'cosine': similarity} ORDER BY similarity DESC, sample_id) AS members "
        f"FROM dedup WHERE status = 'near_duplicate' GROUP BY duplicate_of ORDER BY {order} LIMIT ? OFFSET ?",
        [per_page, page * per_page])
    totals = cat.one("SELECT count(DISTINCT duplicate_of) AS groups, count(*) AS marked, min(similarity) AS lowest "
                     "FROM dedup WHERE status = 'near_duplicate'")
    # the marked cosines in 200 bins over [lowest, 1]: the slider counts what a smaller ε would still remove
    lo = totals["lowest"] if totals["lowest"] is not None else 1.0
    hist = cat.rows("SELECT least(199, CAST(floor((similarity - ?) / ? * 200) AS INTEGER)) AS bin, count(*) AS n "
                    "FROM dedup WHERE status = 'near_duplicate' GROUP BY 1 ORDER BY 1", [lo, max(1.0 - lo, 1e-9)])
    return {"groups": groups, "totals": totals, "lowest": lo, "hist": {r["bin"]: r["n"] for r in hist},
            "report": dedup_report(cat)}


def dedup_report(cat: RunCatalog) -> list[dict]:
    """The removals per ε the dedup step counted itself (its ``report_eps``), from ``reduced/dedup.npz``."""
    from manifests.io import find_manifest_dirs

    out = []
    for d in find_manifest_dirs(cat.run_dir).get("dedup", []):
        f = d.parent / "reduced" / "dedup.npz"
        if f.is_file():
            with np.load(f) as z:
                out += [{"eps": float(e), "removed": int(r)} for e, r in zip(z["eps"], z["removed"])]
            cfg = json.loads((d.parent / "config.json").read_text())
            for r in out:
                r["run"] = math.isclose(r["eps"], float(cfg.get("eps", -1)))
            break
    return out
