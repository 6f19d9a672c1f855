"""A pack's compute cost: its forward + backward FLOPs, from what it holds, by the FLOP accounting MFU uses.

The trainer's FLOP model (``pretrain.trainer.flops``) is linear in five counts per micro-batch, so a pack's
cost is their dot product with one weight per count (``flops.term_weights``)::

    cost = w_tokens·Σ L  +  w_attn_sq·Σ L²  +  w_vit_tokens·Σ (patches + 1)  +  w_vit_sq·Σ (patches + 1)²
           + w_merged·Σ patches/4

over the pack's samples (L: tokens) and images (the tower sees ``patches + 1`` tokens per image, a class token
included; the LLM sees ``patches/4`` merged tokens). ``w`` comes from ``packing/cost_weights.json`` (model
FLOPs per unit count for every recipe × stage, written by ``python -m pretrain.trainer.flops``; a test keeps it
equal to the model) or from a JSON file of the same five keys that a measurement fitted (seconds per unit:
``bench/bench_pack_cost.py``, ``bench/gpu/pack_cost_h200.sh``). For the 4B at stage 1.5 an 8K pack of ten
one-image captions (700 merged tokens each) costs 2.8e14 FLOPs, the tower 27% of it (its attention 8%) and the
LLM's causal attention 2%; a pack of two 4K-token text conversations costs 2.3e14, attention 13% of it.

Per sample the counts come from ``lengths`` (``total_tokens``, ``image_tokens``, ``images``, ``vit_sq``); a
pack's are sums, stored in the ``packs`` manifest with the cost (``attn_sq``, ``images``, ``vit_tokens``,
``vit_sq``, ``cost``), so a new weight file re-costs a run without repacking (``cost_of``).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np

TERMS = ("tokens", "attn_sq", "vit_tokens", "vit_sq", "merged")     # pretrain.trainer.flops.STAT_TERMS
DEFAULT = "llava-ov-1.5-4b/1.5"
TABLE = Path(__file__).with_name("cost_weights.json")


@lru_cache(maxsize=None)
def _table() -> dict:
    return json.loads(TABLE.read_text())


def weights(spec: str = DEFAULT) -> dict:
    """Per-term weights: ``RECIPE/STAGE`` (an entry of ``cost_weights.json``) or a JSON file with the five
    ``TERMS`` (fitted). A bad spec raises ``ValueError`` naming the entries."""
    table = _table()
    if spec in table:
        return dict(table[spec])
    p = Path(spec)
    if not p.is_file():
        raise ValueError(f"cost_weights must be one of {sorted(table)} or a JSON file of the terms {list(TERMS)}, "
                         f"got {spec!r}")
    w = json.loads(p.read_text())
    missing = [k for k in TERMS if not isinstance(w.get(k), (int, float))]
    if missing:
        raise ValueError(f"cost_weights file {spec}: no number for {missing} (it needs all of {list(TERMS)})")
    return {k: float(w[k]) for k in TERMS}


def image_stats(patches: np.ndarray, owner: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sample: (images, Σ (patches + 1)²) over its images (``patches``: the tower's patches of each
    image, ``owner``: the sample it belongs to, ``n`` samples)."""
    t = np.asarray(patches, np.int64) + 1
    owner = np.asarray(owner, np.int64)
    return (np.bincount(owner, minlength=n).astype(np.int64),
            np.bincount(owner, weights=(t * t).astype(np.float64), minlength=n).round().astype(np.int64))


def pack_stats(lengths, image_tokens, images, vit_sq, offs) -> dict:
    """The five counts of every pack (plus ``images``) from its slots' ``lengths`` columns (bin after bin;
    ``offs``: each bin's first slot, ``offs[-1]`` = slots). ``image_tokens`` is ``lengths.image_tokens``:
    merged tokens + 2 (vision start and end) per image."""
    offs = np.asarray(offs, np.int64)
    L = np.asarray(lengths, np.int64)
    img = np.asarray(images, np.int64)
    merged = np.asarray(image_tokens, np.int64) - 2 * img

    def per_bin(x):
        out = np.zeros(len(offs) - 1, np.int64)
        full = offs[:-1] < offs[1:]
        if len(x) and full.any():
            out[full] = np.add.reduceat(x, offs[:-1][full])
        return out

    m = per_bin(merged)
    n_img = per_bin(img)
    return {"tokens": per_bin(L), "attn_sq": per_bin(L * L), "vit_tokens": 4 * m + n_img,
            "vit_sq": per_bin(np.asarray(vit_sq, np.int64)), "merged": m, "images": n_img}


def cost_of(stats: dict, w: dict) -> np.ndarray:
    """Σ_k w[k]·stats[k] per pack, float64 (FLOPs with the model's weights)."""
    return sum(float(w[k]) * np.asarray(stats[k], np.float64) for k in TERMS)


def entry_columns(lengths, grids, w: dict | None = None) -> dict:
    """The ``packs`` cost columns of one packed-shard entry (its samples' ``lengths`` and its images' patch
    ``grids``), for a step that writes entries one at a time (``import-packs``)."""
    L = np.asarray(lengths, np.int64)
    t = np.asarray([int(a) * int(b) for a, b in grids], np.int64) + 1
    stats = {"tokens": int(L.sum()), "attn_sq": int((L * L).sum()), "vit_tokens": int(t.sum()),
             "vit_sq": int((t * t).sum()), "merged": int((t - 1).sum() // 4)}
    return {"attn_sq": stats["attn_sq"], "images": len(t), "vit_tokens": stats["vit_tokens"],
            "vit_sq": stats["vit_sq"], "cost": float(cost_of(stats, w or weights()))}
