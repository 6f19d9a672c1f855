"""``embed-images``: MetaCLIP image embeddings, L2-normalised, as fp16 ``.npy`` shards.

Each rank embeds its contiguous slice of ``samples`` (status ``ok`` only; the others are counted
and written with their status, ``row = -1``). Images are decoded and preprocessed by a pool of
``decode_workers`` threads (PIL releases the GIL while decoding) a few batches ahead of the model,
so the GPU is not starved. Output: ``RUN/embed-images/data/emb-{rank:05d}.npy`` (float16,
[n_ok, d]) and the ``image_embeddings`` manifest (sample_id, file, row, status, error), row-aligned.
A sample that fails to decode here becomes ``status = decode_error`` with the message.
"""
from __future__ import annotations

import io
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


def run(cfg: EmbedImagesConfig, task: TaskContext) -> None:
    import torch

    from curation.clip import load_clip

    torch.set_num_threads(max(1, torch.get_num_threads()))
    samples = task.read_input_slice("samples", step=cfg.samples_step,
                                    columns=["sample_id", "shard", "shard_format", "offset", "size", "images",
                                             "status", "error"]).to_pylist()
    for r in samples:   # curation embeds a sample's first image; a text-only sample has none
        if r["status"] == "ok" and not r["images"]:
            r["status"], r["error"] = "no_image", "text-only sample: nothing to embed"
    ok_rows = [r for r in samples if r["status"] == "ok"]
    for r in samples:
        if r["status"] != "ok":
            task.stats.inc(f"skipped/{r['status']}")
    net, preprocess, _, device = load_clip(cfg.model, cfg.pretrained, cfg.device)
    with task.stats.timer("embed"):
        emb, errors = embed_rows(ok_rows, net, preprocess, device, cfg.batch_size, cfg.decode_workers, task.stats)
    rel = task.write_npy(f"emb-{task.rank:05d}.npy", emb.astype(np.float16))
    rows, k = [], 0
    err_by_id = {r["sample_id"]: e for r, e in zip(ok_rows, errors)}
    for r in samples:
        if r["status"] != "ok":
            rows.append({"sample_id": r["sample_id"], "file": None, "row": -1, "status": r["status"], "error": r["error"]})
        elif err_by_id.get(r["sample_id"]) is not None:
            task.stats.inc("status/decode_error")
            rows.append({"sample_id": r["sample_id"], "file": None, "row": -1, "status": "decode_error",
                         "error": err_by_id[r["sample_id"]]})
        else:
            rows.append({"sample_id": r["sample_id"], "file": rel, "row": k, "status": "ok", "error": None})
            k += 1
    assert k == len(emb), (k, len(emb))
    task.write_part("image_embeddings", rows, sort=False)


def load_embeddings(run_dir, manifest_rows) -> np.ndarray:
    """float32 [n, d] for manifest rows (``file``/``row`` relative to the run folder)."""
    cache: dict[str, np.ndarray] = {}
    out = []
    for r in manifest_rows:
        f = r["file"]
        if f not in cache:
            cache[f] = np.load(f"{run_dir}/{f}", mmap_mode="r")
        out.append(cache[f][r["row"]])
    return np.asarray(out, dtype=np.float32)


STEP = Step("embed-images", EmbedImagesConfig, run, inputs=("samples",), outputs=("image_embeddings",),
            check=EmbedImagesConfig.check,
            description="MetaCLIP image embeddings (open_clip)")
