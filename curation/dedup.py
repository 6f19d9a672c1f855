"""``dedup``: semantic near-duplicates from the image embeddings (SemDeDup; NeMo Curator's semantic dedup).

Exact duplicates (same bytes, same caption hash) are ingest's. This step finds the same picture resized,
recompressed or slightly cropped: images whose MetaCLIP vectors are nearly parallel. Every vector is
assigned to a spherical k-means centroid (faiss; on the GPU where faiss sees one), and inside each cluster

    j is a near_duplicate of kept i   ⇔   cos(x_i, x_j) > 1 − ε   and i comes before j in keep order,

greedily: members in keep order — **the largest image first (width × height from ``samples``), then the
lowest ``sample_id``** — each is kept unless its cosine to an already-kept member exceeds ``1 − ε``; then
``duplicate_of`` is the kept member it is closest to (ties: the earlier one). A pair split over two
clusters is not compared (SemDeDup's approximation; ``cluster_rows`` sets the cluster size).

Map → reduce → apply (``docs/scale.md``), no task holding the corpus:

* map (``sample_for_training``): rank r streams its share of ``image_embeddings`` and keeps the rows whose
  seeded draw ``u(sample_id) < k · train_per_cluster / N`` (at most ``max_train_rows`` in all): the same
  rows whatever the task count. Partial: their ids, shards and rows (not their vectors), and its ok count.
* reduce (``find_duplicates``): gathers the drawn vectors in id order and trains k-means on them; streams
  every ``ok`` row in canonical order (DuckDB joins the image area from ``samples``), assigns it to its
  centroid and spills (cluster, area, position, vector) to one of ≤ 1024 bucket files; then per bucket, per
  cluster — a cluster above ``max_cluster_rows`` is split again by k-means — the greedy keep block by block
  (``keep_blocks``: a block of ``block_rows`` rows against every earlier row; memory one cluster + one block).
  Artifact: row-aligned ``.npy`` arrays over the ok rows in canonical order (sample id, cluster, the
  position it duplicates or −1, its cosine), memory-mapped by the apply ranks, and the removals per ε.
* apply (``write_dedup``): rank r streams its canonical slice and writes its ``dedup`` part: every row
  of ``image_embeddings`` (status ``ok`` | ``near_duplicate`` | the embed status of a row without a vector).
* finalize (``curation.dedup_report``): ``report.md`` (removed per ε, removals per concept),
  ``pairs.png`` (example pairs as thumbnails).

One reduce computes every cluster from canonical-order inputs, so the output is byte-identical at any
task count (tested at 1, 2, 4 tasks and on Slurm).
"""
from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field

import numpy as np

from ovpipe.config import check_local_path, check_range, check_step_folder
from ovpipe.inputs import Input
from ovpipe.step import Step, TaskContext

EMB_COLUMNS = ["sample_id", "file", "row", "status"]


