"""A `balance` task's peak memory does not grow with the corpus. The same task (map rank 0,
the reduce, apply rank 0 of 2) runs in a fresh process at 60K and 480K samples (K = 10); what each
adds to the process's peak resident memory (VmHWM after the task − VmHWM after the imports) must stay
flat. The old step read the whole `assignments` manifest in every rank: its rank 0 grew by 184 MiB
between these two sizes (docs/scale.md)."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from manifests.io import write_part

MiB = 1 << 20

MEASURE = r"""
import json, sys
from pathlib import Path
import numpy, pyarrow, pyarrow.parquet, pyarrow.compute, duckdb          # imports are not the task's memory
import curation.concept_balance, manifests.io, ovpipe.executors.task, packing.binpack
from ovpipe.executors.task import reduce_step, run_task
from ovpipe.mapreduce import vmhwm_bytes

run, phase = Path(sys.argv[1]), sys.argv[2]
sdir = run / "balance"
base = vmhwm_bytes()
if phase == "map":
    run_task("balance", run, 0, 2, phase="map")
elif phase == "reduce":
    reduce_step("balance", run)
else:
    (sdir / "completions" / "apply-00000").unlink()
    run_task("balance", run, 0, 2, phase="apply")
print(json.dumps({"delta": vmhwm_bytes() - base}))
"""


def _corpus(run: Path, n: int, K: int = 10, V: int = 5000, parts: int = 4, seed: int = 0) -> None:
    """`assignments` as `assign` writes it (parts = contiguous ranges of the sorted ids) + `concepts`."""
    rng = np.random.default_rng(seed)
    p = 1 / np.arange(1, V + 1) ** 1.1
    ids = np.sort(rng.integers(0, 2 ** 63, n, dtype=np.int64).astype(np.uint64))
    ids = pa.array([f"{x:016x}" for x in ids.tolist()])
    for k, part in enumerate(np.array_split(np.arange(n), parts)):
        m = len(part)
        c = rng.choice(V, size=m * K, p=p / p.sum()).astype(np.int32)
        offs = pa.array(np.arange(0, m * K + 1, K, dtype=np.int32))
        t = pa.table({"sample_id": ids.slice(int(part[0]), m),
                      "concept_ids": pa.ListArray.from_arrays(offs, pa.array(c)),
                      "scores": pa.ListArray.from_arrays(offs, pa.array(np.full(m * K, 0.5, np.float32)))})
        # Row groups of 4K rows, not write_part's 1M: a task decodes one row group of a list column at
        # a time (pyarrow), so at these test sizes 1M-row groups would hide the streaming behind that cap.
        f = run / "assign" / "assignments" / f"part-{k:05d}.parquet"
        f.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(t, f, row_group_size=1 << 12, compression="zstd")
    write_part({"concept_id": np.arange(V, dtype=np.int32), "text": [f"c{i}" for i in range(V)],
                "file": ["x"] * V, "row": np.arange(V, dtype=np.int32)},
               run / "embed-concepts" / "concepts" / "part-00000.parquet", "concepts")


def _deltas(run: Path) -> dict[str, float]:
    from ovpipe.cli import main

    assert main(["balance", "--run-dir", str(run), "--tasks", "2", "--quiet"]) == 0
    (run / "balance" / "completions" / "reduced").unlink()      # so the measured reduce does its work
    out = {}
    for phase in ("map", "reduce", "apply"):
        r = subprocess.run([sys.executable, "-c", MEASURE, str(run), phase], capture_output=True, text=True,
                           cwd=Path(__file__).parents[2])
        assert r.returncode == 0, r.stderr[-3000:]
        out[phase] = json.loads(r.stdout.strip().splitlines()[-1])["delta"] / MiB
    return out


@pytest.mark.slow
def test_balance_task_memory_does_not_grow_with_the_corpus(tmp_path):
    small, large = tmp_path / "small", tmp_path / "large"
    _corpus(small, 60_000)
    _corpus(large, 480_000)
    a, b = _deltas(small), _deltas(large)
    print(f"VmHWM added by the task, MiB: 60K samples {a}; 480K samples {b}")
    # 8× the samples (the old rank 0 grew by ~170 MiB): map and apply tasks stream a batch at a time;
    # apply also buffers its part's rows up to one row group (~40 B a row of `balanced`). Generous bounds.
    assert b["map"] - a["map"] < 16, (a, b)
    assert b["apply"] - a["apply"] < 32, (a, b)
    assert b["reduce"] - a["reduce"] < 24, (a, b)
