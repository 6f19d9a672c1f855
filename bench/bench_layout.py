"""The map's 2-D layout: the ``index`` step's k-means + PCA against UMAP (umap-learn) and openTSNE, on N unit
vectors of 1024 dims around 2,000 random centres (as ``bench_index`` makes them), each method in a fresh process.

Per method and N: wall time (k-means + PCA split into training and placing every row), the process' peak memory
with the input in it (N × 1024 fp32 for UMAP and openTSNE, which hold it whole; fp16 for k-means + PCA, which
streams it), and what the map keeps, from 2,000 sampled points:

* kNN@10 kept — the share of a point's 10 nearest neighbours in 1024-d (exact cosine) among its 10 nearest on
  the map: local neighbourhoods;
* same centre — the share of its 10 map neighbours drawn around its own centre (its 1024-d neighbours' share
  beside it): clusters kept apart;
* global ρ — Spearman's ρ between 1024-d cosine distance and map distance over 20,000 random pairs: the
  arrangement of clusters.

    make install-layout        # umap-learn, openTSNE (requirements/layout.txt; not in the default install)
    .venv/bin/python -m bench.bench_layout --rows 30000 100000 --kmeans-rows 1000000 \\
        --out bench/results/bench_layout.txt

CPU time at 1M and 85M is projected from the largest measured size (``project``): k-means + PCA by its
arithmetic (training on ≤ ``train_rows`` rows × √N centroids, placing N rows × √N centroids); UMAP and openTSNE
as N log N (an approximate kNN graph, then a fixed number of epochs or iterations over it).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import resource
import subprocess
import sys
import time

import numpy as np

METHODS = ("kmeans-pca", "kmeans-tsne", "umap", "opentsne")
CENTRES, SAMPLED, PAIRS, K = 2000, 2000, 20_000, 10
# One thread for UMAP and openTSNE: on the shared 2-core machine (load ≈ 10) openTSNE took 60 s wall / 22 s CPU on
# one thread and 95 s / 39 s on two for 6,000 rows. k-means + PCA runs faiss as the step does (its threads).
THREADS = 1


def vectors(n: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(N unit vectors as fp16, the centre each was drawn around), made in blocks."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((CENTRES, dim)).astype(np.float32)
    label = rng.integers(0, CENTRES, n)
    x = np.empty((n, dim), np.float16)
    for a in range(0, n, 50_000):
        b = min(n, a + 50_000)
        v = centres[label[a:b]] + 0.9 * rng.standard_normal((b - a, dim), np.float32)
        x[a:b] = v / np.linalg.norm(v, axis=1, keepdims=True)
    return x, label


def kmeans_layout(x: np.ndarray, projection: str = "pca") -> tuple[np.ndarray, dict]:
    """The index step's own layout (``curation.index``): k-means on its training draw, PCA of the centroids, each
    row placed by its centroid and its own shrunk offset — rows streamed in blocks, as the step's reduce does.
    ``projection="tsne"``: the centroids (√N of them: seconds whatever N) laid out by openTSNE instead, on the
    PCA's scale, each row at its centroid's place plus its own PCA offset from it, shrunk the same."""
    from curation.dedup import nearest
    from curation.index import IndexConfig, layout, train

    cfg = IndexConfig(kind="flat")                  # the layout alone: the flat index trains nothing
    n = len(x)
    pick = np.sort(np.random.default_rng(1).choice(n, max(1, round(cfg.train_fraction(n) * n)), replace=False))
    t, cpu = time.perf_counter(), time.process_time()
    _, cents, pca = train(np.asarray(x[pick], np.float32), n, cfg)
    p_cents = pca.apply_py(cents)
    if projection == "tsne":
        from openTSNE import TSNE

        at = np.asarray(TSNE(perplexity=min(30.0, (len(cents) - 1) / 3), metric="cosine", n_jobs=THREADS,
                             random_state=0).fit(cents), np.float32)
        at *= p_cents.std() / at.std()
    split = {"train_s": time.perf_counter() - t, "train_cpu_s": time.process_time() - cpu, "clusters": len(cents),
             "train_rows": len(pick)}
    t, cpu = time.perf_counter(), time.process_time()
    xy = np.empty((n, 2), np.float32)
    for a in range(0, n, cfg.batch_rows):
        v = np.asarray(x[a:a + cfg.batch_rows], np.float32)
        c = nearest(cents, v)
        xy[a:a + len(v)] = (layout(pca, cents, c, v, cfg.spread) if projection == "pca" else
                            at[c] + cfg.spread * (pca.apply_py(v) - p_cents[c]))
    split["place_s"], split["place_cpu_s"] = time.perf_counter() - t, time.process_time() - cpu
    return xy, split


def umap_layout(x: np.ndarray) -> tuple[np.ndarray, dict]:
    """umap-learn as its docs set it up for embeddings: 15 neighbours by cosine, 2 components; seeded, so one
    thread (``THREADS``)."""
    import umap

    x = np.asarray(x, np.float32)
    xy = umap.UMAP(n_neighbors=15, min_dist=0.1, metric="cosine", random_state=0).fit_transform(x)
    return np.asarray(xy, np.float32), {}


def warm_umap() -> float:
    """Seconds of umap-learn's first call in a process (numba compiles its functions): kept out of the figure."""
    import umap

    t = time.perf_counter()
    umap.UMAP(n_neighbors=15, metric="cosine", random_state=0).fit_transform(np.random.default_rng(0).random((600, 8)))
    return time.perf_counter() - t


