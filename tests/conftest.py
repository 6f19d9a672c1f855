"""Shared fixtures: a small demo corpus and an ingested run folder, made once per session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# The longest-running modules, scheduled right after the Slurm group so that no long test starts late and
# holds the suite's end (the 2-core CI machine: `make test` is two xdist workers).
LONG_FIRST = ("tests/pretrain/test_parallel_parity.py", "tests/pretrain/test_kill_drill.py",
              "tests/pretrain/test_export.py", "tests/pretrain/test_tensor_parallel.py",
              "tests/pretrain/test_conversation_training.py", "tests/curation/test_curation_demo.py")


def pytest_collection_modifyitems(config, items):
    # Under xdist the Slurm tests share one worker: each module starts its own loopback cluster, and two
    # clusters at once would compete for the same two cores and node name. The parallel-parity tests share
    # another, so their one-process reference run (a module fixture) is computed once, not on each worker.
    # Both groups go first (xdist's loadgroup hands out work in collection order), then LONG_FIRST.
    def rank(item):
        if "slurm" in item.keywords:
            return 0
        path = item.nodeid.split("::")[0]
        return 1 + LONG_FIRST.index(path) if path in LONG_FIRST else len(LONG_FIRST) + 1

    for item in items:
        if "slurm" in item.keywords:
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif item.nodeid.startswith("tests/pretrain/test_parallel_parity.py"):
            item.add_marker(pytest.mark.xdist_group("parity"))
    items.sort(key=rank)          # stable: collection order within each rank
    if any("gpu" in item.keywords for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def demo_corpus(tmp_path_factory) -> Path:
    """200 demo samples in 4 shards (with the deliberately broken ones)."""
    from demo.corpus import write_demo_corpus

    out = tmp_path_factory.mktemp("demo-data")
    write_demo_corpus(out, n_samples=200, seed=0, shards=4)
    return out


@pytest.fixture(scope="session")
def ingested_run(demo_corpus, tmp_path_factory) -> Path:
    """A run folder where `ingest` ran over the demo corpus (2 tasks)."""
    from ovpipe.cli import main

    run = tmp_path_factory.mktemp("run")
    rc = main(["ingest", "--set", f'inputs=["{demo_corpus}/shards/*.tar"]', "--set", "source=demo",
               "--run-dir", str(run), "--tasks", "2", "--quiet"])
    assert rc == 0
    return run
