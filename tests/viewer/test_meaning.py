"""Search by meaning in the viewer, over the viewer's small run plus vectors the test plants: a near-duplicate
pair (one marked ``duplicate_of`` the other), an image placed on a text's vector through a seeded tiny CLIP, and
concept vectors; the ``index`` step runs on them. Requests through starlette's client, then one headless
Chromium session for the map (select a region → its samples and SQL), "more like this" and text search."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.viewer.run_builder import QUERY


@pytest.fixture(scope="module")
def client(meaning_run):
    from starlette.testclient import TestClient

    from viewer.app import create_app

    return TestClient(create_app(meaning_run["run"]), base_url="http://127.0.0.1")


def _ranked(html: str, grid: str) -> list[str]:
    import re

    part = html.split(f'id="{grid}"')[1]
    return re.findall(r'data-sample="([0-9a-f]{16})"', part)


def test_more_like_this_text_search_and_groups_through_the_client(meaning_run, client):
    r = client.get(f"/similar/{meaning_run['kept']}")
    assert r.status_code == 200 and _ranked(r.text, "neighbours")[0] == meaning_run["twin"]
    assert "grouped with it by dedup" in r.text.split('data-rank="2"')[0]
    r = client.get("/search", params={"q": QUERY})
    assert r.status_code == 200 and _ranked(r.text, "results")[0] == meaning_run["planted"]
    r = client.get("/duplicates")
    assert r.status_code == 200 and f"/similar/{meaning_run['kept']}" in r.text and 'data-cos="' in r.text
    r = client.get("/concepts/0/neighbours")
    assert r.status_code == 200 and len(_ranked(r.text, "neighbourhood")) == 48


def test_search_scores_are_the_stored_vectors_cosines_and_texts_are_embedded_once(meaning_run, monkeypatch):
    import curation.clip
    from viewer import similarity as sim
    from viewer.catalog import RunCatalog
    from viewer.files import allowed_roots

    run = meaning_run["run"]
    ix = sim.EmbeddingIndex(run, sim.find_index(RunCatalog(run)), allowed_roots(run))
    q = ix.vectors([ix.position(meaning_run["kept"])])[0]
    hits = ix.search(q, 10)
    stored = ix.vectors([ix.position(sid) for sid, _ in hits]) @ q
    assert np.allclose([c for _, c in hits], stored, atol=1e-5) and np.all(np.diff(stored) <= 1e-6)
    asked = []
    real = curation.clip.embed_query
    monkeypatch.setattr(curation.clip, "embed_query", lambda net, tok, text: asked.append(text) or real(net, tok, text))
    monkeypatch.setattr(sim, "CACHED_QUERIES", 2)
    first = ix.text_vector(QUERY)
    assert ix.text_vector(f"  {QUERY} ") is first and asked == [QUERY]
    ix.text_vector("b")
    ix.text_vector(QUERY)                                     # the most recent again: "b" is now the oldest
    ix.text_vector("c")
    ix.text_vector(QUERY)
    ix.text_vector("b")
    assert asked == [QUERY, "b", "c", "b"]


@pytest.mark.parametrize("path,params,says", [
    ("/search", {"q": "x" * 201}, "the cap is 200"),
    ("/similar/not-an-id", {}, "16 hex digits"),
    ("/similar/0000000000000000", {"k": "1000"}, "between 1 and 100"),
    ("/map/colours", {"colour": "x); DROP TABLE samples; --"}, "one of"),
    ("/map/region", {"box": "0,1,2"}, "x0,x1,y0,y1"),
    ("/map/region", {"lasso": "0,0;1,nan;1,1"}, "not a finite number"),
])
def test_bad_queries_are_refused_with_a_message(client, path, params, says):
    r = client.get(path, params=params)
    assert r.status_code == 400 and says in r.text


def _body(raw: bytes) -> tuple[dict, bytes]:
    hlen = int.from_bytes(raw[:4], "little")
    return json.loads(raw[4:4 + hlen]), raw[4 + hlen:]


def test_map_body_and_regions_agree_with_the_manifest(meaning_run, client):
    from manifests.io import read_manifest

    m = read_manifest(meaning_run["run"], "embedding_map").to_pydict()
    drawn = sorted((p, x, y, sid) for p, x, y, sid, i in zip(m["position"], m["x"], m["y"], m["sample_id"],
                                                              m["in_map"]) if i)     # the body's order: by position
    head, arrays = _body(client.get("/map/points").content)
    assert head["n"] == len(drawn) and len(arrays) == 8 * len(drawn)
    assert np.allclose(np.frombuffer(arrays, np.float32).reshape(-1, 2), [d[1:3] for d in drawn])
    head, codes = _body(client.get("/map/colours", params={"colour": "near duplicate"}).content)
    assert head["n"] == len(drawn) and sorted(head["labels"]) == ["near_duplicate", "ok"]
    assert sum(head["counts"]) == len(drawn)
    shown = {d[3]: head["labels"][c] for d, c in zip(drawn, codes)}
    assert [sid for sid, label in shown.items() if label == "near_duplicate"] == [meaning_run["twin"]]
    head, codes = _body(client.get("/map/colours", params={"colour": "cluster"}).content)
    cluster = {d[3]: c for d, c in zip(drawn, codes)}
    by_value = dict(zip(m["sample_id"], m["cluster"]))
    assert head["range"] == [min(by_value.values()), max(by_value.values())] and head["nulls"] == 0
    assert sorted(cluster, key=lambda s: (cluster[s], s)) == sorted(cluster, key=lambda s: (by_value[s], s))
    point = client.get(f"/map/point/{len(drawn) - 1}", follow_redirects=False)
    assert point.status_code == 303 and point.headers["location"] == f"/similar/{drawn[-1][3]}"
    xs, ys = np.array(m["x"], np.float64), np.array(m["y"], np.float64)
    x0, x1, y0, y1 = np.quantile(xs, 0.2), np.quantile(xs, 0.7), np.quantile(ys, 0.1), np.quantile(ys, 0.8)
    box = client.get("/map/region", params={"box": f"{x0},{x1},{y0},{y1}"}).json()
    square = client.get("/map/region", params={"lasso": f"{x0},{y0};{x1},{y0};{x1},{y1};{x0},{y1}"}).json()
    inside = int(((xs > x0) & (xs < x1) & (ys > y0) & (ys < y1)).sum())
    assert box["total"] == square["total"] == inside > 0 and "embedding_map" in box["sql"]
    assert [r["sample_id"] for r in box["rows"]] == [r["sample_id"] for r in square["rows"]]


def test_map_region_neighbours_and_text_search_in_chromium(meaning_run, tmp_path):
    """One browser session: the map draws every point it was sent (each one's place is painted, the margin is
    not) and looks the same as with every point sent to WebGL; a box over it fills the grid and shows its SQL, a
    lasso selects part of it; another colour redraws it with its legend and tooltip; a click on the planted
    near-duplicate opens "more like this" on it (or its twin, drawn on the same place) with the other one first;
    the text query shows the planted image first."""
    import io
    import shutil as sh

    from PIL import Image

    from manifests.io import read_manifest

    chromium = sh.which("chromium") or sh.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium on PATH (scripts/install_system_deps.sh installs Debian's)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (make install)")
    m = read_manifest(meaning_run["run"], "embedding_map").to_pydict()
    kept_at = next([x, y] for x, y, sid in zip(m["x"], m["y"], m["sample_id"]) if sid == meaning_run["kept"])
    errors: list[str] = []
    with _serve(meaning_run["run"]) as base, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: m.type == "error" and errors.append(f"{page.url}: {m.text}"))
            page.on("pageerror", lambda e: errors.append(f"{page.url}: {e}"))
            page.goto(base + "/map")
            page.wait_for_function("window.mapReady === true", timeout=20_000)
            drawn = page.evaluate("window.ovpipeMap.drawn")
            places = page.evaluate("ps => ps.map(p => window.ovpipeMap.toScreen(p[0], p[1]))", [
                [x, y] for x, y, i in zip(m["x"], m["y"], m["in_map"]) if i])
            shot = Image.open(io.BytesIO(page.screenshot())).convert("RGB")
            area = page.locator("#map").bounding_box()
            page.mouse.move(area["x"] + 2, area["y"] + 2)
            page.mouse.down()
            page.mouse.move(area["x"] + area["width"] / 2, area["y"] + area["height"] / 2, steps=5)
            page.mouse.move(area["x"] + area["width"] - 2, area["y"] + area["height"] - 2, steps=5)
            page.mouse.up()
            page.wait_for_selector("#region-grid .card img", timeout=10_000)
            count, sql = page.inner_text("#region-count"), page.inner_text("#region-sql")
            page.check("input[name=drag][value=lasso]")
            page.mouse.move(area["x"] + 4, area["y"] + 4)
            page.mouse.down()
            for fx, fy in ((0.9, 0.1), (0.5, 0.9), (0.1, 0.8)):
                page.mouse.move(area["x"] + fx * area["width"], area["y"] + fy * area["height"], steps=4)
            page.mouse.up()
            page.wait_for_function("document.getElementById('region-sql').textContent.includes('% 2 = 1')")
            lasso = int(page.inner_text("#region-count").split()[0])
            page.select_option("#colour", "near duplicate")
            page.wait_for_function("window.mapReady === true", timeout=20_000)
            legend = page.inner_text("#map-legend")
            page.mouse.move(*page.evaluate("p => window.ovpipeMap.toScreen(p[0], p[1])", kept_at))
            page.wait_for_function("document.getElementById('map-overlay').title !== ''")
            tooltip = page.get_attribute("#map-overlay", "title")
            page.screenshot(path=tmp_path / "map.png")
            page.mouse.click(*page.evaluate("p => window.ovpipeMap.toScreen(p[0], p[1])", kept_at))
            page.wait_for_url("**/similar/*")
            clicked = page.url.rsplit("/", 1)[1]
            first_like = page.get_attribute("#neighbours .card >> nth=0", "data-sample")
            page.screenshot(path=tmp_path / "similar.png")
            page.goto(base + "/search")
            page.fill("#q", QUERY)
            page.click("button[type=submit]")
            first = page.get_attribute("#results .card >> nth=0", "data-sample")
            page.screenshot(path=tmp_path / "search.png")
            page.goto(base + "/duplicates")
            page.wait_for_selector("#groups .member")
            page.screenshot(path=tmp_path / "duplicates.png")
            shots = [(_map_pixels(browser, base + "/map", z), _map_pixels(browser, base + "/map?every=1", z))
                     for z in (0, 12)]
        finally:
            browser.close()
    assert errors == []
    assert drawn == len(places) == sum(m["in_map"])
    painted = [min(shot.getpixel((round(x), round(y)))) < 225 for x, y in places]
    assert all(painted), f"{painted.count(False)} of {len(places)} points not drawn"
    assert min(shot.getpixel((round(area["x"]) + 4, round(area["y"]) + 4))) > 250      # the margin stays blank
    assert count.startswith(f"{len(meaning_run['ok'])} images") and "FROM embedding_map" in sql
    assert 0 < lasso < len(meaning_run["ok"]) and "near_duplicate (1)" in legend
    assert tooltip in ("near duplicate: ok", "near duplicate: near_duplicate")     # the kept image or its twin
    pair = {meaning_run["kept"], meaning_run["twin"]}
    assert clicked in pair and {clicked, first_like} == pair
    assert first == meaning_run["planted"]
    assert shots[0][0] != shots[1][0]                           # the wheel zoomed out
    assert [a == b for a, b in shots] == [True, True]            # a frame leaves out only points hidden exactly


def _map_pixels(browser, url: str, zoom_out: int) -> bytes:
    """The map's pixels (the status colour) after ``zoom_out`` wheel steps at its centre (12 pile every point onto a
    few pixels, the twin on its kept image among them)."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(url)
        page.wait_for_function("window.mapReady === true", timeout=20_000)
        area = page.locator("#map-gl").bounding_box()
        page.mouse.move(area["x"] + area["width"] / 2, area["y"] + area["height"] / 2)
        for _ in range(zoom_out):
            page.mouse.wheel(0, 400)
        page.evaluate("() => new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)))")
        return page.locator("#map-gl").screenshot()
    finally:
        page.close()