def opentsne_layout(x: np.ndarray) -> tuple[np.ndarray, dict]:
    """openTSNE's defaults (perplexity 30, 250 + 500 iterations, FFT gradients above 10K rows), cosine."""
    from openTSNE import TSNE

    x = np.asarray(x, np.float32)
    xy = TSNE(n_components=2, perplexity=30, metric="cosine", n_jobs=THREADS, random_state=0).fit(x)
    return np.asarray(xy, np.float32), {}


def quality(x: np.ndarray, label: np.ndarray, xy: np.ndarray) -> dict:
    """kNN@10 kept, same-centre share (map and 1024-d), global ρ — over ``SAMPLED`` points (module docstring)."""
    import faiss
    from scipy.stats import spearmanr

    rng = np.random.default_rng(2)
    n = len(x)
    q_at = rng.choice(n, min(SAMPLED, n), replace=False)
    q = np.asarray(x[q_at], np.float32)
    best_s = np.full((len(q), 0), -np.inf, np.float32)
    best_i = np.full((len(q), 0), -1, np.int64)
    for a in range(0, n, 50_000):                  # exact 1024-d neighbours, in blocks of the fp16 rows
        block = np.asarray(x[a:a + 50_000], np.float32)
        pos = np.arange(a, a + len(block))
        s = q @ block.T
        s[q_at[:, None] == pos[None, :]] = -np.inf
        s = np.concatenate([best_s, s], 1)
        i = np.concatenate([best_i, np.broadcast_to(pos, (len(q), len(pos)))], 1)
        top = np.argpartition(-s, K - 1, 1)[:, :K]
        best_s, best_i = np.take_along_axis(s, top, 1), np.take_along_axis(i, top, 1)
    flat = faiss.IndexFlatL2(2)
    flat.add(np.ascontiguousarray(xy, np.float32))
    _, near = flat.search(np.ascontiguousarray(xy[q_at], np.float32), K + 1)
    on_map = [[p for p in row if p != self][:K] for row, self in zip(near, q_at)]
    kept = np.mean([len(set(m) & set(h)) / K for m, h in zip(on_map, best_i.tolist())])
    same_map = np.mean([np.mean(label[m] == label[s]) for m, s in zip(on_map, q_at)])
    same_hi = np.mean(label[best_i] == label[q_at][:, None])
    a, b = rng.integers(0, n, PAIRS), rng.integers(0, n, PAIRS)
    cos = np.einsum("ij,ij->i", np.asarray(x[a], np.float32), np.asarray(x[b], np.float32))
    rho = spearmanr(1 - cos, np.linalg.norm(xy[a] - xy[b], axis=1)).statistic
    return {"knn_kept": float(kept), "same_centre_map": float(same_map), "same_centre_1024": float(same_hi),
            "global_rho": float(rho)}


