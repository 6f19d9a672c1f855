"""recaption: quality statuses on crafted outputs, the file backend end to end, kill-and-rerun
resume per chunk (identical final manifest), parts independent of the chunking, the balanced restriction, and the transformers backend
on a tiny random Qwen2-VL the test builds (bilingual, deterministic for any task count)."""
import json
import shutil

import pyarrow as pa
import pytest

from curation.recaption import RecaptionConfig, quality, repeat_ratio, script_ratio
from manifests import read_manifest
from manifests.io import write_part
from ovpipe.cli import main

EN = "A small red circle and a blue square on a plain light background."
ZH = "图片中有一个红色的小圆形和一个蓝色的正方形，背景是浅色的。"


def cfg(**kw):
    return RecaptionConfig(backend="file", file="x.jsonl", **kw)


@pytest.mark.parametrize("text,lang,finish,error,status", [
    (EN, "en", "stop", None, "ok"),
    (ZH, "zh", "stop", None, "ok"),
    ("", "en", "stop", None, "empty"),
    ("   \n", "zh", "stop", None, "empty"),
    ("I'm sorry, but I can't describe this image.", "en", "stop", None, "refused"),
    ("抱歉，我无法描述这张图片。", "zh", "stop", None, "refused"),
    ("the cat sat on the mat " * 12, "en", "stop", None, "repetition"),
    ("红色的圆形" * 10, "zh", "length", None, "repetition"),            # a loop that hit the limit: the loop
    (EN, "en", "length", None, "truncated"),
    (EN, "zh", "stop", None, "wrong_language"),                          # English where Chinese was asked
    (ZH, "en", "stop", None, "wrong_language"),
    ("12345 !!!", "en", "stop", None, "wrong_language"),                # no letters at all
    ("A red circle.", "en", "stop", None, "too_short"),
    ("红色圆形。", "zh", "stop", None, "too_short"),
    ("", "en", "error", "image: OSError: gone", "error"),
])
def test_quality_statuses(text, lang, finish, error, status):
    q = quality(text, lang, finish, error, cfg())
    assert q["status"] == status, q
    assert (q["error"] is None) == (status == "ok")


def test_quality_figures():
    assert script_ratio(ZH, "han") == 1.0 and script_ratio(EN, "han") == 0.0
    assert script_ratio("图片 photo", "han") == pytest.approx(2 / 7)
    assert script_ratio("123 。", "latin") is None                        # undefined: NULL, not 0
    assert repeat_ratio(["a", "b"], 4) is None
    assert repeat_ratio(list("abab"), 2) == pytest.approx(1 - 2 / 3)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="scripts.fr"):
        cfg(prompts={"fr": "Décrivez l'image."})
    with pytest.raises(ValueError, match="model"):
        RecaptionConfig(backend="transformers")
    with pytest.raises(ValueError, match="refusal_patterns"):
        cfg(refusal_patterns=["(unclosed"])
    with pytest.raises(ValueError, match="chunk_size"):
        cfg(chunk_size=0)


def crafted_captions(run, path):
    """One JSONL row per (ok sample, lang): mostly good captions, some crafted failures, some missing."""
    ids = sorted({r["sample_id"] for r in read_manifest(run, "samples").to_pylist()
                  if r["status"] == "ok" and r["n_images"] == 1})
    rows = []
    for i, sid in enumerate(ids):
        en, zh = {"caption": f"{EN} Sample {i}."}, {"caption": ZH + f"编号{i}。"}
        if i % 10 == 1:
            zh = {"caption": EN}                                            # wrong language
        if i % 10 == 2:
            en = {"caption": "I cannot help with that."}                    # refused
        if i % 10 == 3:
            en = {"caption": EN, "finish_reason": "length", "tokens": 64}  # truncated
        if i % 10 == 4:
            continue                                                        # missing from the file: error rows
        rows += [{"sample_id": sid, "lang": "en", "model": "some/vlm", **en},
                 {"sample_id": sid, "lang": "zh", "model": "some/vlm", **zh}]
    with open(path, "w") as f:
        f.write("{broken\n")
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return ids


def new_run(ingested_run, tmp_path, name):
    run = tmp_path / name
    shutil.copytree(ingested_run / "ingest", run / "ingest")
    return run


def recaption(run, jsonl, *extra, tasks=2):
    return main(["recaption", "--set", "backend=file", "--set", f"file={jsonl}", "--set", "chunk_size=16",
                 *extra, "--run-dir", str(run), "--tasks", str(tasks), "--quiet"])


