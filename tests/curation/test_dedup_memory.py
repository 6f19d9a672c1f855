"""A `dedup` map or apply task's peak memory does not grow with the corpus: map rank 0 and apply rank 0 of 2
run in a fresh process at 8K and 64K rows; what each adds to the process's peak resident memory (VmHWM after
the task − VmHWM after the imports) stays flat (the reduce holds one cluster: bench/bench_dedup.py)."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from dedup_fixtures import embedded_run, unit  # noqa: E402

MiB = 1 << 20

MEASURE = r"""
import json, sys
from pathlib import Path
import numpy, pyarrow, pyarrow.parquet, pyarrow.compute, duckdb       # imports are not the task's memory
import curation.dedup, curation.assign, manifests.io, manifests.ids, ovpipe.executors.task
from ovpipe.executors.task import run_task
from ovpipe.mapreduce import vmhwm_bytes

run, phase = Path(sys.argv[1]), sys.argv[2]
base = vmhwm_bytes()
if phase == "apply":
    (run / "dedup" / "completions" / "apply-00000").unlink()
run_task("dedup", run, 0, 2, phase=phase)
print(json.dumps({"delta": vmhwm_bytes() - base}))
"""


def _deltas(run: Path) -> dict[str, float]:
    from ovpipe.cli import main

    assert main(["dedup", "--run-dir", str(run), "--tasks", "2", "--quiet", "--set", "cluster_rows=2000",
                 "--set", "report_pairs=0"]) == 0
    out = {}
    for phase in ("apply", "map"):          # a map rerun invalidates the reduce: apply first
        r = subprocess.run([sys.executable, "-c", MEASURE, str(run), phase], capture_output=True, text=True,
                           cwd=Path(__file__).parents[2])
        assert r.returncode == 0, r.stderr[-3000:]
        out[phase] = json.loads(r.stdout.strip().splitlines()[-1])["delta"] / MiB
    return out


@pytest.mark.slow
def test_dedup_map_and_apply_memory_does_not_grow_with_the_corpus(tmp_path):
    rng = np.random.default_rng(0)
    sizes = {"small": 8_000, "large": 64_000}
    deltas = {}
    for name, n in sizes.items():
        run = tmp_path / name
        # row groups of 2K rows, not write_part's 1M: a task decodes one row group at a time, so 1M-row groups
        # would hide the streaming behind that cap at these sizes
        embedded_run(run, unit(rng.normal(size=(n, 16))).astype(np.float32), parts=4, row_group_rows=2048)
        deltas[name] = _deltas(run)
    print(f"VmHWM added by the task, MiB: {deltas}")
    a, b = deltas["small"], deltas["large"]
    # 8× the rows: a map task streams a batch at a time and keeps 16 bytes a drawn row (2.6% of its share);
    # an apply task streams its slice against the memory-mapped arrays and buffers its part up to one row
    # group (65,536 rows). Generous bounds.
    assert b["map"] - a["map"] < 16, deltas
    assert b["apply"] - a["apply"] < 24, deltas


REDUCE = r"""
import json, sys
from pathlib import Path
import numpy, pyarrow, pyarrow.parquet, duckdb, faiss, torch, xxhash     # imports are not the task's memory
import curation.dedup, curation.assign, curation.clip, manifests.io, manifests.ids, ovpipe.executors.task
from ovpipe.executors.task import reduce_step
from ovpipe.mapreduce import vmhwm_bytes

run = Path(sys.argv[1])
(run / "dedup" / "completions" / "reduced").unlink()
base = vmhwm_bytes()
reduce_step("dedup", run)
print(json.dumps({"delta": vmhwm_bytes() - base}))
"""


@pytest.mark.slow
def test_dedup_reduce_memory_is_flat_when_one_cluster_holds_every_row(tmp_path):
    """One k-means cluster holds 100% of the rows (``cluster_rows`` above the corpus), at 12K and 48K rows of
    d = 256: the reduce splits it by streaming and re-spilling, never loading it, so what the reduce adds to
    its process's peak stays flat (loaded whole in fp32, the 48K cluster alone is 48 MiB)."""
    from ovpipe.cli import main

    rng = np.random.default_rng(1)
    deltas = {}
    for n in (12_000, 48_000):
        run = tmp_path / f"n{n}"
        # parts of 3K rows: a shard's pages, mapped while its rows are gathered, are the same size at both sizes
        embedded_run(run, unit(rng.normal(size=(n, 256))).astype(np.float32), parts=n // 3000,
                     row_group_rows=2048)
        assert main(["dedup", "--run-dir", str(run), "--tasks", "2", "--quiet", "--set", "cluster_rows=1000000000",
                     "--set", "max_cluster_rows=1000", "--set", "max_train_rows=4096", "--set", "report_pairs=0",
                     "--set", "report_eps=[0.05]"]) == 0
        r = subprocess.run([sys.executable, "-c", REDUCE, str(run)], capture_output=True, text=True,
                           cwd=Path(__file__).parents[2])
        assert r.returncode == 0, r.stderr[-3000:]
        deltas[n] = json.loads(r.stdout.strip().splitlines()[-1])["delta"] / MiB
        info = json.loads((run / "dedup" / "stats" / "reduce.json").read_text())["info"]
        assert info["clusters"] == 1 and info["largest_cluster"] == n
    print(f"VmHWM added by the reduce, MiB: {deltas}")
    # 4× the rows in the one cluster: the row-aligned arrays (32 bytes a row, memory-mapped) and DuckDB's
    # sort of the ids grow with the corpus, about 3 MiB here; the cluster itself adds nothing
    assert deltas[48_000] - deltas[12_000] < 12, deltas
