import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash
from PIL import Image

from curation.image_header import inspect_image
from curation.ingest import read_image_bytes
from manifests import read_manifest
from ovpipe.cli import main


def test_demo_broken_samples_become_rows(ingested_run, capsys):
    t = read_manifest(ingested_run, "samples").to_pylist()
    assert len(t) == 200
    by_status = {}
    for r in t:
        by_status.setdefault(r["status"], []).append(r)
    for status in ("corrupt_image", "empty_image", "empty_caption", "bad_caption_encoding", "duplicate"):
        assert len(by_status[status]) == 1, status
        assert by_status[status][0]["error"]
    assert len(by_status["ok"]) == 195
    main(["sql", str(ingested_run), "SELECT status, count(*) AS n FROM samples GROUP BY 1 ORDER BY 1", "--format", "csv"])
    out = capsys.readouterr().out
    assert "corrupt_image,1" in out and "ok,195" in out


def test_sample_id_and_image_address(ingested_run, demo_corpus):
    gt = {r["sample_id"]: r for r in pq.read_table(demo_corpus / "ground_truth.parquet").to_pylist()}
    rows = [r for r in read_manifest(ingested_run, "samples").to_pylist() if r["status"] == "ok"][:20]
    for r in rows:
        img = read_image_bytes(r)
        assert xxhash.xxh3_64(img + r["caption"].encode()).hexdigest() == r["sample_id"]
        assert Image.open(io.BytesIO(img)).size == (r["width"], r["height"])
        assert r["sample_id"] in gt


def test_duplicate_marked_against_first_occurrence(ingested_run):
    rows = read_manifest(ingested_run, "samples").to_pylist()
    dup = next(r for r in rows if r["status"] == "duplicate")
    same = [r for r in rows if r["sample_id"] == dup["sample_id"]]
    assert len(same) == 2
    first = next(r for r in same if r["status"] == "ok")
    assert first["key"] < dup["key"] and first["key"] in dup["error"]
    stats = (ingested_run / "ingest" / "stats.json").read_text()
    assert '"duplicates": 1' in stats


def test_parquet_source(tmp_path):
    def jpg(color):
        b = io.BytesIO()
        Image.new("RGB", (30, 20), color).save(b, format="JPEG")
        return b.getvalue()

    good = jpg("red")
    table = pa.table({"image": [{"bytes": good, "path": None}, {"bytes": good[:50], "path": None},
                                {"bytes": jpg("blue"), "path": None}],
                      "caption": ["a red box", "cut", ""]})
    src = tmp_path / "src" / "train-00000.parquet"
    src.parent.mkdir()
    pq.write_table(table, src)
    run = tmp_path / "run"
    assert main(["ingest", "--set", f"inputs=['{src}']", "--run-dir", str(run), "--quiet"]) == 0
    rows = read_manifest(run, "samples", sort=False).to_pylist()
    st = {r["key"]: r["status"] for r in rows}
    assert st == {"000000000": "ok", "000000001": "corrupt_image", "000000002": "empty_caption"}
    ok = next(r for r in rows if r["status"] == "ok")
    assert (ok["width"], ok["height"], ok["source"]) == (30, 20, "src")
    assert read_image_bytes(ok) == good


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_inspect_image_truncation(fmt):
    b = io.BytesIO()
    Image.new("RGB", (64, 48), "green").save(b, format=fmt)
    data = b.getvalue()
    assert inspect_image(data, "header")[:3] == ("ok", 64, 48)
    assert inspect_image(data[: len(data) - 20], "header")[0] == "corrupt_image"
    assert inspect_image(b"", "header")[0] == "empty_image"
    assert inspect_image(b"not an image", "header")[0] == "corrupt_image"