def test_file_backend_statuses_and_report(ingested_run, tmp_path):
    run = new_run(ingested_run, tmp_path, "run")
    ids = crafted_captions(run, tmp_path / "caps.jsonl")
    assert recaption(run, tmp_path / "caps.jsonl") == 0
    rows = read_manifest(run, "captions").to_pylist()
    assert len(rows) == 2 * len(ids)                                        # every (sample, lang), none dropped
    by = {(r["sample_id"], r["lang"]): r for r in rows}
    for i, sid in enumerate(ids):
        en, zh = by[(sid, "en")], by[(sid, "zh")]
        want = {1: ("ok", "wrong_language"), 2: ("refused", "ok"), 3: ("truncated", "ok"),
                4: ("error", "error")}.get(i % 10, ("ok", "ok"))
        assert (en["status"], zh["status"]) == want, (i, en, zh)
        assert en["prompt_id"].startswith("en:") and zh["prompt_id"].startswith("zh:")
    assert by[(ids[3], "en")]["tokens"] == 64 and by[(ids[0], "en")]["tokens"] is None   # unknown: NULL
    assert "in the file" in by[(ids[4], "zh")]["error"]
    stats = json.loads((run / "recaption" / "stats.json").read_text())["counters"]
    assert stats["file/bad_json"] == 2                                     # the broken line, seen by each rank
    assert stats["status/zh/wrong_language"] == sum(1 for i in range(len(ids)) if i % 10 == 1)
    report = (run / "recaption" / "report.md").read_text()
    for s in ("ok", "refused", "truncated", "wrong_language", "error"):
        assert f"| {s} |" in report and f"**{s}**" in report
    assert (run / "recaption" / "caption_lengths.png").stat().st_size > 0
    assert not (run / "recaption" / "chunks").exists()                     # finalize removed them
    from manifests.catalog import run_report

    got = {title: rel.fetchall() for title, rel in run_report(run)}["captions by status"]
    assert sum(r[3] for r in got) == len(rows) and {(r[1], r[2]) for r in got} >= {("en", "refused"), ("zh", "ok")}
    assert {r[0] for r in got} == {"recaption"}                            # the step folder of each row


def test_kill_and_rerun_resumes_from_the_last_chunk(ingested_run, tmp_path, monkeypatch):
    import curation.recaption as rc
    import inference.chunked as chunked

    ref = new_run(ingested_run, tmp_path, "ref")
    crafted_captions(ref, tmp_path / "caps.jsonl")
    assert recaption(ref, tmp_path / "caps.jsonl") == 0

    run = new_run(ingested_run, tmp_path, "killed")
    real_write, real_caption = chunked.write_chunk, rc.caption_chunk

    def dying_write(path, rows, kind):                                     # rank 1 dies writing its 3rd chunk
        if path.parent.name == "00001" and path.name.startswith("chunk-000002-"):
            raise KeyboardInterrupt("pre-empted")
        real_write(path, rows, kind)

    monkeypatch.setattr(chunked, "write_chunk", dying_write)
    with pytest.raises(KeyboardInterrupt):
        recaption(run, tmp_path / "caps.jsonl")
    sdir = run / "recaption"
    assert (sdir / "completions" / "00000").exists() and not (sdir / "completions" / "00001").exists()
    assert [p.name[:12] for p in sorted((sdir / "chunks" / "00001").glob("chunk-*"))] == \
        ["chunk-000000", "chunk-000001"]

    monkeypatch.setattr(chunked, "write_chunk", real_write)
    rank0 = (sdir / "stats" / "00000.json").read_bytes()
    generated = []
    monkeypatch.setattr(rc, "caption_chunk", lambda s, *a: generated.append(len(s)) or real_caption(s, *a))
    assert recaption(run, tmp_path / "caps.jsonl") == 0
    rank1 = json.loads((sdir / "stats" / "00001.json").read_text())["counters"]
    assert rank1["chunks/resumed"] == 2                                    # kept, not regenerated
    assert len(generated) == rank1["chunks/written"] and sum(generated) == rank1["samples"] - 2 * 16
    assert (sdir / "stats" / "00000.json").read_bytes() == rank0            # the completed rank was not redone
    a, b = read_manifest(run, "captions"), read_manifest(ref, "captions")
    assert a.equals(b)
    # and the same for one task (the chunking differs, the manifest does not)
    one = new_run(ingested_run, tmp_path, "one")
    assert recaption(one, tmp_path / "caps.jsonl", tasks=1) == 0
    assert read_manifest(one, "captions").equals(b)


