"""Ingest adapters: each published layout, made small in the test, with its broken rows."""
import io
import json
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash
from PIL import Image

from curation.formats import detect_format
from manifests import read_manifest
from manifests.conversation import read_image, sample_id
from manifests.io import manifest_files
from ovpipe.cli import main

HF_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def img(w=40, h=30, color="red", fmt="JPEG") -> bytes:
    b = io.BytesIO()
    Image.new("RGB", (w, h), color).save(b, format=fmt)
    return b.getvalue()


def ingest(run, inputs, *sets, tasks=1, name="ingest"):
    args = ["ingest", "--name", name, "--set", f"inputs={json.dumps([str(p) for p in inputs])}", "--run-dir", str(run),
            "--tasks", str(tasks), "--quiet"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    return {r["key"]: r for r in read_manifest(run, "samples", step=name).to_pylist()}


def turns_of(row):
    return [(t["role"], t["text"]) for t in row["conversation"]]


def check_ok(row, expected_turns, images: list[bytes]):
    """Status ok, the conversation, the id rule, every image address resolving to its bytes,
    and the legacy columns describing the first image."""
    assert row["status"] == "ok", (row["key"], row["error"])
    assert turns_of(row) == expected_turns
    assert row["turns"] == len(expected_turns) and row["n_images"] == len(images) == len(row["images"])
    assert [read_image(a) for a in row["images"]] == images
    for a, data in zip(row["images"], images):
        assert (a["width"], a["height"]) == Image.open(io.BytesIO(data)).size and a["size"] == len(data)
    assert row["sample_id"] == sample_id(images, expected_turns)
    assert row["caption"] == next(t for r, t in expected_turns if r == "assistant")
    if images:
        first = row["images"][0]
        assert (row["offset"], row["size"], row["image_format"], row["width"], row["height"]) == \
            (first["offset"], first["size"], first["format"], first["width"], first["height"])
    else:
        assert (row["offset"], row["size"], row["image_format"], row["width"], row["height"]) == (-1, 0, "", 0, 0)


def test_llava_json(tmp_path):
    d = tmp_path / "llava"
    (d / "images").mkdir(parents=True)
    a, b = img(40, 30, "red"), img(64, 48, "blue", "PNG")
    (d / "images" / "a.jpg").write_bytes(a)
    (d / "images" / "b.png").write_bytes(b)
    (d / "images" / "cut.jpg").write_bytes(a[:60])
    H, G = "human", "gpt"

    def conv(*pairs):
        return [{"from": f, "value": v} for f, v in pairs]

    records = [
        {"id": "one", "image": "images/a.jpg", "conversations": conv((H, "<image>\nWhat is it?"), (G, "A red box."))},
        {"id": "two", "images": ["images/a.jpg", "images/b.png"], "category": "comparison",
         "conversations": conv(("system", "Be brief."), (H, "<image>\n<image>\nSame?"), (G, "No."), (H, "Sure?"), (G, "Yes."))},
        {"id": "text", "conversations": conv((H, "What is 2 + 2?"), (G, "4."))},
        {"id": "lost", "image": "images/nope.jpg", "conversations": conv((H, "<image>"), (G, "x"))},
        {"id": "cut", "image": "images/cut.jpg", "conversations": conv((H, "<image>"), (G, "x"))},
        {"id": "empty", "image": "images/a.jpg", "conversations": conv((H, "<image>\nQ"), (G, "  "))},
        {"id": "last", "image": "images/a.jpg", "conversations": conv((H, "<image>\nQ"), (G, "A"), (H, "More?"))},
        {"id": "noans", "conversations": conv((H, "Hello?"))},
        {"id": "role", "conversations": conv(("narrator", "Once"), (G, "upon"))},
        {"id": "key", "conversations": [{"from": H, "value": "Q"}, {"from": G, "value": "A", "markdown": "**A**"}]},
        {"id": "weight", "conversations": [{"from": H, "value": "Q2"}, {"from": G, "value": "A2", "weight": 0}]},
        {"id": "mismatch", "image": "images/a.jpg", "conversations": conv((H, "no placeholder"), (G, "A"))},
        {"id": "badrow", "conversations": "not a list of turns"},
        {"id": "one", "image": "images/b.png", "conversations": conv((H, "<image>\nAgain?"), (G, "Blue."))},
        {"conversations": conv((H, "Without an id?"), (G, "Yes."))},
    ]
    (d / "data.json").write_text(json.dumps(records))
    rows = ingest(tmp_path / "run", [d / "data.json"], "format=llava-json", "extra_turn_keys=[weight]")
    assert len(rows) == len(records)
    check_ok(rows["one"], [("user", "<image>\nWhat is it?"), ("assistant", "A red box.")], [a])
    check_ok(rows["two"], [("system", "Be brief."), ("user", "<image>\n<image>\nSame?"), ("assistant", "No."),
                           ("user", "Sure?"), ("assistant", "Yes.")], [a, b])
    check_ok(rows["text"], [("user", "What is 2 + 2?"), ("assistant", "4.")], [])
    check_ok(rows["weight"], [("user", "Q2"), ("assistant", "A2")], [])   # tolerated by extra_turn_keys
    check_ok(rows["one#13"], [("user", "<image>\nAgain?"), ("assistant", "Blue.")], [b])   # repeated id: unique key
    check_ok(rows["000000014"], [("user", "Without an id?"), ("assistant", "Yes.")], [])  # no id: record index
    assert rows["two"]["images"][0]["container"] == "file" and rows["two"]["images"][1]["format"] == "png"
    expected = {"lost": "missing_image", "cut": "corrupt_image", "empty": "empty_turn", "last": "bad_last_turn",
                "noans": "no_assistant", "role": "unknown_role", "key": "unexpected_key",
                "mismatch": "image_mismatch", "badrow": "bad_row"}
    for key, status in expected.items():
        assert rows[key]["status"] == status and rows[key]["error"], (key, rows[key]["status"], rows[key]["error"])
    assert "markdown" in rows["key"]["error"] and "nope.jpg" in rows["lost"]["error"]
    assert rows["lost"]["n_images"] == 1 and rows["lost"]["images"][0]["size"] == 0
    # category: the row's, else the source (the folder name); shard = the JSON file, shard_format json
    assert rows["two"]["category"] == "comparison" and rows["one"]["category"] == "llava"
    assert rows["one"]["shard"] == str((d / "data.json").resolve()) and rows["one"]["shard_format"] == "json"
    stats = json.loads((tmp_path / "run" / "ingest" / "stats.json").read_text())["counters"]
    assert stats["status/ok"] == 6 and stats["status/bad_row"] == 1 and stats["samples"] == len(records)


def test_llava_jsonl_streamed_with_image_root_and_config_category(tmp_path):
    imgs = tmp_path / "elsewhere"
    imgs.mkdir()
    a = img(50, 20)
    (imgs / "x.jpg").write_bytes(a)
    lines = [json.dumps({"id": "0", "image": "x.jpg", "conversations": [
                 {"from": "human", "value": "<image>"}, {"from": "gpt", "value": "a red bar"}]}),
             "{not json",
             "",
             json.dumps(["a", "list"]),
             json.dumps({"id": "3", "messages": [{"role": "user", "content": "Hi"},
                                                 {"role": "assistant", "content": "Hello"}]})]
    src = tmp_path / "set" / "train.jsonl"
    src.parent.mkdir()
    src.write_text("\n".join(lines) + "\n")
    rows = ingest(tmp_path / "run", [src], f"image_root={imgs}", "category=align")
    check_ok(rows["0"], [("user", "<image>"), ("assistant", "a red bar")], [a])
    assert rows["0"]["sample_id"] == xxhash.xxh3_64(a + b"a red bar").hexdigest()  # a caption pair's id
    assert rows["000000001"]["status"] == "bad_row" and "JSON" in rows["000000001"]["error"]
    assert rows["000000002"]["status"] == "bad_row"          # a JSON value that is not an object
    check_ok(rows["3"], [("user", "Hi"), ("assistant", "Hello")], [])   # auto: a messages record
    assert {r["category"] for r in rows.values()} == {"align"}


def test_llava_onevision_parquet(tmp_path):
    a, b, c = img(40, 30, "red"), img(32, 32, "green", "PNG"), img(20, 60, "blue")
    turn = pa.struct([("from", pa.string()), ("value", pa.string()), ("markdown", pa.string())])
    conv = [
        [{"from": "human", "value": "<image>\nColour?", "markdown": None}, {"from": "gpt", "value": "Red.", "markdown": None}],
        [{"from": "human", "value": "Hi", "markdown": None}, {"from": "gpt", "value": "Hello", "markdown": None}],
        [{"from": "human", "value": "<image><image>Two?", "markdown": None}, {"from": "gpt", "value": "Yes", "markdown": "*Yes*"}],
        [{"from": "human", "value": "<image>\nQ", "markdown": None}, {"from": "gpt", "value": "A", "markdown": None}],
    ]
    table = pa.table({
        "id": ["a", "b", "c", "d"],
        "image": pa.array([{"bytes": a, "path": None}, None, {"bytes": b, "path": None}, None], HF_IMAGE),
        "extra_images": pa.array([[], [], [{"bytes": c, "path": None}], [None]], pa.list_(HF_IMAGE)),
        "conversations": pa.array(conv, pa.list_(turn)),
        "data_source": ["vqa", "text", "vqa", "vqa"],
    })
    src = tmp_path / "ov" / "part-0.parquet"
    src.parent.mkdir()
    pq.write_table(table, src)
    # the same layout with conversations as JSON text and a binary image column
    src2 = tmp_path / "ov" / "part-1.parquet"
    pq.write_table(pa.table({"conversations": [json.dumps([{"from": "human", "value": "<image>Q"},
                                                           {"from": "gpt", "value": "A"}]), "[oops"],
                             "img": pa.array([a, a], pa.binary())}), src2)
    assert detect_format(str(src), "auto") == "llava-ov-parquet"
    t = read_manifest(_run(tmp_path, [src, src2]), "samples").to_pylist()
    rows = {(r["shard"].rsplit("/", 1)[1], r["key"]): r for r in t}
    r0 = rows[("part-0.parquet", "a")]
    check_ok(r0, [("user", "<image>\nColour?"), ("assistant", "Red.")], [a])
    assert (r0["images"][0]["container"], r0["images"][0]["column"], r0["images"][0]["index"]) == ("parquet", "image", -1)
    assert r0["category"] == "vqa" and r0["source"] == "vqa"      # the row's id is its key, data_source its source
    check_ok(rows[("part-0.parquet", "b")], [("user", "Hi"), ("assistant", "Hello")], [])  # null image: text-only
    r2 = rows[("part-0.parquet", "c")]
    assert r2["status"] == "unexpected_key" and r2["n_images"] == 2
    assert [(x["column"], x["index"]) for x in r2["images"]] == [("image", -1), ("extra_images", 0)]
    assert [read_image(x) for x in r2["images"]] == [b, c]
    assert rows[("part-0.parquet", "d")]["status"] == "missing_image"   # a null element of a list column
    check_ok(rows[("part-1.parquet", "000000000")], [("user", "<image>Q"), ("assistant", "A")], [a])
    assert rows[("part-1.parquet", "000000001")]["status"] == "bad_row"


def _run(tmp_path, inputs, *sets, tasks=1):
    run = tmp_path / f"run-{tasks}"
    ingest(run, inputs, *sets, tasks=tasks)
    return run


def finevision_table(a: bytes, b: bytes) -> pa.Table:
    texts = pa.list_(pa.struct([("user", pa.string()), ("assistant", pa.string())]))
    rows = [
        ([a], [("How many shapes?", "Three."), ("Colour?", "Red.")], "counting", [5, 4]),
        ([a, b], [("Which has more?", "The first.")], "comparison", [3]),
        ([], [("What is 2 + 3?", "5.")], "text", [5]),
        ([a], [("Look at <image> this", "Ok.")], "counting", [2]),          # literal placeholder: mismatch
        ([a], [("Q", "")], "counting", [1]),                                 # empty assistant turn
        ([a], [("Q", "A"), ("More?", None)], "counting", [1, 1]),            # null assistant: ends with the user
        ([None], [("Q", "A")], "counting", [1]),                             # missing image
    ]
    return pa.table({
        "images": pa.array([[{"bytes": x, "path": None} if x else {"bytes": None, "path": "gone.jpg"} for x in im]
                            for im, _, _, _ in rows], pa.list_(HF_IMAGE)),
        "texts": pa.array([[{"user": u, "assistant": v} for u, v in t] for _, t, _, _ in rows], texts),
        "source": [s for _, _, s, _ in rows],
        "relevance_ratings": pa.array([r for *_, r in rows], pa.list_(pa.int64())),
        "formatting_ratings": pa.array([[5] * len(t) for _, t, _, _ in rows], pa.list_(pa.int64())),
    })


def test_finevision_parquet(tmp_path):
    a, b = img(40, 30, "red"), img(30, 40, "blue", "PNG")
    src = tmp_path / "fv" / "train-00000.parquet"
    src.parent.mkdir()
    pq.write_table(finevision_table(a, b), src, row_group_size=3)
    assert detect_format(str(src), "auto") == "finevision"
    rows = ingest(tmp_path / "run", [src])
    check_ok(rows["000000000"], [("user", "<image>\nHow many shapes?"), ("assistant", "Three."), ("user", "Colour?"),
                                 ("assistant", "Red.")], [a])
    check_ok(rows["000000001"], [("user", "<image>\n<image>\nWhich has more?"), ("assistant", "The first.")], [a, b])
    check_ok(rows["000000002"], [("user", "What is 2 + 3?"), ("assistant", "5.")], [])
    assert rows["000000000"]["turn_ratings"] == [("formatting", [5, 5]), ("relevance", [5, 4])]
    assert [rows[f"00000000{i}"]["category"] for i in range(3)] == ["counting", "comparison", "text"]
    assert [(x["container"], x["column"], x["index"]) for x in rows["000000001"]["images"]] == \
        [("parquet", "images", 0), ("parquet", "images", 1)]
    statuses = {k: rows[k]["status"] for k in ("000000003", "000000004", "000000005", "000000006")}
    assert statuses == {"000000003": "image_mismatch", "000000004": "empty_turn", "000000005": "bad_last_turn",
                        "000000006": "missing_image"}
    rows = ingest(tmp_path / "run2", [src], "category=instruct")
    assert {r["category"] for r in rows.values()} == {"instruct"}


def test_messages_parquet_and_json(tmp_path):
    a, b = img(40, 30, "red"), img(30, 40, "blue")
    part = pa.struct([("type", pa.string()), ("text", pa.string())])
    msg = pa.struct([("role", pa.string()), ("content", pa.list_(part))])
    messages = [
        [{"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image", "text": None},
                                      {"type": "text", "text": " and "}, {"type": "image", "text": None}]},
         {"role": "assistant", "content": [{"type": "text", "text": "Different."}]}],
        [{"role": "user", "content": [{"type": "video", "text": None}]},
         {"role": "assistant", "content": [{"type": "text", "text": "?"}]}],
    ]
    src = tmp_path / "chat" / "m.parquet"
    src.parent.mkdir()
    pq.write_table(pa.table({"messages": pa.array(messages, pa.list_(msg)),
                             "images": pa.array([[a, b], []], pa.list_(pa.binary()))}), src)
    (tmp_path / "chat" / "b.jpg").write_bytes(b)
    jsrc = tmp_path / "chat" / "m.jsonl"
    jsrc.write_text(json.dumps({"id": "j", "images": ["b.jpg"], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]},
        {"role": "assistant", "content": "Blue.", "name": "bot"}]}) + "\n")
    assert detect_format(str(src), "auto") == "messages"
    t = read_manifest(_run(tmp_path, [src, jsrc], "format=messages"), "samples").to_pylist()
    rows = {r["key"]: r for r in t}
    check_ok(rows["000000000"], [("user", "Compare <image> and <image>"), ("assistant", "Different.")], [a, b])
    assert [(x["container"], x["column"], x["index"]) for x in rows["000000000"]["images"]] == \
        [("parquet", "images", 0), ("parquet", "images", 1)]
    assert rows["000000001"]["status"] == "bad_row" and "video" in rows["000000001"]["error"]
    assert rows["j"]["status"] == "unexpected_key"   # `name` is not a messages key
    assert turns_of(rows["j"]) == [("system", "Be brief."), ("user", "<image>What colour?"), ("assistant", "Blue.")]
    assert read_image(rows["j"]["images"][0]) == b


