"""Curation benchmarks.

    python -m bench.bench_curation            # assign 100K × 50K, d=512, K=10; balance 10M × K=10 over 500K
    python -m bench.bench_curation --quick    # 20K × 10K; 1M samples

``assign``: queries/s of the tiled torch path vs faiss-cpu ``IndexFlatIP`` on the same inputs,
and the *matmul floor* = 2·n·V·d FLOPs / the GEMM GFLOP/s measured here on one
(4096 × d) @ (d × 8192) fp32 product — how close each path gets to pure BLAS throughput.
``balance``: wall time and peak memory (VmHWM) of the whole balance computation (counts,
weights, draws, after-counts) on Zipf(1.1)-distributed concepts.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time

import numpy as np


def _unit(rng, n, d):
    x = rng.standard_normal((n, d), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def gemm_gflops(d: int) -> float:
    import torch

    a = torch.randn(4096, d)
    b = torch.randn(d, 8192)
    a @ b
    t0 = time.perf_counter()
    reps = 5
    for _ in range(reps):
        a @ b
    dt = (time.perf_counter() - t0) / reps
    return 2 * 4096 * d * 8192 / dt / 1e9


def bench_assign(n: int, V: int, d: int, k: int) -> None:
    from curation.assign import topk_faiss, topk_torch

    rng = np.random.default_rng(0)
    X, C = _unit(rng, n, d), _unit(rng, V, d)
    gf = gemm_gflops(d)
    floor = 2 * n * V * d / (gf * 1e9)
    print(f"\n### assign: {n:,} images × {V:,} concepts, d={d}, K={k}")
    print(f"measured GEMM: {gf:.1f} GFLOP/s → matmul floor {floor:.2f} s ({n / floor:,.0f} queries/s)\n")
    print("| backend | seconds | queries/s | × floor |\n| --- | ---: | ---: | ---: |")
    t0 = time.perf_counter()
    s1, i1 = topk_torch(X, C, k, image_tile=4096, concept_tile=16384)
    dt = time.perf_counter() - t0
    print(f"| torch matmul+topk (tiled 4096 × 16384) | {dt:.2f} | {n / dt:,.0f} | {dt / floor:.2f} |", flush=True)
    t0 = time.perf_counter()
    s2, i2 = topk_faiss(X, C, k)
    dt = time.perf_counter() - t0
    print(f"| faiss-cpu IndexFlatIP | {dt:.2f} | {n / dt:,.0f} | {dt / floor:.2f} |")
    print(f"\nsame ids: {(i1 == i2).mean():.5f} of entries (the rest are float ties)")


def _balance_child(n, V, k, q):
    from curation.balance import BalanceConfig, balance, uniform_draws
    from packing.binpack import splitmix64
    import pyarrow as pa

    rng = np.random.default_rng(0)
    concepts = (rng.zipf(1.1, size=(n, k)) - 1) % V
    ids = pa.array(np.char.mod("%016x", splitmix64(np.arange(n, dtype=np.uint64))).astype(str))
    t0 = time.perf_counter()
    u = uniform_draws(ids, 0)
    w, copies, before, after, _ = balance(concepts, u, V, BalanceConfig())
    dt = time.perf_counter() - t0
    hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
    q.put((dt, hwm / 1024 ** 2, int(copies.sum())))


def bench_balance(n: int, V: int, k: int) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_balance_child, args=(n, V, k, q))
    p.start()
    dt, gib, copies = q.get()
    p.join()
    print(f"\n### balance: {n:,} samples × K={k} over a {V:,}-concept Zipf(1.1) vocabulary")
    print(f"| seconds | peak memory (process, incl. inputs) | copies drawn |\n| ---: | ---: | ---: |\n"
          f"| {dt:.2f} | {gib:.2f} GiB | {copies:,} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv or [])
    if a.quick:
        bench_assign(20_000, 10_000, 512, 10)
        bench_balance(1_000_000, 500_000, 10)
    else:
        bench_assign(100_000, 50_000, 512, 10)
        bench_balance(10_000_000, 500_000, 10)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
