"""The viewer's guards: it answers only its own Host names (DNS rebinding reads nothing), stops a query at its
time limit and at its result-size cap with a message saying which, encodes the filter values of its links,
answers 400/404 for a bad page, and a real server stops on SIGTERM while a query runs."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

LONG = "SELECT count(*) AS n FROM range(10000000000000)"


@pytest.fixture(scope="module")
def quick_client(view_run):
    """The app with a 1 s query time limit."""
    from starlette.testclient import TestClient

    from viewer.app import create_app

    return TestClient(create_app(view_run["run"], query_timeout=1.0), base_url="http://127.0.0.1")


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8765", "127.0.0.1.evil.example", "10.0.0.1",
                                  "localhost.", "[::2]"])
@pytest.mark.parametrize("path", ["/", "/sql?q=SELECT+1", "/files/ingest/report.md"])
def test_a_foreign_host_header_is_refused(view_client, host, path):
    r = view_client.get(path, headers={"Host": host})
    assert r.status_code == 400 and "samples" not in r.text


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:8765", "localhost:8765", "[::1]:8765", "LOCALHOST"])
def test_loopback_host_names_are_answered(view_client, host):
    assert view_client.get("/", headers={"Host": host}).status_code == 200


def test_the_served_hosts_are_loopback_the_bound_address_and_the_named_ones():
    from viewer.serve import allowed_hosts

    assert allowed_hosts("127.0.0.1", []) == ["127.0.0.1", "localhost", "[::1]"]
    assert allowed_hosts("0.0.0.0", ["gpu-node-3"]) == ["127.0.0.1", "localhost", "[::1]", "gpu-node-3"]
    assert allowed_hosts("fd00::5", []) == ["127.0.0.1", "localhost", "[::1]", "[fd00::5]"]


def test_a_long_query_is_stopped_at_the_time_limit(quick_client):
    t0 = time.monotonic()
    r = quick_client.get("/sql", params={"q": LONG})
    took = time.monotonic() - t0
    assert r.status_code == 422 and "stopped after 1 s" in r.text and 'id="sql-result"' not in r.text
    assert took < 15, took
    assert quick_client.get("/sql", params={"q": "SELECT count(*) AS n FROM samples"}).status_code == 200


@pytest.mark.parametrize("q", ["SELECT repeat('x', 40000000) AS s",
                               "SELECT list(repeat('y', 1000)) AS l FROM range(40000)"])
def test_a_huge_row_is_refused_at_the_size_cap(view_client, q):
    r = view_client.get("/sql", params={"q": q})
    assert r.status_code == 422 and "MiB" in r.text and 'id="sql-result"' not in r.text
    assert len(r.content) < 1_000_000


def test_filter_values_are_encoded_in_the_page_links(view_run, tmp_path):
    """A source holding '&', '+', '=' and a space: the next-page link carries it whole, and following the
    link filters on it again."""
    import re
    import shutil
    from html import unescape

    import pyarrow as pa
    import pyarrow.parquet as pq
    from starlette.testclient import TestClient

    from viewer.app import create_app

    run = tmp_path / "run"
    shutil.copytree(view_run["run"] / "ingest", run / "ingest")
    name = "a&b +c=d"
    for part in (run / "ingest").rglob("samples/part-*.parquet"):
        t = pq.read_table(part)
        t = t.set_column(t.schema.get_field_index("source"), "source", pa.array([name] * t.num_rows, pa.string()))
        pq.write_table(t, part)
    client = TestClient(create_app(run), base_url="http://127.0.0.1")
    first = client.get("/samples", params={"source": name})
    total = re.search(r"page 1 of (\d+)", first.text)
    assert first.status_code == 200 and total and int(total.group(1)) >= 2
    link = unescape(re.search(r'id="next" href="([^"]+)"', first.text).group(1))
    assert "source=a%26b+%2Bc%3Dd" in link
    second = client.get("/samples" + link)
    assert second.status_code == 200 and "page 2 of " + total.group(1) in second.text


@pytest.mark.parametrize("route", ["/samples", "/packs", "/rl"])
@pytest.mark.parametrize("page, code", [("abc", 400), ("-1", 400), ("1.5", 400), ("99999", 404),
                                        ("1" + "0" * 30, 404), ("0", 200)])
def test_a_bad_page_is_400_and_one_past_the_end_404(view_client, route, page, code):
    r = view_client.get(route, params={"page": page})
    assert r.status_code == code, (r.status_code, r.text[:300])


def test_sigterm_stops_the_server_mid_query(view_run):
    """A real server on 127.0.0.1, a query that would run for hours in flight, SIGTERM by PID: the process
    exits within seconds (the query is interrupted), and it refused a foreign Host while it ran."""
    import httpx

    p = subprocess.Popen([sys.executable, "-m", "ovpipe", "view", str(view_run["run"]), "--port", "0",
                          "--query-timeout", "3600"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert "on http://127.0.0.1:" in line, line + p.stderr.read()
        url = line.split(" on ")[1].split("/ ")[0]
        assert httpx.get(url + "/", headers={"Host": "evil.example"}, timeout=30).status_code == 400
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("r", _get(url + "/sql", {"q": LONG})), daemon=True)
        cpu0 = _cpu_seconds(p.pid)
        t.start()
        # the query is running in the server: its CPU time climbs (an idle server's stays put), the request waits
        deadline = time.monotonic() + 60
        while _cpu_seconds(p.pid) - cpu0 < 1.0:
            assert time.monotonic() < deadline, "the query never started running in the server"
            assert p.poll() is None and "r" not in got, (p.poll(), got)
            time.sleep(0.1)
        assert p.poll() is None and "r" not in got
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGTERM)
        p.wait(timeout=20)
        assert time.monotonic() - t0 < 10
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc/PID/stat, fields 14 and 15)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _get(url, params):
    import httpx

    try:
        return httpx.get(url, params=params, timeout=60).status_code
    except httpx.HTTPError as e:
        return repr(e)
