"""The ``index`` step and the viewer's search by meaning at scale: N unit vectors of ``--dim`` (clustered, fp16
``.npy`` shards as ``embed-images`` writes them) → ``ovpipe index`` → the queries and the map.

    .venv/bin/python -m bench.bench_index --rows 100000 1000000 3000000 --work runs/bench-index \
        --text-tower ViT-H-14-quickgelu --browser --out bench/results/bench_index.txt

Per N: the step's wall time and its reduce's peak memory (``stats.json``), the index kind and size; then, in a
fresh process, the time to load the index, "more like this" (``EmbeddingIndex.like``: index search + exact
re-rank, k = 24) over 50 random samples — median and 95th percentile —, recall@10 against exact search over the
fp16 vectors (20 queries), the map's bodies (points and one colour: the server's first build and their size)
and, with ``--browser``, the map's first render in headless Chromium (navigation to ``window.mapReady``: the
points fetched and drawn by WebGL; warm and on a fresh server). ``--text-tower``: the time of one text query
through that open_clip model's text tower (weights left random: the architecture sets the time) padded, trimmed,
and as the viewer runs it, and the index search it adds (``--rows 0 --text-tower M [--measure RUN]``: that alone).
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SHARD_ROWS = 250_000


def write_run(work: Path, rows: int, dim: int, seed: int = 0) -> Path:
    """``embed-images`` as it leaves a run: ``image_embeddings`` parts and fp16 shards of ``SHARD_ROWS`` rows."""
    from curation.embed import EmbedImagesConfig
    from manifests.ids import u64_to_hex
    from manifests.io import write_part
    from ovpipe.config import config_json

    run = work / f"run-{rows}-{dim}"
    emb = run / "embed-images"
    parts = -(-rows // SHARD_ROWS)
    if (emb / "completions" / "finalized").exists():
        return run
    shutil.rmtree(run, ignore_errors=True)
    (emb / "data").mkdir(parents=True)
    rng = np.random.default_rng(seed)
    ids = np.unique(rng.integers(0, 2**63, rows + rows // 100 + 10, dtype=np.uint64))[:rows]   # sorted, distinct
    centres = rng.standard_normal((2000, dim)).astype(np.float32)
    for k, sl in enumerate(np.array_split(np.arange(rows), parts)):
        file = f"embed-images/data/emb-{k:05d}.npy"
        out = np.lib.format.open_memmap(run / file, mode="w+", dtype=np.float16, shape=(len(sl), dim))
        for a in range(0, len(sl), 50_000):
            b = min(len(sl), a + 50_000)
            x = centres[rng.integers(0, len(centres), b - a)] + 0.9 * rng.standard_normal((b - a, dim), np.float32)
            out[a:b] = x / np.linalg.norm(x, axis=1, keepdims=True)
        out.flush()
        del out
        write_part({"sample_id": u64_to_hex(ids[sl]), "file": [file] * len(sl),
                    "row": np.arange(len(sl), dtype=np.int32),
                    "status": ["ok"] * len(sl), "error": [None] * len(sl)},
                   emb / "image_embeddings" / f"part-{k:05d}.parquet", "image_embeddings")
    (emb / "config.json").write_text(config_json(EmbedImagesConfig(model="ovpipe-tiny-clip", pretrained="")))
    (emb / "executor.json").write_text(json.dumps({"step": "embed-images", "tasks": parts, "config_hash": "x",
                                                   "outputs": ["image_embeddings"]}))
    (emb / "completions").mkdir()
    (emb / "completions" / "finalized").touch()
    return run


def build(run: Path, tasks: int) -> dict:
    from ovpipe.cli import main as cli

    if not (run / "index" / "completions" / "finalized").exists():
        t = time.perf_counter()
        assert cli(["index", "--run-dir", str(run), "--tasks", str(tasks), "--quiet"]) == 0
        (run / "index" / "bench_wall_s").write_text(f"{time.perf_counter() - t:.1f}")
    st = json.loads((run / "index" / "stats.json").read_text())
    meta = json.loads((run / "index" / "data" / "index.json").read_text())
    return {"kind": meta["kind"], "nlist": meta["nlist"], "nprobe": meta["nprobe"],
            "build_s": float((run / "index" / "bench_wall_s").read_text()),
            "train_s": st["timings_s"].get("train"), "add_s": st["timings_s"].get("add"),
            "reduce_peak_mib": st["info"]["peak_rss_bytes/reduce"] / 2**20,
            "index_mib": (run / "index" / "data" / "index.faiss").stat().st_size / 2**20}


def measure(run: Path, browser: bool) -> dict:
    """In this (fresh) process: load, more-like-this latency, recall@10, map body and first render."""
    from starlette.testclient import TestClient

    from viewer.app import create_app
    from viewer.similarity import EmbeddingIndex, find_index

    app = create_app(run)
    cat, roots = app.state.catalog, app.state.roots
    t = time.perf_counter()
    ix = EmbeddingIndex(run, find_index(cat), roots)
    out = {"load_s": time.perf_counter() - t}
    rng = np.random.default_rng(1)
    picks = [f"{int(ix.ids[p]):016x}" for p in rng.integers(0, len(ix), 50)]
    ix.like(picks[0], 24)
    times = []
    for sid in picks:
        t = time.perf_counter()
        ix.like(sid, 24)
        times.append(time.perf_counter() - t)
    out["like_ms_median"] = 1000 * statistics.median(times)
    out["like_ms_p95"] = 1000 * float(np.quantile(times, 0.95))
    out["recall_at_10"] = recall(ix, picks[:20])
    client = TestClient(app, base_url="http://127.0.0.1")       # the viewer answers loopback hosts only
    t = time.perf_counter()          # the server builds both bodies on their first request, then keeps them
    size = sum(len(client.get(u).raise_for_status().content) for u in ("/map/points", "/map/colours?colour=cluster"))
    out["map_points_s"], out["map_points_mib"] = time.perf_counter() - t, size / 2**20
    if browser:
        out["map_first_render_s"], out["map_first_render_cold_s"] = first_render(run)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def recall(ix, picks: list[str], k: int = 10) -> float:
    """Share of the exact top-k (brute force over the fp16 shards, in blocks) that the index's top-k holds. Each
    block is read, not mapped, so the process does not keep every shard's pages resident (6 GB at 3M × 1024)."""
    q = ix.vectors([ix.position(s) for s in picks])
    best = np.full((len(q), 0), -1, np.int64), np.full((len(q), 0), -np.inf, np.float32)
    at = 0
    for shard in ix.shards:
        with open(shard.filename, "rb") as f:
            f.seek(shard.offset)
            for a in range(0, len(shard), 100_000):
                block = np.fromfile(f, shard.dtype, min(100_000, len(shard) - a) * shard.shape[1])
                s = block.reshape(-1, shard.shape[1]).astype(np.float32) @ q.T
                pos = np.arange(at + a, at + a + len(s))
                cos = np.concatenate([best[1], s.T], 1)
                ids = np.concatenate([best[0], np.broadcast_to(pos, (len(q), len(pos)))], 1)
                top = np.argsort(-cos, 1)[:, :k + 1]
                best = np.take_along_axis(ids, top, 1), np.take_along_axis(cos, top, 1)
        at += len(shard)
    hit = 0
    for j, sid in enumerate(picks):
        mine = ix.position(sid)
        exact = [p for p in best[0][j] if p != mine][:k]
        got = {ix.position(h) for h, _ in ix.like(sid, k)}
        hit += len(got & set(exact))
    return hit / (k * len(picks))