@dataclass
class DedupConfig:
    eps: float = 0.05                      # near_duplicate: cosine to a kept image > 1 − eps
    report_eps: list[float] = field(default_factory=lambda: [0.01, 0.02, 0.05, 0.1])   # removals counted per ε
    cluster_rows: int = 10_000             # mean rows per k-means cluster: k = ceil(N / cluster_rows)
    max_cluster_rows: int = 50_000         # a cluster above this is split again by k-means (bounded memory)
    train_per_cluster: int = 256           # rows drawn per centroid to train k-means (faiss's own default cap);
                                           # 40 found 87% of the bench's planted pairs, 256: 94% (docs/curation.md)
    max_train_rows: int = 1_000_000        # at most this many training rows (× d fp32 in the reduce: 4 GB at d=1024)
    niter: int = 20                        # k-means iterations
    block_rows: int = 1024                 # rows of a cluster's cosine matrix at once (block × cluster fp32)
    seed: int = 0
    device: str = "auto"                   # auto: k-means and the cosines on the GPU where faiss / torch see one
    embeddings_step: str = "embed-images"  # the image_embeddings (and, through it, the samples) deduplicated
    concepts_from: str = ""                # an assign step folder: the report counts removals per concept
    report_pairs: int = 12                 # example pairs in pairs.png
    planted: str = ""                      # demo: planted.parquet (sample_id, kind, original) — the report scores it

    def __post_init__(self):
        check_range(self, "eps", 0, 1, lo_open=True)
        if not self.report_eps or any(not (0 < e <= 1) for e in self.report_eps):
            raise ValueError(f"report_eps: values in (0, 1], got {self.report_eps}")
        for name in ("cluster_rows", "max_cluster_rows", "train_per_cluster", "max_train_rows", "niter",
                     "block_rows"):
            check_range(self, name, 1)
        check_range(self, "report_pairs", 0)
        check_range(self, "seed", 0, 2**63 - 1)
        check_step_folder("embeddings_step", self.embeddings_step)
        if self.concepts_from:
            check_step_folder("concepts_from", self.concepts_from)
        if self.planted:
            check_local_path("planted", self.planted)
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")

    @property
    def thresholds(self) -> list[float]:
        """1 − ε for the step's ε and every reported one, loosest last."""
        return sorted({1.0 - e for e in [self.eps, *self.report_eps]}, reverse=True)

    def clusters_for(self, n: int) -> int:
        return max(1, math.ceil(n / self.cluster_rows))


def _gpu(device: str) -> bool:
    if device == "cpu":
        return False
    import faiss

    return faiss.get_num_gpus() > 0


def _torch_device(device: str) -> str:
    from curation.clip import pick_device

    return pick_device(device)


# ------------------------------------------------------------------------------ the computation

def kmeans(x: np.ndarray, k: int, cfg: DedupConfig, seed_offset: int = 0) -> np.ndarray:
    """Spherical k-means centroids (k × d, unit rows) of ``x`` (fp32, unit rows) by faiss."""
    import faiss

    k = max(1, min(k, len(x)))
    km = faiss.Kmeans(x.shape[1], k, niter=cfg.niter, seed=int((cfg.seed + seed_offset) % (2**31 - 1)),
                      spherical=True, gpu=_gpu(cfg.device), verbose=False,
                      max_points_per_centroid=max(256, cfg.train_per_cluster), min_points_per_centroid=1)
    km.train(np.ascontiguousarray(x, dtype=np.float32))
    return np.ascontiguousarray(km.centroids, dtype=np.float32)


