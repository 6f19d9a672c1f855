"""The source parsers ingest and rl-ingest share (``manifests.sources``): every shape of image cell, JSON
records with their errors, chat messages with image parts in place."""
import json

import pytest

from manifests.sources import BadRow, image_cell, image_path, iter_json_records, message_turns


def test_image_cell_as_hf_datasets_stores_it():
    assert image_cell(b"\x89PNG") == b"\x89PNG"
    assert image_cell(memoryview(b"ab")) == b"ab"
    assert image_cell({"bytes": b"ab", "path": "x.png"}) == b"ab"        # bytes win over the path
    assert image_cell({"bytes": None, "path": "x.png"}) == "x.png"
    assert image_cell("img/a.png") == "img/a.png"
    assert image_cell(None) is None and image_cell({"bytes": None, "path": None}) is None
    with pytest.raises(BadRow, match=r"images\[2\].bytes: expected binary, got str"):
        image_cell({"bytes": "abc"}, "images[2]")
    with pytest.raises(BadRow, match="an image cell of type int"):
        image_cell(7)
    assert image_path("a/../b.png", "/data") == "/data/b.png" and image_path("/abs.png", "/data") == "/abs.png"


def test_json_records_with_their_errors(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b'{"x": 1}\n\n{broken\n[1]\n')
    got = list(iter_json_records(str(tmp_path / "a.jsonl")))
    assert [(i, rec) for i, rec, _, _ in got] == [(0, {"x": 1}), (1, None), (2, [1])]
    assert got[1][2] == b"{broken" and got[1][3].startswith("not valid JSON")
    (tmp_path / "b.json").write_text(json.dumps([{"x": 1}, {"x": 2}]))
    assert [rec for _, rec, _, err in iter_json_records(str(tmp_path / "b.json"))] == [{"x": 1}, {"x": 2}]
    (tmp_path / "c.json").write_text('{"x": 1}')
    ((_, rec, _, err),) = iter_json_records(str(tmp_path / "c.json"))
    assert rec is None and "expected a JSON array of records, got dict" in err
    (tmp_path / "d.out").write_text('{"x": 1}\n{"x": 2}\n')                 # lines=True: any name
    assert [rec["x"] for _, rec, _, _ in iter_json_records(str(tmp_path / "d.out"), lines=True)] == [1, 2]


def test_message_turns_put_images_in_place():
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
            {"role": "gpt", "content": "A cat.", "name": "x"}]
    turns, problem = message_turns(msgs)
    assert turns == [("system", "Be brief."), ("user", "<image>What is it?"), ("assistant", "A cat.")]
    assert problem == ("unexpected_key", "messages[2] has key(s) ['name'] (expected role/content)")
    assert message_turns(json.dumps(msgs), frozenset({"name"}))[1] is None     # JSON text, an allowed extra key
    with pytest.raises(BadRow, match=r"messages\[0\].content\[0\]"):
        message_turns([{"role": "user", "content": [{"type": "video"}]}])
