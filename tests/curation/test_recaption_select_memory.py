"""recaption's selection holds the rank's slice, not the corpus: rank 0 of 2, ``limit`` fixed (the same 512-sample
slice), over a corpus of 150K and of 1.2M samples, under ``OVPIPE_REDUCE_MEMORY=48MB``. DuckDB works within its
limit and spills under the step folder, so the peak follows the limit; the in-memory selection held every input
``sample_id`` (≈ 30 B a sample, plus its sort) and grew with the corpus."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

from manifests.conversation import IMAGE_ADDRESS, TURN
from manifests.io import write_part

MEASURE = r"""
import json, sys
from pathlib import Path
import numpy, pyarrow, pyarrow.parquet, pyarrow.compute, duckdb, xxhash   # not the selection's memory
import curation.recaption as rc
from ovpipe.step import TaskContext
from ovpipe.mapreduce import vmhwm_bytes

run = Path(sys.argv[1])
cfg = rc.RecaptionConfig(backend="file", file="x.jsonl", limit=1024)
task = TaskContext.for_step(rc.STEP, cfg, run, 0, 2)
base = vmhwm_bytes()
ids, rows = rc.slice_rows(task, cfg)
print(json.dumps({"delta": vmhwm_bytes() - base, "n": len(ids)}))
"""


def _corpus(run: Path, n: int, parts: int = 4) -> None:
    """``n`` ok one-image samples in ``parts`` canonical parts, built column-wise (no Python row per sample)."""
    ids = np.sort(np.random.default_rng(0).integers(0, 2 ** 63, n, dtype=np.int64))
    sids = pa.array(np.char.mod("%016x", ids).tolist(), pa.string())
    addr = pa.array([{"file": "/nowhere/x.tar", "container": "tar", "offset": 0, "size": 4096, "column": None,
                      "index": -1, "format": "jpeg", "width": 64, "height": 64}], IMAGE_ADDRESS)
    turns = pa.array([{"role": "user", "text": "<image>"}, {"role": "assistant", "text": "c"}], TURN)
    per = -(-n // parts)
    for k in range(parts):
        s = sids[k * per:(k + 1) * per]
        m = len(s)

        def const(v, t=pa.string()):
            return pa.array([v], t).take(np.zeros(m, np.int64))
        write_part(pa.table({
            "sample_id": s, "source": const("s"), "lang": const(None), "shard": const(f"shard-{k}.tar"), "key": s,
            "shard_format": const("tar"), "offset": const(0, pa.int64()), "size": const(4096, pa.int64()),
            "image_format": const("jpeg"), "width": const(64, pa.int32()), "height": const(64, pa.int32()),
            "caption": const("c"), "category": const("caption"), "n_images": const(1, pa.int32()),
            "images": pa.ListArray.from_arrays(pa.array(np.arange(m + 1, dtype=np.int32)), addr.take(np.zeros(m, np.int64))),
            "conversation": pa.ListArray.from_arrays(pa.array(np.arange(0, 2 * m + 1, 2, dtype=np.int32)),
                                                     turns.take(np.tile([0, 1], m))),
            "turns": const(2, pa.int32()), "turn_ratings": pa.nulls(m, pa.map_(pa.string(), pa.list_(pa.int32()))),
            "status": const("ok"), "error": pa.nulls(m, pa.string())}),
            run / "ingest" / "samples" / f"part-{k:05d}.parquet", "samples")


def _rank0_peak_mib(run: Path) -> float:
    env = dict(os.environ, OVPIPE_REDUCE_MEMORY="48MB")
    r = subprocess.run([sys.executable, "-c", MEASURE, str(run)], capture_output=True, text=True, env=env,
                       cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["n"] == 512
    return out["delta"] / 2 ** 20


def test_selection_memory_follows_the_slice_not_the_corpus(tmp_path):
    deltas = []
    for n in (150_000, 1_200_000):
        _corpus(tmp_path / str(n), n)
        deltas.append(_rank0_peak_mib(tmp_path / str(n)))
    print(f"VmHWM added by slice_rows, rank 0 of 2, a 512-sample slice, MiB: corpus of 150K {deltas[0]:.1f}; "
          f"of 1.2M {deltas[1]:.1f}")
    assert deltas[1] - deltas[0] < 45, deltas          # the in-memory selection: +99 MiB from 200K to 1.6M