def test_caption_pair_ids_unchanged(tmp_path):
    """Tar and caption Parquet keep the old id: xxh3(image bytes + caption bytes as stored)."""
    a, b = img(40, 30, "red"), img(30, 40, "blue")
    shard = tmp_path / "web" / "shard-0.tar"
    shard.parent.mkdir()
    members = [("k0.jpg", a), ("k0.txt", b"  a red box \n"), ("k1.jpg", b), ("k1.txt", b"\xff broken"), ("k2.txt", b"lost")]
    with tarfile.open(shard, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    src = tmp_path / "cap" / "c.parquet"
    src.parent.mkdir()
    pq.write_table(pa.table({"caption": ["  a red box \n", " x "], "image": pa.array([{"bytes": a, "path": None},
                                                                               {"bytes": b, "path": None}], HF_IMAGE)}), src)
    t = read_manifest(_run(tmp_path, [shard, src]), "samples").to_pylist()
    rows = {(r["shard_format"], r["key"]): r for r in t}
    k0 = rows[("tar", "k0")]
    assert k0["sample_id"] == xxhash.xxh3_64(a + b"  a red box \n").hexdigest()
    assert turns_of(k0) == [("user", "<image>"), ("assistant", "a red box")] and k0["category"] == "caption"
    assert read_image(k0["images"][0]) == a and k0["images"][0]["container"] == "tar"
    assert rows[("tar", "k1")]["sample_id"] == xxhash.xxh3_64(b + b"\xff broken").hexdigest()
    assert rows[("tar", "k1")]["status"] == "bad_caption_encoding"
    k2 = rows[("tar", "k2")]
    assert (k2["status"], k2["n_images"], k2["offset"]) == ("missing_image", 0, -1)
    assert k2["sample_id"] == xxhash.xxh3_64(b"lost").hexdigest()
    p1 = rows[("parquet", "000000001")]
    assert p1["sample_id"] == xxhash.xxh3_64(b + b" x ").hexdigest() and p1["caption"] == "x"
    assert read_image(p1["images"][0]) == b and p1["images"][0]["column"] == "image"
    # the same caption pair in a tar and a Parquet file is one sample: first in (source, shard, key)
    # order ("cap" < "web") stays ok, the other is marked duplicate
    p0 = rows[("parquet", "000000000")]
    assert p0["sample_id"] == k0["sample_id"] and p0["status"] == "ok"
    assert k0["status"] == "duplicate" and "c.parquet/000000000" in k0["error"]


def test_task_count_independence(tmp_path, monkeypatch):
    """1 vs 3 tasks (JSON split in chunks of 4 records, Parquet in row groups of 3) → the same bytes."""
    import curation.formats_json

    monkeypatch.setattr(curation.formats_json, "JSON_CHUNK_ROWS", 4)
    a, b = img(40, 30, "red"), img(30, 40, "blue")
    d = tmp_path / "data"
    (d / "img").mkdir(parents=True)
    (d / "img" / "a.jpg").write_bytes(a)
    recs = [{"id": f"r{i}", "image": "img/a.jpg",
             "conversations": [{"from": "human", "value": f"<image>\nQ{i % 7}"}, {"from": "gpt", "value": f"A{i % 7}"}]}
            for i in range(15)]
    recs[5]["conversations"][1]["value"] = ""
    (d / "x.json").write_text(json.dumps(recs))
    pq.write_table(finevision_table(a, b), d / "fv.parquet", row_group_size=3)
    inputs = [d / "x.json", d / "fv.parquet"]
    one = read_manifest(_run(tmp_path, inputs, tasks=1), "samples")
    three_run = _run(tmp_path, inputs, tasks=3)
    three = read_manifest(three_run, "samples")
    assert len(manifest_files(three_run, "samples")) == 3
    assert all(pq.read_metadata(f).num_rows > 0 for f in manifest_files(three_run, "samples"))
    assert one.equals(three) and one.num_rows == 22
    sink_a, sink_b = pa.BufferOutputStream(), pa.BufferOutputStream()
    pq.write_table(one, sink_a)
    pq.write_table(three, sink_b)
    assert sink_a.getvalue().to_pybytes() == sink_b.getvalue().to_pybytes()
    st = one.column("status").to_pylist()
    # Q{i%7}: 7 conversations, plus record 5 made different by its empty answer → 8 distinct, 7 duplicates
    assert st.count("duplicate") == 7 and st.count("empty_turn") == 2


def test_detect_format_errors(tmp_path):
    p = tmp_path / "x.parquet"
    pq.write_table(pa.table({"foo": [1]}), p)
    with pytest.raises(ValueError, match="cannot tell the format"):
        detect_format(str(p), "auto")
    with pytest.raises(ValueError, match="cannot read"):
        detect_format(str(p), "llava-json")
    with pytest.raises(ValueError, match="unknown input type"):
        detect_format(str(tmp_path / "x.csv"), "auto")
    assert main(["ingest", "--set", f"inputs=['{p}']", "--set", "format=csv", "--run-dir", str(tmp_path / "r"),
                 "--quiet"]) == 2


def test_demo_conversation_sets_ingest(tmp_path):
    """The demo's LLaVA-558K-style and instruction sets: every broken kind shows up as its status."""
    from demo.conversations import write_demo_conversations

    write_demo_conversations(tmp_path / "dd", seed=0, n_caption=40, n_llava=60, n_finevision=40)
    run = tmp_path / "run"
    rows = ingest(run, [tmp_path / "dd" / "llava-558k" / "blip_laion_cc_sbu_558k.json"], "category=caption",
                  name="ingest-llava")
    st = [r["status"] for r in rows.values()]
    assert st.count("ok") == 40 - 3 and {"missing_image", "corrupt_image", "empty_turn"} <= set(st)
    assert {r["category"] for r in rows.values()} == {"caption"}
    ok = next(r for r in rows.values() if r["status"] == "ok")
    assert turns_of(ok)[0][1].startswith("<image>\n") and ok["n_images"] == 1
    ingest(run, [tmp_path / "dd" / "instruct" / "llava" / "instruct.json",
                 tmp_path / "dd" / "instruct" / "finevision" / "train-00000.parquet"], name="ingest-instruct")
    t = read_manifest(run, "samples", step="ingest-instruct").to_pylist()   # keys repeat across the two files
    by_source = {s: {r["status"] for r in t if r["source"] == s} for s in ("llava", "finevision")}
    assert by_source["llava"] >= {"ok", "image_mismatch", "bad_last_turn", "unknown_role", "unexpected_key",
                                  "empty_turn", "missing_image"}
    assert by_source["finevision"] >= {"ok", "image_mismatch", "bad_last_turn", "empty_turn", "missing_image",
                                       "corrupt_image"}
    ok = [r for r in t if r["status"] == "ok"]
    assert {r["category"] for r in ok} == {"counting", "color", "position", "comparison", "text"}
    assert {r["n_images"] for r in ok} == {0, 1, 2} and max(r["turns"] for r in ok) >= 4
    assert all(r["turn_ratings"] for r in ok if r["source"] == "finevision")
    dup = [r for r in t if r["status"] == "duplicate"]   # the first FineVision row repeats a LLaVA one
    assert len(dup) == 1 and dup[0]["source"] == "llava" and "train-00000.parquet" in dup[0]["error"]


def test_hub_layout_source_is_the_dataset_and_keys_are_the_row_ids(tmp_path):
    """The hub's layout (``<dataset>/data/train-0000K-of-0000N.parquet``, as ``datasets`` pushes it): with no
    ``source`` in the config, a row's source is its ``data_source`` where it has one, else the dataset folder
    above ``data/`` (the dataset's name inside a hub cache); its key is its ``id``."""
    a, b = img(40, 30, "red"), img(30, 40, "blue")
    msgs = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))

    def shard(path, ids, sources=None):
        path.parent.mkdir(parents=True, exist_ok=True)
        cols = {"id": ids, "messages": pa.array([[{"role": "user", "content": "<image>What colour?"},
                                                  {"role": "assistant", "content": f"Colour {i}."}] for i in ids], msgs),
                "images": pa.array([[{"bytes": a if k % 2 else b, "path": None}] for k in range(len(ids))],
                                   pa.list_(HF_IMAGE))}
        if sources is not None:
            cols["data_source"] = sources
        pq.write_table(pa.table(cols), path)

    shard(tmp_path / "MyVQA" / "data" / "train-00000-of-00002.parquet", ["q-1", "q-2"])
    shard(tmp_path / "MyVQA" / "data" / "train-00001-of-00002.parquet", ["q-3"])
    cache = tmp_path / "hub" / "datasets--org--MixSet" / "snapshots" / "0123abcd" / "data"
    shard(cache / "train-00000-of-00001.parquet", ["m-1", "m-2"], ["chartqa", None])
    rows = ingest(tmp_path / "run", [tmp_path / "MyVQA" / "data" / "*.parquet", cache / "*.parquet"])
    assert {k: (r["source"], r["status"]) for k, r in rows.items()} == {
        "q-1": ("MyVQA", "ok"), "q-2": ("MyVQA", "ok"), "q-3": ("MyVQA", "ok"),
        "m-1": ("chartqa", "ok"), "m-2": ("MixSet", "ok")}
    shards = read_manifest(tmp_path / "run", "shards", step="ingest").to_pylist()
    assert sorted(s["source"] for s in shards) == ["MixSet", "MyVQA", "MyVQA"]
    # the config's source still wins over both
    rows = ingest(tmp_path / "run", [cache / "*.parquet"], "source=mine", name="ingest-mine")
    assert {r["source"] for r in rows.values()} == {"mine"}