def first_render(run: Path) -> tuple[float, float]:
    """Seconds from navigating to /map until its points are drawn, in headless Chromium: the median of 3 once the
    server holds the map's bodies, and the first navigation, on a fresh server that builds them."""
    from playwright.sync_api import sync_playwright

    from viewer.app import create_app
    from viewer.serve import serving_in_thread

    out = []
    with serving_in_thread(create_app(run)) as root:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=shutil.which("chromium") or shutil.which("chromium-browser"),
                                         args=["--no-sandbox"])
            try:
                for _ in range(4):
                    page = browser.new_page(viewport={"width": 1280, "height": 900})
                    t = time.perf_counter()
                    page.goto(f"{root}/map")
                    page.wait_for_function("window.mapReady === true", timeout=120_000, polling=20)
                    out.append(time.perf_counter() - t)
                    page.close()
            finally:
                browser.close()
    return statistics.median(out[1:]), out[0]


def text_query(model: str, run: Path | None = None, repeat: int = 15) -> dict:
    """One text query's time on this CPU, on one thread as the viewer runs it, through ``model``'s text tower
    (random weights: the architecture sets the time): padded to the context (``embed_texts``, as align and
    embed-concepts run it), trimmed to its tokens in fp32, and as the viewer runs it (``embed_query``: trimmed, in
    ``query_precision()``); cosine of the trimmed vectors to the padded one; with ``run``, the index search
    (``EmbeddingIndex.search``, k = 24) the query adds. Medians over ``repeat`` queries, with the load average."""
    import os

    import torch

    from curation.clip import embed_query, load_text_tower, query_precision
    from curation.concepts import embed_texts

    torch.set_num_threads(1)          # as the viewer runs it (viewer.similarity)
    torch.manual_seed(0)
    net, tok = load_text_tower(model, None, "fp32")
    texts = [f"a handwritten receipt {i}" for i in range(repeat)]

    cpu = []

    def median_ms(fn) -> float:
        fn("warm up")
        times = []
        cpu.clear()
        for text in texts:
            t, c = time.perf_counter(), time.process_time()
            fn(text)
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        return 1000 * statistics.median(times)

    out = {"load_before": os.getloadavg()[0], "precision": query_precision(),
           "tokens": int(tok([texts[0]]).argmax(-1).max()) + 1, "context": int(tok([texts[0]]).shape[1])}
    padded = embed_texts(texts[:3], ["{}"], net, tok, "cpu", 1)
    out["padded_ms"] = median_ms(lambda text: embed_texts([text], ["{}"], net, tok, "cpu", 1))
    out["trimmed_fp32_ms"] = median_ms(lambda text: embed_query(net, tok, text))
    out["trimmed_fp32_cos"] = min(float(embed_query(net, tok, t) @ p) for t, p in zip(texts, padded))
    if out["precision"] != "fp32":
        del net
        torch.manual_seed(0)          # the same random weights, converted as open_clip converts them
        net, tok = load_text_tower(model, None, out["precision"])
    out["viewer_ms"] = median_ms(lambda text: embed_query(net, tok, text))
    out["viewer_cpu_ms"] = 1000 * statistics.median(cpu)
    out["viewer_cos"] = min(float(embed_query(net, tok, t) @ p) for t, p in zip(texts, padded))
    if run is not None:
        from viewer.catalog import RunCatalog
        from viewer.files import allowed_roots
        from viewer.similarity import EmbeddingIndex, find_index

        ix = EmbeddingIndex(run, find_index(RunCatalog(run)), allowed_roots(run))
        rng = np.random.default_rng(2)
        qs = rng.standard_normal((repeat + 1, ix.meta["dim"])).astype(np.float32)
        qs = iter(qs / np.linalg.norm(qs, axis=1, keepdims=True))
        out["search_ms"] = median_ms(lambda _: ix.search(next(qs), 24))
        out["rows"] = len(ix)
    out["load_after"] = os.getloadavg()[0]
    return out


