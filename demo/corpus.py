"""The embedded demo corpus: synthetic image-text pairs with a known, long-tailed concept mix.

Concepts are coloured shapes ("red circle", "teal star", …): 15 colours × 15 shapes = 225.
Concept frequencies follow Zipf with exponent ``zipf_s`` (1.2 by default) over a seeded
random order of the vocabulary, so a few concepts fill most images and most concepts are
rare — the long tail the curation stage is meant to lift. Each image shows 1–4 distinct
concepts drawn from that distribution, laid out in a grid at a random native resolution
(56–448 px per side, so packing sees a realistic spread of image-token counts); its caption
names them. ``ground_truth.parquet`` records what was drawn, so retrieval can be scored.

A few samples are broken on purpose, so every stage's bad-input path runs on the demo:
a truncated JPEG, a zero-byte image, an empty caption, a non-UTF-8 caption, and one exact
duplicate of another sample. Everything is deterministic for a seed (tar mtimes fixed).

With ``planted`` (``ovpipe demo-data``), a fifth shard holds what curation past exact duplicates should
find: resized, recompressed and slightly cropped copies of earlier images (same caption, other bytes) and
images under a caption of other concepts, drawn from their own RNG stream after the rest; ``planted.parquet``
lists them (sample_id, kind, original) so ``dedup`` and ``align`` can count what they found.

The conversation sets (LLaVA-558K-style JSON, the LLaVA JSON + FineVision instruction set) are
written by ``demo.conversations`` from their own RNG streams, so this corpus is unchanged.
"""
from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np

from rl_select.gym.shapes import COLORS, SHAPES, draw_shape

CAPTION_TEMPLATES = [
    "a photo of {objs}.",
    "an image showing {objs}.",
    "{objs} on a plain background.",
    "a simple drawing with {objs}, rendered on a light textured canvas for the demo corpus.",
    "this synthetic picture contains {objs}; nothing else is visible in the scene.",
]


def concept_names() -> list[str]:
    return [f"{c} {s}" for s in SHAPES for c in COLORS]


