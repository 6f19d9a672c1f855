"""lengths/pack ``caption_source``: raw | recaption:<lang> | both (two samples or one two-turn sample).
Recaptioned samples get a derived sample_id, name their source in ``source_sample_id``, inherit its
``balanced`` copies, and the packed shards hold the recaption's tokens."""
import json
import shutil

import pyarrow as pa
import pytest

from manifests import read_manifest
from manifests.io import write_part
from ovpipe.cli import main
from packing.caption_source import derived_sample_id, parse

EN = "A small red circle and a blue square on a plain light background."
ZH = "图片中有一个红色的小圆形和一个蓝色的正方形，背景是浅色的。"


@pytest.fixture(scope="module")
def recaptioned_run(ingested_run, tmp_path_factory):
    """ingest + recaption (file backend: every 4th sample's English caption refused) + a tokenizer
    + a balanced manifest (copies 0..2)."""
    from packing.tiny_tokenizer import build_tiny_tokenizer

    run = tmp_path_factory.mktemp("capsrc")
    shutil.copytree(ingested_run / "ingest", run / "ingest")
    ids = sorted({r["sample_id"] for r in read_manifest(run, "samples").to_pylist()
                  if r["status"] == "ok" and r["n_images"] == 1})
    with open(run / "caps.jsonl", "w") as f:
        for i, sid in enumerate(ids):
            en = "I'm sorry, I cannot describe it." if i % 4 == 0 else f"{EN} Number {i}."
            f.write(json.dumps({"sample_id": sid, "lang": "en", "caption": en}) + "\n")
            f.write(json.dumps({"sample_id": sid, "lang": "zh", "caption": ZH}, ensure_ascii=False) + "\n")
    assert main(["recaption", "--set", "backend=file", "--set", f"file={run / 'caps.jsonl'}", "--run-dir", str(run),
                 "--tasks", "2", "--quiet"]) == 0
    texts = [EN, ZH, "Describe the image in detail.", "请详细描述这张图片。"] + [
        t["text"] for r in read_manifest(run, "samples").to_pylist() for t in r["conversation"] or []]
    build_tiny_tokenizer(texts, run / "tokenizer", 600)
    write_part(pa.table({"sample_id": ids, "weight": [1.0] * len(ids),
                         "copies": pa.array([i % 3 for i in range(len(ids))], pa.int32())}),
               run / "balance" / "balanced" / "part-00000.parquet", "balanced")
    return run, ids


def lengths(run, name, *sets):
    args = ["lengths", "--name", name, "--set", f"tokenizer={run / 'tokenizer'}", "--set", "seq_len=1024"]
    for s in sets:
        args += ["--set", s]
    assert main([*args, "--run-dir", str(run), "--tasks", "2", "--quiet"]) == 0
    rows = read_manifest(run, "lengths", step=name).to_pylist()
    return rows, {r["sample_id"]: r for r in rows if r["status"] != "duplicate"}   # the demo's one duplicate row


def test_parse():
    assert parse("raw") == ("raw", None) and parse("recaption:zh") == ("recaption", "zh")
    assert parse("both") == ("both", "en") and parse("both:zh") == ("both", "zh")
    for bad in ("recaption", "raw:en", "alt"):
        with pytest.raises(ValueError, match="caption_source"):
            parse(bad)


def test_config_checks(recaptioned_run, capsys):
    run, _ = recaptioned_run
    rc = main(["lengths", "--name", "l-bad", "--set", f"tokenizer={run / 'tokenizer'}",
               "--set", "caption_source=recaption:fr",
               "--run-dir", str(run), "--quiet"])
    assert rc == 2 and "recaption_prompts" in capsys.readouterr().err


def test_raw_and_recaption(recaptioned_run):
    run, ids = recaptioned_run
    raw_rows, raw = lengths(run, "l-raw")
    assert all(r["source_sample_id"] == r["sample_id"] for r in raw_rows)
    rec_rows, rec = lengths(run, "l-en", "caption_source=recaption:en")
    assert len(rec_rows) == len(raw_rows)                                   # one sample per source, none dropped
    refused = set(ids[::4])
    for s, r in rec.items():
        src = r["source_sample_id"]
        if src in refused or src not in ids:                                # no ok recaption / not a caption pair
            assert s == src
        else:                                                               # the recaptioned conversation's id
            i = ids.index(src)
            assert raw[src]["status"] == "ok" and s == derived_sample_id(
                src, [("user", "<image>Describe the image in detail."), ("assistant", f"{EN} Number {i}.")])
    stats = json.loads((run / "l-en" / "stats.json").read_text())["counters"]
    assert stats["caption_source/raw_fallback"] == len(refused)
    assert stats["caption_source/recaptioned"] == len(ids) - len(refused)
    strict, _ = lengths(run, "l-en-strict", "caption_source=recaption:en", "missing_recaption=status")
    assert sum(r["status"] == "no_recaption" for r in strict) == len(refused)


def test_both_two_samples_and_two_turns(recaptioned_run):
    run, ids = recaptioned_run
    raw_rows, raw = lengths(run, "l-raw2")
    two, _ = lengths(run, "l-both", "caption_source=both:zh")
    assert len(two) == len(raw_rows) + len(ids)                             # every pair + its zh recaption
    derived = [r for r in two if r["sample_id"] != r["source_sample_id"]]
    assert sorted(r["source_sample_id"] for r in derived) == ids
    turns_rows, turns = lengths(run, "l-turns", "caption_source=both:zh", "both_as=two_turns")
    assert len(turns_rows) == len(raw_rows)
    for s, r in turns.items():
        if r["source_sample_id"] in ids:
            assert r["turns_kept"] == 4 and r["target_tokens"] > raw[r["source_sample_id"]]["target_tokens"]  # + a turn


def test_pack_uses_source_copies_and_encodes_the_recaption(recaptioned_run):
    from packing.shards import iter_packed, packed_shards
    from packing.tokens import load_tokenizer

    run, ids = recaptioned_run
    _, lens = lengths(run, "l-pack", "caption_source=both:en")
    assert main(["pack", "--name", "p-both", "--set", "lengths_step=l-pack", "--set", "copies_from=balanced",
                 "--set", "seq_len=1024", "--set", "packs_per_shard=8", "--run-dir", str(run), "--quiet"]) == 0
    copies = {s: i % 3 for i, s in enumerate(ids)}
    packs = read_manifest(run, "packs", step="p-both").to_pylist()
    seen = {}
    for p in packs:
        for s in p["sample_ids"]:
            seen[s] = seen.get(s, 0) + 1
    for s, r in lens.items():
        if r["status"] == "ok" and r["source_sample_id"] in copies:
            assert seen.get(s, 0) == copies[r["source_sample_id"]], s      # a recaption inherits its source's copies
    tok = load_tokenizer(str(run / "tokenizer"))
    want = {derived_sample_id(s, [("user", "<image>Describe the image in detail."), ("assistant", f"{EN} Number {i}.")])
            for i, s in enumerate(ids) if i % 4}
    found = 0
    for shard in packed_shards(run, "p-both"):
        for seq in iter_packed(shard):
            for k, s in enumerate(seq.sample_ids):
                if s in want:
                    text = tok.decode(seq.input_ids[seq.cu_seqlens[k]:seq.cu_seqlens[k + 1]])
                    assert EN in text and "Describe the image in detail." in text
                    found += 1
    assert found == sum(copies[s] for i, s in enumerate(ids) if i % 4)
