"""``pack``: the ``lengths`` manifest (optionally weighted by ``balanced`` copies) → ``packs``
manifest + packed webdataset shards. Algorithm: ``packing.binpack`` (hash buckets + exact BFD),
optionally ``packing.refine`` (``refine_passes``: gap consolidation + ejection chains after BFD).

Every rank solves the same global packing (deterministic, seconds for millions of samples) and
writes the packs of its contiguous ``pack_id`` range — manifest part and tar shards — so the
expensive part (reading images, tokenising into shards) is parallel over ranks and the result
is identical for any task count. ``finalize`` writes the packing report (``report.md``,
``fill_histogram.png``): bins vs the lower bound ⌈Σ lengths / seq_len⌉, fill rate, padding
tokens, and padding compression against padding every sample to ``seq_len`` and against an
online rolling-buffer packer (B = 64, 512, 4096).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from ovpipe.step import Step, TaskContext, slice_bounds

PACKABLE = ("ok", "truncated")


@dataclass
class PackConfig:
    seq_len: int = 8192
    seed: int = 0
    lengths_step: str = "lengths"               # step folder of the lengths manifest to pack
    copies_from: Literal["none", "balanced"] = "none"
    write_shards: bool = True
    packs_per_shard: int = 256
    report_buffers: list[int] = field(default_factory=lambda: [64, 512, 4096])
    report_max_samples: int = 1_000_000          # the online-buffer baselines run on at most this many
    refine_passes: int = 0                       # post-BFD gap consolidation + ejection (packing.refine)

    def __post_init__(self):
        if self.seq_len < 64:
            raise ValueError(f"seq_len must be >= 64, got {self.seq_len}")
        if self.packs_per_shard < 1:
            raise ValueError("packs_per_shard must be >= 1")
        if self.refine_passes < 0:
            raise ValueError(f"refine_passes must be >= 0, got {self.refine_passes}")


def packing_items(task: TaskContext, cfg: PackConfig):
    """(sample_ids, lengths, copy_index, keys) of every item to pack (copies expanded)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from packing.binpack import GOLDEN, hex_ids_to_u64, splitmix64

    lengths = task.read_input("lengths", step=cfg.lengths_step,
                              columns=["sample_id", "total_tokens", "status"])
    mask = pc.is_in(lengths.column("status"), value_set=pa.array(PACKABLE))
    lengths = lengths.filter(mask)
    sid = lengths.column("sample_id").combine_chunks()
    L = lengths.column("total_tokens").to_numpy().astype(np.int64)
    copies = np.ones(len(L), np.int64)
    if cfg.copies_from == "balanced":
        bal = task.read_input("balanced", columns=["sample_id", "copies"])
        pos = pc.index_in(sid, value_set=bal.column("sample_id").combine_chunks())
        got = pc.take(bal.column("copies").combine_chunks(), pos)
        copies = pc.fill_null(got, 0).to_numpy(zero_copy_only=False).astype(np.int64)
    idx = np.repeat(np.arange(len(L)), copies)
    copy_no = np.arange(len(idx)) - np.repeat(np.cumsum(copies) - copies, copies)
    u = hex_ids_to_u64(sid)[idx]
    with np.errstate(over="ignore"):
        keys = splitmix64(u ^ splitmix64(np.uint64(cfg.seed) + copy_no.astype(np.uint64) * GOLDEN))
    return sid, L, idx, keys


def run(cfg: PackConfig, task: TaskContext) -> None:
    from packing.binpack import lower_bound, pack

    with task.stats.timer("solve"):
        sid, L, idx, keys = packing_items(task, cfg)
        P = pack(L[idx], cfg.seq_len, keys=keys, seed=cfg.seed, refine_passes=cfg.refine_passes)
    lo, hi = slice_bounds(P.n_bins, task.rank, task.world_size)
    if task.rank == 0:  # global figures once (merged stats add ranks up)
        task.stats.inc("items", len(idx))
        task.stats.inc("bins", P.n_bins)
        task.stats.inc("lower_bound", lower_bound(L[idx], cfg.seq_len))
        task.stats.inc("tokens", int(L[idx].sum()))
    table = packs_table(sid, L, idx, P, lo, hi, cfg.packs_per_shard if cfg.write_shards else None, task.rank)
    task.stats.inc("packs_written", hi - lo)
    if cfg.write_shards and hi > lo:
        with task.stats.timer("write_shards"):
            write_pack_shards(task, cfg, table)
    task.write_part("packs", table)


