"""The Makefile on Slurm: the curation + packing + rl part of the demo with EXECUTOR=slurm TASKS=2 WORKERS=2 on
the loopback cluster gives the manifests of the same targets run locally, byte for byte (``ovpipe sql`` dumps).

Kept as small as the targets allow: a 300-sample demo corpus and a 20-step demo CLIP (both runs alike).
The whole demo, pretrain included, is `make slurm-up && make slurm-demo && make slurm-down` (docs/slurm.md)."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from slurm_cluster import SlurmCluster, missing_binaries  # noqa: E402

REPO = Path(__file__).parents[2]
VENV = REPO / ".venv"

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(bool(missing_binaries()), reason=f"Slurm not installed ({', '.join(missing_binaries())} "
                                                         f"missing): run scripts/install_slurm.sh"),
    pytest.mark.skipif(Path(sys.prefix).resolve() != VENV.resolve() or not (VENV / ".installed").exists(),
                       reason="runs the Makefile, which uses the checkout's .venv (make install)"),
]

TARGETS = ["ingest", "curation", "packing", "rl"]
SMALL = ["DEMO_DATA_ARGS=--samples 300", "DEMO_CLIP_ARGS=--set steps=20", "TASKS=2", "WORKERS=2"]
# every manifest these targets write; each one's dump must be the same bytes (in part order, no ORDER BY)
MANIFESTS = ["samples", "image_embeddings", "concepts", "assignments", "dedup", "alignment", "concept_counts",
             "balanced", "lengths", "packs", "mixed", "rl_prompts", "rollouts", "rewards", "selection"]


def _make(run: Path, data: Path, executor: str, env: dict) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.time()
    res = subprocess.run(["make", "-C", str(REPO), "--no-print-directory", *TARGETS, f"RUN={run}",
                          f"DEMO_DATA={data}", f"EXECUTOR={executor}", *SMALL],
                         env=env, capture_output=True, text=True, timeout=1800)
    return res, time.time() - t0


def _dump(run: Path, view: str) -> bytes:
    res = subprocess.run([str(VENV / "bin" / "ovpipe"), "sql", str(run), f"SELECT * FROM {view}", "--format", "csv"],
                         capture_output=True, timeout=300)
    assert res.returncode == 0, f"{view}: {res.stderr.decode()}"
    return res.stdout


def _export_files(run: Path) -> dict[str, bytes]:
    out = run / "export"
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.suffix in (".parquet", ".jsonl", ".json") and p.parent.name not in ("stats", "logs")
            and p.name not in ("stats.json", "executor.json", "slurm_jobs.json")}


def test_demo_targets_on_slurm_match_the_local_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
    # Both runs write to the same path (manifests hold absolute paths of the demo data and RUN/rl-data);
    # the local run is moved aside before the Slurm run starts.
    data, slurm_run, local = tmp_path / "data", tmp_path / "run", tmp_path / "local"
    res, t_local = _make(slurm_run, data, "local", env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    slurm_run.rename(local)
    with SlurmCluster() as cluster:
        res, t_slurm = _make(slurm_run, data, "slurm", {**env, **cluster.env})
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
        status = subprocess.run([str(VENV / "bin" / "ovpipe"), "status", str(slurm_run)], capture_output=True,
                                text=True, env={**env, **cluster.env})
    print(f"\nlocal {t_local:.0f} s, slurm {t_slurm:.0f} s\n{status.stdout}")
    assert status.returncode == 0, status.stdout + status.stderr
    # every step was a Slurm chain that the Makefile waited for: all done, none left queued
    body = status.stdout.split("\n", 1)[1]          # below the column titles
    assert "slurm: map" in body and not any(w in body for w in (" failed", "pending", "running"))
    for step in ("ingest", "balance", "lengths", "pack", "pack-instruct", "mix", "select", "export"):
        assert (slurm_run / step / "slurm_jobs.json").exists(), step
        assert (slurm_run / step / "completions" / "finalized").exists(), step
    assert "submitted map" in res.stdout and "task(s) on Slurm" in res.stdout

    for view in MANIFESTS:
        a, b = _dump(local, view), _dump(slurm_run, view)
        assert a.count(b"\n") > 1, f"{view}: empty in the local run"
        assert a == b, f"{view}: the Slurm run's dump differs from the local run's"
    assert _export_files(local) and _export_files(local) == _export_files(slurm_run)
