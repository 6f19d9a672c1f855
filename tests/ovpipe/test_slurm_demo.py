"""The Makefile on Slurm: the curation + packing + rl part of the demo with EXECUTOR=slurm TASKS=2 WORKERS=2 on
the loopback cluster gives the manifests of the same targets run locally, their tasks one after another in the
step's own process (TASKS=2 WORKERS=1), byte for byte (``ovpipe sql`` dumps).

Kept as small as the targets allow: the demo corpus at ``--samples 100`` (182 caption samples, the broken ones
among them; every manifest compared still has rows) and a demo CLIP trained 2 steps at batch 16 (both runs alike;
the suite's curation tests train it for real). The local run goes on beside the Slurm one: each writes under its
own folder of the same length (``local/``, ``slurm/``), and the local run's absolute paths are read as the Slurm
run's before the bytes are compared.
Run by `make test-slurm-demo` (and .ci/run after `make test`, which leaves it out: a quarter of its CPU in one
test). The whole demo, pretrain included, is `make slurm-up && make slurm-demo && make slurm-down` (docs/slurm.md)."""
import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from slurm_cluster import SlurmCluster  # noqa: E402

REPO = Path(__file__).parents[2]
VENV = REPO / ".venv"

# Slurm and the checkout's .venv (the Makefile's): skips without them, fails under CI=true (tests/conftest.py NEEDS)
pytestmark = [pytest.mark.slurm, pytest.mark.checkout_venv]

TARGETS = ["ingest", "curation", "packing", "rl"]
# RL_LOOP=0: the rl target up to its export; the loop after it (grpo, then rollout/score/select twice) would
# double this test's time, and grpo on Slurm against torchrun is tests/grpo/test_grpo_slurm.py's
SMALL = ["DEMO_DATA_ARGS=--samples 100", "DEMO_CLIP_ARGS=--set steps=2 --set batch_size=16", "RL_LOOP=0"]
# the local run's tasks in the step's process: no pool of spawned workers to start (a manifest such as
# image_embeddings names each vector's task shard, so the task count is the same on both sides)
SPLIT = {"local": ["TASKS=2", "WORKERS=1"], "slurm": ["TASKS=2", "WORKERS=2"]}
# every manifest these targets write; each one's dump must be the same bytes (in part order, no ORDER BY)
MANIFESTS = ["samples", "image_embeddings", "concepts", "assignments", "dedup", "alignment", "concept_counts",
             "balanced", "lengths", "packs", "mixed", "rl_prompts", "rollouts", "rewards", "selection"]


def _make(run: Path, executor: str, env: dict) -> subprocess.Popen:
    """The targets into ``run`` (the demo data beside it, in ``run.parent / "data"``), started."""
    return subprocess.Popen(["make", "-C", str(REPO), "--no-print-directory", *TARGETS, f"RUN={run}",
                             f"DEMO_DATA={run.parent / 'data'}", f"EXECUTOR={executor}", *SMALL, *SPLIT[executor]],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)     # its own process group: stopped whole if the test fails


def _finish(proc: subprocess.Popen, t0: float) -> tuple[subprocess.CompletedProcess, float]:
    out, err = proc.communicate(timeout=1800)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.time() - t0


def _dump(run: Path, view: str) -> bytes:
    """``ovpipe sql RUN "SELECT * FROM view" --format csv``, in this process (one Python start, not thirty)."""
    from ovpipe.cli import main

    with contextlib.redirect_stdout(io.StringIO()) as out:
        rc = main(["sql", str(run), f"SELECT * FROM {view}", "--format", "csv"])
    assert rc == 0, f"{view}: ovpipe sql exited {rc}"
    return out.getvalue().encode()


def _export_files(run: Path) -> dict[str, bytes]:
    out = run / "export"
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.suffix in (".parquet", ".jsonl", ".json") and p.parent.name not in ("stats", "logs")
            and p.name not in ("stats.json", "executor.json", "slurm_jobs.json")}


def test_demo_targets_on_slurm_match_the_local_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
    # manifests hold absolute paths (the demo data, RUN/rl-data): the two roots differ only in their last name
    local, slurm_root = tmp_path / "local", tmp_path / "slurm"
    local_run, slurm_run = local / "run", slurm_root / "run"
    t0 = time.time()
    local_proc = _make(local_run, "local", env)
    try:
        with SlurmCluster() as cluster:
            res, t_slurm = _finish(_make(slurm_run, "slurm", {**env, **cluster.env}), t0)
            status = subprocess.run([str(VENV / "bin" / "ovpipe"), "status", str(slurm_run)], capture_output=True,
                                    text=True, env={**env, **cluster.env})
    except BaseException:
        os.killpg(local_proc.pid, signal.SIGKILL)     # make and the step it runs (pool workers die with it)
        local_proc.wait()
        raise
    local_res, t_local = _finish(local_proc, t0)
    assert local_res.returncode == 0, local_res.stdout[-3000:] + local_res.stderr[-3000:]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    print(f"\nlocal {t_local:.0f} s, slurm {t_slurm:.0f} s (side by side)\n{status.stdout}")
    assert status.returncode == 0, status.stdout + status.stderr
    # every step was a Slurm chain that the Makefile waited for: all done, none left queued
    body = status.stdout.split("\n", 1)[1]          # below the column titles
    assert "slurm: map" in body and not any(w in body for w in (" failed", "pending", "running"))
    for step in ("ingest", "balance", "lengths", "pack", "pack-instruct", "mix", "select", "export"):
        assert (slurm_run / step / "slurm_jobs.json").exists(), step
        assert (slurm_run / step / "completions" / "finalized").exists(), step
        assert not (local_run / step / "slurm_jobs.json").exists(), step
    assert "submitted map" in res.stdout and "task(s) on Slurm" in res.stdout

    def as_slurm(b: bytes) -> bytes:          # the local run's paths, read as the Slurm run's
        return b.replace(str(local).encode(), str(slurm_root).encode())

    for view in MANIFESTS:
        a, b = _dump(local_run, view), _dump(slurm_run, view)
        assert a.count(b"\n") > 1, f"{view}: empty in the local run"
        assert as_slurm(a) == b, f"{view}: the Slurm run's dump differs from the local run's"
    exports = {name: data if name.endswith(".parquet") else as_slurm(data)
               for name, data in _export_files(local_run).items()}
    assert exports and exports == _export_files(slurm_run)
