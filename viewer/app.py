"""The viewer's web app: starlette routes over one run folder, pages rendered from jinja2 templates.

Read-only by construction: every route is a GET (the SQL box included, ``check_read_only`` before DuckDB
sees it), every manifest read goes through ``viewer.catalog.RunCatalog`` (the locked catalog of
``ovpipe sql``), every file read through ``viewer.files`` (the run folder and its declared inputs only).

Served to this machine only: a request whose ``Host`` header is not one of ``allowed_hosts`` (127.0.0.1,
localhost, [::1] by default) is answered 400 by starlette's ``TrustedHostMiddleware``, so a web page whose
DNS name is rebound to 127.0.0.1 reads nothing. Every query runs under the catalog's time limit; the SQL box
shows at most ``SQL_MAX_ROWS`` rows and ``SQL_MAX_BYTES`` of result, and says so when it stops one. Every
numeric parameter is bounded (``viewer.params``: 400 naming the bound); a ``page=`` that is not a whole number
≥ 0 is 400, one past the last page 404.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path
from urllib.parse import urlencode

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from viewer import meaning_routes, pages, params
from viewer.catalog import SAMPLE_FILTERS, QueryStopped, RunCatalog
from viewer.files import (SERVED_SUFFIXES, Refused, allowed_roots, blob_thumbnail, run_file, step_overview,
                          thumbnail)

HERE = Path(__file__).parent
NAV = (("overview", "/"), ("samples", "/samples"), ("map", "/map"), ("search", "/search"), ("duplicates", "/duplicates"),
       ("concepts", "/concepts"), ("packs", "/packs"), ("training", "/training"), ("RL selection", "/rl"), ("SQL", "/sql"))
THUMB_PX = (96, 160, 320, 640)
SQL_MAX_ROWS = 200
SQL_MAX_BYTES = 16 * 2**20
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
# the layout ``/packs`` shows a step of: DP ranks, packs a micro-batch, micro-batches a step, and the packs of one
# step in all (a row per rank, a link per pack: the page's size follows dp × mb × ga, so that is bounded too)
MAX_DP, MAX_MB, MAX_GA, MAX_STEP_PACKS = 4096, 64, 4096, 16384


def _int(request: Request, name: str, default: int = 0, hi: int = params.MAX_ID) -> int:
    return params.whole(request, name, default, 0, hi)


def create_app(run_dir: str | Path, memory_limit: str = "1GB", allowed_hosts=LOOPBACK_HOSTS,
               query_timeout: float = 30.0) -> Starlette:
    """The app over ``run_dir``: a ``RunCatalog`` and the allowed roots are made once, here. ``allowed_hosts``:
    the ``Host`` names it answers (without the port)."""
    run_dir = Path(run_dir).resolve()
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run folder")
    cat = RunCatalog(run_dir, memory_limit=memory_limit, query_timeout=query_timeout)
    roots = allowed_roots(run_dir)
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    templates.env.globals.update(nav=NAV, run_name=run_dir.name)

    def page(request: Request, name: str, status_code: int = 200, **ctx) -> Response:
        return templates.TemplateResponse(request, name, {"active": name.split(".")[0], **ctx},
                                          status_code=status_code)

    def overview(request: Request):
        steps = step_overview(run_dir)
        counts = {v: cat.one(f"SELECT count(*) AS n FROM {v}")["n"] for v in sorted(cat.views)}
        return page(request, "overview.html", steps=steps, counts=counts, run_dir=str(run_dir))

    def samples(request: Request):
        if not cat.has("samples"):
            return page(request, "missing.html", what="samples (run `ovpipe ingest`)")
        filters = {k: request.query_params.get(k, "") for k in SAMPLE_FILTERS}
        for k in ("concept", "copies", "pack"):
            if filters[k] != "":
                _int(request, k)
        pg = params.page(request)
        rows, total = cat.sample_page(filters, pg)
        params.on_a_page(pg, -(-total // 48))
        query = urlencode({k: v for k, v in filters.items() if v})
        return page(request, "samples.html", rows=rows, total=total, page=pg, pages=-(-total // 48),
                    filters=filters, choices=cat.sample_choices(), query=query)

    def sample(request: Request):
        sid = request.path_params["sample_id"]
        row = cat.sample(sid)
        if row is None:
            raise HTTPException(404, f"no sample {sid}")
        return page(request, "sample.html", s=row, lineage=cat.lineage(sid))

    def thumb(request: Request):
        sid, idx = request.path_params["sample_id"], request.path_params["index"]
        px = _int(request, "px", 160)
        if px not in THUMB_PX:
            raise HTTPException(400, f"px={px}: one of {THUMB_PX}")
        addr = cat.image_address(sid, idx)
        if addr is None:
            raise HTTPException(404, f"sample {sid} has no image {idx}")
        try:
            return Response(thumbnail(addr, px, roots), media_type="image/jpeg",
                            headers={"Cache-Control": "max-age=3600"})
        except Refused as e:
            raise HTTPException(403, str(e)) from None
        except OSError as e:
            raise HTTPException(404, f"image unreadable: {e}") from None

    def concepts(request: Request):
        return page(request, "concepts.html", d=pages.concepts(cat))

    def concept(request: Request):
        return page(request, "concept.html", d=pages.concept(cat, request.path_params["concept_id"]))

    def packs(request: Request):
        pg = params.page(request)
        layout = {k: _int(request, k, hi=hi) for k, hi in (("dp", MAX_DP), ("mb", MAX_MB), ("ga", MAX_GA),
                                                            ("at", params.MAX_ID))}
        try:
            d = pages.packs(cat, request.query_params.get("step"), pg, layout, max_step_packs=MAX_STEP_PACKS)
        except pages.LayoutTooLarge as e:
            raise HTTPException(400, str(e)) from None
        params.on_a_page(pg, d.get("pages", 0))
        return page(request, "packs.html", d=d)

    def pack(request: Request):
        try:
            d = pages.pack(cat, request.path_params["step"], request.path_params["pack_id"], roots)
        except Refused as e:
            raise HTTPException(403, str(e)) from None
        if d is None:
            raise HTTPException(404, "no such pack")
        return page(request, "pack.html", d=d)

    def training(request: Request):
        return page(request, "training.html", d=pages.training(cat))

    def rl(request: Request):
        pg = params.page(request)
        d = pages.rl(cat, pg)
        params.on_a_page(pg, d.get("pages", 0))
        return page(request, "rl.html", d=d)

    def prompt(request: Request):
        d = pages.prompt(cat, request.path_params["prompt_id"])
        if d is None:
            raise HTTPException(404, "no such prompt")
        return page(request, "prompt.html", d=d)

    def prompt_img(request: Request):
        data = pages.prompt_image(cat, request.path_params["prompt_id"], request.path_params["index"])
        if data is None:
            raise HTTPException(404, "no such image")
        return Response(blob_thumbnail(data, 320), media_type="image/jpeg")

    def sql(request: Request):
        from manifests.catalog import ReadOnlyError

        q = request.query_params.get("q", "")
        cols, rows, error = [], [], None
        if q.strip():
            try:
                got = cat.rows(f"SELECT * FROM ({q.strip().rstrip(';')}) LIMIT {SQL_MAX_ROWS + 1}"
                               if _is_select(q) else q, steps=True, max_bytes=SQL_MAX_BYTES)
                cols = list(got[0]) if got else []
                rows = [[r[c] for c in cols] for r in got]
            except ReadOnlyError as e:
                return page(request, "sql.html", q=q, cols=[], rows=[], error=f"refused: {e}", max_rows=SQL_MAX_ROWS,
                            status_code=403)
            except QueryStopped as e:
                return page(request, "sql.html", q=q, cols=[], rows=[], error=f"stopped: {e}", max_rows=SQL_MAX_ROWS,
                            status_code=422)
            except Exception as e:    # a DuckDB error (syntax, unknown column, a path outside the run): one line
                error = str(e).splitlines()[0]
        return page(request, "sql.html", q=q, cols=cols, rows=rows[:SQL_MAX_ROWS], error=error,
                    more=len(rows) > SQL_MAX_ROWS, max_rows=SQL_MAX_ROWS)

    def files(request: Request):
        try:
            path = run_file(run_dir, request.path_params["path"])
        except Refused as e:
            raise HTTPException(403, str(e)) from None
        except OSError:
            raise HTTPException(404, "no such file") from None
        if path.suffix == ".md" and "raw" not in request.query_params:     # a step's report.md, rendered
            from markupsafe import Markup

            from viewer.markdown import render

            rel = request.path_params["path"]
            folder = rel.rsplit("/", 1)[0] if "/" in rel else ""
            return page(request, "report.html", report=rel, raw=f"/files/{rel}?raw=1",
                        body=Markup(render(path.read_text(errors="replace"), folder)))
        return FileResponse(path, media_type=SERVED_SUFFIXES[path.suffix])

    def plotly_js(request: Request):
        return Response(_plotly_js(), media_type="application/javascript",
                        headers={"Cache-Control": "max-age=86400"})

    routes = [
        Route("/", overview), Route("/samples", samples), Route("/samples/{sample_id}", sample),
        Route("/thumb/{sample_id}/{index:int}", thumb), Route("/concepts", concepts),
        Route("/concepts/{concept_id:int}", concept), Route("/packs", packs),
        Route("/packs/{step}/{pack_id:int}", pack), Route("/training", training), Route("/rl", rl),
        Route("/rl/{prompt_id}", prompt), Route("/rl/{prompt_id}/image/{index:int}", prompt_img),
        Route("/sql", sql), Route("/files/{path:path}", files), Route("/static/plotly.min.js", plotly_js),
        *meaning_routes.routes(cat, roots, page),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: partial(_error, templates),
                                                       QueryStopped: partial(_stopped, templates)},
                    middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts),
                                           www_redirect=False)])
    app.state.catalog, app.state.roots = cat, roots
    return app


def _is_select(q: str) -> bool:
    import duckdb

    try:
        st = duckdb.extract_statements(q)
    except duckdb.Error:
        return False
    return len(st) == 1 and st[0].type.name == "SELECT" and not q.lstrip().upper().startswith(("DESCRIBE", "SHOW",
                                                                                                   "SUMMARIZE"))


_JS: list[str] = []


def _plotly_js() -> str:
    if not _JS:
        from viewer.charts import plotly_js

        _JS.append(plotly_js())
    return _JS[0]


async def _stopped(templates, request: Request, exc: QueryStopped):
    """A page whose query the catalog stopped (time limit, or the server stopping): 503, saying which."""
    return await _error(templates, request, HTTPException(503, f"query stopped: {exc}"))


async def _error(templates, request: Request, exc: HTTPException):
    if request.url.path.startswith(("/thumb/", "/files/", "/static/")) or "/image/" in request.url.path:
        return PlainTextResponse(exc.detail, status_code=exc.status_code)
    return templates.TemplateResponse(request, "error.html", {"active": "", "code": exc.status_code,
                                                              "detail": exc.detail}, status_code=exc.status_code)
