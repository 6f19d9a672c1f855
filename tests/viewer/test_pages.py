"""The viewer's pages over a small run whose contents the test knows (tests/viewer/conftest.py)."""
from __future__ import annotations

import re

from viewer.catalog import consumed_by


def test_a_samples_lineage_names_its_concepts_copies_pack_and_training_step(view_run, view_client):
    sid = view_run["known"]
    r = view_client.get(f"/samples/{sid}")
    assert r.status_code == 200
    lineage = r.text.split('id="lineage"')[1]
    assert view_run["known_concept"] in lineage
    assert 'href="/packs/pack/0"' in lineage and "sample 1 of the pack" in lineage
    assert "pretrain stage 1.5 step 1" in lineage          # 2 packs a step: pack 0 is step 1's
    assert f"{view_run['copies'][sid]} (weight" in lineage
    assert f'src="/thumb/{sid}/0?px=320"' in r.text


def test_pack_stream_position_gives_the_stage_step_across_epochs():
    stages = [{"stage": "2", "data": "pack-instruct", "gbs": 4, "steps": 5}, {"stage": "1", "data": "pack", "gbs": 2,
                                                                              "steps": 1}]
    # 6 packs read 4 a step for 5 steps = 20 packs: pack 5 at positions 5, 11, 17 → steps 2, 3, 5
    assert [(c["step"], c["epoch"]) for c in consumed_by(stages, "pack-instruct", 5, 6)] == [(2, 0), (3, 1), (5, 2)]
    assert consumed_by(stages, "pack", 3, 10) == []         # stage 1 stops after 2 packs


def _shown_ids(html: str) -> list[str]:
    return re.findall(r'<a href="/samples/([0-9a-f]{16})">', html)


def test_sample_filters_run_server_side_and_page(view_run, view_client):
    copies, top = view_run["copies"], view_run["top"]
    want = sorted(s for s in view_run["ok"] if copies[s] == 0 and 2 in top[s])
    r = view_client.get("/samples?copies=0&concept=2&status=ok")
    assert f"({len(want)} match)" in r.text and _shown_ids(r.text) == want[:48]
    pack = view_run["packs"][1]
    assert sorted(_shown_ids(view_client.get("/samples?pack=1").text)) == sorted(pack)
    first, second = view_client.get("/samples").text, view_client.get("/samples?page=1").text
    assert len(_shown_ids(first)) == 48 and not set(_shown_ids(first)) & set(_shown_ids(second))
    assert view_client.get("/samples?copies=x").status_code == 400


def test_concept_page_shows_kept_beside_dropped(view_run, view_client):
    r = view_client.get("/concepts/2")
    kept, dropped = r.text.split('id="kept"')[1].split('id="dropped"')
    top1 = [s for s in view_run["ok"] if view_run["top"][s][0] == 2]
    assert all(view_run["copies"][s] > 0 for s in _shown_ids(kept))
    assert sorted(_shown_ids(dropped)) == sorted(s for s in top1 if view_run["copies"][s] == 0)
    assert 'id="head-tail"' in view_client.get("/concepts").text


def test_pack_page_draws_its_samples_and_loss_mask(view_run, view_client):
    r = view_client.get("/packs/pack/0")
    assert r.status_code == 200 and "32 under the loss" in r.text       # 4 samples × 8 loss tokens
    assert r.text.count('<span class="on"') == 4 and r.text.count('<span class="off"') == 4
    assert all(f'href="/samples/{s}"' in r.text for s in view_run["packs"][0])
    assert view_client.get("/packs/pack/999").status_code == 404


def test_training_rl_and_prompt_pages(view_run, view_client):
    t = view_client.get("/training").text
    assert "10.0%" in t                                   # data-wait share 0.1 s of 1.0 s
    rl = view_client.get("/rl").text
    assert "kept 1" in rl and "too_easy 1" in rl and "too_hard 1" in rl
    p = view_client.get("/rl/p0")
    assert "kept: kept" in p.text and p.text.count("answer p0.") == 4
    img = view_client.get("/rl/p0/image/0")
    assert img.status_code == 200 and img.headers["content-type"] == "image/jpeg"


def test_thumbnails_come_from_the_tar_and_are_cached_in_bounded_memory(view_run, view_client):
    from viewer import files

    sid = view_run["known"]
    r = view_client.get(f"/thumb/{sid}/0?px=96")
    assert r.status_code == 200 and r.content[:2] == b"\xff\xd8"
    hits = files._address_thumbnail.cache_info().hits
    view_client.get(f"/thumb/{sid}/0?px=96")
    info = files._address_thumbnail.cache_info()
    assert info.hits == hits + 1 and info.maxsize == files.THUMB_CACHE
    assert view_client.get(f"/thumb/{sid}/0?px=97").status_code == 400
    assert not any(p.suffix in (".jpg", ".jpeg") for p in view_run["run"].rglob("*"))   # nothing written


def test_overview_lists_every_step_with_its_status(view_run, view_client):
    r = view_client.get("/")
    for folder in ("ingest", "assign", "balance", "pack", "pretrain/stage-1.5", "select"):
        assert f'data-step="{folder}"' in r.text
    assert "st-done" in r.text


def test_a_run_with_nothing_yet_answers_every_page_without_a_server_error(tmp_path):
    from starlette.testclient import TestClient

    from viewer.app import create_app

    client = TestClient(create_app(tmp_path), raise_server_exceptions=False, base_url="http://127.0.0.1")
    for url in ("/", "/samples", "/concepts", "/packs", "/training", "/rl", "/sql?q=SELECT+1"):
        assert client.get(url).status_code == 200, url
    for url in ("/samples/0123456789abcdef", "/thumb/0123456789abcdef/0", "/packs/pack/0", "/rl/p0"):
        assert client.get(url).status_code == 404, url
    assert "no samples" in client.get("/samples").text


def test_packs_page_shows_costs_and_a_steps_ranks_side_by_side(view_client):
    """10 packs costing 1..10: at DP 2 × 2 micro-batches of 1, step 2 (packs 4..7) puts packs 4, 6 on rank 0
    (cost 5 + 7) and 5, 7 on rank 1 (6 + 8), as the loader's round robin hands them out."""
    r = view_client.get("/packs?step=pack&dp=2&ga=2&mb=1&at=1")
    assert r.status_code == 200
    listing = r.text.split('id="pack-list"')[1].split("</table>")[0]
    assert '<td class="num">1</td>' in listing and '<td class="num">10</td>' in listing   # the cost column
    ranks = r.text.split('id="rank-list"')[1].split("</table>")[0]
    rows = re.findall(r'<tr><td class="num">(\d+)</td><td>(.*?)</td><td class="num">([\d.]+)</td>', ranks)
    assert [(int(k), re.findall(r">(\d+)</a>", p), float(c)) for k, p, c in rows] == \
        [(0, ["4", "6"], 12.0), (1, ["5", "7"], 14.0)]
    assert "Packed without balancing" in r.text
    assert view_client.get("/packs?step=pack&dp=x").status_code == 400
