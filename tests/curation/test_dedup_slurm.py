"""`dedup` and `align` on the loopback Slurm cluster (map array → reduce job → apply array → merge): the bytes of a
local run."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from dedup_fixtures import embedded_run  # noqa: E402
from slurm_cluster import SlurmCluster  # noqa: E402
from test_dedup import _merged_bytes, planted_set  # noqa: E402

from ovpipe.cli import main  # noqa: E402

pytestmark = pytest.mark.slurm      # skips, or fails under CI=true, without Slurm (tests/conftest.py NEEDS)


@pytest.fixture(scope="module")
def slurm():
    with SlurmCluster() as cluster:
        yield cluster


def test_dedup_on_slurm_gives_the_local_bytes(slurm, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    vectors, areas, _ = planted_set(n_groups=6, per_group=15, seed=3)
    args = ["--set", "cluster_rows=40", "--set", "report_pairs=0", "--quiet"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    embedded_run(ref, vectors, areas, parts=2, bad=1)
    embedded_run(run, vectors, areas, parts=2, bad=1)
    assert main(["dedup", "--run-dir", str(ref), "--tasks", "1", *args]) == 0
    assert main(["dedup", "--run-dir", str(run), "--tasks", "2", "--workers", "2", "--executor", "slurm", "--wait",
                 *args]) == 0
    chain = json.loads((run / "dedup" / "slurm_jobs.json").read_text())["chain"]
    assert [j["phase"] for j in chain] == ["map", "reduce", "apply", "merge"]
    assert _merged_bytes(run, tmp_path) == _merged_bytes(ref, tmp_path)


def test_align_on_slurm_gives_the_local_bytes(slurm, tmp_path, monkeypatch):
    """`align` (map → reduce of the per-source histograms → apply) as a Slurm chain of 2 tasks: the bytes of
    one local task."""
    import numpy as np
    import torch

    from manifests import read_manifest
    from manifests.io import write_table
    from test_align import _tiny_clip

    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    net, _, tokenizer, _ = _tiny_clip(tmp_path / "tiny.pt")
    captions = [f"a picture number {i} of {'red' if i % 3 else 'blue'} things" for i in range(24)]
    with torch.no_grad():
        img = torch.nn.functional.normalize(net.encode_text(tokenizer(captions)), dim=-1).numpy()
    img = img + np.random.default_rng(1).normal(scale=0.05, size=img.shape)
    img = (img / np.linalg.norm(img, axis=1, keepdims=True)).astype(np.float32)
    out = []
    for name, extra in (("ref", ["--tasks", "1"]),
                        ("run", ["--tasks", "2", "--workers", "2", "--executor", "slurm", "--wait"])):
        run = tmp_path / name
        embedded_run(run, img, parts=2, bad=1, captions=captions, sources=["web" if i % 2 else "books"
                                                                           for i in range(24)])
        cfg = run / "embed-images" / "config.json"
        cfg.write_text(cfg.read_text().replace('"pretrained": ""', f'"pretrained": "{tmp_path / "tiny.pt"}"'))
        assert main(["align", "--run-dir", str(run), "--quiet", "--set", "percentile=20", *extra]) == 0
        write_table(read_manifest(run, "alignment"), tmp_path / f"{name}.parquet")
        out.append((tmp_path / f"{name}.parquet").read_bytes())
    chain = json.loads((tmp_path / "run" / "align" / "slurm_jobs.json").read_text())["chain"]
    assert [j["phase"] for j in chain][-1] == "merge"
    assert out[0] == out[1]
