"""The curation steps end to end on the small demo run (a few training steps only)."""
import json
import shutil

import numpy as np
import pytest

from manifests import read_manifest
from ovpipe.cli import main


@pytest.mark.slow
def test_curation_pipeline_on_demo(ingested_run, demo_corpus, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ingested_run / "ingest", run / "ingest")
    assert main(["demo-clip", "--run-dir", str(run), "--quiet", "--set", f"ground_truth={demo_corpus}/ground_truth.parquet",
                 "--set", f"vocabulary={demo_corpus}/concepts.txt", "--set", "steps=40", "--set", "batch_size=64"]) == 0
    info = json.loads((run / "demo-clip" / "stats.json").read_text())["info"]
    assert info["recall_after"] > info["recall_before"]
    ckpt = str(run / "demo-clip" / "data" / "tiny-clip.pt")
    common = ["--set", "model=ovpipe-tiny-clip", "--set", f"pretrained={ckpt}", "--run-dir", str(run), "--quiet"]
    assert main(["embed-images", *common, "--tasks", "2", "--set", "batch_size=32"]) == 0
    assert main(["embed-concepts", *common, "--set", f"vocabulary={demo_corpus}/concepts.txt"]) == 0
    emb = read_manifest(run, "image_embeddings").to_pylist()
    assert sum(r["status"] == "ok" for r in emb) == 195 and len(emb) == 200
    ok = next(r for r in emb if r["status"] == "ok")
    v = np.load(run / ok["file"])
    assert v.dtype == np.float16 and np.allclose(np.linalg.norm(v.astype(np.float32), axis=1), 1, atol=1e-2)
    assert main(["assign", "--run-dir", str(run), "--quiet", "--set", "k=5", "--tasks", "2"]) == 0
    a = read_manifest(run, "assignments").to_pylist()
    assert len(a) == 195 and all(len(r["concept_ids"]) == 5 for r in a)
    assert all(r["scores"] == sorted(r["scores"], reverse=True) for r in a)
    assert main(["balance", "--run-dir", str(run), "--quiet"]) == 0
    assert main(["balance-report", "--run-dir", str(run), "--quiet"]) == 0
    info = json.loads((run / "balance-report" / "stats.json").read_text())["info"]
    assert info["after_entropy"] > info["before_entropy"]
    assert (run / "balance-report" / "concept_coverage.png").stat().st_size > 1000
