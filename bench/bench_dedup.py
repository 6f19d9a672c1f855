"""``dedup`` at scale on the CPU, beside a brute-force reference; the alignment step's text tower rate.

1. **The step**: ``--rows`` × ``--dim`` random-but-clustered unit vectors (``--rows / 500`` centres, each
   row ``normalize(centre + 0.45·noise/√dim)``: neighbours at cosine ≈ 0.83, like photos of the same kind)
   with ``--planted`` of them copied at cosine 0.97–0.995 (resize / recompression / crop), written as an
   ``embed-images`` run (fp16 ``.npy`` shards + manifests) and deduplicated by ``ovpipe dedup`` through
   the local executor (``--tasks``, ``--workers``): wall time, CPU time, each task's peak memory (what it
   recorded: ``peak_rss_bytes/*``), and precision / recall of the planted pairs.
2. **Brute force on a subset**: the first ``--subset`` rows (canonical order) through ``dedup_vectors``
   (k-means + pairwise inside clusters, the step's computation in memory) and through the same greedy keep
   over *every* pair of the subset (blockwise matmul): the pairs each finds, and the time of each.
3. **Alignment** (``--align``): the text tower of open_clip ``ViT-H-14`` (MetaCLIP's; random init) on
   77-token captions: FLOPs per caption (torch FlopCounterMode) and CPU seconds per caption, the rates
   ``bench_scale``'s projection uses (``--dedup-json``).

    python -m bench.bench_dedup --rows 1000000 --dim 1024 --subset 50000 --json bench/results/bench_dedup.json
    python -m bench.bench_dedup --quick
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

GIB = 1 << 30


def _unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def clustered(n: int, d: int, planted: int, seed: int = 0, chunk: int = 65536):
    """(vectors fp16 [n, d] memory-mapped under a temp file, area int64[n], {copy row: original row}):
    clustered rows, the last ``planted`` copies of earlier ones (smaller, as a resize or crop leaves them)."""
    rng = np.random.default_rng(seed)
    centres = _unit(rng.normal(size=(max(1, n // 500), d))).astype(np.float32)
    base = n - planted
    out = np.empty((n, d), np.float16)
    for a in range(0, base, chunk):
        b = min(a + chunk, base)
        c = rng.integers(0, len(centres), b - a)
        out[a:b] = _unit(centres[c] + rng.normal(size=(b - a, d)).astype(np.float32) * (0.45 / np.sqrt(d)))
    src = rng.choice(base, planted, replace=False)
    for a in range(0, planted, chunk):
        s = src[a:a + chunk]
        x = out[s].astype(np.float32)
        x = _unit(x)
        noise = rng.normal(size=x.shape).astype(np.float32)
        noise = _unit(noise - (noise * x).sum(1, keepdims=True) * x)
        cos = rng.uniform(0.97, 0.995, len(s)).astype(np.float32)[:, None]
        out[base + a:base + a + len(s)] = x * cos + noise * np.sqrt(1 - cos ** 2)
    area = np.r_[np.full(base, 10_000), np.full(planted, 2_500)].astype(np.int64)
    return out, area, {base + k: int(o) for k, o in enumerate(src)}


def write_run(run: Path, vectors: np.ndarray, area: np.ndarray, parts: int, seed: int = 0) -> np.ndarray:
    """``run/ingest/samples`` + ``run/embed-images`` as the steps leave them; returns the row of each sample
    in canonical order (the sample ids are random, so canonical order is a permutation of the rows)."""
    import pyarrow as pa

    from curation.embed import EmbedImagesConfig
    from manifests.ids import u64_to_hex
    from manifests.io import write_part
    from manifests.schemas import schema_for
    from ovpipe.config import config_json

    n = len(vectors)
    rng = np.random.default_rng(seed + 1)
    ids = np.unique(rng.integers(0, 2**63, int(n * 1.01), dtype=np.int64).astype(np.uint64))[:n]
    rows_in_order = rng.permutation(n)  # canonical position p (id ids[p], ids sorted) holds vector row rows_in_order[p]
    emb = run / "embed-images"
    (emb / "data").mkdir(parents=True, exist_ok=True)
    for k, idx in enumerate(np.array_split(np.arange(n), parts)):
        file = f"embed-images/data/emb-{k:05d}.npy"
        np.save(run / file, vectors[rows_in_order[idx]])
        m = len(idx)
        sid = u64_to_hex(ids[idx])
        w = area[rows_in_order[idx]].astype(np.int32)
        smp = {f.name: pa.nulls(m, f.type) for f in schema_for("samples")}
        smp.update({"sample_id": sid, "source": pa.array(["bench"] * m), "width": pa.array(w),
                    "height": pa.array(np.ones(m, np.int32)), "caption": pa.array(["x"] * m),
                    "category": pa.array(["caption"] * m), "status": pa.array(["ok"] * m)})
        write_part(pa.table(smp), run / "ingest" / "samples" / f"part-{k:05d}.parquet", "samples")
        write_part({"sample_id": sid, "file": pa.array([file] * m), "row": pa.array(np.arange(m, dtype=np.int32)),
                    "status": pa.array(["ok"] * m), "error": pa.nulls(m, pa.string())},
                   emb / "image_embeddings" / f"part-{k:05d}.parquet", "image_embeddings")
    (emb / "config.json").write_text(config_json(EmbedImagesConfig()))
    (emb / "executor.json").write_text(json.dumps({"step": "embed-images", "tasks": parts, "config_hash": "bench",
                                                   "outputs": ["image_embeddings"]}))
    (emb / "completions").mkdir(exist_ok=True)
    (emb / "completions" / "finalized").touch()
    return ids, rows_in_order


def pair_scores(found: dict[int, int], truth: dict[int, int]) -> dict:
    truth_pairs = {frozenset(p) for p in truth.items()}
    hit = sum(frozenset(p) in truth_pairs for p in found.items())
    return {"marked": len(found), "planted": len(truth), "hit": hit,
            "precision": round(hit / len(found), 4) if found else None,
            "recall": round(hit / len(truth), 4) if truth else None}


def step_figures(run: Path, ids, rows_in_order, truth, a) -> dict:
    from bench.bench_scale import run_step
    from manifests import read_manifest

    sdir = run / "dedup"
    argv = ["dedup", "--run-dir", str(run), "--tasks", str(a.tasks), "--workers", str(a.workers), "--quiet",
            "--set", f"cluster_rows={a.cluster_rows}", "--set", f"eps={a.eps}", "--set", "report_pairs=0"]
    r = run_step(argv, sdir, run / "dedup.log", int(a.guard_gib * GIB), 0.1)
    if r["rc"]:
        raise SystemExit(f"dedup failed: {r['log_tail']}")
    t = read_manifest(run, "dedup", columns=["sample_id", "duplicate_of", "status"])
    from manifests.ids import hex_ids_to_u64

    dup = np.flatnonzero(np.asarray(t.column("status").to_pylist(), object) == "near_duplicate")
    sid = hex_ids_to_u64(t.column("sample_id").take(dup))
    of = hex_ids_to_u64(t.column("duplicate_of").take(dup))
    pos = {int(s): p for p, s in enumerate(ids.tolist())} if len(ids) <= 2_000_000 else None
    found = {int(rows_in_order[pos[int(x)]]): int(rows_in_order[pos[int(y)]]) for x, y in zip(sid, of)}
    stats = json.loads((sdir / "stats.json").read_text())
    cpu = sum(x["cpu_s"] or 0 for x in r["tasks"]) + ((r["finalize"] or {}).get("cpu_s") or 0)
    by_phase = {}
    for x in r["tasks"]:
        ph = by_phase.setdefault(x["phase"], {"tasks": 0, "peak_bytes": 0, "wall_s": 0.0})
        ph["tasks"] += 1
        ph["peak_bytes"] = max(ph["peak_bytes"], x["peak_bytes"] or 0)
        ph["wall_s"] = max(ph["wall_s"], x["wall_s"] or 0)
    return {"wall_s": r["wall_s"], "cpu_s": round(cpu, 1), "phases": by_phase, "timings_s": stats["timings_s"],
            "info": stats["info"], "planted": pair_scores(found, truth), "load_end": r["load_end"]}


def brute_force(x: np.ndarray, area: np.ndarray, a) -> dict:
    """The subset through ``dedup_vectors`` (clusters) and through every pair (no clusters), same greedy keep."""
    from curation.dedup import DedupConfig, dedup_vectors, greedy_keep, similar_pairs

    cfg = DedupConfig(eps=a.eps, report_eps=[a.eps], cluster_rows=a.cluster_rows)
    x = _unit(x.astype(np.float32))
    similar_pairs(x[:8], 0.5)              # torch and faiss imported before either clock starts
    t0 = time.perf_counter()
    _, dup_of, _, _ = dedup_vectors(x, area, cfg)
    t_dedup = time.perf_counter() - t0
    t0 = time.perf_counter()
    order = np.lexsort((np.arange(len(x)), -area))           # the keep order over the whole subset
    i, j, s = similar_pairs(x[order], 1 - a.eps, cfg.block_rows)
    d, _ = greedy_keep(len(x), i, j, s, 1 - a.eps)
    ref = np.full(len(x), -1, np.int64)
    ref[order[d >= 0]] = order[d[d >= 0]]
    t_brute = time.perf_counter() - t0
    got = {(int(p), int(q)) for p, q in zip(np.flatnonzero(dup_of >= 0), dup_of[dup_of >= 0])}
    want = {(int(p), int(q)) for p, q in zip(np.flatnonzero(ref >= 0), ref[ref >= 0])}
    return {"rows": len(x), "dedup_s": round(t_dedup, 2), "brute_s": round(t_brute, 2),
            "pairs_brute": len(want), "pairs_dedup": len(got), "same": len(got & want),
            "only_dedup": len(got - want), "only_brute": len(want - got)}


def nearest_rate(dim: int, rows: int = 16384, k: int = 4096, reps: int = 2) -> dict:
    """Seconds per (row × centroid) of the reduce's nearest-centroid search (faiss ``IndexFlatIP``), the part
    of its streaming pass that grows with k: ``bench_scale`` scales it by N·k, the rest by N."""
    from curation.dedup import nearest

    rng = np.random.default_rng(0)
    cents = _unit(rng.normal(size=(k, dim)).astype(np.float32))
    x = _unit(rng.normal(size=(rows, dim)).astype(np.float32))
    nearest(cents, x[:256])
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        nearest(cents, x)
        ts.append(time.perf_counter() - t0)
    return {"rows": rows, "centroids": k, "s": min(ts), "s_per_row_centroid": min(ts) / (rows * k),
            "load": os.getloadavg()[0]}


def text_tower_figures(batch: int = 16, reps: int = 2, threads: int = 2) -> dict:
    """FLOPs per 77-token caption of open_clip ViT-H-14's text tower and its CPU time per caption."""
    import open_clip
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = open_clip.create_model("ViT-H-14", pretrained=None).eval()
    del model.visual
    tok = torch.randint(1, 49000, (batch, 77))
    fc = FlopCounterMode(display=False)
    with fc:                      # autograd on: the fused attention path under inference_mode is not counted
        model.encode_text(tok[:1])
    ts = []
    with torch.inference_mode():
        model.encode_text(tok)
        for _ in range(reps):
            t0 = time.perf_counter()
            model.encode_text(tok)
            ts.append((time.perf_counter() - t0) / batch)
    return {"model": "open_clip ViT-H-14 text tower (random init), 77 tokens, fp32", "threads": threads,
            "flops_per_caption": int(fc.get_total_flops()), "cpu_s_per_caption": min(ts), "batch": batch}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--planted", type=float, default=0.05, help="share of rows that are planted copies")
    ap.add_argument("--subset", type=int, default=50_000)
    ap.add_argument("--eps", type=float, default=0.05)
    ap.add_argument("--cluster-rows", type=int, default=10_000)
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--parts", type=int, default=8)
    ap.add_argument("--guard-gib", type=float, default=14.0)
    ap.add_argument("--align", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--work", type=Path, default=Path("runs/bench-dedup"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true", help="100K × 256, a 10K subset, no text tower")
    ap.add_argument("--rates-into", type=Path, help="measure only the nearest-centroid rate (and the text tower, "
                    "with --align) and add them to this saved --json")
    a = ap.parse_args(argv or [])
    if a.quick:
        a.rows, a.dim, a.subset, a.cluster_rows, a.align = 100_000, 256, 10_000, 5_000, False
    if a.rates_into:
        saved = json.loads(a.rates_into.read_text())
        saved["nearest"] = nearest_rate(saved["dim"])
        print(f"nearest centroid: {saved['nearest']['s_per_row_centroid'] * 1e9:.2f} ns per row × centroid "
              f"(d={saved['dim']}, load {saved['nearest']['load']:.1f})")
        if a.align:
            saved["text_tower"] = text_tower_figures()
        a.rates_into.write_text(json.dumps(saved, indent=1, default=str) + "\n")
        return 0
    print(f"bench_dedup: {a.rows:,} × {a.dim}, {a.planted:.0%} planted, subset {a.subset:,}, ε = {a.eps}, "
          f"cluster_rows {a.cluster_rows}, {a.tasks} tasks / {a.workers} workers, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    run = a.work.resolve() / f"run-{a.rows}x{a.dim}"
    shutil.rmtree(run, ignore_errors=True)
    t0 = time.perf_counter()
    vectors, area, truth = clustered(a.rows, a.dim, int(a.rows * a.planted))
    ids, rows_in_order = write_run(run, vectors, area, a.parts)
    print(f"synthesised in {time.perf_counter() - t0:.0f} s", flush=True)
    from curation.dedup import DedupConfig

    dflt = DedupConfig()
    out = {"rows": a.rows, "dim": a.dim, "eps": a.eps, "cluster_rows": a.cluster_rows, "tasks": a.tasks,
           "train_per_cluster": dflt.train_per_cluster, "max_train_rows": dflt.max_train_rows,
           "workers": a.workers, "cpus": os.cpu_count(), "load_start": os.getloadavg()[0]}
    out["step"] = step_figures(run, ids, rows_in_order, truth, a)
    out["nearest"] = nearest_rate(a.dim)
    s = out["step"]
    print(f"\n| dedup step, {a.rows:,} × {a.dim} | wall s | CPU s | CPU µs / row | peak GiB (map / reduce / apply) | "
          f"planted pairs: precision / recall |\n| --- | ---: | ---: | ---: | --- | --- |")
    peaks = " / ".join(f"{s['phases'].get(p, {}).get('peak_bytes', 0) / GIB:.2f}" for p in ("map", "reduce", "apply"))
    print(f"| {a.tasks} tasks, {a.workers} workers | {s['wall_s']:.0f} | {s['cpu_s']:.0f} | "
          f"{s['cpu_s'] / a.rows * 1e6:.0f} | {peaks} | {s['planted']['precision']} / {s['planted']['recall']} |")
    print(f"reduce timings: {s['timings_s']}; {s['info'].get('clusters')} clusters, largest "
          f"{s['info'].get('largest_cluster')}", flush=True)
    # the subset: the first rows of the canonical order (a random sample of the clusters)
    sub_rows = rows_in_order[:a.subset]
    out["subset"] = brute_force(vectors[sub_rows], area[sub_rows], a)
    b = out["subset"]
    print(f"\n| {b['rows']:,}-row subset | seconds | pairs found |\n| --- | ---: | ---: |\n"
          f"| brute force: every pair, one greedy keep | {b['brute_s']} | {b['pairs_brute']} |\n"
          f"| dedup: k-means, pairs inside clusters | {b['dedup_s']} ({b['brute_s'] / max(b['dedup_s'], 1e-9):.1f}× "
          f"faster) | {b['pairs_dedup']}: {b['same']} the same, {b['only_dedup']} only here, "
          f"{b['only_brute']} only in brute force |", flush=True)
    if a.align:
        out["text_tower"] = text_tower_figures()
        t = out["text_tower"]
        print(f"\nalign's text tower ({t['model']}): {t['flops_per_caption'] / 1e9:.1f} GFLOPs per caption, "
              f"{t['cpu_s_per_caption'] * 1e3:.0f} ms per caption on {t['threads']} CPU threads (batch {t['batch']})")
    out["load_end"] = os.getloadavg()[0]
    if a.json:
        a.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
    del vectors
    shutil.rmtree(run, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
