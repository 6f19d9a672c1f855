"""`dedup` on the loopback Slurm cluster (map array → reduce job → apply array → merge): the bytes of a local run."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from dedup_fixtures import embedded_run  # noqa: E402
from slurm_cluster import SlurmCluster, missing_binaries  # noqa: E402
from test_dedup import _merged_bytes, planted_set  # noqa: E402

from ovpipe.cli import main  # noqa: E402

pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(bool(missing_binaries()),
                                 reason=f"Slurm not installed ({', '.join(missing_binaries())} missing): "
                                        f"run scripts/install_slurm.sh")]


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
