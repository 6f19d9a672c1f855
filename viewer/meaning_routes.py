"""The viewer's pages over the ``index`` step: the map, "more like this", text search, duplicate groups and a
concept's neighbourhood (``viewer.similarity`` computes; this module turns requests into pages). All GET, all
read-only; a refused query (``QueryError``) is a 400 page that says why.
"""
from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from viewer import params
from viewer import similarity as sim
from viewer.catalog import RunCatalog
from viewer.files import Refused

NEIGHBOURS = 24
log = logging.getLogger(__name__)


def _k(request: Request, default: int = NEIGHBOURS) -> int:
    v = request.query_params.get("k", "")
    try:
        k = int(v) if v else default
    except ValueError:
        raise HTTPException(400, f"k={v!r}: expected a whole number") from None
    if not 1 <= k <= sim.MAX_K:
        raise HTTPException(400, f"k={k}: between 1 and {sim.MAX_K}")
    return k


def routes(cat: RunCatalog, roots: list[Path], page) -> list[Route]:
    """The routes, given the app's catalog, allowed roots and page renderer ``page(request, template, **ctx)``."""
    held: dict = {}
    bodies: dict = {}           # map body name → [its lock, its bytes once built]
    lock = threading.Lock()

    def step() -> Path | None:
        """The index step's folder: enough for the map, which never loads the faiss index itself."""
        with lock:
            if "step" not in held:
                held["step"] = sim.find_index(cat)
            return held["step"]

    def index() -> sim.EmbeddingIndex | None:
        with lock:
            if "index" not in held:
                found = sim.find_index(cat)
                try:
                    held["index"] = sim.EmbeddingIndex(cat.run_dir, found, roots) if found else None
                except Refused as e:
                    raise HTTPException(403, str(e)) from None
            return held["index"]

    def missing(request: Request):
        return page(request, "missing.html", what="the index (run `ovpipe index` after `embed-images`)")

    def refused(request: Request, template: str, e: sim.QueryError, **ctx):
        return page(request, template, error=str(e), status_code=400, **ctx)

    def map_page(request: Request):
        found = step()
        if found is None:
            return missing(request)
        meta = json.loads((found / "data" / "index.json").read_text())
        colours = sorted(sim.colours(cat))
        first = "status" if "status" in colours else "cluster"
        # the bodies the page asks for next start building now, while the browser reads the page and its script
        threading.Thread(target=prebuild, args=(first,), daemon=True).start()
        n_map = cat.one("SELECT count(*) FILTER (WHERE in_map) AS n FROM embedding_map")["n"]
        return page(request, "map.html", colours=colours, first=first, n_map=n_map, meta=meta)

    def built(key: str, make):
        """What ``make`` builds for the map, on the first request that needs it, then kept: the run is read-only,
        and at 1M points the query behind a map body takes about a second where sending it takes milliseconds."""
        if step() is None:
            raise HTTPException(404, "no index in this run")
        with lock:
            slot = bodies.setdefault(key, [threading.Lock(), None])
        with slot[0]:
            if slot[1] is None:
                try:
                    slot[1] = make()
                except sim.QueryError as e:
                    raise HTTPException(400, str(e)) from None
        return slot[1]

    def prebuild(first: str) -> None:
        """``/map``'s head start on its bodies. A build that fails here (refused, stopped, no index) is left
        unbuilt: the body's own request builds it again and answers the error, so nothing is raised here."""
        try:
            built("layout", lambda: sim.map_layout(cat))
            built("colour:" + first, lambda: sim.map_colours(cat, first))
        except Exception as e:       # noqa: BLE001 — this thread has no request to answer
            log.debug("map prebuild: %s", e)

    def map_points(request: Request):
        return Response(built("layout", lambda: sim.map_layout(cat))[0], media_type="application/octet-stream")

    def map_colours(request: Request):
        colour = request.query_params.get("colour", "cluster")
        if colour not in sim.colours(cat):        # checked before the name becomes a key of the cache
            raise HTTPException(400, f"colour {colour!r}: one of {sorted(sim.colours(cat))}")
        return Response(built("colour:" + colour, lambda: sim.map_colours(cat, colour)),
                        media_type="application/octet-stream")

    def map_region(request: Request):
        if step() is None:
            raise HTTPException(404, "no index in this run")
        try:
            region = sim.region_sql(request.query_params.get("box"), request.query_params.get("lasso"))
        except sim.QueryError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        sql, rows, total = sim.region_samples(cat, region)
        return JSONResponse({"sql": sql, "total": total, "rows": rows})

    def map_point(request: Request):
        """The n-th point of the map's body (what the page clicked) → "more like this" on its sample."""
        positions = built("layout", lambda: sim.map_layout(cat))[1]
        n = request.path_params["n"]
        if not 0 <= n < len(positions):
            raise HTTPException(404, "no such point")
        got = cat.one("SELECT sample_id FROM embedding_map WHERE position = ?", [int(positions[n])])
        return RedirectResponse(f"/similar/{got['sample_id']}", status_code=303)

    def similar(request: Request):
        ix = index()
        if ix is None:
            return missing(request)
        sid, k = request.path_params["sample_id"], _k(request)
        try:
            hits = sim.describe(cat, ix.like(sid, k), of=sid)
        except sim.QueryError as e:
            return refused(request, "similar.html", e, sid=sid, hits=[], me=None)
        me = sim.describe(cat, [(sid, 1.0)])[0]
        return page(request, "similar.html", sid=sid, hits=hits, me=me, k=k)

    def search(request: Request):
        ix = index()
        if ix is None:
            return missing(request)
        q, k = request.query_params.get("q", ""), _k(request)
        if not q:
            return page(request, "search.html", q="", hits=[], cap=sim.MAX_QUERY_CHARS)
        try:
            hits = sim.describe(cat, ix.search(ix.text_vector(q), k))
        except sim.QueryError as e:
            return refused(request, "search.html", e, q=q[:sim.MAX_QUERY_CHARS], hits=[], cap=sim.MAX_QUERY_CHARS)
        return page(request, "search.html", q=q, hits=hits, cap=sim.MAX_QUERY_CHARS)

    def duplicates(request: Request):
        sort = request.query_params.get("sort", "size")
        pg = params.page(request)
        try:
            d = sim.duplicate_groups(cat, sort, pg)
        except sim.QueryError as e:
            raise HTTPException(400, str(e)) from None
        if "totals" in d:
            params.on_a_page(pg, -(-(d["totals"]["groups"] or 0) // sim.GROUPS_PER_PAGE))
        return page(request, "duplicates.html", d=d, sort=sort, page_no=pg)

    def neighbours(request: Request):
        ix = index()
        if ix is None:
            return missing(request)
        cid, k = request.path_params["concept_id"], _k(request, 48)
        try:
            got = sim.concept_vector(cat, cid, roots)
        except Refused as e:
            raise HTTPException(403, str(e)) from None
        if got is None:
            raise HTTPException(404, f"no vector for concept {cid} (run `ovpipe embed-concepts`)")
        info, v = got
        try:
            hits = sim.describe(cat, ix.search(v, k))
        except sim.QueryError as e:
            raise HTTPException(400, str(e)) from None
        return page(request, "neighbours.html", info=info, hits=hits, balanced=cat.has("balanced"))

    return [Route("/map", map_page), Route("/map/points", map_points), Route("/map/colours", map_colours),
            Route("/map/region", map_region),
            Route("/map/point/{n:int}", map_point), Route("/similar/{sample_id}", similar),
            Route("/search", search), Route("/duplicates", duplicates),
            Route("/concepts/{concept_id:int}/neighbours", neighbours)]