def one(method: str, rows: int, dim: int) -> dict:
    """In this (fresh) process: make the vectors, lay them out, the figures."""
    x, label = vectors(rows, dim)
    warm = {"first_call_s": warm_umap()} if method == "umap" else {}
    if "tsne" in method:
        import openTSNE  # noqa: F401  (its import, 10 s on the loaded machine, is not the method's time)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t, cpu = time.perf_counter(), time.process_time()
    xy, split = {"kmeans-pca": kmeans_layout, "kmeans-tsne": lambda v: kmeans_layout(v, "tsne"),
                 "umap": umap_layout, "opentsne": opentsne_layout}[method](x)
    out = {"method": method, "rows": rows, "wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - cpu,
           **split, **warm,
           "input_mib": x.nbytes / 2**20 * (1 if method.startswith("kmeans") else 2), "rss_before_mib": before,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    return {**out, **quality(x, label, xy)}


def project(method: str, got: list[dict], to: int) -> float:
    """CPU seconds at ``to`` rows from the measured sizes (module docstring): CPU time, as the wall time on the
    shared machine moves with its load."""
    from curation.index import IndexConfig

    if method.startswith("kmeans"):
        cfg, r = IndexConfig(), max(got, key=lambda g: g["rows"])
        n0, k0, k1 = r["rows"], math.sqrt(r["rows"]), math.sqrt(to)
        train = r["train_cpu_s"] * min(cfg.train_rows, cfg.train_per_list * k1) * k1 / (r["train_rows"] * k0)
        return train + r["place_cpu_s"] * (to * k1) / (n0 * k0)
    big = max(got, key=lambda g: g["rows"])
    return big["cpu_s"] * to * math.log(to) / (big["rows"] * math.log(big["rows"]))


def slope(small: dict, big: dict) -> float:
    return math.log(big["cpu_s"] / small["cpu_s"]) / math.log(big["rows"] / small["rows"])


def hours(s: float) -> str:
    return f"{s:,.0f} s" if s < 3600 else f"{s / 3600:,.1f} h"


def table(results: list[dict]) -> str:
    """The measured rows, then the projections, from ``one``'s results (with the load each ran at)."""
    got: dict[str, list[dict]] = {}
    lines = ["| method | rows | load | wall s | CPU s | peak MiB (input) | kNN@10 kept | same centre: map (1024-d) "
             "| global ρ |", "| --- " * 9 + "|"]
    for r in results:
        method = r["method"]
        got.setdefault(method, []).append(r)
        split = (f" (train {r['train_s']:.0f} + place {r['place_s']:.0f})" if method.startswith("kmeans") else
                 f" (+ {r['first_call_s']:.0f} first call)" if "first_call_s" in r else "")
        lines.append(f"| {method} | {r['rows']:,} | {r['load']:.0f} | {r['wall_s']:,.0f}{split} "
                     f"| {r['cpu_s']:,.0f} | {r['peak_rss_mib']:,.0f} "
                     f"({r['input_mib']:,.0f}) | {r['knn_kept']:.3f} | {r['same_centre_map']:.3f} "
                     f"({r['same_centre_1024']:.3f}) | {r['global_rho']:.2f} |")
    lines += ["", "| method | projected CPU time at 1M | at 85M | from |", "| --- " * 4 + "|"]
    for method, rs in got.items():
        basis = "its arithmetic, from the largest N"
        if not method.startswith("kmeans"):
            basis = "N log N from the largest N"
            if len(rs) > 1:
                basis += (f" (the two sizes measured N^{slope(*sorted(rs, key=lambda g: g['rows'])[-2:]):.2f}: "
                          f"the smaller one's share of one-off costs flattens it)")
        lines.append(f"| {method} | {hours(project(method, rs, 1_000_000))} "
                     f"| {hours(project(method, rs, 85_000_000))} | {basis} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[10_000, 30_000])
    ap.add_argument("--kmeans-rows", type=int, nargs="*", default=[100_000, 1_000_000],
                    help="k-means + PCA alone at these")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="3,000 and 6,000 rows of 64 dims")
    ap.add_argument("--out", help="also write the table here")
    ap.add_argument("--from-logs", nargs="+", metavar="LOG",
                    help="the table from the JSON lines earlier runs printed (methods run side by side)")
    ap.add_argument("--one", nargs=2, metavar=("METHOD", "ROWS"), help=argparse.SUPPRESS)   # internal: as JSON
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.dim)))
        return 0
    if args.quick:
        args.rows, args.kmeans_rows, args.dim = [3_000, 6_000], [], 64
    needs = {"umap": "umap", "opentsne": "openTSNE", "kmeans-tsne": "openTSNE"}
    missing = [m for m in args.methods if m in needs and importlib.util.find_spec(needs[m]) is None]
    if missing:
        print(f"{', '.join(missing)}: left out, not installed (make install-layout)", flush=True)
        args.methods = [m for m in args.methods if m not in missing]
    results = []
    if args.from_logs:
        for log in args.from_logs:
            with open(log) as f:
                results += [json.loads(line) for line in f if line.startswith("{")]
    else:
        runs = [(m, n) for n in args.rows for m in args.methods]
        runs += [(m, n) for n in args.kmeans_rows for m in args.methods if m.startswith("kmeans")]
        for method, rows in runs:
            cmd = [sys.executable, "-m", "bench.bench_layout", "--one", method, str(rows), "--dim", str(args.dim)]
            load = os.getloadavg()[0]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
            results.append({**json.loads(res.stdout.splitlines()[-1]), "load": load})
            print(json.dumps(results[-1]), flush=True)
    text = table(results)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