def nearest(centroids: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The centroid each row of ``x`` is closest to (largest inner product), int32."""
    import faiss

    index = faiss.IndexFlatIP(centroids.shape[1])
    index.add(centroids)
    return index.search(np.ascontiguousarray(x, dtype=np.float32), 1)[1][:, 0].astype(np.int32)


def similar_pairs(x: np.ndarray, threshold: float, block_rows: int = 1024, device: str = "cpu"):
    """Every pair (i < j) of rows of ``x`` (unit rows, fp32) with cosine > ``threshold``: (i, j, cos), by row
    blocks (memory one block × len(x) + the pairs) — the brute-force reference of the bench and the tests."""
    import torch

    X = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(device)
    out_i, out_j, out_s = [], [], []
    with torch.inference_mode():
        for a in range(0, len(x), block_rows):
            b = min(a + block_rows, len(x))
            S = X[a:b] @ X[:b].T                                  # rows j ∈ [a, b), columns i < b
            tri = torch.arange(b, device=X.device)[None, :] < torch.arange(a, b, device=X.device)[:, None]
            jj, ii = torch.nonzero((S > threshold) & tri, as_tuple=True)
            out_s.append(S[jj, ii].float().cpu().numpy())
            out_i.append(ii.cpu().numpy())
            out_j.append((jj + a).cpu().numpy())
    if not out_i:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
    return np.concatenate(out_i), np.concatenate(out_j), np.concatenate(out_s)


def greedy_keep(m: int, i: np.ndarray, j: np.ndarray, s: np.ndarray, threshold: float):
    """Rows 0..m-1 in keep order, pairs (i < j, cos s): row j is a duplicate when a kept row i < j has
    cos > ``threshold``; its ``duplicate_of`` is the kept one it is closest to (ties: the lowest i).
    Returns (dup_of int64[m], −1 where kept; similarity float32[m], NaN where kept)."""
    dup_of = np.full(m, -1, np.int64)
    sim = np.full(m, np.nan, np.float32)
    sel = s > threshold
    i, j, s = i[sel], j[sel], s[sel]
    if not len(j):
        return dup_of, sim
    order = np.lexsort((i, j))               # by j, then i
    i, j, s = i[order], j[order], s[order]
    starts = np.flatnonzero(np.r_[True, j[1:] != j[:-1]])
    ends = np.r_[starts[1:], len(j)]
    for a, b in zip(starts.tolist(), ends.tolist()):
        ci, cs = i[a:b], s[a:b]
        kept = dup_of[ci] == -1
        if kept.any():
            w = np.flatnonzero(kept)[np.argmax(cs[kept])]
            dup_of[j[a]], sim[j[a]] = ci[w], cs[w]
    return dup_of, sim


def split_cluster(x: np.ndarray, cfg: DedupConfig, depth: int = 0) -> list[np.ndarray]:
    """Row groups of ``x`` (indices, each in ascending order) of at most ``max_cluster_rows`` rows:
    ``x`` itself, or k-means on it again (seeded by the depth) until every group fits."""
    if len(x) <= cfg.max_cluster_rows:
        return [np.arange(len(x))]
    k = 2 * math.ceil(len(x) / cfg.max_cluster_rows)
    sample = x[:: max(1, len(x) // cfg.max_train_rows)]
    labels = nearest(kmeans(sample, k, cfg, seed_offset=depth + 1), x)
    if len(np.unique(labels)) == 1:            # identical vectors: k-means cannot split them; cut in order
        return [np.arange(a, min(a + cfg.max_cluster_rows, len(x))) for a in range(0, len(x), cfg.max_cluster_rows)]
    groups = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        groups += [idx[g] for g in split_cluster(x[idx], cfg, depth + 1)]
    return groups


def dedup_cluster(x: np.ndarray, cfg: DedupConfig, device: str = "cpu") -> dict[float, tuple[np.ndarray, np.ndarray]]:
    """``x``: one cluster's unit vectors in keep order. {threshold: (dup_of, similarity)} for every threshold
    of ``cfg`` — the greedy keep of ``greedy_keep``, computed block by block (``keep_blocks``) over each group
    ``split_cluster`` cuts it into (``dup_of`` indexes rows of ``x``)."""
    m = len(x)
    out = {t: (np.full(m, -1, np.int64), np.full(m, np.nan, np.float32)) for t in cfg.thresholds}
    for g in split_cluster(x, cfg):
        for t, (d, sim) in keep_blocks(x[g], cfg.thresholds, cfg.block_rows, device).items():
            dup = d >= 0
            out[t][0][g[dup]] = g[d[dup]]
            out[t][1][g[dup]] = sim[dup]
    return out


def keep_blocks(x: np.ndarray, thresholds: list[float], block_rows: int = 1024, device: str = "cpu"):
    """The greedy keep of ``greedy_keep`` without listing pairs: rows in blocks of ``block_rows``; a block's
    cosines to every earlier row (``block_rows`` × m, the memory bound); a row's best *kept* earlier row
    outside the block by a masked max, those inside it in order. {threshold: (dup_of, similarity)}."""
    import torch

    m = len(x)
    X = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(device)
    out = {t: (np.full(m, -1, np.int64), np.full(m, np.nan, np.float32)) for t in thresholds}
    with torch.inference_mode():
        for a in range(0, m, block_rows):
            b = min(a + block_rows, m)
            S = X[a:b] @ X[:b].T                                          # rows a..b-1 against rows 0..b-1
            inner = torch.tril(S[:, a:b], diagonal=-1).cpu().numpy()      # i < j inside the block
            for t in thresholds:
                dup_of, sim = out[t]
                if a:
                    kept = torch.from_numpy(dup_of[:a] == -1).to(S.device)
                    best_s, best_i = S[:, :a].masked_fill(~kept, -2.0).max(dim=1)
                    best_s, best_i = best_s.cpu().numpy(), best_i.cpu().numpy()
                else:
                    best_s, best_i = np.full(b - a, -2.0, np.float32), np.zeros(b - a, np.int64)
                over = inner > t
                inside = over.any(axis=1)
                alone = np.flatnonzero(~inside & (best_s > t))    # decided by the earlier blocks alone
                dup_of[a + alone], sim[a + alone] = best_i[alone], best_s[alone]
                for j in np.flatnonzero(inside).tolist():         # in order: earlier rows of the block first
                    s_j, i_j = best_s[j], best_i[j]
                    c = np.flatnonzero(over[j, :j])
                    c = c[dup_of[a + c] == -1]
                    if len(c):
                        w = c[np.argmax(inner[j, c])]
                        if inner[j, w] > s_j:                      # ties: the earlier row (outside the block)
                            s_j, i_j = inner[j, w], a + w
                    if s_j > t:
                        dup_of[a + j], sim[a + j] = i_j, s_j
    return out


def dedup_vectors(x: np.ndarray, area: np.ndarray, cfg: DedupConfig, device: str = "cpu"):
    """The whole computation in memory (tests, bench): ``x`` unit rows in canonical (sample_id) order,
    ``area`` their width × height. (cluster int32[n], dup_of int64[n] (−1: kept), similarity, removed per ε)."""
    k = cfg.clusters_for(len(x))
    frac = min(1.0, min(k * cfg.train_per_cluster, cfg.max_train_rows) / max(len(x), 1))
    train = x[_draws(np.arange(len(x), dtype=np.uint64), cfg.seed) < frac]
    cents = kmeans(train if len(train) else x, k, cfg)
    cluster = nearest(cents, x)
    dup_of = np.full(len(x), -1, np.int64)
    sim = np.full(len(x), np.nan, np.float32)
    removed = {t: 0 for t in cfg.thresholds}
    for c in np.unique(cluster):
        pos = np.flatnonzero(cluster == c)
        pos = pos[np.lexsort((pos, -area[pos]))]
        res = dedup_cluster(x[pos], cfg, device)
        for t, (d, s) in res.items():
            removed[t] += int((d >= 0).sum())
        d, s = res[1.0 - cfg.eps]
        dup = d >= 0
        dup_of[pos[dup]] = pos[d[dup]]
        sim[pos[dup]] = s[dup]
    return cluster, dup_of, sim, removed


def _draws(ids_u64: np.ndarray, seed: int) -> np.ndarray:
    from manifests.ids import splitmix64

    u = splitmix64(np.asarray(ids_u64, np.uint64) ^ splitmix64(np.uint64(seed)))
    return (u >> np.uint64(11)).astype(np.float64) / float(1 << 53)


# ------------------------------------------------------------------------------------- the step

def sample_for_training(cfg: DedupConfig, task: TaskContext) -> None:
    """Map: this rank's share of ``image_embeddings`` → where the ok rows drawn to train k-means lie (id,
    shard, row: 16 bytes and a shard index a row; the reduce gathers their vectors) and the ok count."""
    n = task.input_num_rows("image_embeddings")
    drawn = min(cfg.clusters_for(n) * cfg.train_per_cluster, cfg.max_train_rows)
    write_training_draw(task, min(1.0, drawn / max(n, 1)), cfg.seed)


def write_training_draw(task: TaskContext, frac: float, seed: int) -> None:
    """This rank's share of ``image_embeddings`` → the partial ``train``: where the ok rows whose seeded draw
    ``u(sample_id) < frac`` lie (the same rows at any task count) and the ok count (``_training_rows`` reads it)."""
    import pyarrow.compute as pc

    from manifests.ids import hex_ids_to_u64

    ids, files, rows = [], [], []
    n_ok = 0
    for batch in task.iter_input_share("image_embeddings", EMB_COLUMNS):
        ok = batch.filter(pc.equal(batch.column("status"), "ok"))
        task.stats.inc("images", ok.num_rows)
        n_ok += ok.num_rows
        u64 = hex_ids_to_u64(ok.column("sample_id"))
        pick = np.flatnonzero(_draws(u64, seed) < frac)
        ids.append(u64[pick])
        files.append(ok.column("file").to_numpy(zero_copy_only=False)[pick].astype(str))
        rows.append(ok.column("row").to_numpy()[pick].astype(np.int64))
    task.write_partial("train", ok=np.array([n_ok], np.int64),
                       ids=np.concatenate(ids) if ids else np.zeros(0, np.uint64),
                       files=np.concatenate(files) if files else np.zeros(0, str),
                       rows=np.concatenate(rows) if rows else np.zeros(0, np.int64))


def _training_rows(task: TaskContext) -> tuple[np.ndarray | None, int]:
    """The drawn rows' vectors (fp32, in sample_id order, gathered from the mapped shards) and the ok count."""
    from curation.assign import NpyShards

    ids, files, rows = [], [], []
    n_ok = 0
    for part in task.iter_partials("train"):
        ids.append(part["ids"])
        files.append(part["files"])
        rows.append(part["rows"])
        n_ok += int(part["ok"][0])
    ids = np.concatenate(ids) if ids else np.zeros(0, np.uint64)
    if not len(ids):
        return None, n_ok
    order = np.argsort(ids, kind="stable")
    shards = NpyShards(task.run_dir)
    try:
        return shards.gather(np.concatenate(files)[order].astype(object), np.concatenate(rows)[order],
                             np.float32), n_ok
    finally:
        shards.close()


