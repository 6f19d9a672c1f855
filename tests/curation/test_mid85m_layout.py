"""The Mid-Training-85M layout as it ships (``<source>/<EN|CN>/partNN/*.parquet``, columns id, image,
caption): one ingest keeps each row's source and language from its path, ``**`` globs match, a wrong
column stops the run, and ``embed-images`` reads several ingest steps."""
from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq

from manifests import read_manifest
from ovpipe.cli import main

LAYOUT = {("coyo", "EN"): 3, ("coyo", "CN"): 2, ("laion", "EN"): 2, ("laion", "CN"): 1}


def _png(k: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32 + k, 24), (k * 20 % 255, 80, 160)).save(buf, "PNG")
    return buf.getvalue()


def write_mid85m(root) -> dict[str, tuple[str, str]]:
    """The tree, one part folder per source/language; returns {caption: (source, lang)}."""
    want, k = {}, 0
    for (source, lang), n in LAYOUT.items():
        part = root / source / lang / "part00"
        part.mkdir(parents=True)
        rows = []
        for i in range(n):
            caption = f"{source} {lang} caption {i}"
            rows.append({"id": f"{source}-{lang}-{i}", "image": {"bytes": _png(k), "path": None}, "caption": caption})
            want[caption] = (source, lang)
            k += 1
        image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
        pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([("id", pa.string()), ("image", image),
                                                                    ("caption", pa.string())])),
                       part / "000.parquet")
    return want


def test_one_ingest_keeps_each_rows_source_and_language_from_the_path(tmp_path):
    want = write_mid85m(tmp_path / "mid85m")
    run = tmp_path / "run"
    assert main(["ingest", "--run-dir", str(run), "--quiet", "--tasks", "2",
                 "--set", f"inputs={tmp_path}/mid85m/**/*.parquet",          # a scalar for a list field; a ** glob
                 "--set", "source_from='{source}/{lang}/*/*.parquet'"]) == 0
    rows = read_manifest(run, "samples", columns=["caption", "source", "lang", "status", "key"]).to_pylist()
    assert len(rows) == sum(LAYOUT.values())
    assert {r["caption"]: (r["source"], r["lang"]) for r in rows} == want
    assert {r["status"] for r in rows} == {"ok"} and {r["key"] for r in rows} >= {"coyo-EN-0", "laion-CN-0"}
    out = main(["sql", str(run), "SELECT source, lang, count(*) AS n FROM samples GROUP BY ALL ORDER BY ALL",
                "--format", "json"])
    assert out == 0


def test_a_source_from_pattern_that_misses_a_file_is_refused_before_any_work(tmp_path, capsys):
    write_mid85m(tmp_path / "mid85m")
    run = tmp_path / "run"
    assert main(["ingest", "--run-dir", str(run), "--set", f"inputs={tmp_path}/mid85m/**/*.parquet",
                 "--set", "source_from='{source}/{lang}/part99/*.parquet'"]) == 2
    assert "source_from" in capsys.readouterr().err and not (run / "ingest").exists()
    assert main(["ingest", "--run-dir", str(run), "--set", f"inputs={tmp_path}/x.parquet",
                 "--set", "source_from='{site}/*.parquet'"]) == 2
    assert "{site}" in capsys.readouterr().err


def test_a_wrong_caption_column_fails_the_ingest_naming_the_column(tmp_path, capsys):
    write_mid85m(tmp_path / "mid85m")
    run = tmp_path / "run"
    rc = main(["ingest", "--run-dir", str(run), "--quiet", "--set", f"inputs={tmp_path}/mid85m/*/*/*/*.parquet",
               "--set", "caption_column=text"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "no ok sample" in err and "'text'" in err and "caption_column" in err
    # the detail is in the manifests, and no later step reads the failed ingest
    shards = read_manifest(run, "shards").to_pylist()
    assert {s["status"] for s in shards} == {"missing_column"} and len(shards) == len(LAYOUT)
    assert main(["lengths", "--run-dir", str(run), "--quiet", "--set", "tokenizer=Qwen/Qwen2-VL-2B"]) != 0


def test_embed_images_reads_two_ingest_steps(tmp_path):
    write_mid85m(tmp_path / "mid85m")
    run = tmp_path / "run"
    for lang in ("EN", "CN"):
        assert main(["ingest", "--name", f"ingest-{lang}", "--run-dir", str(run), "--quiet",
                     "--set", f"inputs={tmp_path}/mid85m/*/{lang}/*/*.parquet", "--set", f"lang={lang}"]) == 0
    cfg = tmp_path / "embed.yaml"
    cfg.write_text(json.dumps({"model": "ovpipe-tiny-clip", "pretrained": "", "device": "cpu", "batch_size": 4,
                               "decode": "threads", "samples_step": ["ingest-EN", "ingest-CN"]}))
    assert main(["embed-images", "--config", str(cfg), "--run-dir", str(run), "--quiet"]) == 0
    emb = read_manifest(run, "image_embeddings").to_pylist()
    ids = read_manifest(run, "samples", step=["ingest-EN", "ingest-CN"], columns=["sample_id"]).column(0).to_pylist()
    assert sorted(r["sample_id"] for r in emb) == sorted(ids) and len(ids) == sum(LAYOUT.values())
    assert {r["status"] for r in emb} == {"ok"}
