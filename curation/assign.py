"""``assign``: exact top-K inner-product retrieval of concepts for every image.

Vectors are L2-normalised, so inner product = cosine similarity. Backends (same ids on the
same inputs, ties aside — ``tests/curation/test_clip_assign.py``):

* ``faiss`` — brute force: a flat inner-product index (BLAS sgemm + heap) on CPU, moved to the GPU
  with ``faiss.index_cpu_to_gpu`` when there is one;
* ``torch`` — ``matmul`` + ``topk`` tiled over images *and* concepts, merging each concept tile's
  top-K into a running top-K, so memory is O(image_tile × concept_tile), never the
  85M × 500K score matrix (which would be 170 TB in fp32). On CPU in fp32; on a GPU
  (``curation.assign_gpu``) the keys stay resident in fp16, each score tile's top candidates are taken
  in fp16 and rescored in fp32, certified exact (a doubtful row is recomputed in fp32), with one
  transfer back per query tile, the next tile queued while the last is read.

``auto`` picks faiss where it can run on the device (faiss-gpu on a GPU, faiss-cpu on a CPU), else torch.

Each rank streams its canonical slice of ``image_embeddings`` in batches of ``image_tile`` rows
(``TaskContext.iter_input``). The vectors of a batch are gathered from the memory-mapped fp16
``.npy`` shards (``NpyShards``), whose mapped pages are dropped again after the batch
(``madvise(MADV_DONTNEED)``: touched file pages count in the resident set until then), and the
``assignments`` part is written batch by batch (``TaskContext.part_writer``, which holds at most one
1M-row row group, ~110 MB at K=10). So a task holds the concept matrix, one batch and that buffer,
whatever the size of its slice (``tests/curation/test_assign_streaming.py``). The concept matrix is
gathered from its mapped shards block by block into the index (500K × 1024 fp32 ≈ 2 GB; fp16 on GPU),
built once per task. Rows whose status is not ``ok`` get no assignment and are counted as ``skipped/<status>``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np

from ovpipe.step import Step, TaskContext, slice_bounds


@dataclass
class AssignConfig:
    k: int = 10  # concepts kept per image (top-K by inner product)
    # exact inner product on faiss or torch; auto: faiss where installed
    backend: Literal["auto", "faiss", "torch"] = "auto"
    image_tile: Optional[int] = None     # None: 16384 on CPU, 32768 on a GPU
    concept_tile: Optional[int] = None   # None: 65536 on CPU, 262144 on a GPU (docs/curation.md)
    device: str = "auto"  # auto: cuda when present, else cpu

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if (self.image_tile is not None and self.image_tile < 1) or (self.concept_tile is not None
                                                                      and self.concept_tile < 1):
            raise ValueError("image_tile and concept_tile must be >= 1 (or null: by device)")

    def for_device(self, device: str) -> "AssignConfig":
        """The tiles resolved for ``device``: a GPU's fp16 score tile of 32768 × 262144 (17 GB), the fastest
        of the tile shapes measured (docs/curation.md, *assign on a GPU*); a CPU's fp32 tile stays at
        16384 × 65536."""
        from dataclasses import replace

        gpu = device.startswith("cuda")
        return replace(self, image_tile=self.image_tile or (32768 if gpu else 16384),
                       concept_tile=self.concept_tile or (262144 if gpu else 65536))


class NpyShards:
    """Row gathers from ``.npy`` shards (paths relative to the run folder), memory-mapped, not loaded.

    ``gather(files, rows)`` reads only the rows asked for; ``release()`` drops the pages mapped so
    far (they stay in the page cache, but leave this process's resident set), so a task walking a
    20 GB shard holds one batch of it, not the pages it has touched."""

    def __init__(self, run_dir):
        self.run_dir = run_dir
        self._open: dict[str, tuple] = {}

    def _array(self, rel: str) -> np.ndarray:
        if rel not in self._open:
            import mmap

            with open(f"{self.run_dir}/{rel}", "rb") as f:
                major, _ = np.lib.format.read_magic(f)
                read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                shape, fortran, dtype = read_header(f)
                offset = f.tell()
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            if fortran or len(shape) != 2:
                mm.close()
                raise ValueError(f"{rel}: expected a C-order 2-D .npy array, got shape {shape}")
            self._open[rel] = (mm, np.ndarray(shape, dtype, buffer=mm, offset=offset))
        return self._open[rel][1]

    def gather(self, files, rows, dtype=np.float32) -> np.ndarray:
        """[n, d] in ``dtype`` (None: the shards' own, fp16 for ``embed-*``'s): row ``rows[j]`` of shard
        ``files[j]``."""
        files = np.asarray(files, dtype=object)
        rows = np.asarray(rows, dtype=np.int64)
        out = None
        names = list(dict.fromkeys(files.tolist()))
        if dtype is None and names:
            dtype = np.result_type(*(self._array(rel).dtype for rel in names))
        for rel in names:
            a = self._array(rel)
            if out is None:
                out = np.empty((len(rows), a.shape[1]), dtype)
            j = np.flatnonzero(files == rel)
            r = rows[j]
            if len(r) and (r.min() < 0 or r.max() >= len(a)):
                raise IndexError(f"{rel}: rows up to {r.max()} asked, the shard has {len(a)}")
            out[j] = a[r]
        return out if out is not None else np.zeros((0, 0), np.float32 if dtype is None else dtype)

    def release(self, keep=()) -> None:
        """Drop the mapped pages of every open shard; close the shards not in ``keep``."""
        import mmap

        for rel in list(self._open):
            if rel in keep:
                self._open[rel][0].madvise(mmap.MADV_DONTNEED)
            else:
                mm, array = self._open.pop(rel)
                del array                     # the only view of the mapping: now it can close
                mm.close()

    def close(self) -> None:
        self.release(keep=())


CONCEPT_COLUMNS = ["concept_id", "file", "row"]


def concept_blocks(concepts, run_dir, block_rows: int = 65536, dtype=np.float32):
    """(concept_ids int64[V] in concept_id order, an iterator of their vectors as ``dtype`` blocks (None:
    the shards' own) of at most ``block_rows`` rows, in the same order), gathered from the mapped shards (paths relative to
    ``run_dir``) that the ``concepts`` manifest's ``CONCEPT_COLUMNS`` (canonical order) point at: the
    index or tensor is filled block by block, never beside a second whole copy of the matrix."""
    t = concepts
    files, rows = t.column("file").to_numpy(zero_copy_only=False), t.column("row").to_numpy()

    def blocks():
        shards = NpyShards(run_dir)
        try:
            for a in range(0, len(rows), block_rows):
                yield shards.gather(files[a:a + block_rows], rows[a:a + block_rows], dtype)
                shards.release(keep=set(files[a:a + block_rows].tolist()))
        finally:
            shards.close()

    return t.column("concept_id").to_numpy().astype(np.int64), blocks()


def _topk_tiles(queries: np.ndarray, K, k: int, image_tile: int, concept_tile: int, device: str):
    import torch

    dtype = K.dtype
    out_s = np.empty((len(queries), k), np.float32)
    out_i = np.empty((len(queries), k), np.int64)
    with torch.inference_mode():
        for a in range(0, len(queries), image_tile):
            Q = torch.from_numpy(np.ascontiguousarray(queries[a:a + image_tile], dtype=np.float32)).to(device, dtype)
            best_s = best_i = None
            for c in range(0, len(K), concept_tile):
                s = Q @ K[c:c + concept_tile].T
                ts, ti = torch.topk(s.float(), min(k, s.shape[1]), dim=1)
                ti = ti + c
                if best_s is None:
                    best_s, best_i = ts, ti
                else:
                    ms, pos = torch.topk(torch.cat([best_s, ts], 1), k, dim=1)
                    best_i = torch.gather(torch.cat([best_i, ti], 1), 1, pos)
                    best_s = ms
            out_s[a:a + len(Q)] = best_s.cpu().numpy()
            out_i[a:a + len(Q)] = best_i.cpu().numpy()
    return out_s, out_i


def _torch_keys(keys: np.ndarray, device: str):
    import torch

    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    return torch.from_numpy(np.ascontiguousarray(keys, dtype=np.float32)).to(device, dtype)


def topk_torch(queries: np.ndarray, keys: np.ndarray, k: int, image_tile: int = 16384,
               concept_tile: int = 65536, device: str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k of ``queries @ keys.T`` with bounded memory; (scores [n,k] desc, ids [n,k])."""
    if device.startswith("cuda"):
        from curation.assign_gpu import GpuTopK, topk_tiles

        return topk_tiles(GpuTopK(keys, k, device, concept_tile), queries, image_tile)
    return _topk_tiles(queries, _torch_keys(keys, device), min(k, len(keys)), image_tile, concept_tile, device)


def _faiss_index(keys, device: str):
    """A flat inner-product index over ``keys`` (an array, or an iterable of row blocks in order)."""
    import faiss

    index = None
    for block in ([keys] if isinstance(keys, np.ndarray) else keys):
        if index is None:
            index = faiss.IndexFlatIP(block.shape[1])
        index.add(np.ascontiguousarray(block, dtype=np.float32))
    if index is None:
        return None
    if device.startswith("cuda") and hasattr(faiss, "StandardGpuResources"):
        res = faiss.StandardGpuResources()
        gpu = faiss.index_cpu_to_gpu(res, int(device.partition(":")[2] or 0), index)
        gpu.referenced_resources = res      # keep the resources alive as long as the index
        return gpu
    return index


def topk_faiss(queries: np.ndarray, keys: np.ndarray, k: int, device: str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    return _faiss_index(keys, device).search(np.ascontiguousarray(queries, dtype=np.float32), min(k, len(keys)))


def resolve_backend(backend: str, device: str = "cpu") -> str:
    """``auto``: faiss where it runs on ``device`` (faiss-cpu on a GPU machine would leave the GPU idle)."""
    if backend != "auto":
        return backend
    try:
        import faiss
    except ImportError:
        return "torch"
    if device.startswith("cuda") and not hasattr(faiss, "StandardGpuResources"):
        return "torch"
    return "faiss"


class Searcher:
    """Exact top-K over a fixed concept matrix, its index (faiss) or tensor (torch) built once and
    queried batch after batch."""

    def __init__(self, keys, cfg: AssignConfig, device: str, n_keys: int | None = None):
        """``keys``: float32 [V, d] (fp16 on the GPU path), or an iterable of its row blocks in order (``concept_blocks``; then
        ``n_keys`` = V)."""
        self.backend = resolve_backend(cfg.backend, device)
        self.gpu = None
        cfg = cfg.for_device(device)
        self.cfg, self.device = cfg, device
        if self.backend == "faiss":
            self.index = _faiss_index(keys, device)
            n = 0 if self.index is None else self.index.ntotal
        else:
            if not isinstance(keys, np.ndarray):       # fill one array block by block (no second copy)
                whole, at = None, 0
                for block in keys:
                    if whole is None:
                        whole = np.empty((n_keys, block.shape[1]), block.dtype)
                    whole[at:at + len(block)] = block
                    at += len(block)
                keys = whole if whole is not None else np.zeros((0, 0), np.float32)
            n = len(keys)
            if device.startswith("cuda") and n:
                from curation.assign_gpu import GpuTopK

                self.gpu = GpuTopK(keys, cfg.k, device, cfg.concept_tile)
            else:
                self.keys = _torch_keys(keys, device)
        if n == 0:
            raise ValueError("assign: the concepts manifest has no rows — run embed-concepts on a vocabulary first")
        self.k = min(cfg.k, n)

    def submit(self, queries: np.ndarray):
        """Start a batch; ``result`` of the handle gives (scores, ids). On the GPU path the work is queued
        and this returns at once, so the caller can gather the next batch meanwhile."""
        if self.gpu is not None and len(queries):
            from curation.assign_gpu import topk_tiles

            if len(queries) <= self.cfg.image_tile:
                return ("gpu", self.gpu.submit(queries))
            return ("done", topk_tiles(self.gpu, queries, self.cfg.image_tile))
        return ("done", self._search(queries))

    def result(self, handle) -> tuple[np.ndarray, np.ndarray]:
        kind, h = handle
        return self.gpu.result(h) if kind == "gpu" else h

    def __call__(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.result(self.submit(queries))

    def _search(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if len(queries) == 0:
            return np.zeros((0, self.k), np.float32), np.zeros((0, self.k), np.int64)
        if self.backend == "faiss":
            return self.index.search(np.ascontiguousarray(queries, dtype=np.float32), self.k)
        return _topk_tiles(queries, self.keys, self.k, self.cfg.image_tile, self.cfg.concept_tile, self.device)


def topk(queries, keys, cfg: AssignConfig, device: str) -> tuple[np.ndarray, np.ndarray, str]:
    search = Searcher(keys, cfg, device)
    s, i = search(queries)
    return s, i, search.backend


def run(cfg: AssignConfig, task: TaskContext) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc

    from curation.clip import pick_device

    device = pick_device(cfg.device)
    cfg = cfg.for_device(device)
    # on a GPU the fp16 shards travel as they are (half the bytes to convert, hold and upload; GpuTopK
    # rescores in fp32 from the same exact values); the CPU paths compute in fp32
    native = None if device.startswith("cuda") else np.float32
    cids, blocks = concept_blocks(task.read_input("concepts", columns=CONCEPT_COLUMNS), task.run_dir, dtype=native)
    search = Searcher(blocks, cfg, device, n_keys=len(cids))
    task.stats.info["backend"] = search.backend
    k = search.k
    lo, hi = slice_bounds(task.input_num_rows("image_embeddings"), task.rank, task.world_size)
    shards = NpyShards(task.run_dir)

    def write(out, ok, handle):
        with task.stats.timer("topk"):
            s, i = search.result(handle)
        offsets = pa.array(np.arange(0, (ok.num_rows + 1) * k, k, dtype=np.int32))
        out.write(pa.table({
            "sample_id": ok.column("sample_id"),
            "concept_ids": pa.ListArray.from_arrays(offsets, pa.array(cids[i].astype(np.int32).ravel())),
            "scores": pa.ListArray.from_arrays(offsets, pa.array(s.astype(np.float32).ravel())),
        }))

    try:
        with task.part_writer("assignments") as out:
            pending = None          # the batch on the GPU while the next one is gathered here
            for batch in task.iter_input("image_embeddings", ["sample_id", "file", "row", "status"], lo=lo, hi=hi,
                                         batch_rows=cfg.image_tile):
                status = batch.column("status")
                for s, n in zip(*np.unique(status.to_numpy(zero_copy_only=False).astype(str), return_counts=True)):
                    if s != "ok":
                        task.stats.inc(f"skipped/{s}", int(n))
                ok = batch.filter(pc.equal(status, "ok"))
                task.stats.inc("images", ok.num_rows)
                files = ok.column("file").to_numpy(zero_copy_only=False)
                X = shards.gather(files, ok.column("row").to_numpy(), native)
                with task.stats.timer("topk"):
                    handle = search.submit(X)
                shards.release(keep=set(files.tolist()))
                if pending is not None:
                    write(out, *pending)
                pending = (ok, handle)
            if pending is not None:
                write(out, *pending)
    finally:
        shards.close()


STEP = Step("assign", AssignConfig, run, inputs={"image_embeddings": None, "concepts": None}, outputs=("assignments",),
            description="exact top-K concepts per image (faiss / tiled torch)")