def _canonical_rows(task: TaskContext, con, batch_rows: int = 65_536):
    """The ok rows of ``image_embeddings`` in canonical order with their image's area, streamed by DuckDB."""
    def files(kind):
        return "[" + ", ".join("'" + str(f).replace("'", "''") + "'" for f in task.input_files(kind)) + "]"

    sql = f"""
        SELECT e.sample_id, e.file, e.row, coalesce(s.area, 0) AS area
        FROM read_parquet({files('image_embeddings')}) e
        LEFT JOIN (SELECT sample_id, max(CAST(width AS BIGINT) * height) AS area
                   FROM read_parquet({files('samples')}) GROUP BY sample_id) s USING (sample_id)
        WHERE e.status = 'ok' ORDER BY e.sample_id, e.file, e.row"""
    yield from con.sql(sql).to_arrow_reader(batch_rows)


class _Buckets:
    """Rows spilled to ≤ 1024 bucket files by cluster, buffered (64 MB) so few files are open at once."""

    def __init__(self, folder, k: int, d: int):
        self.folder, self.n = folder, min(k, 1024)
        self.dtype = np.dtype([("cluster", "<i4"), ("area", "<i8"), ("pos", "<i8"), ("vec", "<f2", (d,))])
        self.buf: dict[int, list] = {}
        self.bytes = 0
        folder.mkdir(parents=True, exist_ok=True)

    def add(self, cluster, area, pos, vec) -> None:
        rec = np.empty(len(pos), self.dtype)
        rec["cluster"], rec["area"], rec["pos"], rec["vec"] = cluster, area, pos, vec
        g = cluster % self.n
        for b in np.unique(g):
            self.buf.setdefault(int(b), []).append(rec[g == b])
        self.bytes += rec.nbytes
        if self.bytes > 64 << 20:
            self.flush()

    def flush(self) -> None:
        for b, recs in self.buf.items():
            with open(self.folder / f"{b:05d}.bin", "ab") as f:
                for r in recs:
                    f.write(r.tobytes())
        self.buf, self.bytes = {}, 0

    def __iter__(self):
        self.flush()
        for b in range(self.n):
            p = self.folder / f"{b:05d}.bin"
            if p.exists():
                yield np.memmap(p, self.dtype, mode="r")


