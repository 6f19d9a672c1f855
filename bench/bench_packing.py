"""Packing benchmark: ovpipe's hash-bucket BFD vs TRL's BFD, first-fit-decreasing (NeMo's
offline approach) and the online rolling-buffer packer, on the same length distributions,
in one run.

    python -m bench.bench_packing            # demo-like, realistic 1M and 10M, half-capacity 1M
    python -m bench.bench_packing --quick    # 100K-sample versions

"ovpipe" is timed end to end: read a ``lengths`` Parquet file → solve → build the ``packs``
table → write it as Parquet, in a fresh process whose peak RSS is reported. The Python peers
run on the 1M distributions (TRL on a 100K subset: it packs real token lists).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def realistic(n: int, seed: int = 0, patches: bool = False):
    """Long-tailed caption/answer lengths + image tokens of a realistic spread of resolutions (one image
    each). ``patches``: also each image's tower patches (``bench.bench_balance`` costs them)."""
    from packing.tokens import ImageTokenConfig, image_grid, image_tokens

    rng = np.random.default_rng(seed)
    text = np.minimum(rng.lognormal(4.3, 1.0, n).astype(np.int64) + 24, 6000)
    side = np.exp(rng.normal(np.log(700), 0.55, n))                      # ~700 px median, 200–2500 px
    aspect = np.exp(rng.normal(0, 0.35, n))
    h = np.clip(side / np.sqrt(aspect), 32, 4000).astype(np.int64)
    w = np.clip(side * np.sqrt(aspect), 32, 4000).astype(np.int64)
    L = text + image_tokens(h, w, ImageTokenConfig())
    return (L, np.prod(image_grid(h, w, ImageTokenConfig()), axis=0)) if patches else L


def demo_like(n: int, seed: int = 0, patches: bool = False):
    from packing.tokens import ImageTokenConfig, image_grid, image_tokens

    rng = np.random.default_rng(seed)
    h = rng.integers(56, 449, n)
    w = rng.integers(56, 449, n)
    cfg = ImageTokenConfig(max_pixels=200704)
    L = 30 + rng.integers(0, 25, n) + image_tokens(h, w, cfg)
    return (L, np.prod(image_grid(h, w, cfg), axis=0)) if patches else L


