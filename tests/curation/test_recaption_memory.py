"""A recaption task holds one chunk, not its slice: the same rank, run again in a fresh process over a slice
8× larger, adds about the same to its peak resident memory. The slice's captions (≈ 1 KB each, from the
``file`` backend), their image addresses and the part's rows would otherwise all be held until the part
is written."""
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa

from manifests.conversation import IMAGE_ADDRESS, TURN
from manifests.io import write_part
from ovpipe.cli import main

MEASURE = r"""
import json, sys
from pathlib import Path
import numpy, pyarrow, pyarrow.parquet, pyarrow.compute, duckdb, xxhash   # not the task's memory
import curation.recaption, inference.backends, packing.lengths, manifests.io, ovpipe.executors.task
from ovpipe.executors.task import run_task
from ovpipe.mapreduce import vmhwm_bytes

run = Path(sys.argv[1])
# row groups of 256 captions: the small slice already fills several, so what the part writer buffers is the
# same for both slices (the default, 16K rows ≈ 16 MB of captions, is the bound at scale)
manifests.io.ROW_GROUP_ROWS["captions"] = 256
base = vmhwm_bytes()
(run / "recaption" / "completions" / "00000").unlink()
run_task("recaption", run, 0, 1)
print(json.dumps({"delta": vmhwm_bytes() - base}))
"""

WORDS = " ".join(f"word{k % 97}" for k in range(160))          # ≈ 1 KB, all distinct 4-grams: an ok caption


def _corpus(run: Path, n: int) -> Path:
    """``n`` ok one-image samples in 4 canonical parts (the image addresses point nowhere: the file backend
    reads no image) and a captions JSONL with one ≈ 1 KB English caption each."""
    ids = [f"{i * 0x9E3779B97F4A7C15 % 2**64:016x}" for i in range(n)]
    ids.sort()
    per = -(-n // 4)
    for k in range(4):
        mine = ids[k * per:(k + 1) * per]
        m = len(mine)
        addr = [[{"file": f"/nowhere/shard-{k}.tar", "container": "tar", "offset": 512 * i, "size": 4096,
                  "column": None, "index": -1, "format": "jpeg", "width": 64, "height": 64}] for i in range(m)]
        write_part(pa.table({
            "sample_id": mine, "source": ["s"] * m, "shard": [f"shard-{k}.tar"] * m, "key": mine,
            "shard_format": ["tar"] * m, "offset": [0] * m, "size": [4096] * m, "image_format": ["jpeg"] * m,
            "width": pa.array([64] * m, pa.int32()), "height": pa.array([64] * m, pa.int32()),
            "caption": ["c"] * m, "category": ["caption"] * m, "n_images": pa.array([1] * m, pa.int32()),
            "images": pa.array(addr, pa.list_(IMAGE_ADDRESS)),
            "conversation": pa.array([[{"role": "user", "text": "<image>"}, {"role": "assistant", "text": "c"}]] * m,
                                     pa.list_(TURN)),
            "turns": pa.array([2] * m, pa.int32()), "turn_ratings": pa.array([None] * m, pa.map_(pa.string(), pa.list_(pa.int32()))),
            "status": ["ok"] * m, "error": pa.array([None] * m, pa.string())}),
            run / "ingest" / "samples" / f"part-{k:05d}.parquet", "samples")
    data = run / "caps.jsonl"
    with open(data, "w") as f:
        f.writelines(json.dumps({"sample_id": s, "lang": "en", "caption": f"{i}: {WORDS}", "model": "m"}) + "\n"
                     for i, s in enumerate(ids))
    return data


def _rank0_peak_mib(run: Path) -> float:
    r = subprocess.run([sys.executable, "-c", MEASURE, str(run)], capture_output=True, text=True,
                       cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])["delta"] / 2 ** 20


def test_recaption_task_memory_follows_its_chunk_not_its_slice(tmp_path):
    """One task over 1,024 and over 8,192 samples (8 MB of captions), chunks of 64."""
    deltas = []
    for name, n in (("small", 1024), ("large", 8192)):
        run = tmp_path / name
        data = _corpus(run, n)
        assert main(["recaption", "--set", "backend=file", "--set", f"file={data}", "--set", "chunk_size=64",
                     "--set", "prompts={en: Describe.}", "--set", "scripts={en: latin}", "--set", "min_length={en: 3}",
                     "--run-dir", str(run), "--tasks", "1", "--quiet"]) == 0
        (run / "recaption" / "completions" / "finalized").unlink()
        deltas.append(_rank0_peak_mib(run))
    print(f"VmHWM added by recaption rank 0, MiB: a 1,024-sample slice {deltas[0]:.1f}; a 8,192-sample slice "
          f"{deltas[1]:.1f}")
    assert deltas[1] - deltas[0] < 8, deltas
