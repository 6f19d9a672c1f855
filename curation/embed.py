"""``embed-images``: MetaCLIP image embeddings, L2-normalised, as fp16 ``.npy`` shards.

Each rank embeds its contiguous slice of ``samples`` (status ``ok`` only; the others are counted
and written with their status, ``row = -1``), in batches of ``batch_size`` rows cut at global row
numbers (``curation.decode``): the vectors go to the ``.npy`` shard batch by batch (``NpyRowWriter``)
and the rows to the manifest part (``TaskContext.part_writer``), so a task holds the model and the
batches in flight, whatever its slice. Decoding runs ahead of the model, off its thread's GIL:
``decode = threads`` (a thread pool, the CPU default) or ``processes`` (DataLoader workers, each
decoding ``decode_unit`` rows of a batch at a time, the batch reassembled in pinned memory: the GPU
default), ``prefetch`` deep, with ``jpeg_draft`` (libjpeg's reduced-scale decode; the GPU default);
``jpeg_decode = nvjpeg`` decodes JPEGs on the GPU instead. Output: ``RUN/embed-images/data/emb-{rank:05d}.npy`` (float16, [n_ok, d]) and the
``image_embeddings`` manifest (sample_id, file, row, status, error), row-aligned. A sample that fails
to decode here becomes ``status = decode_error`` with the message.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from functools import partial

import numpy as np

from curation.decode import DecodeConfig
from ovpipe.config import check_step_folder
from ovpipe.step import Step, TaskContext


@dataclass
class EmbedImagesConfig:
    model: str = "ViT-H-14-quickgelu"         # the open_clip architecture (MetaCLIP's ViT-H/14 by default)
    pretrained: str = "metaclip_fullcc"       # an open_clip tag or a checkpoint path
    batch_size: int = 256                     # images embedded per forward pass
    decode_workers: int | None = None          # threads or processes that decode (``decode``); None: processes
                                               # on every CPU the task may use but one (at most 32), threads: 8
    decode: str = "auto"                       # auto: processes on a GPU, threads on a CPU
    prefetch: int = 2                          # decode units ahead, per worker process (batches, per pool, for threads)
    decode_unit: int = 256                     # processes: rows a worker decodes at a time (a batch is cut into
                                               # such units, spread over the workers). Smaller units fill the
                                               # pipeline sooner but cost the main process a merge per unit:
                                               # 32 measured slower than 128-256 (docs/curation.md)
    jpeg_decode: str = "auto"                  # nvjpeg: JPEGs decoded on the GPU (torchvision.io.decode_jpeg);
                                               # auto: the CPU workers (measured faster: docs/curation.md)
    nvjpeg_share: float = 1.0                  # with nvjpeg: the share of JPEG rows it takes (the rest: CPU workers)
    jpeg_draft: bool | None = None             # CPU decode of a JPEG at the smallest DCT scale covering the crop;
                                               # None: on with a GPU (the fastest measured path), off on a CPU
    fast_resize: bool | None = None            # the resize + crop as torch's uint8 antialiased interpolation
                                               # (within two uint8 levels of PIL's; 0.64x the decode time);
                                               # None: on with a GPU, off on a CPU (bit-identical to open_clip)
    device: str = "auto"                       # auto: cuda when present, else cpu
    # the ingest step folder(s) whose images are embedded: one name, or a list (each source / language
    # ingested on its own, read together in canonical order); dedup and align read the same samples
    samples_step: str | list[str] = "ingest"

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        self.decode_config()      # the decoder's fields, checked by DecodeConfig (it names the field)
        if self.jpeg_decode == "nvjpeg" and self.device == "cpu":
            raise ValueError("jpeg_decode='nvjpeg' needs a CUDA device, got device='cpu'")
        steps = [self.samples_step] if isinstance(self.samples_step, str) else self.samples_step
        if not steps:
            raise ValueError("samples_step must name at least one ingest step folder")
        for s in steps:
            check_step_folder("samples_step", s)
        if len(set(steps)) != len(steps):
            raise ValueError(f"samples_step names a step twice: {steps!r}")

    def check(self, run_dir) -> None:
        """Before any task: the model name and a checkpoint path (``curation.clip.check_clip``)."""
        from curation.clip import check_clip

        check_clip(self.model, self.pretrained, run_dir)

    def decode_config(self) -> DecodeConfig:
        """The decoder's knobs (this config's fields of the same names), as one value."""
        return DecodeConfig(**{f.name: getattr(self, f.name) for f in fields(DecodeConfig)})


def embedded_batches(source, net, preprocess, device: str, decode: DecodeConfig, stats=None):
    """The embedding pipeline, the step's and every caller's: the batches of ``source()`` (a picklable
    callable yielding row batches) decoded ahead as ``decode`` says (resolved here for ``device``), then
    embedded: (prepared batch, positions embedded, float32 [n, d] L2-normalised embeddings or None), per
    batch, in order. ``stats`` gets the decode's description (``info["decode"]``) and the embedding
    loop's counters and host waits."""
    from curation import decode as dec

    pre = dec.split_preprocess(preprocess)
    decode = decode.resolve(device)
    decoder = dec.make_decoder(pre, device, decode)
    if stats is not None:
        stats.info["decode"] = dec.describe(decode, decoder)
    yield from dec.embed_batches(dec.decoded_batches(source, decoder, decode, device), net, pre, device, stats)


