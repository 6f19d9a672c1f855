"""``index``: a faiss index over ``embed-images``' vectors and a 2-D layout of them for the viewer's map.

The index answers "more like this" and text queries (cosine = inner product of unit vectors):

* ``flat`` — exact: every vector as fp16 codes (``SQfp16``, exact over the fp16 shards embed wrote),
  2 bytes × d a row; a query scans all of them (43 ms at 100K, 539 ms at 1M × 1024 on the shared 2-core
  machine), so ``auto`` takes it up to ``exact_max_rows``;
* ``ivf`` — ``IVF{nlist},SQfp16``: the same codes in ``nlist`` k-means lists, ``nprobe`` lists scanned a query;
* ``ivfpq`` — ``IVF{nlist},PQ{pq_bytes}``: ``pq_bytes`` a row (64: 32× smaller than fp16 at d = 1024),
  from ``ivfpq_min_rows`` on, where fp16 codes stop fitting a serving machine (85M × 1024 × 2 = 174 GB;
  IVF-PQ64: 5.4 GB + 0.7 GB of ids).

The layout: spherical k-means (``layout_clusters`` centroids, faiss; the same centroids are the IVF lists), the
centroids projected to 2-D by PCA (faiss ``PCAMatrix``), each point drawn at ``(1 − spread)·P(c) + spread·P(x)``
— its centroid's place plus its own offset along the same two axes, shrunk. What it loses: everything outside
the centroids' top two principal axes, so clusters far apart in d dimensions can land on top of each other, and
2-D distance is not cosine (the neighbour pages query the index, never the map): of a point's 10 nearest
neighbours in 1024-d, 5% (30K rows) to 0.1% (1M) are among its 10 nearest on the map (UMAP: 70% at 30K). It costs
the k-means and list assignment the IVF index needs anyway plus one projection — 55 CPU-s at 1M × 1024, ≈ 8
CPU-hours projected to 85M, streamed in bounded memory — where UMAP and openTSNE hold every vector in one process
and build a kNN graph over all of them (``bench/bench_layout.py``, ``bench/results/bench_layout.txt``).

Map → reduce → apply, byte-identical at any task count:

* map (``draw_training_rows``): rank r streams its share of ``image_embeddings`` and keeps where the ok rows
  drawn to train lie — a seeded hash draw of the sample id, so the same rows whatever the task count.
* reduce (``build_index``): gathers the drawn vectors in id order, trains (k-means, PCA, PQ: fixed seeds, one
  process), streams every ok row in canonical order into the index (memory: the index's codes + one batch) and
  writes ``data/index.faiss``, ``data/ids.npy`` (uint64 sample id of each index position, ascending),
  ``data/rows.npy`` (its vector's shard — ``index.json``'s ``shards`` — and row, for exact cosines) and the
  row-aligned ``reduced/{xy,cluster}.npy``.
* apply (``write_map``): rank r writes its ``embedding_map`` part — every ``image_embeddings`` row with its
  2-D place, cluster, and ``in_map`` (a seeded draw of ≈ ``map_rows`` rows, the points the map page draws).

An ``ok`` row whose vector has no cosine (``curation.dedup.bad_vectors``: NaN, ±inf, a norm off 1 — a zero row)
is left out of the index by the reduce (``reduced/bad_ids.npy``) and is ``bad_vector`` in ``embedding_map``:
no place, position −1, never ``in_map`` — as ``align`` and ``dedup`` treat it.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np

from curation.dedup import BAD_VECTOR, _draws, _training_rows, bad_vectors, nearest, write_training_draw
from ovpipe.config import check_range, check_step_folder
from ovpipe.step import Step, TaskContext

KINDS = ("auto", "flat", "ivf", "ivfpq")
EMB_COLUMNS = ["sample_id", "file", "row", "status"]
SMALL_TRAIN = 1 << 24                  # training floats below which faiss trains on one thread
ROW_DTYPE = np.dtype([("shard", "<i4"), ("row", "<i8")])   # data/rows.npy: where position p's vector lies


@dataclass
class IndexConfig:
    kind: str = "auto"                 # flat | ivf | ivfpq; auto: by rows (the two thresholds below)
    exact_max_rows: int = 200_000      # auto: flat (exact) up to here — a query scans them all (≈ 90 ms at 200K)
    ivfpq_min_rows: int = 2_000_000    # auto: IVF-PQ from here (fp16 codes: 4 GB at 2M × 1024), IVF-SQfp16 below
    nlist: int = 0                     # IVF lists = layout clusters; 0: √N (1,000 at 1M, 9,200 at 85M), ≤ 65,536
    train_per_list: int = 64           # rows drawn to train per list (faiss warns below 39)
    nprobe: int = 32                   # IVF lists scanned a query (stored in the index)
    pq_bytes: int = 64                 # IVF-PQ bytes a vector (d must be a multiple of it)
    train_rows: int = 600_000          # at most this many rows drawn to train (× d fp32 in the reduce: 2.5 GB)
    map_rows: int = 1_000_000          # rows the map draws (``in_map``): WebGL stays interactive up to ≈ 1M
    spread: float = 0.35               # a point's own offset from its centroid's place, shrunk by this
    niter: int = 20                    # k-means iterations
    seed: int = 0  # the training-row draw and the map layout's initialisation
    batch_rows: int = 65_536           # rows gathered and added at a time in the reduce
    embeddings_step: str = "embed-images"  # the step folder of the image vectors indexed

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("exact_max_rows", "ivfpq_min_rows", "nprobe", "pq_bytes", "train_per_list", "train_rows",
                     "map_rows", "niter", "batch_rows"):
            check_range(self, name, lo=1)
        check_range(self, "nlist", lo=0, hi=65_536)
        check_range(self, "spread", lo=0, hi=1)
        check_step_folder("embeddings_step", self.embeddings_step)

    def kind_for(self, n: int) -> str:
        if self.kind != "auto":
            return self.kind
        return "flat" if n <= self.exact_max_rows else ("ivf" if n < self.ivfpq_min_rows else "ivfpq")

    def clusters_for(self, n: int) -> int:
        """k-means centroids (the IVF lists): ``nlist`` or √N."""
        return max(1, min(self.nlist or int(math.sqrt(max(n, 1))), 65_536))

    def train_fraction(self, n: int) -> float:
        """The share of rows drawn to train: ``train_per_list`` a list, at most ``train_rows``."""
        return min(1.0, min(self.train_rows, self.train_per_list * self.clusters_for(n)) / max(n, 1))


# ------------------------------------------------------------------------------------- the step

def draw_training_rows(cfg: IndexConfig, task: TaskContext) -> None:
    """Map: where this rank's drawn ok rows lie (id, shard, row) and its ok count."""
    write_training_draw(task, cfg.train_fraction(task.input_num_rows("image_embeddings")), cfg.seed)


