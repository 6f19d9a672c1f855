"""What the fuzzing found, pinned as plain tests: each failed before its fix (a dead task, a task that never
ends, or a rerun that is not byte-identical)."""
from __future__ import annotations

import json
import os
import threading

import pytest

from tests.fuzz.targets import ingest_rows


@pytest.mark.parametrize("name, text", [("a.json", b"[" * 100_000),
                                        ("b.jsonl", b"[" * 100_000 + b"\n" + json.dumps({"x": 1}).encode())])
def test_json_nested_deeper_than_the_stack_is_a_bad_row(tmp_path, name, text):
    (tmp_path / name).write_bytes(text)
    rows, shard_status = ingest_rows(str(tmp_path / name))
    assert shard_status is None and rows[0]["status"] == "bad_row" and "recursion" in rows[0]["error"]
    assert len(rows) == (1 if name.endswith(".json") else 2)


@pytest.mark.parametrize("image", ["fifo.jpg", "/dev/zero"])
def test_an_image_path_naming_a_fifo_or_a_device_is_a_missing_image(tmp_path, image):
    os.mkfifo(tmp_path / "fifo.jpg")              # no writer: opening it would block for ever
    rec = {"id": "x", "image": image, "conversations": [{"from": "human", "value": "<image>hi"},
                                                        {"from": "gpt", "value": "a cat."}]}
    (tmp_path / "d.json").write_text(json.dumps([rec]))
    got = {}
    t = threading.Thread(target=lambda: got.update(rows=ingest_rows(str(tmp_path / "d.json"))[0]), daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the reader is still reading the image"
    assert [r["status"] for r in got["rows"]] == ["missing_image"] and "not a regular file" in got["rows"][0]["error"]


def test_an_unreadable_image_error_names_no_memory_address():
    from curation.image_header import inspect_image
    from packing.import_packs import image_size

    status, *_, error = inspect_image(b"\x00 not an image", "header")
    assert status == "corrupt_image" and "0x" not in error
    with pytest.raises(ValueError) as e:
        image_size(b"\x00 not an image")
    assert str(e.value).startswith("bad_image: ") and "0x" not in str(e.value)


def test_an_official_json_nested_deeper_than_the_stack_is_bad_json():
    from packing.official import parse_entry

    with pytest.raises(ValueError, match="^bad_json: RecursionError"):
        parse_entry({"json": b"[" * 100_000, "img0.jpg": b"x"})


def test_a_finevision_ratings_column_of_strings_is_a_bad_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"images": pa.nulls(2, pa.list_(pa.binary())),
                             "texts": [[{"user": "hi", "assistant": "a cat."}]] * 2,
                             "relevance_ratings": ["w", None]}), tmp_path / "f.parquet")
    rows, shard_status = ingest_rows(str(tmp_path / "f.parquet"))
    assert shard_status is None and [r["status"] for r in rows][0] == "bad_row" and len(rows) == 2
    assert "relevance_ratings" in rows[0]["error"]


def test_an_image_path_with_a_nul_byte_is_a_missing_image(tmp_path):
    rec = {"id": "x", "image": "a\x00.jpg", "conversations": [{"from": "human", "value": "<image>hi"},
                                                              {"from": "gpt", "value": "a cat."}]}
    (tmp_path / "d.json").write_text(json.dumps([rec]))
    rows, _ = ingest_rows(str(tmp_path / "d.json"))
    assert [r["status"] for r in rows] == ["missing_image"] and "null byte" in rows[0]["error"]


def test_a_query_stopped_while_its_result_streams_is_stopped_not_a_crash(tmp_path):
    """The SQL box streams its result as Arrow batches; an interrupt that lands then surfaces as Arrow's
    OSError, and must still be the time limit's message."""
    from viewer.catalog import QueryStopped, RunCatalog

    (tmp_path / "run").mkdir()
    cat = RunCatalog(tmp_path / "run", query_timeout=0.3)
    with pytest.raises(QueryStopped, match="stopped after 0.3 s"):
        cat.rows("SELECT repeat('x', 1000) AS s FROM range(100000000)", max_bytes=2**40)