def lognormal(n: int, C: int, seed: int = 0) -> np.ndarray:
    """The reference point of the issue: a plain lognormal length mix."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(6.0, 0.8, n).astype(np.int64), 1, C)


def half_capacity(n: int, C: int, seed: int = 0) -> np.ndarray:
    """The classic hard case: most items a little over or under C/2."""
    rng = np.random.default_rng(seed)
    near = rng.integers(C // 2 - 300, C // 2 + 300, n)
    small = np.clip(rng.lognormal(5.0, 0.8, n).astype(np.int64), 1, C // 4)
    return np.where(rng.random(n) < 0.6, near, small)


def write_lengths(path: Path, L: np.ndarray) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from manifests.ids import splitmix64

    n = len(L)
    ids = np.char.mod("%016x", splitmix64(np.arange(n, dtype=np.uint64)))
    pq.write_table(pa.table({"sample_id": pa.array(ids.astype(str)), "source": pa.array(["bench"] * n),
                             "text_tokens": pa.array(np.zeros(n, np.int32)), "image_tokens": pa.array(np.zeros(n, np.int32)),
                             "total_tokens": pa.array(L.astype(np.int32)), "status": pa.array(["ok"] * n),
                             "error": pa.nulls(n, pa.string())}), path)


def _ours_end_to_end(lengths_path: str, out_path: str, C: int, q) -> None:
    import pyarrow.parquet as pq

    from manifests.ids import hex_ids_to_u64, splitmix64

    from packing.binpack import pack
    from packing.pack import packs_table

    t0 = time.perf_counter()
    t = pq.read_table(lengths_path, columns=["sample_id", "total_tokens"])
    sid = t.column("sample_id").combine_chunks()
    L = t.column("total_tokens").to_numpy().astype(np.int64)
    keys = splitmix64(hex_ids_to_u64(sid) ^ splitmix64(np.uint64(0)))
    P = pack(L, C, keys=keys, seed=0)
    idx = np.arange(len(L))
    table = packs_table(sid, L, idx, P, 0, P.n_bins, None)
    pq.write_table(table, out_path, compression="zstd")
    dt = time.perf_counter() - t0
    # VmHWM (the one reader every task's peak uses), not ru_maxrss: ru_maxrss survives exec and would include
    # the parent's RSS at fork.
    from ovpipe.mapreduce import vmhwm_bytes

    q.put((dt, P.n_bins, (vmhwm_bytes() or 0) / 2 ** 30))        # vmhwm_bytes: bytes; the table: GiB


def ours(L: np.ndarray, C: int, tmp: Path) -> dict:
    lp, op = tmp / "lengths.parquet", tmp / "packs.parquet"
    write_lengths(lp, L)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_ours_end_to_end, args=(str(lp), str(op), C, q))
    p.start()
    dt, bins, rss = q.get()
    p.join()
    return {"bins": bins, "seconds": dt, "peak_rss_gib": rss}


def trl_bfd_bins(L: np.ndarray, C: int) -> tuple[int | None, float, str]:
    try:
        from datasets import Dataset
        from trl import pack_dataset
    except Exception as e:  # pragma: no cover - depends on the environment
        return None, 0.0, f"unavailable ({type(e).__name__})"
    try:  # keep the progress bar out of the results file
        from datasets.utils.logging import disable_progress_bar

        disable_progress_bar()
    except Exception:  # pragma: no cover
        pass
    ds = Dataset.from_dict({"input_ids": [[1] * int(x) for x in L]})
    t0 = time.perf_counter()
    packed = pack_dataset(ds, seq_length=C, strategy="bfd")
    dt = time.perf_counter() - t0
    return len(packed), dt, ""


def row(name, bins, lb, C, tokens, n, seconds, extra=""):
    fill = tokens / (bins * C) if bins else float("nan")
    rate = n / seconds if seconds else float("nan")
    return f"| {name} | {bins} | {bins / lb:.6f} | {fill:.4%} | {rate:,.0f} | {extra} |"


def main(argv: list[str] | None = None) -> int:
    from packing.binpack import ffd_bins, lower_bound, online_buffer_bins

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv or [])
    n1 = 100_000 if a.quick else 1_000_000
    dists = [("demo-like", demo_like(20_000 if a.quick else 200_000), 1024, True),
             (f"realistic {n1:,}", realistic(n1), 8192, True),
             (f"lognormal {n1:,}", lognormal(n1, 8192), 8192, True),
             (f"half-capacity {n1:,}", half_capacity(n1, 8192), 8192, True)]
    if not a.quick:
        dists.append(("realistic 10,000,000", realistic(10_000_000, seed=1), 8192, False))
    with tempfile.TemporaryDirectory() as td:
        for name, L, C, peers in dists:
            tokens, n, lb = int(L.sum()), len(L), lower_bound(L, C)
            print(f"\n### {name} (seq_len {C}, {n:,} samples, lower bound {lb:,} bins)")
            print("| packer | bins | bins / LB | fill | samples/s | note |\n| --- | ---: | ---: | ---: | ---: | --- |")
            o = ours(L, C, Path(td))
            print(row("ovpipe (lengths.parquet → packs.parquet)", o["bins"], lb, C, tokens, n, o["seconds"],
                      f"{o['seconds']:.2f} s, peak RSS {o['peak_rss_gib']:.2f} GiB"), flush=True)
            if not peers:
                continue
            from packing.binpack import pack

            t0 = time.perf_counter()
            b = pack(L, C, refine_passes=12).n_bins
            print(row("ovpipe + refine_passes=12 (in-process solve)", b, lb, C, tokens, n, time.perf_counter() - t0),
                  flush=True)
            t0 = time.perf_counter()
            b = ffd_bins(L, C)
            print(row("first-fit-decreasing", b, lb, C, tokens, n, time.perf_counter() - t0), flush=True)
            t0 = time.perf_counter()
            b = online_buffer_bins(L, C, 512)
            print(row("online buffer B=512", b, lb, C, tokens, n, time.perf_counter() - t0,
                      f"padding ×{(b * C - tokens) / max(o['bins'] * C - tokens, 1):.1f} ours"), flush=True)
            sub = L[:20_000 if a.quick else 100_000]
            tb, tdt, note = trl_bfd_bins(sub, C)
            if tb is None:
                print(f"| TRL pack_dataset bfd | – | – | – | – | {note} |")
            else:
                from packing.binpack import pack

                ob = pack(sub, C).n_bins
                print(row(f"TRL pack_dataset bfd ({len(sub):,} subset)", tb, lower_bound(sub, C), C, int(sub.sum()),
                          len(sub), tdt, f"ovpipe on the same subset: {ob} bins"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