def test_part_is_the_slice_sorted_whatever_the_chunking(ingested_run, tmp_path, monkeypatch):
    """A rank streams its slice in sample_id order a chunk at a time and its chunks into its part: each part
    has the bytes of the old whole-slice write (``write_part`` of its rows, sorted), the same for any chunk
    size, and the merged manifest is the same for any task count — also over two samples steps, whose slice
    is not in sample_id order (a second ingest with new samples and repeats of the first's), and with
    parts of several row groups."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    import xxhash

    from manifests.io import ROW_GROUP_ROWS, read_part

    src = read_manifest(ingested_run, "samples", step="ingest")
    ok = src.filter(pc.and_(pc.equal(src.column("status"), "ok"), pc.equal(src.column("n_images"), 1)))
    more = ok.take(list(range(0, ok.num_rows, 3))).to_pylist()
    for i, r in enumerate(more):
        if i % 2:                                     # a new sample (same image, another id); else a repeat
            r["sample_id"] = xxhash.xxh3_64_hexdigest(f"b{i}".encode())

    def run_with(name, tasks, chunk):
        run = new_run(ingested_run, tmp_path, name)
        write_part(more, run / "ingest_b" / "samples" / "part-00000.parquet", "samples", sort=True)
        crafted_captions(run, tmp_path / "caps.jsonl")
        assert recaption(run, tmp_path / "caps.jsonl", "--set", f"chunk_size={chunk}", "--set",
                         "samples_steps=[ingest, ingest_b]", tasks=tasks) == 0
        parts = sorted((run / "recaption" / "captions").glob("*.parquet"))
        for k, part in enumerate(parts):
            whole = write_part(read_part(part, "captions"), tmp_path / f"{name}-{k}.parquet", "captions", sort=True)
            assert part.read_bytes() == whole.read_bytes(), (name, part)
        return [p.read_bytes() for p in parts], read_manifest(run, "captions")

    ref, merged = run_with("t1c16", 1, 16)
    assert merged.num_rows == 2 * (ok.num_rows + (len(more) // 2))
    assert run_with("t1c5", 1, 5)[0] == ref
    two = run_with("t2c16", 2, 16)
    assert run_with("t2c3", 2, 3)[0] == two[0] and two[1].equals(merged)
    assert run_with("t3c7", 3, 7)[1].equals(merged)
    monkeypatch.setitem(ROW_GROUP_ROWS, "captions", 8)               # a part of many row groups
    assert run_with("groups", 2, 5)[1].equals(merged)
    assert pq.ParquetFile(tmp_path / "groups" / "recaption" / "captions" / "part-00000.parquet").num_row_groups > 4


def test_only_balanced(ingested_run, tmp_path):
    run = new_run(ingested_run, tmp_path, "bal")
    ids = crafted_captions(run, tmp_path / "caps.jsonl")
    keep = set(ids[::3])
    write_part(pa.table({"sample_id": ids, "weight": [1.0] * len(ids),
                         "copies": pa.array([2 if s in keep else 0 for s in ids], pa.int32())}),
               run / "balance" / "balanced" / "part-00000.parquet", "balanced")
    assert recaption(run, tmp_path / "caps.jsonl", "--set", "only_balanced=true", "--set", "prompts={en: Describe.}",
                     "--set", "min_length={en: 3}", "--set", "scripts={en: latin}") == 0
    rows = read_manifest(run, "captions").to_pylist()
    assert {r["sample_id"] for r in rows} == keep and {r["lang"] for r in rows} == {"en"}


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from demo.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-vlm")


def test_transformers_backend_bilingual_and_deterministic(ingested_run, tmp_path, tiny_vlm):
    args = ["--set", "backend=transformers", "--set", f"model={tiny_vlm}", "--set", "limit=3",
            "--set", "max_new_tokens=6", "--set", "cpu_threads=1", "--set", "chunk_size=2"]
    r1 = new_run(ingested_run, tmp_path, "t1")
    assert main(["recaption", *args, "--run-dir", str(r1), "--tasks", "1", "--quiet"]) == 0
    rows = read_manifest(r1, "captions").to_pylist()
    assert len(rows) == 6 and {r["lang"] for r in rows} == {"en", "zh"}
    assert all(r["backend"] == "transformers" and r["model"] == str(tiny_vlm) and 0 < r["tokens"] <= 6 for r in rows)
    assert all(r["status"] in {"truncated", "wrong_language", "too_short", "repetition", "empty", "ok"} for r in rows)
    # two prompts, two languages: the same image gets a different prompt per language
    assert len({r["prompt_id"] for r in rows}) == 2
    r2 = new_run(ingested_run, tmp_path, "t2")
    assert main(["recaption", *args, "--run-dir", str(r2), "--tasks", "2", "--quiet"]) == 0
    assert read_manifest(r2, "captions").equals(read_manifest(r1, "captions"))
