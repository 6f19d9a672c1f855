"""`pack`'s reduce keeps ~48 bytes per item (the items themselves are on disk, sorted a
partition at a time: `packing.solve`) and an apply rank's peak does not grow with the corpus (it writes
its pack range a chunk of bins at a time). The same tasks run in a fresh process at 200K and 1.6M
samples; what each adds to the process's peak resident memory (VmHWM after the task − VmHWM after the
imports) is compared. The in-memory solve it replaced grew by 328 bytes per item here (9.8 GiB at 40M)."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from manifests.ids import u64_to_hex

MiB = 1 << 20

MEASURE = r"""
import json, sys
from pathlib import Path
import numpy, pyarrow, pyarrow.parquet, pyarrow.compute, duckdb          # imports are not the task's memory
import packing.pack, packing.solve, manifests.io, ovpipe.executors.task, ovpipe.mapreduce
from ovpipe.executors.task import reduce_step, run_task
from ovpipe.mapreduce import vmhwm_bytes

run, phase = Path(sys.argv[1]), sys.argv[2]
base = vmhwm_bytes()
if phase == "reduce":
    reduce_step("pack", run)
else:
    (run / "pack" / "completions" / "apply-00000").unlink()
    run_task("pack", run, 0, 2, phase="apply")
print(json.dumps({"delta": vmhwm_bytes() - base}))
"""


def _corpus(run: Path, n: int, parts: int = 4, seed: int = 0) -> None:
    """A `lengths` manifest as an external step folder: lognormal lengths (mean ≈ 800 of 8192), parts
    that are contiguous ranges of the sorted ids, 16K-row row groups."""
    rng = np.random.default_rng(seed)
    u = np.unique(rng.integers(0, 2 ** 63, n, dtype=np.int64).astype(np.uint64))
    L = np.clip(rng.lognormal(6.5, 0.6, len(u)), 1, 8192).astype(np.int32)
    for k, part in enumerate(np.array_split(np.arange(len(u)), parts)):
        ids = u64_to_hex(u[part])
        m = len(part)
        t = pa.table({"sample_id": ids, "source": pa.array(["s"] * m), "text_tokens": L[part],
                      "image_tokens": np.zeros(m, np.int32), "total_tokens": L[part], "target_tokens": L[part] // 4,
                      "turns_kept": np.full(m, 2, np.int32), "images": np.zeros(m, np.int32),
                      "vit_sq": np.zeros(m, np.int64), "status": pa.array(["ok"] * m),
                      "error": pa.nulls(m, pa.string()), "source_sample_id": ids})
        f = run / "lengths" / "lengths" / f"part-{k:05d}.parquet"
        f.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(t, f, row_group_size=1 << 14, compression="zstd")


def _deltas(run: Path) -> dict[str, float]:
    import os

    from ovpipe.cli import main

    # partitions of 64K items (the test sets OVPIPE_PACK_PART_ITEMS) and a 10K-item report sample:
    # constants the 200K corpus already reaches (at their defaults, 4M and 1M, both sizes here would
    # still be growing into them)
    assert main(["pack", "--run-dir", str(run), "--tasks", "2", "--quiet", "--set", "write_shards=false",
                 "--set", "report_max_samples=10000"]) == 0
    (run / "pack" / "completions" / "reduced").unlink()         # so the measured reduce does its work
    out = {}
    for phase in ("reduce", "apply"):
        r = subprocess.run([sys.executable, "-c", MEASURE, str(run), phase], capture_output=True, text=True,
                           cwd=Path(__file__).parents[2], env=dict(os.environ))
        assert r.returncode == 0, r.stderr[-3000:]
        out[phase] = json.loads(r.stdout.strip().splitlines()[-1])["delta"] / MiB
    return out


@pytest.mark.slow
def test_pack_reduce_and_apply_memory_per_item(tmp_path, monkeypatch):
    monkeypatch.setenv("OVPIPE_PACK_PART_ITEMS", str(1 << 16))
    small, large = tmp_path / "small", tmp_path / "large"
    _corpus(small, 200_000)
    _corpus(large, 1_600_000)
    a, b = _deltas(small), _deltas(large)
    print(f"VmHWM added by the task, MiB: 200K samples {a}; 1.6M samples {b}")
    per_item = (b["reduce"] - a["reduce"]) * MiB / 1_400_000
    # measured: ≈ 81 bytes per item (48 of them the per-slot arrays) and +15 MiB for an apply rank; the
    # in-memory solve it replaced: 328 bytes per item and +97 MiB (the 961f12b code, same corpus)
    assert per_item < 120, (a, b, per_item)
    assert b["apply"] - a["apply"] < 48, (a, b)     # 8× the packs per rank: chunks of 8K bins