def _serve(run):
    from viewer.app import create_app
    from viewer.serve import serving_in_thread

    return serving_in_thread(create_app(run))


def test_lasso_region_route_answers_400(client):
    r = client.get("/map/region", params={"lasso": "0,0;1e308,1;-1e308,2"})
    assert r.status_code == 400 and "outside" in r.json()["error"]


@pytest.mark.parametrize("page,code", [("-1", 400), ("x", 400), ("1" + "0" * 12, 404), ("5", 404), ("0", 200)])
def test_duplicates_pages_like_every_page(client, page, code):
    assert client.get("/duplicates", params={"page": page}).status_code == code


def test_the_maps_background_build_handles_its_own_error(meaning_run, monkeypatch):
    """``/map`` starts building its bodies in a thread; a refused build there is the body route's 400 later,
    never an exception that kills the thread unhandled."""
    import threading

    from starlette.testclient import TestClient

    from viewer import similarity as sim
    from viewer.app import create_app

    def refuse(cat, *a):
        raise sim.QueryError("no layout here")

    monkeypatch.setattr(sim, "map_layout", refuse)
    unhandled = []
    monkeypatch.setattr(threading, "excepthook", lambda args: unhandled.append(args.exc_value))
    before = set(threading.enumerate())
    client = TestClient(create_app(meaning_run["run"]), base_url="http://127.0.0.1")
    assert client.get("/map").status_code == 200
    for t in set(threading.enumerate()) - before:
        if t.daemon:
            t.join(10)
    assert unhandled == []
    r = client.get("/map/points")
    assert r.status_code == 400 and "no layout here" in r.text
