"""Curation benchmarks.

    python -m bench.bench_curation            # assign 100K × 50K, d=512, K=10; balance 10M × K=10 over 500K
    python -m bench.bench_curation --quick    # 20K × 10K; 1M samples
    python -m bench.bench_curation --gpu      # on one GPU: embed-images and assign vs the model / GEMM floor
                                              # (bench.bench_curation_gpu; its --help)

``assign``: queries/s of the tiled torch path vs faiss-cpu ``IndexFlatIP`` on the same inputs, and
each against the *matmul floor* = 2·n·V·d FLOPs / the best GEMM throughput measured in this process,
right before (and again right after) the timed runs, on products shaped like the real tiles: the
torch path's (image_tile × d) @ (d × concept_tile) and faiss's blocked sgemm (4096 queries × 1024
database vectors, ``distance_compute_blas_{query,database}_bs``), each through torch's BLAS and
numpy's, several repetitions each. The best of all probes is the floor (a path at ≥ 1.0× is no faster
than pure BLAS); the table prints the probes' spread (min / median / max GFLOP/s), which on a shared
machine says how much to trust a ratio. (One probe of one shape swung 147 → 58 GFLOP/s between two
runs and made faiss look faster than the floor.)
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


TORCH_TILE = (4096, 16384)      # (image_tile, concept_tile) of the timed torch run
FAISS_TILE = (4096, 1024)       # faiss IndexFlatIP: distance_compute_blas_query_bs × _database_bs


def gemm_probes(d: int, reps: int = 5) -> list[tuple[str, float]]:
    """GFLOP/s of (m × d) @ (d × n) products shaped like the real tiles, through torch's and numpy's
    BLAS, ``reps`` timed repetitions each after one warm-up: ``[(label, GFLOP/s), ...]``."""
    import torch

    out = []
    rng = np.random.default_rng(1)
    for name, (m, n) in (("torch tile", TORCH_TILE), ("faiss block", FAISS_TILE)):
        a = rng.standard_normal((m, d), dtype=np.float32)
        b = rng.standard_normal((d, n), dtype=np.float32)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        for lib, mm in (("torch", lambda: ta @ tb), ("numpy", lambda: a @ b)):
            mm()
            for _ in range(reps):
                t0 = time.perf_counter()
                mm()
                out.append((f"{name} {m}×{d}×{n} ({lib})", 2 * m * d * n / (time.perf_counter() - t0) / 1e9))
    return out


def _spread(probes: list[tuple[str, float]]) -> str:
    rows = []
    for label in dict.fromkeys(lbl for lbl, _ in probes):
        g = sorted(v for lbl, v in probes if lbl == label)
        rows.append(f"| {label} | {len(g)} | {g[0]:.1f} | {g[len(g) // 2]:.1f} | {g[-1]:.1f} |")
    return "\n".join(rows)


def bench_assign(n: int, V: int, d: int, k: int) -> None:
    import torch

    from curation.assign import topk_faiss, topk_torch

    rng = np.random.default_rng(0)
    X, C = _unit(rng, n, d), _unit(rng, V, d)
    print(f"\n### assign: {n:,} images × {V:,} concepts, d={d}, K={k} (torch threads {torch.get_num_threads()})")
    before = gemm_probes(d)
    runs = []
    t0 = time.perf_counter()
    s1, i1 = topk_torch(X, C, k, image_tile=TORCH_TILE[0], concept_tile=TORCH_TILE[1])
    runs.append((f"torch matmul+topk (tiled {TORCH_TILE[0]} × {TORCH_TILE[1]})", time.perf_counter() - t0))
    t0 = time.perf_counter()
    s2, i2 = topk_faiss(X, C, k)
    runs.append(("faiss-cpu IndexFlatIP", time.perf_counter() - t0))
    after = gemm_probes(d)
    best = max(v for _, v in before + after)
    floor = 2 * n * V * d / (best * 1e9)
    print(f"matmul floor: best GEMM probe {best:.1f} GFLOP/s → {floor:.2f} s ({n / floor:,.0f} queries/s)\n")
    print("| backend | seconds | queries/s | × floor |\n| --- | ---: | ---: | ---: |")
    for name, dt in runs:
        print(f"| {name} | {dt:.2f} | {n / dt:,.0f} | {dt / floor:.2f} |")
    print(f"\nsame ids: {(i1 == i2).mean():.5f} of entries (the rest are float ties)")
    print("\nGEMM probes, GFLOP/s (before the timed runs):\n\n| probe | reps | min | median | max |\n"
          "| --- | ---: | ---: | ---: | ---: |\n" + _spread(before))
    print("\n(after the timed runs):\n\n| probe | reps | min | median | max |\n| --- | ---: | ---: | ---: | ---: |\n"
          + _spread(after), flush=True)


def _balance_child(n, V, k, q):
    from curation.concept_balance import BalanceConfig, balance, uniform_draws
    from manifests.ids import splitmix64
    from ovpipe.mapreduce import vmhwm_bytes
    import pyarrow as pa

    rng = np.random.default_rng(0)
    concepts = (rng.zipf(1.1, size=(n, k)) - 1) % V
    ids = pa.array(np.char.mod("%016x", splitmix64(np.arange(n, dtype=np.uint64))).astype(str))
    t0 = time.perf_counter()
    u = uniform_draws(ids, 0)
    w, copies, before, after, _ = balance(concepts, u, V, BalanceConfig())
    dt = time.perf_counter() - t0
    q.put((dt, (vmhwm_bytes() or 0) / 1024 ** 3, int(copies.sum())))


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
    if argv and "--gpu" in argv:
        from bench.bench_curation_gpu import main as gpu_main

        return gpu_main(argv)
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
