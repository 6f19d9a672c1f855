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
* reduce (``find_duplicates``): gathers the drawn vectors in id order (a bad one left out) and trains k-means
  on them; streams every ``ok`` row in canonical order (DuckDB joins the image area from ``samples``),
  assigns it to its centroid and spills (cluster, area, position, vector) to ≤ 1024 files by cluster and
  (hash, area, position) by the vector's xxh3-128; then ``_Engine``: every set of byte-identical vectors
  keeps its first row in keep order and the rest are its copies; per cluster, the greedy keep block by block
  (``keep_blocks``: a block of ``block_rows`` rows against every earlier row) over the distinct rows. A
  cluster above ``max_cluster_rows`` is never loaded: it is split by k-means on a strided sample and
  re-spilled, level by level, so the reduce holds at most ``max_cluster_rows`` rows (their vectors fp32)
  and ``max_train_rows`` training rows at once, whatever the clusters' sizes (a 50M-row cluster of d = 1024
  as much as a 50K one: one 50K × 1024 fp32 group is 200 MB). Artifact: row-aligned ``.npy`` arrays over
  the ok rows in canonical order (sample id, cluster, the position it duplicates or −1, its cosine),
  memory-mapped by the apply ranks, and the removals per ε.
* apply (``write_dedup``): rank r streams its canonical slice and writes its ``dedup`` part: every row
  of ``image_embeddings`` (status ``ok`` | ``near_duplicate`` | ``bad_vector`` | the embed status of a row
  without a vector).
* finalize (``curation.dedup_report``): ``report.md`` (removed per ε, removals per concept),
  ``pairs.png`` (example pairs as thumbnails).

A ``bad_vector`` is an ``ok`` row whose vector has a NaN or ±inf component or a norm off 1 by more than 1% (all
zeros, say; embed writes unit vectors): it has no cosine, so it is drawn for no centroid, put in no cluster
(cluster −1), compared with nothing and duplicates nothing. Byte-identical vectors, however many, keep exactly
one row: the first in keep order is kept (or is itself a near-duplicate of an earlier row) and every other is a
``near_duplicate`` of the row the first one stands for, with similarity 1 when that is the first row itself,
whatever ε is. A pair that the split of an oversized cluster parts is not compared, as with a pair over two
clusters.

One reduce computes every cluster from canonical-order inputs, so the output is byte-identical at any
task count (tested at 1, 2, 4 tasks and on Slurm).
"""
from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ovpipe.config import check_local_path, check_range, check_step_folder
from ovpipe.inputs import Input
from ovpipe.step import Step, TaskContext

EMB_COLUMNS = ["sample_id", "file", "row", "status"]
BAD_VECTOR = "bad_vector"
BAD_VECTOR_ERROR = "image vector has a NaN or infinite component, or is not of unit length (all zeros, ...)"


@dataclass
class DedupConfig:
    eps: float = 0.05                      # near_duplicate: cosine to a kept image > 1 − eps
    report_eps: list[float] = field(default_factory=lambda: [0.01, 0.02, 0.05, 0.1])   # removals counted per ε
    cluster_rows: int = 10_000             # mean rows per k-means cluster: k = ceil(N / cluster_rows)
    max_cluster_rows: int = 50_000         # rows the reduce holds at once: a larger cluster is split by k-means
                                           # and re-spilled, never loaded (fp32 vectors: 200 MB at d = 1024)
    train_per_cluster: int = 256           # rows drawn per centroid to train k-means (faiss's own default cap);
                                           # 40 found 87% of the bench's planted pairs, 256: 94% (docs/curation.md)
    max_train_rows: int = 1_000_000        # at most this many training rows (× d fp32 in the reduce: 4 GB at d=1024)
    niter: int = 20                        # k-means iterations
    block_rows: int = 1024                 # rows of a cluster's cosine matrix at once (block × cluster fp32)
    seed: int = 0  # the k-means initialisation and the training-row draw
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
    ``area`` their width × height. (cluster int32[n] (−1: a bad vector), dup_of int64[n] (−1: kept),
    similarity, removed per ε)."""
    import tempfile

    x = np.ascontiguousarray(x, dtype=np.float32)
    good = np.flatnonzero(~bad_vectors(x))
    k = cfg.clusters_for(len(good))
    frac = min(1.0, min(k * cfg.train_per_cluster, cfg.max_train_rows) / max(len(good), 1))
    train = x[good[_draws(good.astype(np.uint64), cfg.seed) < frac]]
    cluster = np.full(len(x), -1, np.int32)
    dup_of = np.full(len(x), -1, np.int64)
    sim = np.full(len(x), np.nan, np.float32)
    if not len(good):
        return cluster, dup_of, sim, {t: 0 for t in cfg.thresholds}
    cluster[good] = nearest(kmeans(train if len(train) else x[good], k, cfg), x[good])
    with tempfile.TemporaryDirectory(prefix="ovpipe-dedup-") as work:
        engine = _Engine(Path(work), len(x), x.shape[1], k, cfg, device, dup_of, sim, np.float32)
        engine.add(cluster[good], area[good], good, x[good])
        removed = engine.run()
        del engine
    return cluster, dup_of, sim, removed


