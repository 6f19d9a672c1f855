"""``ovpipe view`` at scale: the samples page over a generated N-row ``samples`` manifest (with ``assignments``
and ``balanced`` beside it, for the filters), server time of the first response and the server's peak memory.

    .venv/bin/python -m bench.bench_view --rows 100000 1000000 3000000 --work runs/bench-view --reference runs/demo

The manifests are written with pyarrow in the schema ``ovpipe ingest`` writes (sorted by sample_id, row groups
of ``manifests.io.ROW_GROUP_ROWS``); the requests go through the app in this process (starlette's test
client), so the time is the server's own, with no network or browser. Reference: the same page over the 2,000
samples of ``make demo``'s run (``--reference runs/demo``), on the same machine. Each measurement is a fresh server
process (median of ``--repeat``); ``*_peak_rss_mb`` is that process's peak resident memory after the request.
"""
from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import numpy as np


def write_run(work: Path, rows: int, parts: int = 4, seed: int = 0) -> Path:
    import pyarrow as pa

    from manifests.ids import u64_to_hex
    from manifests.io import write_part

    run = work / f"run-{rows}"
    if (run / "ingest" / "samples" / f"part-{parts - 1:05d}.parquet").exists():
        return run
    rng = np.random.default_rng(seed)
    ids = np.sort(np.asarray(u64_to_hex(rng.integers(0, 2**63, rows, dtype=np.uint64)).to_pylist()))
    for step in ("ingest", "assign", "balance"):
        (run / step).mkdir(parents=True, exist_ok=True)
        (run / step / "executor.json").write_text(json.dumps({"step": step, "tasks": parts, "inputs": {}}))
    for k, sl in enumerate(np.array_split(np.arange(rows), parts)):
        sid = pa.array(ids[sl])
        n = len(sl)
        shard = np.char.add("/data/shards/s-", (sl // 10_000).astype(str))
        status = np.where(rng.random(n) < 0.01, "corrupt_image", "ok")
        addr = [[{"file": f"{s}.tar", "container": "tar", "offset": int(o) * 4096, "size": 4096, "column": None,
                  "index": -1, "format": "jpeg", "width": 64, "height": 64}] for s, o in zip(shard, sl)]
        write_part({"sample_id": sid, "source": ["web"] * n, "shard": shard, "key": sl.astype(str),
                    "shard_format": ["tar"] * n, "offset": sl * 4096, "size": [4096] * n, "image_format": ["jpeg"] * n,
                    "width": [64] * n, "height": [64] * n, "caption": ["a photo of a thing."] * n,
                    "category": ["caption"] * n, "n_images": [1] * n, "images": addr,
                    "conversation": [[{"role": "user", "text": "<image>"},
                                      {"role": "assistant", "text": "a photo of a thing."}]] * n,
                    "turns": [2] * n, "turn_ratings": [None] * n, "status": status, "error": [None] * n},
                   run / "ingest" / "samples" / f"part-{k:05d}.parquet", "samples")
        cids = rng.zipf(1.3, (n, 5)).clip(1, 500_000).astype(np.int32) - 1
        write_part({"sample_id": sid, "concept_ids": list(cids), "scores": list(np.full((n, 5), 0.5, np.float32))},
                   run / "assign" / "assignments" / f"part-{k:05d}.parquet", "assignments")
        write_part({"sample_id": sid, "weight": np.ones(n), "copies": rng.integers(0, 3, n).astype(np.int32)},
                   run / "balance" / "balanced" / f"part-{k:05d}.parquet", "balanced")
    return run


def measure(run: Path) -> dict:
    from starlette.testclient import TestClient

    from viewer.app import create_app

    t0 = time.perf_counter()
    client = TestClient(create_app(run))
    out = {"startup_s": time.perf_counter() - t0}
    for name, url in (("samples_first_s", "/samples"), ("samples_page_100_s", "/samples?page=100"),
                      ("samples_status_s", "/samples?status=corrupt_image"), ("samples_copies_s", "/samples?copies=0"),
                      ("samples_concept_s", "/samples?concept=3"), ("sample_lineage_s", None)):
        if url is None:
            got = client.app.state.catalog.one("SELECT sample_id FROM samples ORDER BY sample_id LIMIT 1 OFFSET "
                                               "(SELECT count(*) // 2 FROM samples)")
            url = f"/samples/{got['sample_id']}"          # a sample in the middle: its lineage
        t = time.perf_counter()
        r = client.get(url)
        out[name] = time.perf_counter() - t
        out[name[:-2] + "_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        assert r.status_code == 200, (url, r.status_code, r.text[:300])
    return out


def measure_fresh(run: Path, repeat: int) -> dict:
    """``measure`` in ``repeat`` fresh processes (a server's first response is a cold start each time): the
    median of each time, the largest of each peak."""
    import statistics
    import subprocess
    import sys

    runs = [json.loads(subprocess.run([sys.executable, "-m", "bench.bench_view", "--measure", str(run)], check=True,
                                      capture_output=True, text=True).stdout.splitlines()[-1]) for _ in range(repeat)]
    return {k: (max if k.endswith("_mb") else statistics.median)(r[k] for r in runs) for k in runs[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1_000_000])
    ap.add_argument("--work", type=Path, default=Path("runs/bench-view"))
    ap.add_argument("--reference", type=Path, help="a run folder to measure the same way (runs/demo)")
    ap.add_argument("--repeat", type=int, default=3, help="fresh server processes per run folder (median time)")
    ap.add_argument("--measure", type=Path, help=argparse.SUPPRESS)     # internal: one measurement, as JSON
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return 0
    ref = None
    if args.reference:
        ref = measure_fresh(args.reference, args.repeat)
        print("reference", args.reference, json.dumps({k: round(v, 3) for k, v in ref.items()}), flush=True)
    for rows in args.rows:
        t = time.perf_counter()
        run = write_run(args.work, rows)
        print(f"manifests of {rows:,} rows in {run} ({time.perf_counter() - t:.1f} s)", flush=True)
        got = measure_fresh(run, args.repeat)
        print(f"{rows:,} rows", json.dumps({k: round(v, 3) for k, v in got.items()}), flush=True)
        if ref:
            print(f"  first samples page: {got['samples_first_s'] / ref['samples_first_s']:.2f}x the reference's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
