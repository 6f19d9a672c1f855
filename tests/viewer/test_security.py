"""Safe by default: loopback bind, reads only, no path outside the run folder and its declared inputs."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("path", ["/files/..%2F..%2Fetc%2Fpasswd.txt", "/files/ingest/..%2F..%2Fsecret.txt",
                                  "/files/%2Fetc%2Fpasswd.txt", "/files//etc/hostname.txt"])
def test_path_traversal_is_refused(view_client, path):
    r = view_client.get(path)
    assert r.status_code in (403, 404) and "root:" not in r.text


def test_a_symlink_out_of_the_run_folder_is_refused(view_run, view_client, tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("not for the viewer")
    link = view_run["run"] / "ingest" / "leak.txt"
    os.symlink(outside, link)
    try:
        r = view_client.get("/files/ingest/leak.txt")
        assert r.status_code == 403 and "not for the viewer" not in r.text
    finally:
        link.unlink()
    assert view_client.get("/files/ingest/report.md").status_code == 200


def test_an_image_outside_the_declared_inputs_is_refused(view_run, tmp_path):
    from viewer.files import Refused, allowed_roots, image_bytes

    roots = allowed_roots(view_run["run"])
    shards = {p.resolve() for p in roots}
    assert view_run["run"].resolve() in shards and len(shards) == 2      # the run and its ingest's shard folder
    stray = tmp_path / "x.jpg"
    stray.write_bytes(b"\xff\xd8")
    with pytest.raises(Refused):
        image_bytes({"file": str(stray), "container": "file", "offset": 0, "size": 2}, roots)


@pytest.mark.parametrize("q", ["DELETE FROM samples", "CREATE TABLE t AS SELECT 1",
                               "COPY (SELECT 1) TO 'RUN/ingest/samples/part-00000.parquet'",
                               "EXPLAIN ANALYZE COPY (SELECT 1) TO 'RUN/x.parquet'", "SELECT 1; DROP VIEW samples",
                               "ATTACH 'RUN/x.db'"])
def test_a_write_through_the_sql_route_is_refused(view_run, view_client, q):
    run = view_run["run"]
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*.parquet")}
    r = view_client.get("/sql", params={"q": q.replace("RUN", str(run))})
    assert r.status_code == 403 and "refused" in r.text
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*.parquet")} == before
    assert view_client.get("/sql", params={"q": "SELECT count(*) AS n FROM samples"}).status_code == 200


def test_sql_cannot_read_outside_the_run(view_client, tmp_path):
    (tmp_path / "o.csv").write_text("a\n1\n")
    r = view_client.get("/sql", params={"q": f"SELECT * FROM read_csv('{tmp_path / 'o.csv'}')"})
    assert 'id="sql-result"' not in r.text and 'id="sql-error"' in r.text


def test_the_default_bind_is_loopback(view_run):
    from viewer.serve import DEFAULT_HOST, build_parser

    assert build_parser().parse_args(["RUN"]).host == DEFAULT_HOST == "127.0.0.1"
    p = subprocess.Popen([sys.executable, "-m", "ovpipe", "view", str(view_run["run"]), "--port", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert "on http://127.0.0.1:" in line and f"pid {p.pid}" in line, line + p.stderr.read()
    finally:
        p.terminate()
        p.wait(10)
