"""Packed shards: webdataset tars, one entry per packed sequence, written once, read by the trainer.

Entry ``{pack_id:012d}`` holds::

    .json      {"pack_id", "sample_ids", "lengths", "offsets", "total_tokens", "seq_len",
                "image_counts", "image_grids", "image_exts"}
    .ids.npy   int32[total_tokens]   token ids of every sample, concatenated (image pads expanded)
    .mask.npy  uint8[total_tokens]   1 on loss tokens: every assistant turn's text + its end-of-turn token
    .img000.jpg, .img001.png, …      every image of every sample, as ingested (never re-encoded)

The ``.json`` fields:

* ``sample_ids`` / ``lengths`` / ``offsets`` — the samples in sequence order, their token counts
  (the ``lengths`` manifest's ``total_tokens``) and where each starts; ``total_tokens = Σ lengths``.
* ``image_counts`` — images per sample, aligned with ``sample_ids`` (0 for a text-only sample; a
  conversation may hold several). The images of sample ``k`` are the ``image_counts[k]`` entries
  after those of samples ``0..k-1``, in placeholder order: ``img{i:03d}`` numbers images across
  the whole pack, so ``Σ image_counts == len(image_grids) == len(image_exts)`` (possibly 0).
* ``image_grids`` — ``[grid_h, grid_w]`` per image: the ViT patch grid (h'/14, w'/14) after
  smart-resize; each image holds ``grid_h·grid_w/4`` ``<|image_pad|>`` ids in ``ids``, in the same order.
* ``image_exts`` — the file extension of each image member.

``iter_packed(path)`` yields :class:`PackedSequence` with ``cu_seqlens`` (sample boundaries,
for THD attention), ``position_ids`` restarting at every sample and ``images_per_sample``, so
the trainer builds its batch without re-tokenising. ``len(ids) == total_tokens`` by construction,
and a test checks it against the ``packs`` manifest for every pack.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np


@dataclass
class PackedSequence:
    pack_id: int
    sample_ids: list[str]
    input_ids: np.ndarray        # int32[T]
    loss_mask: np.ndarray        # uint8[T]
    cu_seqlens: np.ndarray       # int32[n_samples + 1]
    position_ids: np.ndarray     # int32[T], restart at 0 for each sample
    images: list[bytes]          # every image of the pack, sample by sample, in placeholder order
    image_grids: np.ndarray      # int32[n_images, 2]: ViT patch grid (h/14, w/14) per image
    seq_len: int
    images_per_sample: list[int] = field(default_factory=list)  # aligned with sample_ids; sums to len(images)

    @property
    def total_tokens(self) -> int:
        return int(len(self.input_ids))


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def write_shard(path: Path, entries: list[dict]) -> None:
    """entries: dicts with pack_id, sample_ids, lengths, offsets, seq_len, ids, mask, images, exts,
    grids (one per image) and image_counts (one per sample)."""
    import webdataset as wds

    from manifests.io import atomic_write

    with atomic_write(path) as tmp, wds.TarWriter(str(tmp), mtime=0, encoder=False) as tw:
        for e in entries:
            counts = [int(x) for x in e["image_counts"]]
            if len(counts) != len(e["sample_ids"]) or not (sum(counts) == len(e["images"]) == len(e["grids"])
                                                           == len(e["exts"])):
                raise ValueError(f"pack {e['pack_id']}: image_counts {counts} for {len(e['sample_ids'])} samples do "
                                 f"not match {len(e['images'])} images / {len(e['grids'])} grids / {len(e['exts'])} exts")
            meta = {"pack_id": int(e["pack_id"]), "sample_ids": list(e["sample_ids"]),
                    "lengths": [int(x) for x in e["lengths"]], "offsets": [int(x) for x in e["offsets"]],
                    "total_tokens": int(len(e["ids"])), "seq_len": int(e["seq_len"]), "image_counts": counts,
                    "image_grids": [[int(a), int(b)] for a, b in e["grids"]], "image_exts": list(e["exts"])}
            sample = {"__key__": f"{int(e['pack_id']):012d}", "json": json.dumps(meta).encode(),
                      "ids.npy": _npy(np.asarray(e["ids"], np.int32)),
                      "mask.npy": _npy(np.asarray(e["mask"], np.uint8))}
            for i, (img, ext) in enumerate(zip(e["images"], e["exts"])):
                sample[f"img{i:03d}.{ext}"] = img
            tw.write(sample)


def iter_packed(path: str | Path) -> Iterator[PackedSequence]:
    """Yield the packed sequences of one shard, in file order."""
    import webdataset as wds

    # One shard, read whole: which rank reads which shard is the caller's decision (tensor-parallel
    # ranks must see the same data), so webdataset's own node/worker splitting is switched off.
    keep_all = lambda urls: urls  # noqa: E731
    for s in wds.WebDataset(str(path), shardshuffle=False, empty_check=False, nodesplitter=keep_all,
                            workersplitter=keep_all):
        yield decode_packed(s)


def decode_packed(parts: dict) -> PackedSequence:
    """One tar entry's members (``{"json": bytes, "ids.npy": bytes, "mask.npy": bytes, "img000.jpg": bytes,
    ...}``, as webdataset or energon's ``CrudeWebdataset`` hands them over, undecoded) → a
    :class:`PackedSequence`: the one decoding of a pack, shared by ``iter_packed`` and the energon cooker
    (``packing.energon``)."""
    meta = json.loads(parts["json"])
    ids = np.load(io.BytesIO(parts["ids.npy"]), allow_pickle=False)
    mask = np.load(io.BytesIO(parts["mask.npy"]), allow_pickle=False)
    lengths = np.asarray(meta["lengths"], np.int32)
    cu = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(lengths, out=cu[1:])
    pos = (np.arange(len(ids), dtype=np.int32) - np.repeat(cu[:-1], lengths)).astype(np.int32)
    images = [parts[f"img{i:03d}.{ext}"] for i, ext in enumerate(meta["image_exts"])]
    # Shards written before conversations held exactly one image per sample.
    per_sample = meta.get("image_counts", [1] * len(lengths))
    return PackedSequence(meta["pack_id"], meta["sample_ids"], ids, mask, cu, pos, images,
                          np.asarray(meta["image_grids"], np.int32).reshape(-1, 2), meta["seq_len"],
                          [int(x) for x in per_sample])


def _shard_order(path: Path) -> tuple:
    """Sort key: the numbers in the name, as integers (``pack-000012.tar`` → (12,)), so the order is
    pack_id order even past the zero padding; older rank-named shards (``pack-RRRRR-KKKKK.tar``,
    written in pack_id order rank by rank) sort by (rank, k)."""
    import re

    return tuple(int(x) for x in re.findall(r"\d+", path.name)), path.name


def packed_shards(run_dir: str | Path, step: str = "pack") -> list[Path]:
    """The packed shards of a pack step, in ``pack_id`` order (shard ``j`` holds pack_ids
    ``[j·packs_per_shard, (j+1)·packs_per_shard)``)."""
    files = sorted((Path(run_dir) / step / "data").glob("pack-*.tar"), key=_shard_order)
    if not files:
        raise FileNotFoundError(f"no packed shards under {run_dir}/{step}/data — did you run `ovpipe pack`?")
    if len({len(_shard_order(f)[0]) for f in files}) > 1:
        raise ValueError(f"{run_dir}/{step}/data mixes rank-named shards (pack-RRRRR-KKKKK.tar, an older ovpipe) "
                         f"with pack_id-named ones (pack-JJJJJJ.tar): re-run `ovpipe pack --name {step} --overwrite`")
    return files
