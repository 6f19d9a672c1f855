"""``embed-images``: MetaCLIP image embeddings, L2-normalised, as fp16 ``.npy`` shards.

Each rank embeds its contiguous slice of ``samples`` (status ``ok`` only; the others are counted
and written with their status, ``row = -1``), streamed in blocks of ``4 × batch_size`` rows
(``manifests.io.iter_manifest``): the vectors go to the ``.npy`` shard block by block
(``NpyRowWriter``) and the rows to the manifest part (``TaskContext.part_writer``), so a task holds
the model and one block, whatever its slice. Within a block, images are decoded and preprocessed by a
pool of ``decode_workers`` threads (PIL releases the GIL while decoding) a few batches ahead of the
model, so the GPU is not starved. Output: ``RUN/embed-images/data/emb-{rank:05d}.npy`` (float16,
[n_ok, d]) and the ``image_embeddings`` manifest (sample_id, file, row, status, error), row-aligned.
A sample that fails to decode here becomes ``status = decode_error`` with the message.
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass

import numpy as np

from ovpipe.config import check_step_folder
from ovpipe.step import Step, TaskContext, require_manifest


@dataclass
class EmbedImagesConfig:
    model: str = "ViT-H-14-quickgelu"
    pretrained: str = "metaclip_fullcc"       # an open_clip tag or a checkpoint path
    batch_size: int = 256
    decode_workers: int = 8
    device: str = "auto"
    samples_step: str = "ingest"               # the ingest step folder whose images are embedded

    def __post_init__(self):
        if self.batch_size < 1 or self.decode_workers < 1:
            raise ValueError("batch_size and decode_workers must be >= 1")
        check_step_folder("samples_step", self.samples_step)

    def check(self, run_dir) -> None:
        require_manifest(run_dir, "samples", self.samples_step, "samples_step")


def _decode(row: dict, preprocess):
    from PIL import Image, ImageOps

    from curation.ingest import read_image_bytes

    try:
        with Image.open(io.BytesIO(read_image_bytes(row))) as im:   # upright, as ingest sized it
            return preprocess(ImageOps.exif_transpose(im).convert("RGB")), None
    except Exception as e:  # corrupt data that passed ingest's header check
        return None, f"{type(e).__name__}: {e}"[:300]


def embed_rows(rows: list[dict], net, preprocess, device: str, batch_size: int, workers: int, stats=None):
    """Embeddings (float32, L2-normalised) of rows that decode, plus per-row (ok, error)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from curation.clip import autocast

    out, errors = [], [None] * len(rows)
    with ThreadPoolExecutor(workers) as pool, torch.inference_mode():
        futures = [pool.map(lambda r: _decode(r, preprocess), rows[i:i + batch_size])
                   for i in range(0, len(rows), batch_size)]  # decoding runs ahead of the model
        for b, fut in enumerate(futures):
            got = list(fut)
            ok_idx = [j for j, (x, _) in enumerate(got) if x is not None]
            for j, (_, err) in enumerate(got):
                errors[b * batch_size + j] = err
            if not ok_idx:
                continue
            x = torch.stack([got[j][0] for j in ok_idx]).to(device)
            with autocast(device):
                e = net.encode_image(x)
            e = torch.nn.functional.normalize(e.float(), dim=-1)
            out.append(e.cpu().numpy())
            if stats is not None:
                stats.inc("embedded", len(ok_idx))
    d = net.visual.output_dim if hasattr(net.visual, "output_dim") else (out[0].shape[1] if out else 0)
    emb = np.concatenate(out) if out else np.zeros((0, d), np.float32)
    return emb, errors


