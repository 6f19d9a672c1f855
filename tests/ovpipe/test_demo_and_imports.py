import hashlib
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq


def test_demo_corpus_is_deterministic_and_long_tailed(tmp_path):
    from demo.corpus import write_demo_corpus

    a = write_demo_corpus(tmp_path / "a", n_samples=120, seed=3, shards=2)
    write_demo_corpus(tmp_path / "b", n_samples=120, seed=3, shards=2)
    for s in ("demo-00000.tar", "demo-00001.tar"):
        da = hashlib.sha256((tmp_path / "a" / "shards" / s).read_bytes()).hexdigest()
        db = hashlib.sha256((tmp_path / "b" / "shards" / s).read_bytes()).hexdigest()
        assert da == db
    assert a["concepts"] >= 200
    names = (tmp_path / "a" / "concepts.txt").read_text().splitlines()
    assert len(names) == a["concepts"] and len(set(names)) == len(names)
    gt = pq.read_table(tmp_path / "a" / "ground_truth.parquet").to_pylist()
    assert max(len(r["concept_ids"]) for r in gt) >= 3  # several concepts per image
    assert {r["broken"] for r in gt} >= {"truncated_jpeg", "zero_byte_image", "empty_caption", "non_utf8_caption"}


def test_zipf_long_tail():
    from demo.corpus import zipf_probs

    p = np.sort(zipf_probs(225, 1.2, np.random.default_rng(0)))[::-1]
    assert abs(p.sum() - 1) < 1e-12
    assert p[0] / p[99] > 100 ** 1.2 * 0.99  # ratio of rank 1 to rank 100 follows s = 1.2


def test_light_packages_do_not_import_torch():
    code = ("import sys, manifests, manifests.catalog, ovpipe.cli, packing; "
            "bad = [m for m in ('torch', 'open_clip', 'megatron', 'faiss') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def _tree_digest(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_demo_data_cli_writes_conversation_sets_deterministically(tmp_path):
    """`ovpipe demo-data` writes the caption shards as before plus the LLaVA-558K-style and
    instruction sets, byte-identical for a seed; the caption shards do not change with them."""
    import json

    from ovpipe.cli import main
    from demo.corpus import write_demo_corpus

    for d in ("a", "b"):
        assert main(["demo-data", "--out", str(tmp_path / d), "--samples", "40", "--shards", "2", "--seed", "5"]) == 0
    a, b = _tree_digest(tmp_path / "a"), _tree_digest(tmp_path / "b")
    assert a == b
    assert {"llava-558k/blip_laion_cc_sbu_558k.json", "instruct/llava/instruct.json",
            "instruct/finevision/train-00000.parquet", "eval-tasks/demo_vqa.yaml", "eval-tasks/test.jsonl"} <= set(a)
    assert sum(k.startswith("llava-558k/images/") for k in a) >= 290
    write_demo_corpus(tmp_path / "c", n_samples=40, seed=5, shards=2, planted=24)   # the caption corpus alone
    c = _tree_digest(tmp_path / "c")
    assert {k: a[k] for k in c} == c
    recs = json.loads((tmp_path / "a" / "instruct" / "llava" / "instruct.json").read_text())
    assert len(recs) == 300 and any(len(r.get("images", [])) == 2 for r in recs)
    assert any("image" not in r and "images" not in r for r in recs)       # text-only samples
    fv = pq.read_table(tmp_path / "a" / "instruct" / "finevision" / "train-00000.parquet")
    assert fv.num_rows == 200 and {"images", "texts", "source", "relevance_ratings", "formatting_ratings",
                                   "image_correspondence_ratings", "visual_dependency_ratings"} <= set(fv.column_names)
    assert set(fv.column("source").to_pylist()) == {"counting", "color", "position", "comparison", "text"}