NORM_TOLERANCE = 0.01     # embed writes unit vectors: fp16 rounding moves a norm by ~1e-4, corruption by more


def bad_vectors(x: np.ndarray) -> np.ndarray:
    """Rows no cosine can be taken from (bool): a NaN or ±inf component, or a norm off 1 by more than
    ``NORM_TOLERANCE`` (all zeros, a subnormal or an overflowing row, anything embed cannot have written).
    They get status ``bad_vector`` and take part in nothing (k-means, clusters, scores)."""
    x = np.asarray(x, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        sq = np.einsum("ij,ij->i", x, x)                 # NaN or inf where a component is (or where it overflows)
        return ~(np.abs(np.sqrt(sq) - 1.0) <= NORM_TOLERANCE)


def vector_hashes(x: np.ndarray) -> np.ndarray:
    """xxh3-128 of each row's bytes as uint64[n, 2]: byte-identical vectors, and only they (up to a 2^-128
    collision), share one."""
    import xxhash

    x = np.ascontiguousarray(x)
    raw = b"".join(xxhash.xxh3_128_digest(r) for r in x.view(np.uint8).reshape(len(x), -1))
    return np.frombuffer(raw, np.uint64).reshape(len(x), 2).copy()


class _Spill:
    """Records spilled to ≤ 1024 files by an integer key, buffered (``buffer_rows`` rows, 1–64 MB) so few
    files are open at once;
    read back a chunk at a time (``_chunks``: plain reads, not a memory map, so a chunk's pages leave the
    process with it)."""

    def __init__(self, folder: Path, n_keys: int, dtype: np.dtype, buffer_rows: int):
        self.folder, self.n, self.dtype = folder, max(1, min(int(n_keys), 1024)), dtype
        self.cap = min(64 << 20, max(1 << 20, buffer_rows * dtype.itemsize))
        self.buf: dict[int, list] = {}
        self.bytes = 0
        self.written: set[int] = set()
        folder.mkdir(parents=True, exist_ok=True)

    def add(self, rec: np.ndarray, key: np.ndarray) -> None:
        g = np.asarray(key, np.uint64) % np.uint64(self.n)
        for b in np.unique(g):
            self.buf.setdefault(int(b), []).append(rec[g == b])
        self.bytes += rec.nbytes
        if self.bytes > self.cap:
            self.flush()

    def flush(self) -> None:
        for b, recs in self.buf.items():
            with open(self.folder / f"{b:05d}.bin", "ab") as f:
                for r in recs:
                    f.write(r.tobytes())
            self.written.add(b)
        self.buf, self.bytes = {}, 0

    def files(self) -> list[Path]:
        self.flush()
        return [self.folder / f"{b:05d}.bin" for b in sorted(self.written)]


def _chunks(path: Path, dtype: np.dtype, rows: int):
    with open(path, "rb") as f:
        while len(a := np.fromfile(f, dtype, count=rows)):
            yield a


def _rows(path: Path, dtype: np.dtype) -> int:
    return path.stat().st_size // dtype.itemsize


HASH_REC = np.dtype([("h", "<u8", (2,)), ("area", "<i8"), ("pos", "<i8")])
MAX_DEPTH = 8          # splits of one cluster before its rows are cut in order (k-means cannot part them)


class _Engine:
    """The pairwise keep over every cluster with at most ``max_cluster_rows`` rows held at once, whatever
    the clusters' sizes. Rows (their top-level cluster, image area, canonical position, vector) are spilled
    to disk as they stream in, twice: by cluster and by vector hash. Then

    1. identical vectors: rows grouped by their vector's xxh3-128 (a file above the budget is re-spilled
       on the next 10 bits of the hash; one holding a single hash is streamed); every row but the first in
       keep order is a copy of that first row and leaves the computation (``copy_of``);
    2. clusters: a file whose distinct rows fit the budget is loaded and each of its clusters goes through
       ``keep_blocks``; a larger file is streamed again — a cluster above the budget is split by k-means
       on a strided sample of its rows (≤ ``max_train_rows`` in all), the rest renumbered — and re-spilled
       one level down, recursively; a cluster k-means cannot part is cut in canonical order (after
       ``MAX_DEPTH`` levels, or when the sample lands on one centroid);
    3. a copy then takes its first row's outcome: a ``near_duplicate`` of the first row (similarity 1) if
       that was kept, else of the row the first one duplicates.

    Results land in ``dup_of`` / ``similarity`` (indexed by position); ``run`` returns the removals per
    threshold."""

    def __init__(self, work: Path, n: int, d: int, k: int, cfg: DedupConfig, device: str, dup_of: np.ndarray,
                 similarity: np.ndarray, vec_dtype=np.float16):
        self.work, self.cfg, self.device, self.m = work, cfg, device, cfg.max_cluster_rows
        self.dup_of, self.sim = dup_of, similarity
        self.rec = np.dtype([("cluster", "<i8"), ("area", "<i8"), ("pos", "<i8"), ("vec", vec_dtype, (d,))])
        work.mkdir(parents=True, exist_ok=True)
        self.copy_of = np.lib.format.open_memmap(work / "copy_of.npy", mode="w+", dtype=np.int64, shape=(n,))
        self.copy_of[:] = -1
        self.by_cluster = _Spill(work / "c0", k, self.rec, self.m)
        self.by_hash = _Spill(work / "h0", -(-n // self.m), HASH_REC, self.m)      # files of ~max_cluster_rows rows
        self.removed = {t: 0 for t in cfg.thresholds}
        self.copies = 0

    def add(self, cluster, area, pos, vec) -> None:
        rec = np.empty(len(pos), self.rec)
        rec["cluster"], rec["area"], rec["pos"], rec["vec"] = cluster, area, pos, vec
        self.by_cluster.add(rec, cluster)
        h = np.empty(len(pos), HASH_REC)
        h["h"], h["area"], h["pos"] = vector_hashes(vec), area, pos
        self.by_hash.add(h, h["h"][:, 0])

    def run(self) -> dict[float, int]:
        for f in self.by_hash.files():
            self._identical(f, 1)
        shutil.rmtree(self.work / "h0", ignore_errors=True)
        for f in self.by_cluster.files():
            self._clusters(f, 0)
        self._copies_follow_their_first()
        return self.removed

    # -- 1. identical vectors
    def _identical(self, path: Path, level: int) -> None:
        n = _rows(path, HASH_REC)
        if n <= self.m:
            self._mark_copies(np.fromfile(path, HASH_REC))
            return
        first = None
        single = True
        for a in _chunks(path, HASH_REC, self.m):
            first = a["h"][0] if first is None else first
            single &= bool((a["h"] == first).all())
        if single or level >= 12:                 # one vector, however many rows: stream it twice
            best = None
            for a in _chunks(path, HASH_REC, self.m):
                i = np.lexsort((a["pos"], -a["area"]))[0]
                cand = (-int(a["area"][i]), int(a["pos"][i]))
                best = cand if best is None or cand < best else best
            for a in _chunks(path, HASH_REC, self.m):
                copy = a["pos"] != best[1]
                self.copy_of[a["pos"][copy]] = best[1]
                self.copies += int(copy.sum())
            return
        word, shift = divmod(level, 6)            # the next 10 bits of the hash
        sub = _Spill(path.with_suffix(".d"), 1024, HASH_REC, self.m)
        for a in _chunks(path, HASH_REC, self.m):
            sub.add(a, a["h"][:, word] >> np.uint64(10 * shift))
        for f in sub.files():
            self._identical(f, level + 1)
        shutil.rmtree(sub.folder, ignore_errors=True)

    def _mark_copies(self, a: np.ndarray) -> None:
        o = np.lexsort((a["pos"], -a["area"], a["h"][:, 1], a["h"][:, 0]))
        h = a["h"][o]
        start = np.r_[True, (h[1:] != h[:-1]).any(axis=1)]
        first = np.maximum.accumulate(np.where(start, np.arange(len(o)), 0))
        copy = ~start
        self.copy_of[a["pos"][o][copy]] = a["pos"][o][first][copy]
        self.copies += int(copy.sum())

    # -- 2. clusters
    def _distinct(self, path: Path):
        for a in _chunks(path, self.rec, self.m):
            yield a[self.copy_of[a["pos"]] < 0]

    def _clusters(self, path: Path, depth: int) -> None:
        ids, counts = np.zeros(0, np.int64), np.zeros(0, np.int64)
        for a in self._distinct(path):
            u, c = np.unique(a["cluster"], return_counts=True)
            ids, inv = np.unique(np.r_[ids, u], return_inverse=True)
            counts = np.bincount(inv, weights=np.r_[counts, c], minlength=len(ids)).astype(np.int64)
        if counts.sum() <= self.m:
            rows = [a for a in self._distinct(path)]
            if rows:
                self._keep(np.concatenate(rows))
            return
        self._split(path, ids, counts, depth)

    def _keep(self, a: np.ndarray) -> None:
        o = np.lexsort((a["pos"], -a["area"], a["cluster"]))
        cl = a["cluster"][o]
        bounds = np.flatnonzero(np.r_[True, cl[1:] != cl[:-1], True])
        for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            members = o[lo:hi]
            pos = a["pos"][members]
            res = keep_blocks(a["vec"][members].astype(np.float32), self.cfg.thresholds, self.cfg.block_rows,
                              self.device)
            for t, (d, _) in res.items():
                self.removed[t] += int((d >= 0).sum())
            d, s = res[1.0 - self.cfg.eps]
            dup = d >= 0
            self.dup_of[pos[dup]] = pos[d[dup]]
            self.sim[pos[dup]] = s[dup]

    def _split(self, path: Path, ids: np.ndarray, counts: np.ndarray, depth: int) -> None:
        cfg, m = self.cfg, self.m
        big = counts > m
        k_sub = np.where(big, -(-counts // m) * 2, 1)
        base = np.r_[0, np.cumsum(k_sub)[:-1]]             # new ids: a small cluster one, a big one k_sub
        # a strided sample of each big cluster's rows, ≤ max_train_rows in all
        want = np.minimum(counts, k_sub * max(256, cfg.train_per_cluster)) * big
        scale = min(1.0, cfg.max_train_rows / max(int(want.sum()), 1))
        stride = np.maximum(1, counts // np.maximum(1, (want * scale).astype(np.int64)))
        cents: dict[int, np.ndarray | None] = {}
        if depth < MAX_DEPTH:
            seen, sample = np.zeros(len(ids), np.int64), {int(i): [] for i in np.flatnonzero(big)}
            for a in self._distinct(path):
                at = np.searchsorted(ids, a["cluster"])
                for i in np.unique(at[big[at]]).tolist():
                    rows = np.flatnonzero(at == i)
                    take = rows[(seen[i] + np.arange(len(rows))) % stride[i] == 0]
                    sample[i].append(a["vec"][take].astype(np.float32))
                    seen[i] += len(rows)
            for i, parts in sample.items():
                x = np.concatenate(parts)
                c = kmeans(x, int(k_sub[i]), cfg, seed_offset=depth + 1)
                cents[i] = c if len(np.unique(nearest(c, x))) > 1 else None   # one centroid: cut in order
        sub = _Spill(path.with_suffix(".d"), int(k_sub.sum()), self.rec, self.m)
        seen = np.zeros(len(ids), np.int64)
        for a in self._distinct(path):
            at = np.searchsorted(ids, a["cluster"])
            new = base[at].astype(np.int64)
            for i in np.unique(at[big[at]]).tolist():
                rows = np.flatnonzero(at == i)
                if cents.get(i) is not None:
                    new[rows] += nearest(cents[i], a["vec"][rows].astype(np.float32))
                else:
                    new[rows] += (seen[i] + np.arange(len(rows))) // m
                seen[i] += len(rows)
            a = a.copy()
            a["cluster"] = new
            sub.add(a, new)
        for f in sub.files():
            self._clusters(f, depth + 1)
        shutil.rmtree(sub.folder, ignore_errors=True)

    # -- 3. copies
    def _copies_follow_their_first(self) -> None:
        for t in self.removed:
            self.removed[t] += self.copies
        for lo in range(0, len(self.copy_of), self.m):
            cp = np.asarray(self.copy_of[lo:lo + self.m])
            at = np.flatnonzero(cp >= 0)
            if not len(at):
                continue
            first = cp[at]
            d, s = np.asarray(self.dup_of[first]), np.asarray(self.sim[first])
            self.dup_of[lo + at] = np.where(d >= 0, d, first)
            self.sim[lo + at] = np.where(d >= 0, s, np.float32(1.0))


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
        x = shards.gather(np.concatenate(files)[order].astype(object), np.concatenate(rows)[order], np.float32)
    finally:
        shards.close()
    x = x[~bad_vectors(x)]                          # a NaN, inf or zero row would poison every centroid
    return (x if len(x) else None), n_ok


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


def _npy(task: TaskContext, name: str, dtype, n: int, fill):
    """A row-aligned reduced array ``reduced/<name>.npy``, written through a temp name (``_publish``)."""
    tmp = task.reduced_path(f".tmp-{os.getpid()}-{name}.npy")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    a = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(n,))
    a[:] = fill
    return a, tmp


def find_duplicates(cfg: DedupConfig, task: TaskContext) -> None:
    """Reduce: k-means on the drawn rows; every ok row to its centroid (a bad vector to none: cluster −1),
    spilled by cluster and by vector hash; then ``_Engine`` — identical vectors, the greedy keep per cluster
    with a bounded number of rows held → ``reduced/{ids,cluster,dup_of,similarity}.npy`` + ``dedup.npz``."""
    from curation.assign import NpyShards
    from manifests.ids import hex_ids_to_u64

    train, n_ok = _training_rows(task)
    n_total = task.input_num_rows("image_embeddings")
    device = _torch_device(cfg.device)
    gpu = _gpu(cfg.device)
    task.stats.info.update({"kmeans_device": "cuda" if gpu else "cpu", "pairwise_device": device})
    work = task.step_dir / "reduce-work"          # the spills; a killed reduce's are removed by the next try
    shutil.rmtree(work, ignore_errors=True)
    arrays = {}
    engine = None
    try:
        with task.stats.timer("kmeans"):
            cents = kmeans(train, cfg.clusters_for(n_total), cfg) if train is not None else None
        # the row-aligned arrays of every ok row (8 + 4 + 8 + 4 bytes a row, on disk, memory-mapped)
        for name, dtype, fill in (("ids", np.uint64, 0), ("cluster", np.int32, -1), ("dup_of", np.int64, -1),
                                  ("similarity", np.float32, np.nan)):
            arrays[name] = _npy(task, name, dtype, n_ok, fill)
        at, last = 0, None
        sizes = np.zeros(0 if cents is None else len(cents), np.int64)
        shards = NpyShards(task.run_dir)
        with task.stats.timer("assign"), task.duckdb() as con:
            for batch in _canonical_rows(task, con, max(1024, min(65_536, cfg.max_cluster_rows))):
                files = batch.column("file").to_numpy(zero_copy_only=False)
                x = shards.gather(files, batch.column("row").to_numpy(), np.float16)
                shards.release(keep=set(files.tolist()))
                xf = x.astype(np.float32)
                good = np.flatnonzero(~bad_vectors(xf))
                if cents is None and len(good):
                    raise ValueError("dedup: no usable row was drawn to train k-means although image_embeddings "
                                     "has ok rows with finite vectors — rerun the step (the map partials are stale)")
                u = hex_ids_to_u64(batch.column("sample_id"))
                if at + len(u) > n_ok:
                    raise RuntimeError("image_embeddings changed under the reduce — rerun the step with --overwrite")
                if np.any(np.diff(u) == 0) or (last is not None and len(u) and u[0] == last):
                    raise ValueError("dedup: two ok image_embeddings rows share a sample_id — ingest marks exact "
                                     "duplicates; rerun ingest and embed-images")
                c = np.full(len(u), -1, np.int32)
                if len(good):
                    c[good] = nearest(cents, xf[good])
                    if engine is None:
                        engine = _Engine(work, n_ok, x.shape[1], len(cents), cfg, device,
                                         arrays["dup_of"][0], arrays["similarity"][0])
                    engine.add(c[good], batch.column("area").to_numpy()[good], at + good, x[good])
                    sizes += np.bincount(c[good], minlength=len(sizes))
                arrays["ids"][0][at:at + len(u)] = u
                arrays["cluster"][0][at:at + len(u)] = c
                at += len(u)
                last = u[-1] if len(u) else last
        shards.close()
        if at != n_ok:
            raise RuntimeError(f"image_embeddings changed under the reduce: {at} ok rows now, {n_ok} when mapped")
        with task.stats.timer("pairwise"):
            removed = engine.run() if engine is not None else {t: 0 for t in cfg.thresholds}
        copies = engine.copies if engine is not None else 0
        engine = None
        for name, (a, tmp) in arrays.items():
            a.flush()
            del a
            os.replace(tmp, task.reduced_path(f"{name}.npy"))
        arrays = {}
    finally:
        engine = None
        for a, tmp in arrays.values():
            del a
            tmp.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    clusters, largest = int((sizes > 0).sum()), int(sizes.max(initial=0))
    bad = n_ok - int(sizes.sum())
    eps = [round(1.0 - t, 10) for t in cfg.thresholds]
    task.write_reduced("dedup", eps=np.array(eps, np.float64),
                       removed=np.array([removed[t] for t in cfg.thresholds], np.int64),
                       images=np.array([n_ok]), clusters=np.array([clusters]), largest=np.array([largest]))
    task.stats.info.update({"clusters": clusters, "largest_cluster": largest, "images": n_ok, "bad_vectors": bad,
                            "identical_copies": copies,
                            "removed_per_eps": {f"{e:g}": removed[t] for e, t in zip(eps, cfg.thresholds)}})


def write_dedup(cfg: DedupConfig, task: TaskContext) -> None:
    """Apply: this rank's canonical slice of ``image_embeddings`` → its ``dedup`` part, row for row."""
    import pyarrow as pa
    import pyarrow.compute as pc

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
            bad = ok[cluster[ok] < 0]                   # an ok row the reduce put in no cluster: its vector
            status[bad] = BAD_VECTOR
            error = batch.column("error")
            if len(bad):
                mark = np.zeros(batch.num_rows, bool)
                mark[bad] = True
                error = pc.if_else(pa.array(mark), pa.scalar(BAD_VECTOR_ERROR), error)
            dup_of = np.full(batch.num_rows, None, object)
            dup_of[dup] = np.asarray(u64_to_hex(r["ids"][d[d >= 0]]).to_pylist(), object)
            sim = np.full(batch.num_rows, np.nan, np.float32)
            sim[dup] = r["similarity"][p[d >= 0]]
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