def packs_table(sid, L, idx, P, lo: int, hi: int, packs_per_shard: int | None, rank: int = 0):
    """The ``packs`` rows of bins [lo, hi) — built with Arrow list arrays, no loop per bin."""
    import pyarrow as pa
    import pyarrow.compute as pc

    a, b = int(P.start[lo]), int(P.start[hi])
    items = idx[P.item[a:b]]
    offs = (P.start[lo:hi + 1] - a).astype(np.int32)
    lens = L[items].astype(np.int32)
    n_in_bin = np.diff(offs)
    bin_start_tok = np.zeros(len(lens), np.int64)
    if len(lens):
        csum = np.cumsum(lens, dtype=np.int64)
        first = np.repeat(offs[:-1], n_in_bin)
        bin_base = np.where(first > 0, csum[np.maximum(first - 1, 0)], 0)
        bin_start_tok = (csum - lens) - bin_base
    off_arr = pa.array(offs)
    shard = None
    if packs_per_shard:
        j = np.arange(hi - lo) // packs_per_shard
        names = np.array([f"pack-{rank:05d}-{k:05d}.tar" for k in range(int(j.max()) + 1 if len(j) else 0)])
        shard = pa.array(names[j] if len(j) else [], pa.string())
    else:
        shard = pa.nulls(hi - lo, pa.string())
    return pa.table({
        "pack_id": pa.array(np.arange(lo, hi, dtype=np.int64)),
        "sample_ids": pa.ListArray.from_arrays(off_arr, pc.take(sid, pa.array(items))),
        "lengths": pa.ListArray.from_arrays(off_arr, pa.array(lens)),
        "offsets": pa.ListArray.from_arrays(off_arr, pa.array(bin_start_tok.astype(np.int32))),
        "total_tokens": pa.array(P.load[lo:hi].astype(np.int32)),
        "shard": shard,
    })


def write_pack_shards(task: TaskContext, cfg: PackConfig, packs) -> None:
    from curation.ingest import read_image_bytes
    from packing.lengths import LengthsConfig
    from packing.tokens import encode_sample, image_grid, load_tokenizer
    from packing.shards import write_shard
    from ovpipe.config import load_config

    lcfg = load_config(LengthsConfig, json.loads((task.run_dir / cfg.lengths_step / "config.json").read_text()))
    tok = load_tokenizer(lcfg.tokenizer)
    need = set(s for ids in packs.column("sample_ids").to_pylist() for s in ids)
    samples = task.read_input("samples", columns=["sample_id", "shard", "shard_format", "offset", "size",
                                                  "image_format", "width", "height", "caption", "status"])
    rows = {}
    for r in samples.to_pylist():
        if r["sample_id"] in need and r["status"] == "ok" and r["sample_id"] not in rows:
            rows[r["sample_id"]] = r
    entries, shard = [], None
    for p in packs.to_pylist():
        ids, mask, images, exts, grids = [], [], [], [], []
        for s, want in zip(p["sample_ids"], p["lengths"]):
            r = rows[s]
            a, m, _ = encode_sample(tok, r["caption"], r["height"], r["width"], lcfg.template,
                                    lcfg.image_cfg(), max_tokens=want)
            if len(a) != want:
                raise RuntimeError(f"sample {s}: encoded {len(a)} tokens but lengths says {want} — "
                                   f"tokenizer or template changed since `lengths` ran?")
            ids.append(a)
            mask.append(m)
            images.append(read_image_bytes(r))
            exts.append({"jpeg": "jpg"}.get(r["image_format"], r["image_format"] or "bin"))
            gh, gw = image_grid(np.array([r["height"]]), np.array([r["width"]]), lcfg.image_cfg())
            grids.append((int(gh[0]), int(gw[0])))
        e = {"pack_id": p["pack_id"], "sample_ids": p["sample_ids"], "lengths": p["lengths"],
             "offsets": p["offsets"], "seq_len": cfg.seq_len, "ids": np.concatenate(ids),
             "mask": np.concatenate(mask), "images": images, "exts": exts, "grids": grids}
        if shard is not None and p["shard"] != shard:
            write_shard(task.data_path(shard), entries)
            entries = []
        shard = p["shard"]
        entries.append(e)
    if entries:
        write_shard(task.data_path(shard), entries)


def finalize(cfg: PackConfig, task: TaskContext) -> None:
    from packing.report import packing_report

    packing_report(cfg, task)


STEP = Step("pack", PackConfig, run, inputs=("lengths",), outputs=("packs",), finalize=finalize,
            description="offline hash-bucket BFD packing into fixed-length sequences")