def text_query_line(model: str, q: dict) -> str:
    search = ""
    if "search_ms" in q:
        search = f"; the index search it adds at {q['rows']:,} rows: {q['search_ms']:.0f} ms"
    return (f"Text query through {model}'s text tower, one thread, load {q['load_before']:.1f}–"
            f"{q['load_after']:.1f}: padded to {q['context']} tokens {q['padded_ms']:.0f} ms; trimmed to its "
            f"{q['tokens']} tokens, fp32 {q['trimmed_fp32_ms']:.0f} ms (cosine to padded ≥ "
            f"{q['trimmed_fp32_cos']:.7f}); as the viewer runs it ({q['precision']}) {q['viewer_ms']:.0f} ms, "
            f"{q['viewer_cpu_ms']:.0f} ms of CPU (cosine ≥ {q['viewer_cos']:.5f}){search}")


def demo_ranks(run: Path, data: Path) -> dict:
    """Text search on ``make demo``'s own tiny CLIP: each concept of the vocabulary that some indexed image holds
    (the corpus' ``ground_truth.parquet``), its text as the query, the rank of the first image holding it and the
    share of the top 10 that hold it; against the share a random image holds it (chance)."""
    import pyarrow.parquet as pq

    from viewer.catalog import RunCatalog
    from viewer.files import allowed_roots
    from viewer.similarity import EmbeddingIndex, find_index

    cat = RunCatalog(run)
    ix = EmbeddingIndex(run, find_index(cat), allowed_roots(run))
    texts = (data / "concepts.txt").read_text().splitlines()
    gt = pq.read_table(data / "ground_truth.parquet", columns=["sample_id", "concept_ids"]).to_pylist()
    holds = {}
    for r in gt:
        if ix.position(r["sample_id"]) is not None:
            for c in r["concept_ids"] or []:
                holds.setdefault(c, set()).add(r["sample_id"])
    first, p10, chance = [], [], []
    for c, ids in sorted(holds.items()):
        hits = [sid for sid, _ in ix.search(ix.text_vector(texts[c]), 100)]
        at = next((i + 1 for i, sid in enumerate(hits) if sid in ids), None)
        first.append(at if at is not None else 101)
        p10.append(sum(sid in ids for sid in hits[:10]) / 10)
        chance.append(len(ids) / len(ix))
    return {"concepts": len(first), "images": len(ix), "median_first_rank": float(np.median(first)),
            "first_at_rank_1": float(np.mean([f == 1 for f in first])), "precision_at_10": float(np.mean(p10)),
            "chance_at_10": float(np.mean(chance))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[100_000])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--tasks", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("runs/bench-index"))
    ap.add_argument("--browser", action="store_true", help="time the map's first render in headless Chromium")
    ap.add_argument("--text-tower", help="an open_clip model whose text tower is timed (ViT-H-14-quickgelu)")
    ap.add_argument("--quick", action="store_true", help="10K rows of 256 dims")
    ap.add_argument("--out", type=Path, help="also write the table here")
    ap.add_argument("--demo-ranks", type=Path, nargs=2, metavar=("RUN", "DATA"),
                    help="text-search ranks on a demo run (after `ovpipe index`) and its demo-data folder")
    ap.add_argument("--measure", type=Path, help=argparse.SUPPRESS)     # internal: one measurement, as JSON
    args = ap.parse_args(argv)
    if args.text_tower and args.rows == [0]:       # --rows 0 --text-tower M [--measure RUN]: the query alone
        print(text_query_line(args.text_tower, text_query(args.text_tower, args.measure)))
        return 0
    if args.demo_ranks:
        print(json.dumps(demo_ranks(*args.demo_ranks)))
        return 0
    if args.measure:
        print(json.dumps(measure(args.measure, args.browser)))
        return 0
    if args.quick:
        args.rows, args.dim = [10_000], 256
    lines = ["| rows | index | nlist/nprobe | build s (train, add) | reduce peak MiB | index MiB | load s "
             "| like ms median / p95 | recall@10 | map bodies s / MiB | map first render s (fresh server) "
             "| viewer peak MiB |", "| --- " * 12 + "|"]
    for rows in args.rows:
        t = time.perf_counter()
        run = write_run(args.work, rows, args.dim)
        print(f"{rows:,} vectors × {args.dim} in {run} ({time.perf_counter() - t:.1f} s)", flush=True)
        b = build(run, args.tasks)
        print(json.dumps(b), flush=True)
        cmd = [sys.executable, "-m", "bench.bench_index", "--measure", str(run)] + (["--browser"] * args.browser)
        got = subprocess.run(cmd, capture_output=True, text=True)
        if got.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{got.stderr[-3000:]}")
        m = json.loads(got.stdout.splitlines()[-1])
        print(json.dumps(m), flush=True)
        nan = float("nan")
        lines.append(f"| {rows:,} | {b['kind']} | {b['nlist']}/{b['nprobe']} | {b['build_s']:.0f} ({b['train_s']:.0f}, "
                     f"{b['add_s']:.0f}) | {b['reduce_peak_mib']:,.0f} | {b['index_mib']:,.0f} | {m['load_s']:.1f} "
                     f"| {m['like_ms_median']:.1f} / {m['like_ms_p95']:.1f} | {m['recall_at_10']:.3f} "
                     f"| {m['map_points_s']:.2f} / {m['map_points_mib']:.1f} "
                     f"| {m.get('map_first_render_s', nan):.2f} ({m.get('map_first_render_cold_s', nan):.2f}) "
                     f"| {m['peak_rss_mib']:,.0f} |")
    if args.text_tower:
        lines.append("\n" + text_query_line(args.text_tower, text_query(args.text_tower, run if args.rows else None)))
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