def embed_rows(rows: list[dict], net, preprocess, device: str, batch_size: int,
               decode: DecodeConfig = DecodeConfig(), stats=None):
    """``embedded_batches`` over in-memory ``rows`` (tests, benches): the embeddings (float32,
    L2-normalised) of the rows that decode, in order, and per-row errors (None where the row was
    embedded)."""
    from curation.decode import list_batches

    out, errors = [], [None] * len(rows)
    for b, (batch, _, e) in enumerate(embedded_batches(partial(list_batches, rows, batch_size), net, preprocess,
                                                       device, decode, stats)):
        for j, err in batch["errors"].items():
            errors[b * batch_size + j] = err
        if e is not None:
            out.append(e)
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

        from manifests.io import atomic_write

        self._f.close()
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                  "shape": (self.rows, self.dim if self.dim is not None else dim)}
        with atomic_write(self.path) as tmp, open(tmp, "wb") as out, open(self.raw, "rb") as raw:
            np.lib.format.write_array_header_1_0(out, header)
            shutil.copyfileobj(raw, out, 16 << 20)
        self.raw.unlink()

    def abort(self) -> None:
        self._f.close()
        self.raw.unlink(missing_ok=True)


SAMPLE_COLUMNS = ["sample_id", "shard", "shard_format", "offset", "size", "images", "status", "error"]


def run(cfg: EmbedImagesConfig, task: TaskContext) -> None:
    """This rank's canonical slice of ``samples``, batch by batch: decode (ahead, in workers) + embed,
    append the vectors to the ``.npy`` shard and the rows to the manifest part. Memory: the model + the
    decode units in flight (``decode_workers × prefetch`` at most), whatever the size of the slice."""
    import torch

    import pyarrow as pa

    from curation.clip import load_clip
    from curation.decode import manifest_batches
    from manifests.schemas import schema_for
    from ovpipe.step import slice_bounds

    torch.set_num_threads(max(1, torch.get_num_threads()))
    lo, hi = slice_bounds(task.input_num_rows("samples"), task.rank, task.world_size)
    net, preprocess, _, device = load_clip(cfg.model, cfg.pretrained, cfg.device)
    files = [str(f) for f in task.input_files("samples")]     # plain paths: the decode workers read them too
    source = partial(manifest_batches, files, SAMPLE_COLUMNS, lo, hi, cfg.batch_size, str(task.step_dir))
    name = f"emb-{task.rank:05d}.npy"
    rel = f"{task.step}/data/{name}"
    vecs = NpyRowWriter(task.data_path(name))
    try:
        with task.part_writer("image_embeddings") as out:
            with task.stats.timer("embed"):
                for batch, pos, emb in embedded_batches(source, net, preprocess, device, cfg.decode_config(),
                                                        task.stats):
                    at = dict(zip(pos, range(vecs.rows, vecs.rows + len(pos))))
                    rows = []
                    for j, r in enumerate(batch["rows"]):
                        if r["status"] != "ok":
                            task.stats.inc(f"skipped/{r['status']}")
                            rows.append({"sample_id": r["sample_id"], "file": None, "row": -1,
                                         "status": r["status"], "error": r["error"]})
                        elif j in batch["errors"]:
                            task.stats.inc("status/decode_error")
                            rows.append({"sample_id": r["sample_id"], "file": None, "row": -1,
                                         "status": "decode_error", "error": batch["errors"][j]})
                        else:
                            rows.append({"sample_id": r["sample_id"], "file": rel, "row": at[j], "status": "ok",
                                         "error": None})
                    assert len(at) == (0 if emb is None else len(emb)), (len(at), None if emb is None else emb.shape)
                    if emb is not None:
                        vecs.write(emb)
                    out.write(pa.Table.from_pylist(rows, schema=schema_for("image_embeddings")))
        vecs.close(dim=getattr(net.visual, "output_dim", 0))   # (the width of an empty shard)
    except BaseException:
        vecs.abort()
        raise


STEP = Step("embed-images", EmbedImagesConfig, run, inputs={"samples": "samples_step"}, outputs=("image_embeddings",),
            check=EmbedImagesConfig.check,
            description="MetaCLIP image embeddings (open_clip)")
