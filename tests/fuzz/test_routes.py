"""The fuzzer's lists against the app: every route the viewer serves is one ``route_request`` draws
(``strategies.app_routes`` reads them from the app), and every query parameter a route reads is in
``strategies.QUERY_KEYS`` — found by asking each route, over the run with every step, with the parameters
recorded as the app reads them."""
from __future__ import annotations

import re

from starlette.datastructures import QueryParams
from starlette.routing import Mount
from starlette.testclient import TestClient

from tests.fuzz import strategies as S


def _filled(path: str, view: dict) -> str:
    """A route's path with real values: a sample, a pack step and pack, a prompt, a concept; the first image."""
    subs = {"sample_id": view["known"], "prompt_id": view["prompt"], "step": "pack", "path": "ingest/stats.json",
            "concept_id": "0", "pack_id": "0", "index": "0", "n": "0"}
    return re.sub(r"\{([^}:]+)(:[^}]+)?\}", lambda m: subs[m.group(1)], path)


def test_every_route_and_parameter_is_fuzzed(view_run, meaning_run, monkeypatch):
    from viewer.app import create_app

    app = create_app(meaning_run["run"])
    paths = [r.path for r in app.routes if not isinstance(r, Mount)]
    drawn = set(S.app_routes())
    for p in paths:
        assert re.sub(r"\{([^}:]+)(:[^}]+)?\}", lambda m: "{i}" if m.group(2) == ":int" else "{s}", p) in drawn, p
    for name in ("/map", "/map/region", "/similar/{s}", "/search", "/duplicates",
                 "/concepts/{i}/neighbours", "/packs"):
        assert name in drawn, name

    read: set[str] = set()
    real_get, real_item = QueryParams.get, QueryParams.__getitem__
    monkeypatch.setattr(QueryParams, "get",
                        lambda self, key, default=None: read.add(key) or real_get(self, key, default))
    monkeypatch.setattr(QueryParams, "__getitem__", lambda self, key: read.add(key) or real_item(self, key))
    client = TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False)
    for p in paths:
        url = _filled(p, view_run)
        client.get(url)
        if p == "/map/region":
            client.get(url, params={"box": "0,1,0,1"})
    assert {"dp", "mb", "ga", "at", "k", "box", "lasso", "colour", "sort", "q", "page", "px", "step"} <= read
    assert read <= set(S.QUERY_KEYS), sorted(read - set(S.QUERY_KEYS))
