"""Every page of a small run in headless Chromium (Debian's package, driven by playwright): no console errors,
the expected elements present, a screenshot of each page in the test's temp folder. Skips where chromium or
playwright is missing (``scripts/install_system_deps.sh`` installs chromium), and fails there under CI=true
(the ``chromium`` marker: tests/conftest.py NEEDS)."""
from __future__ import annotations

import shutil

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.chromium
def test_every_page_loads_in_chromium_without_console_errors(view_run, view_server, tmp_path):
    from playwright import sync_api

    sid = view_run["known"]
    pages = {  # page: (path, selectors that must be there)
        "overview": ("/", ['tr[data-step="pack"]', ".st-done"]),
        "samples": ("/samples", ["#samples .card img", "#next"]),
        "sample": (f"/samples/{sid}", ['#packs a[href="/packs/pack/0"]', "#concepts a", "img[alt='image 0']"]),
        "concepts": ("/concepts", ["#head-tail .main-svg"]),
        "concept": ("/concepts/0", ["#kept .card", "#dropped .card"]),
        "packs": ("/packs", ["#fill .main-svg", "#pack-list a"]),
        "pack": ("/packs/pack/0", ["#pack-bar .img-tok", "#loss-mask .on"]),
        "training": ("/training", ["#stages", ".chart .main-svg"]),
        "rl": ("/rl", ["#prompts a", ".chart .main-svg"]),
        "prompt": (f"/rl/{view_run['prompt']}", ["#decision", "#rollouts", "img[alt='image 0']"]),
        "sql": ("/sql?q=SELECT+count(*)+AS+n+FROM+samples", ["#sql-result"]),
    }
    errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: m.type == "error" and errors.append(f"{page.url}: {m.text}"))
            page.on("pageerror", lambda e: errors.append(f"{page.url}: {e}"))
            for name, (path, selectors) in pages.items():
                page.goto(view_server + path, wait_until="load")
                for sel in selectors:
                    page.wait_for_selector(sel, timeout=10_000)
                assert page.evaluate("[...document.images].every(i => !i.complete || i.naturalWidth > 0)"), name  # none broken
                page.screenshot(path=tmp_path / f"{name}.png")
            lineage = page.goto(f"{view_server}/samples/{sid}") and page.inner_text("#lineage")
        finally:
            browser.close()
    assert errors == []
    assert "pack · pack 0" in lineage and view_run["known_concept"] in lineage and "stage 1.5 step 1" in lineage
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(f"{n}.png" for n in pages)