def _npy(task: TaskContext, name: str, dtype, n: int, fill):
    """A row-aligned reduced array ``reduced/<name>.npy``, written through a temp name (``_publish``)."""
    tmp = task.reduced_path(f".tmp-{os.getpid()}-{name}.npy")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    a = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(n,))
    a[:] = fill
    return a, tmp


def find_duplicates(cfg: DedupConfig, task: TaskContext) -> None:
    """Reduce: k-means on the drawn rows; every ok row to its centroid, spilled by cluster; per cluster the
    pairs above 1 − ε and the greedy keep → ``reduced/{ids,cluster,dup_of,similarity}.npy`` + ``dedup.npz``."""
    from curation.assign import NpyShards
    from manifests.ids import hex_ids_to_u64

    train, n_ok = _training_rows(task)
    n_total = task.input_num_rows("image_embeddings")
    device = _torch_device(cfg.device)
    gpu = _gpu(cfg.device)
    task.stats.info.update({"kmeans_device": "cuda" if gpu else "cpu", "pairwise_device": device})
    work = task.reduced_path(f".tmp-{os.getpid()}-buckets")
    arrays = {}
    try:
        with task.stats.timer("kmeans"):
            cents = kmeans(train, cfg.clusters_for(n_total), cfg) if train is not None else None
        # the row-aligned arrays of every ok row (8 + 4 + 8 + 4 bytes a row, on disk, memory-mapped)
        for name, dtype, fill in (("ids", np.uint64, 0), ("cluster", np.int32, -1), ("dup_of", np.int64, -1),
                                  ("similarity", np.float32, np.nan)):
            arrays[name] = _npy(task, name, dtype, n_ok, fill)
        at, last = 0, None
        buckets = None
        shards = NpyShards(task.run_dir)
        with task.stats.timer("assign"), task.duckdb() as con:
            for batch in _canonical_rows(task, con):
                if cents is None:
                    raise ValueError("dedup: no row was drawn to train k-means although image_embeddings has ok "
                                     "rows — rerun the step (the map partials are stale)")
                files = batch.column("file").to_numpy(zero_copy_only=False)
                x = shards.gather(files, batch.column("row").to_numpy(), np.float16)
                shards.release(keep=set(files.tolist()))
                c = nearest(cents, x.astype(np.float32))
                if buckets is None:
                    buckets = _Buckets(work, len(cents), x.shape[1])
                u = hex_ids_to_u64(batch.column("sample_id"))
                if at + len(u) > n_ok:
                    raise RuntimeError("image_embeddings changed under the reduce — rerun the step with --overwrite")
                if np.any(np.diff(u) == 0) or (last is not None and len(u) and u[0] == last):
                    raise ValueError("dedup: two ok image_embeddings rows share a sample_id — ingest marks exact "
                                     "duplicates; rerun ingest and embed-images")
                pos = np.arange(at, at + len(c), dtype=np.int64)
                buckets.add(c, batch.column("area").to_numpy(), pos, x)
                arrays["ids"][0][at:at + len(u)] = u
                arrays["cluster"][0][at:at + len(u)] = c
                at += len(u)
                last = u[-1] if len(u) else last
        shards.close()
        if at != n_ok:
            raise RuntimeError(f"image_embeddings changed under the reduce: {at} ok rows now, {n_ok} when mapped")
        removed = {t: 0 for t in cfg.thresholds}
        clusters, largest = 0, 0
        with task.stats.timer("pairwise"):
            for rec in (buckets or []):
                cl = np.asarray(rec["cluster"])
                by = np.lexsort((np.asarray(rec["pos"]), -np.asarray(rec["area"]), cl))   # cluster, keep order
                bounds = np.flatnonzero(np.r_[True, cl[by][1:] != cl[by][:-1], True])
                for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
                    members = by[a:b]
                    x = np.asarray(rec["vec"][members], dtype=np.float32)
                    pos = np.asarray(rec["pos"][members])
                    res = dedup_cluster(x, cfg, device)
                    for t, (d, _) in res.items():
                        removed[t] += int((d >= 0).sum())
                    d, s = res[1.0 - cfg.eps]
                    dup = d >= 0
                    arrays["dup_of"][0][pos[dup]] = pos[d[dup]]
                    arrays["similarity"][0][pos[dup]] = s[dup]
                    clusters += 1
                    largest = max(largest, b - a)
                del rec
        for name, (a, tmp) in arrays.items():
            a.flush()
            del a
            os.replace(tmp, task.reduced_path(f"{name}.npy"))
        arrays = {}
    finally:
        for a, tmp in arrays.values():
            del a
            tmp.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    eps = [round(1.0 - t, 10) for t in cfg.thresholds]
    task.write_reduced("dedup", eps=np.array(eps, np.float64),
                       removed=np.array([removed[t] for t in cfg.thresholds], np.int64),
                       images=np.array([n_ok]), clusters=np.array([clusters]), largest=np.array([largest]))
    task.stats.info.update({"clusters": clusters, "largest_cluster": largest, "images": n_ok,
                            "removed_per_eps": {f"{e:g}": removed[t] for e, t in zip(eps, cfg.thresholds)}})


