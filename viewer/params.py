"""The viewer's query parameters as bounded numbers: each is a whole number in a stated range or the request is
400 naming the range, so no parameter can make a page do unbounded work (every route is a GET: a page on another
site can send any of them with an ``<img src>``). ``page=`` past ``MAX_PAGE`` is 404 (no such page)."""
from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request

MAX_PAGE = 10**9                 # page × rows per page stays a 64-bit OFFSET
MAX_ID = 2**62                   # an id or count DuckDB reads as a BIGINT


def whole(request: Request, name: str, default: int = 0, lo: int = 0, hi: int = MAX_ID) -> int:
    """``name=`` as a whole number in ``[lo, hi]`` (``default`` when absent or empty); 400 naming the bounds."""
    v = request.query_params.get(name, "")
    if v == "":
        return default
    try:
        n = int(v)
    except ValueError:
        raise HTTPException(400, f"{name}={v[:40]!r}: expected a whole number") from None
    if not lo <= n <= hi:
        raise HTTPException(400, f"{name}={str(n)[:40]}: between {lo} and {hi}")
    return n


def page(request: Request) -> int:
    """``page=`` as a whole number: 400 when it is not one or is negative, 404 past ``MAX_PAGE``."""
    v = request.query_params.get("page", "")
    try:
        pg = int(v) if v != "" else 0
    except ValueError:
        raise HTTPException(400, f"page={v[:40]!r}: expected a whole number") from None
    if pg < 0:
        raise HTTPException(400, f"page={pg}: pages count from 0")
    if pg > MAX_PAGE:
        raise HTTPException(404, f"page={str(pg)[:40]}: no such page")
    return pg


def on_a_page(pg: int, pages: int) -> None:
    """404 for a page past the last one (page 0 of nothing is an empty page)."""
    if pg > 0 and pg >= pages:
        raise HTTPException(404, f"page={pg}: there are {pages} pages (0 to {max(pages - 1, 0)})")