class NpyRowWriter:
    """An ``.npy`` shard written block by block: rows are appended to a temp file, and ``close`` puts the
    ``.npy`` header (the final row count) in front of them and renames the file into place — so a task
    never holds its shard's embeddings at once. Temp names are ``.tmp-{pid}-*`` (removed by the run
    folder's cleanup if the task dies)."""

    def __init__(self, path, dtype=np.float16):
        from pathlib import Path

        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.raw = self.path.with_name(f".tmp-{os.getpid()}-{self.path.name}.raw")
        self.tmp = self.path.with_name(f".tmp-{os.getpid()}-{self.path.name}")
        self._f = open(self.raw, "wb")
        self.rows, self.dim = 0, None

    def write(self, block: np.ndarray) -> None:
        block = np.ascontiguousarray(block, dtype=self.dtype)
        if block.ndim != 2:
            raise ValueError(f"{self.path.name}: expected a 2-D block, got shape {block.shape}")
        if not len(block):
            return
        if self.dim is None:
            self.dim = block.shape[1]
        elif block.shape[1] != self.dim:
            raise ValueError(f"{self.path.name}: rows of width {block.shape[1]} after rows of width {self.dim}")
        self._f.write(block.tobytes())
        self.rows += len(block)

    def close(self, dim: int = 0) -> None:
        """Finish the shard; ``dim`` is its width if no row was written."""
        import shutil

        self._f.close()
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                  "shape": (self.rows, self.dim if self.dim is not None else dim)}
        with open(self.tmp, "wb") as out, open(self.raw, "rb") as raw:
            np.lib.format.write_array_header_1_0(out, header)
            shutil.copyfileobj(raw, out, 16 << 20)
        self.raw.unlink()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self._f.close()
        self.raw.unlink(missing_ok=True)
        self.tmp.unlink(missing_ok=True)


SAMPLE_COLUMNS = ["sample_id", "shard", "shard_format", "offset", "size", "images", "status", "error"]


def run(cfg: EmbedImagesConfig, task: TaskContext) -> None:
    """This rank's canonical slice of ``samples``, streamed ``4 × batch_size`` rows at a time: decode +
    embed a block, append its vectors to the ``.npy`` shard and its rows to the manifest part. Memory:
    the model + one block (its decoded images), whatever the size of the slice."""
    import torch

    import pyarrow as pa

    from curation.clip import load_clip
    from manifests.io import iter_manifest, manifest_num_rows
    from manifests.schemas import schema_for
    from ovpipe.step import slice_bounds

    torch.set_num_threads(max(1, torch.get_num_threads()))
    n = manifest_num_rows(task.run_dir, "samples", cfg.samples_step)
    lo, hi = slice_bounds(n, task.rank, task.world_size)
    net, preprocess, _, device = load_clip(cfg.model, cfg.pretrained, cfg.device)
    name = f"emb-{task.rank:05d}.npy"
    rel = f"{task.step}/data/{name}"
    vecs = NpyRowWriter(task.data_path(name))
    try:
        with task.part_writer("image_embeddings") as out:
            for batch in iter_manifest(task.run_dir, "samples", step=cfg.samples_step, columns=SAMPLE_COLUMNS,
                                       lo=lo, hi=hi, batch_rows=4 * cfg.batch_size):
                samples = batch.to_pylist()
                for r in samples:   # curation embeds a sample's first image; a text-only sample has none
                    if r["status"] == "ok" and not r["images"]:
                        r["status"], r["error"] = "no_image", "text-only sample: nothing to embed"
                    if r["status"] != "ok":
                        task.stats.inc(f"skipped/{r['status']}")
                ok_pos = [j for j, r in enumerate(samples) if r["status"] == "ok"]
                with task.stats.timer("embed"):
                    emb, errors = embed_rows([samples[j] for j in ok_pos], net, preprocess, device, cfg.batch_size,
                                             cfg.decode_workers, task.stats)
                error_at = dict(zip(ok_pos, errors))
                rows, k = [], vecs.rows
                for j, r in enumerate(samples):
                    if r["status"] != "ok":
                        rows.append({"sample_id": r["sample_id"], "file": None, "row": -1, "status": r["status"],
                                     "error": r["error"]})
                    elif error_at[j] is not None:
                        task.stats.inc("status/decode_error")
                        rows.append({"sample_id": r["sample_id"], "file": None, "row": -1, "status": "decode_error",
                                     "error": error_at[j]})
                    else:
                        rows.append({"sample_id": r["sample_id"], "file": rel, "row": k, "status": "ok", "error": None})
                        k += 1
                assert k - vecs.rows == len(emb), (k - vecs.rows, len(emb))
                vecs.write(emb)
                out.write(pa.Table.from_pylist(rows, schema=schema_for("image_embeddings")))
        vecs.close(dim=getattr(net.visual, "output_dim", 0))   # (the width of an empty shard)
    except BaseException:
        vecs.abort()
        raise


STEP = Step("embed-images", EmbedImagesConfig, run, inputs=("samples",), outputs=("image_embeddings",),
            check=EmbedImagesConfig.check,
            description="MetaCLIP image embeddings (open_clip)")