def train(x: np.ndarray, n: int, cfg: IndexConfig):
    """(faiss index, empty and trained; centroids k × d; 2-D PCA of the centroids) from the training rows ``x``
    (fp32 unit rows in id order) for an index of ``n`` rows."""
    import faiss

    d = x.shape[1]
    threads = faiss.omp_get_max_threads()
    if x.size < SMALL_TRAIN:             # OpenMP's spin-waits cost more than a second thread gains here: measured
        faiss.omp_set_num_threads(1)     # 0.5 s against 11 s for IVF-PQ on 1,200 rows on the loaded 2-core machine
    try:
        return _train(x, n, cfg, d)
    finally:
        faiss.omp_set_num_threads(threads)


def _train(x: np.ndarray, n: int, cfg: IndexConfig, d: int):
    import faiss

    k = max(1, min(cfg.clusters_for(n), len(x) // 39))      # faiss's minimum: 39 training rows a centroid
    km = faiss.Kmeans(d, k, niter=cfg.niter, seed=cfg.seed % (2**31 - 1) or 1, spherical=True, verbose=False,
                      max_points_per_centroid=max(256, -(-len(x) // k)), min_points_per_centroid=1)
    km.train(x)
    cents = np.ascontiguousarray(km.centroids, dtype=np.float32)
    pca = faiss.PCAMatrix(d, 2)
    pca.train(cents if k >= 3 else x)
    kind = cfg.kind_for(n)
    if kind == "flat":
        index = faiss.IndexScalarQuantizer(d, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
    else:
        quantizer = faiss.IndexFlatIP(d)
        quantizer.add(cents)
        if kind == "ivf":
            index = faiss.IndexIVFScalarQuantizer(quantizer, d, k, faiss.ScalarQuantizer.QT_fp16,
                                                  faiss.METRIC_INNER_PRODUCT)
        else:
            if d % cfg.pq_bytes:
                raise ValueError(f"pq_bytes={cfg.pq_bytes} must divide the vectors' width {d}")
            index = faiss.IndexIVFPQ(quantizer, d, k, cfg.pq_bytes, 8, faiss.METRIC_INNER_PRODUCT)
            index.pq.cp.seed = cfg.seed % (2**31 - 1) or 1
        index.cp.seed = cfg.seed % (2**31 - 1) or 1
        index.own_fields = True
        quantizer.this.disown()
        index.train(x)                   # the coarse quantizer is already trained: only the codes' training runs
        index.nprobe = min(cfg.nprobe, k)
    return index, cents, pca


def layout(pca, cents: np.ndarray, cluster: np.ndarray, x: np.ndarray, spread: float) -> np.ndarray:
    """The 2-D place of each row of ``x``: its centroid's projection plus its own, shrunk by ``spread``."""
    own = pca.apply_py(np.ascontiguousarray(x, dtype=np.float32))
    at = pca.apply_py(cents)[cluster]
    return ((1.0 - spread) * at + spread * own).astype(np.float32)


def build_index(cfg: IndexConfig, task: TaskContext) -> None:
    """Reduce: train on the drawn rows, add every ok row in canonical order, write the index and the layout."""
    import faiss
    import pyarrow.compute as pc

    from curation.assign import NpyShards
    from manifests.ids import hex_ids_to_u64

    x, n_ok = _training_rows(task)
    meta = {"kind": cfg.kind_for(n_ok), "rows": n_ok, "dim": 0, "nlist": 0, "nprobe": 0, "shards": []}
    data = task.step_dir / "data"
    data.mkdir(parents=True, exist_ok=True)
    tmp = {name: data / f".tmp-{os.getpid()}-{name}" for name in ("index.faiss", "ids.npy", "rows.npy")}
    tmp.update({name: task.reduced_path(f".tmp-{os.getpid()}-{name}") for name in ("xy.npy", "cluster.npy")})
    task.reduced_path("").mkdir(parents=True, exist_ok=True)
    try:
        ids = np.lib.format.open_memmap(tmp["ids.npy"], mode="w+", dtype=np.uint64, shape=(n_ok,))
        rows = np.lib.format.open_memmap(tmp["rows.npy"], mode="w+", dtype=ROW_DTYPE, shape=(n_ok,))
        xy = np.lib.format.open_memmap(tmp["xy.npy"], mode="w+", dtype=np.float32, shape=(n_ok, 2))
        cluster = np.lib.format.open_memmap(tmp["cluster.npy"], mode="w+", dtype=np.int32, shape=(n_ok,))
        x_trained, at, bad_ids = x is not None, 0, []
        if x is None:
            if n_ok:
                raise ValueError("index: no row was drawn to train although image_embeddings has ok rows — "
                                 "rerun the step with --overwrite (the map partials are stale)")
            faiss.write_index(faiss.IndexFlatIP(1), str(tmp["index.faiss"]))
        else:
            with task.stats.timer("train"):
                index, cents, pca = train(x, n_ok, cfg)
            del x
            meta.update(dim=index.d, nlist=len(cents), nprobe=int(getattr(index, "nprobe", 0)))
            shards = NpyShards(task.run_dir)
            at, last, shard_no = 0, None, {}
            n_bad, bad_ids = 0, []
            with task.stats.timer("add"):
                for batch in task.iter_input_canonical("image_embeddings", EMB_COLUMNS):
                    batch = batch.filter(pc.equal(batch.column("status"), "ok"))
                    if not batch.num_rows:
                        continue
                    files = batch.column("file").to_numpy(zero_copy_only=False)
                    v = shards.gather(files, batch.column("row").to_numpy(), np.float32)
                    shards.release(keep=set(files.tolist()))
                    u = hex_ids_to_u64(batch.column("sample_id"))
                    if at + n_bad + len(u) > n_ok or np.any(np.diff(u) <= 0) or (last is not None and u[0] <= last):
                        raise RuntimeError("index: image_embeddings is not in sample_id order or changed under the "
                                           "reduce — rerun embed-images, then this step with --overwrite")
                    last = u[-1]
                    # a NaN, inf or zero vector has no cosine: not in the index, not on the map (as align, dedup)
                    bad = bad_vectors(v)
                    if bad.any():
                        bad_ids.append(u[bad])
                        n_bad += int(bad.sum())
                        keep = np.flatnonzero(~bad)
                        v, u, files = v[keep], u[keep], files[keep]
                        batch = batch.take(keep)
                        if not len(u):
                            continue
                    c = nearest(cents, v)
                    if meta["kind"] == "flat":
                        index.add(v)
                    else:                        # the lists are the layout's clusters: assigned once, not twice
                        lists = c.astype(np.int64)
                        index.add_core(len(v), faiss.swig_ptr(v), None, faiss.swig_ptr(lists))
                    ids[at:at + len(u)] = u
                    rows["shard"][at:at + len(u)] = [shard_no.setdefault(f, len(shard_no)) for f in files.tolist()]
                    rows["row"][at:at + len(u)] = batch.column("row").to_numpy()
                    cluster[at:at + len(u)] = c
                    xy[at:at + len(u)] = layout(pca, cents, c, v, cfg.spread)
                    at += len(u)
            shards.close()
            if at + n_bad != n_ok:
                raise RuntimeError(f"index: image_embeddings changed under the reduce: {at + n_bad} ok rows, "
                                   f"{n_ok} mapped")
            faiss.write_index(index, str(tmp["index.faiss"]))
            meta["shards"] = list(shard_no)
        for a in (ids, rows, xy, cluster):
            a.flush()
        del ids, rows, xy, cluster
        n_bad = n_ok - at if x_trained else 0
        if n_bad:                        # the arrays were sized for every ok row: cut them to the indexed ones
            for name in ("ids.npy", "rows.npy", "xy.npy", "cluster.npy"):
                _truncate(tmp[name], at)
        meta["rows"], meta["bad_vectors"] = n_ok - n_bad, n_bad
        _save_npy(task.reduced_path("bad_ids.npy"),
                  np.sort(np.concatenate(bad_ids)) if n_bad else np.zeros(0, np.uint64))
        (data / ".tmp-index.json").write_text(json.dumps(meta, sort_keys=True) + "\n")
        os.replace(data / ".tmp-index.json", data / "index.json")
        for name, p in tmp.items():
            os.replace(p, (data if name in ("index.faiss", "ids.npy", "rows.npy") else task.reduced_path("")) / name)
    finally:
        for p in tmp.values():
            p.unlink(missing_ok=True)
    task.stats.info.update({k: meta[k] for k in ("kind", "rows", "nlist", "bad_vectors")})
    task.stats.info["index_mb"] = round((data / "index.faiss").stat().st_size / 2**20, 1)


def _truncate(path, n: int) -> None:
    """Cut the ``.npy`` at ``path`` to its first ``n`` rows, copied a million rows at a time (bounded memory)."""
    src = np.load(path, mmap_mode="r")
    tmp = path.with_name(path.name + ".cut")
    dst = np.lib.format.open_memmap(tmp, mode="w+", dtype=src.dtype, shape=(n, *src.shape[1:]))
    for i in range(0, n, 1 << 20):
        j = min(n, i + (1 << 20))
        dst[i:j] = src[i:j]
    dst.flush()
    del src, dst
    os.replace(tmp, path)


def _save_npy(path, a: np.ndarray) -> None:
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    np.save(tmp, a)
    os.replace(tmp, path)


def write_map(cfg: IndexConfig, task: TaskContext) -> None:
    """Apply: this rank's canonical slice of ``image_embeddings`` → its ``embedding_map`` part, row for row."""
    import pyarrow as pa

    from manifests.ids import hex_ids_to_u64
    from ovpipe.mapreduce import BATCH_ROWS

    ids = np.load(task.step_dir / "data" / "ids.npy", mmap_mode="r")
    bad_path = task.reduced_path("bad_ids.npy")
    bad_ids = np.load(bad_path) if bad_path.exists() else np.zeros(0, np.uint64)
    xy = np.load(task.reduced_path("xy.npy"), mmap_mode="r")
    cluster_of = np.load(task.reduced_path("cluster.npy"), mmap_mode="r")
    frac = min(1.0, cfg.map_rows / max(len(ids), 1))
    with task.part_writer("embedding_map", row_group_rows=BATCH_ROWS) as out:
        for batch in task.iter_input_slice("image_embeddings", ["sample_id", "status"]):
            status = batch.column("status").to_numpy(zero_copy_only=False).astype(object)
            ok = np.flatnonzero(status == "ok")
            u = hex_ids_to_u64(batch.column("sample_id").take(pa.array(ok, pa.int64())))
            if len(bad_ids):             # the reduce left these out: bad_vector, no place, not on the map
                is_bad = np.isin(u, bad_ids)
                status[ok[is_bad]] = BAD_VECTOR
                ok, u = ok[~is_bad], u[~is_bad]
                task.stats.inc("bad_vectors", int(is_bad.sum()))
            p = np.searchsorted(ids, u)
            if len(p) and (p.max() >= len(ids) or np.any(ids[np.minimum(p, len(ids) - 1)] != u)):
                raise RuntimeError("index: image_embeddings changed since the reduce — rerun with --overwrite")
            pos = np.full(batch.num_rows, -1, np.int64)
            pos[ok] = p
            x = np.full(batch.num_rows, np.nan, np.float32)
            y = x.copy()
            cl = np.full(batch.num_rows, -1, np.int32)
            x[ok], y[ok], cl[ok] = xy[p, 0], xy[p, 1], cluster_of[p]
            drawn = np.zeros(batch.num_rows, bool)
            drawn[ok] = _draws(u, cfg.seed + 1) < frac
            out.write(pa.table({"sample_id": batch.column("sample_id"), "position": pa.array(pos),
                                "x": pa.array(x, mask=np.isnan(x)), "y": pa.array(y, mask=np.isnan(y)),
                                "cluster": pa.array(cl), "in_map": pa.array(drawn),
                                "status": pa.array(status.tolist(), pa.string())}))
            task.stats.inc("rows", batch.num_rows)
            task.stats.inc("in_map", int(drawn.sum()))


STEP = Step("index", IndexConfig, draw_training_rows, reduce=build_index, apply=write_map,
            inputs={"image_embeddings": "embeddings_step"}, outputs=("embedding_map",),
            description="faiss index + 2-D map layout of the image vectors")
