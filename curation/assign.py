"""``assign``: exact top-K inner-product retrieval of concepts for every image.

Vectors are L2-normalised, so inner product = cosine similarity. Backends (same ids on the
same inputs, ties aside — ``tests/curation/test_assign.py``):

* ``faiss`` — brute force: ``faiss.knn_gpu`` on a GPU, ``IndexFlatIP`` (BLAS sgemm + heap) on CPU;
* ``torch`` — ``matmul`` + ``topk`` tiled over images *and* concepts, merging each concept tile's
  top-K into a running top-K, so memory is O(image_tile × concept_tile), never the
  85M × 500K score matrix (which would be 170 TB in fp32).

Each rank handles a contiguous slice of ``image_embeddings`` (status ok); the concept matrix is
loaded whole (500K × 1024 fp32 ≈ 2 GB, fp16 on GPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from ovpipe.step import Step, TaskContext


@dataclass
class AssignConfig:
    k: int = 10
    backend: Literal["auto", "faiss", "torch"] = "auto"
    image_tile: int = 16384
    concept_tile: int = 65536
    device: str = "auto"

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if self.image_tile < 1 or self.concept_tile < 1:
            raise ValueError("image_tile and concept_tile must be >= 1")


def topk_torch(queries: np.ndarray, keys: np.ndarray, k: int, image_tile: int = 16384,
               concept_tile: int = 65536, device: str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k of ``queries @ keys.T`` with bounded memory; (scores [n,k] desc, ids [n,k])."""
    import torch

    k = min(k, len(keys))
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    K = torch.from_numpy(np.ascontiguousarray(keys, dtype=np.float32)).to(device, dtype)
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


def topk_faiss(queries: np.ndarray, keys: np.ndarray, k: int, device: str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    import faiss

    q = np.ascontiguousarray(queries, dtype=np.float32)
    x = np.ascontiguousarray(keys, dtype=np.float32)
    k = min(k, len(x))
    if device.startswith("cuda") and hasattr(faiss, "StandardGpuResources"):
        res = faiss.StandardGpuResources()
        s, i = faiss.knn_gpu(res, q, x, k, metric=faiss.METRIC_INNER_PRODUCT)
        return s, i
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    return index.search(q, k)


def topk(queries, keys, cfg: AssignConfig, device: str) -> tuple[np.ndarray, np.ndarray, str]:
    backend = cfg.backend
    if backend == "auto":
        try:
            import faiss  # noqa: F401

            backend = "faiss"
        except ImportError:
            backend = "torch"
    if backend == "faiss":
        s, i = topk_faiss(queries, keys, cfg.k, device)
    else:
        s, i = topk_torch(queries, keys, cfg.k, cfg.image_tile, cfg.concept_tile, device)
    return s, i, backend


def run(cfg: AssignConfig, task: TaskContext) -> None:
    import pyarrow as pa

    from curation.clip import pick_device
    from curation.concepts import load_concept_matrix
    from curation.embed import load_embeddings

    device = pick_device(cfg.device)
    cids, C, _ = load_concept_matrix(task.run_dir)
    rows = [r for r in task.read_input_slice("image_embeddings").to_pylist() if r["status"] == "ok"]
    task.stats.inc("images", len(rows))
    X = load_embeddings(task.run_dir, rows) if rows else np.zeros((0, C.shape[1]), np.float32)
    with task.stats.timer("topk"):
        s, i, backend = topk(X, C, cfg, device)
    task.stats.info["backend"] = backend
    k = s.shape[1] if len(s) else min(cfg.k, len(C))
    ids = cids[i] if len(i) else np.zeros((0, k), np.int64)
    offsets = pa.array(np.arange(0, (len(rows) + 1) * k, k, dtype=np.int32))
    task.write_part("assignments", pa.table({
        "sample_id": pa.array([r["sample_id"] for r in rows], pa.string()),
        "concept_ids": pa.ListArray.from_arrays(offsets, pa.array(ids.astype(np.int32).ravel())),
        "scores": pa.ListArray.from_arrays(offsets, pa.array(s.astype(np.float32).ravel())),
    }))


STEP = Step("assign", AssignConfig, run, inputs=("image_embeddings", "concepts"), outputs=("assignments",),
            description="exact top-K concepts per image (faiss / tiled torch)")