def write_dedup(cfg: DedupConfig, task: TaskContext) -> None:
    """Apply: this rank's canonical slice of ``image_embeddings`` → its ``dedup`` part, row for row."""
    import pyarrow as pa

    from manifests.ids import hex_ids_to_u64, u64_to_hex
    from ovpipe.mapreduce import BATCH_ROWS

    r = {name: np.load(task.reduced_path(f"{name}.npy"), mmap_mode="r")
         for name in ("ids", "cluster", "dup_of", "similarity")}
    with task.part_writer("dedup", row_group_rows=BATCH_ROWS) as out:
        for batch in task.iter_input_slice("image_embeddings", ["sample_id", "status", "error"]):
            status = batch.column("status").to_numpy(zero_copy_only=False).astype(object)
            ok = np.flatnonzero(status == "ok")
            u = hex_ids_to_u64(batch.column("sample_id").take(pa.array(ok, pa.int64())))
            p = np.searchsorted(r["ids"], u)
            if len(p) and (p.max() >= len(r["ids"]) or np.any(r["ids"][np.minimum(p, len(r["ids"]) - 1)] != u)):
                raise RuntimeError("dedup: image_embeddings changed since the reduce — rerun with --overwrite")
            cluster = np.full(batch.num_rows, -1, np.int32)
            cluster[ok] = r["cluster"][p]
            d = np.asarray(r["dup_of"][p])
            dup = ok[d >= 0]
            status[dup] = "near_duplicate"
            dup_of = np.full(batch.num_rows, None, object)
            dup_of[dup] = np.asarray(u64_to_hex(r["ids"][d[d >= 0]]).to_pylist(), object)
            sim = np.full(batch.num_rows, np.nan, np.float32)
            sim[dup] = r["similarity"][p[d >= 0]]
            error = batch.column("error")
            out.write(pa.table({
                "sample_id": batch.column("sample_id"), "cluster": pa.array(cluster),
                "duplicate_of": pa.array(dup_of, pa.string()),
                "similarity": pa.array(sim, mask=np.isnan(sim)),
                "status": pa.array(status, pa.string()), "error": error}))
            for s, n in zip(*np.unique(status.astype(str), return_counts=True)):
                task.stats.inc(f"status/{s}", int(n))


def _finalize(cfg: DedupConfig, task: TaskContext) -> None:
    from curation.dedup_report import write_report

    write_report(cfg, task)


STEP = Step("dedup", DedupConfig, sample_for_training, reduce=find_duplicates, apply=write_dedup, finalize=_finalize,
            inputs={"image_embeddings": "embeddings_step", "samples": Input(via="embeddings_step"),
                    "assignments": Input("concepts_from", when=lambda c: bool(c.concepts_from)),
                    "concepts": Input(when=lambda c: bool(c.concepts_from))},
            outputs=("dedup",), description="semantic near-duplicates: k-means + cosine inside clusters")