def render_image(concepts: list[int], names: list[str], rng: np.random.Generator, width: int, height: int) -> bytes:
    from PIL import Image, ImageDraw

    bg = rng.integers(225, 245, size=(height, width, 1), dtype=np.uint8)
    noise = rng.integers(0, 10, size=(height, width, 3), dtype=np.uint8)
    img = Image.fromarray(np.clip(bg + noise, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    n = len(concepts)
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    cw, ch = width / cols, height / rows
    for i, cid in enumerate(concepts):
        color_name, shape = names[cid].split(" ", 1)
        r0, c0 = divmod(i, cols)
        r = min(cw, ch) * rng.uniform(0.28, 0.42)
        cx = (c0 + 0.5) * cw + rng.uniform(-0.08, 0.08) * cw
        cy = (r0 + 0.5) * ch + rng.uniform(-0.08, 0.08) * ch
        draw_shape(draw, shape, COLORS[color_name], cx, cy, r)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def caption_for(concepts: list[int], names: list[str], rng: np.random.Generator) -> str:
    objs = [f"a {names[c]}" for c in concepts]
    joined = objs[0] if len(objs) == 1 else ", ".join(objs[:-1]) + " and " + objs[-1]
    return CAPTION_TEMPLATES[int(rng.integers(len(CAPTION_TEMPLATES)))].format(objs=joined)


def zipf_probs(n: int, s: float, rng: np.random.Generator) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1) ** s
    p /= p.sum()
    out = np.empty(n)
    out[rng.permutation(n)] = p  # which concept is frequent is random, not alphabetical
    return out


def write_demo_corpus(out: Path, n_samples: int = 2000, seed: int = 0, shards: int = 4,
                      zipf_s: float = 1.2, min_side: int = 56, max_side: int = 448, planted: int = 0) -> dict:
    """Write ``out/shards/demo-{i:05d}.tar``, ``out/concepts.txt``, ``out/ground_truth.parquet``; with
    ``planted`` > 0, that many copies of each kind and mismatched captions in one more shard
    (``plant_cases``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import webdataset as wds
    import xxhash

    out = Path(out)
    (out / "shards").mkdir(parents=True, exist_ok=True)
    names = concept_names()
    (out / "concepts.txt").write_text("\n".join(names) + "\n")
    rng = np.random.default_rng(seed)
    probs = zipf_probs(len(names), zipf_s, rng)

    per_shard = math.ceil(n_samples / shards)
    broken = {3: "truncated_jpeg", 11: "zero_byte_image", 17: "empty_caption", 23: "non_utf8_caption",
              29: "duplicate"}
    gt_rows = []
    first_sample = None
    idx = 0
    for s in range(shards):
        path = out / "shards" / f"demo-{s:05d}.tar"
        with wds.TarWriter(str(path), mtime=0, encoder=False) as tw:
            for j in range(per_shard):
                if idx >= n_samples:
                    break
                k = int(rng.choice([1, 2, 2, 3, 3, 4]))
                concepts = sorted(int(c) for c in rng.choice(len(names), size=k, replace=False, p=probs))
                w = int(rng.integers(min_side, max_side + 1))
                h = int(rng.integers(min_side, max_side + 1))
                img = render_image(concepts, names, rng, w, h)
                caption = caption_for(concepts, names, rng).encode()
                kind = broken.get(idx)
                if kind == "truncated_jpeg":
                    img = img[: len(img) // 3]
                elif kind == "zero_byte_image":
                    img = b""
                elif kind == "empty_caption":
                    caption = b""
                elif kind == "non_utf8_caption":
                    caption = b"\xff\xfe caption in a broken encoding \xc3\x28"
                elif kind == "duplicate" and first_sample is not None:
                    img, caption, concepts, w, h = first_sample
                if idx == 0:
                    first_sample = (img, caption, concepts, w, h)
                key = f"s{s:03d}_{j:06d}"
                meta = {"concepts": concepts, "names": [names[c] for c in concepts], "broken": kind}
                tw.write({"__key__": key, "jpg": img, "txt": caption, "json": json.dumps(meta).encode()})
                gt_rows.append({"sample_id": xxhash.xxh3_64(img + caption).hexdigest(), "key": key,
                                "shard": path.name, "concept_ids": concepts, "broken": kind})
                idx += 1
    planted_info = plant_cases(out, shards, planted, gt_rows, names, probs, seed) if planted else {}
    table = pa.Table.from_pylist(gt_rows, schema=pa.schema([
        ("sample_id", pa.string()), ("key", pa.string()), ("shard", pa.string()),
        ("concept_ids", pa.list_(pa.int32())), ("broken", pa.string())]))
    pq.write_table(table, out / "ground_truth.parquet")
    counts = np.zeros(len(names), dtype=np.int64)
    for r in gt_rows:
        counts[r["concept_ids"]] += 1
    extra = sum(planted_info.get("planted", {}).values())
    return {"out": str(out), "samples": idx + extra, "shards": shards + bool(extra), "concepts": len(names),
            "concepts_seen": int((counts > 0).sum()), "top1pct_share": float(np.sort(counts)[::-1][:3].sum() / counts.sum()),
            "broken": sorted(set(broken.values())), **planted_info}


PLANTED_KINDS = ("resized", "recompressed", "cropped", "mismatched_caption")


def _variant(img: bytes, kind: str, rng: np.random.Generator) -> bytes:
    """A near-duplicate of an encoded image: resized to 55–75% (a thumbnail), re-encoded at JPEG quality
    30–45, or 3–6% cut from each side."""
    from PIL import Image

    with Image.open(io.BytesIO(img)) as im:
        im = im.convert("RGB")
        w, h = im.size
        quality = 90
        if kind == "resized":
            f = rng.uniform(0.55, 0.75)
            im = im.resize((max(1, round(w * f)), max(1, round(h * f))), Image.LANCZOS)
        elif kind == "recompressed":
            quality = int(rng.integers(30, 46))
        else:
            dx, dy = (int(round(v * rng.uniform(0.03, 0.06))) for v in (w, h))
            im = im.crop((dx, dy, w - dx, h - dy))
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def plant_cases(out: Path, shard_index: int, n: int, gt_rows: list[dict], names: list[str], probs: np.ndarray,
                seed: int) -> dict:
    """``shards/demo-{shard_index:05d}.tar``: ``n`` copies of each near-duplicate kind (of distinct earlier
    images at least 160 px a side, read back from their shards) and ``n`` new images captioned with other
    concepts; ``planted.parquet`` (sample_id, key, kind, original); rows appended to ``gt_rows``. Its own
    RNG stream: the rest of the corpus is what it was without them."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import webdataset as wds
    import xxhash

    rng = np.random.default_rng([seed, 44])
    source = {}
    for s in sorted({r["shard"] for r in gt_rows}):
        for sample in wds.WebDataset(str(out / "shards" / s), shardshuffle=False, empty_check=False):
            source[sample["__key__"]] = (sample["jpg"], sample["txt"])
    from PIL import Image

    def big(r):
        if r["broken"]:
            return False
        with Image.open(io.BytesIO(source[r["key"]][0])) as im:
            return min(im.size) >= 160
    candidates = [r for r in gt_rows if big(r)]
    picks = rng.choice(len(candidates), size=min(3 * n, len(candidates)), replace=False)
    rows, planted = [], []
    path = out / "shards" / f"demo-{shard_index:05d}.tar"
    with wds.TarWriter(str(path), mtime=0, encoder=False) as tw:
        for j, p in enumerate(picks.tolist()):
            orig = candidates[p]
            kind = PLANTED_KINDS[j % 3]
            img0, caption = source[orig["key"]]
            img = _variant(img0, kind, rng)
            rows.append((img, caption, orig["concept_ids"], kind, orig["sample_id"]))
        for _ in range(n):
            k = int(rng.choice([1, 2, 2, 3]))
            concepts = sorted(int(c) for c in rng.choice(len(names), size=k, replace=False, p=probs))
            others = sorted(int(c) for c in rng.choice(np.setdiff1d(np.arange(len(names)), concepts), size=k,
                                                       replace=False))
            w, h = (int(v) for v in rng.integers(160, 449, size=2))
            img = render_image(concepts, names, rng, w, h)
            rows.append((img, caption_for(others, names, rng).encode(), concepts, "mismatched_caption", None))
        for j, (img, caption, concepts, kind, original) in enumerate(rows):
            key = f"p{shard_index:03d}_{j:06d}"
            meta = {"concepts": concepts, "names": [names[c] for c in concepts], "broken": kind}
            tw.write({"__key__": key, "jpg": img, "txt": caption, "json": json.dumps(meta).encode()})
            sid = xxhash.xxh3_64(img + caption).hexdigest()
            gt_rows.append({"sample_id": sid, "key": key, "shard": path.name, "concept_ids": concepts, "broken": kind})
            planted.append({"sample_id": sid, "key": key, "kind": kind, "original": original})
    pq.write_table(pa.Table.from_pylist(planted, schema=pa.schema([
        ("sample_id", pa.string()), ("key", pa.string()), ("kind", pa.string()), ("original", pa.string())])),
        out / "planted.parquet")
    return {"planted": {k: sum(p["kind"] == k for p in planted) for k in PLANTED_KINDS}}
