"""A run folder as ingest + embed-images leave it, made from given vectors (no model): the inputs of
`dedup` and `align` in the tests."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from manifests.io import as_manifest_table, write_part, write_table


def unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def embedded_run(run: Path, vectors: np.ndarray, areas=None, parts: int = 2, bad: int = 0, captions=None,
                 sources=None, ids=None, conversations=None, row_group_rows=None) -> list[str]:
    """``run/ingest/samples`` and ``run/embed-images/{image_embeddings,data}`` for ``vectors`` (one ok sample
    each, ``areas`` = width × height as width w, height 1), plus ``bad`` samples without a vector
    (decode_error), parts in row groups of ``row_group_rows`` (default: write_part's); ``conversations[k]``
    (a list of (role, text), or None) makes ok sample k a conversation. The embed folder is a finished step
    (executor.json, config.json, finalized), so a step that reads ``samples`` through it resolves the ingest
    folder. Returns the sample ids, in order."""
    from curation.embed import EmbedImagesConfig
    from ovpipe.config import config_json

    n = len(vectors) + bad
    rng = np.random.default_rng(len(vectors))
    ids = ids or sorted({f"{x:016x}" for x in rng.integers(0, 2**63, n * 2).tolist()})[:n]
    ids = sorted(ids)
    order = rng.permutation(n)                      # which ids are ok is not their order
    ok_rows = {int(i): k for k, i in enumerate(sorted(order[:len(vectors)]))}
    areas = np.ones(len(vectors), np.int64) * 100 if areas is None else np.asarray(areas)
    emb_dir = run / "embed-images"
    rows_s, rows_e = [], []
    for k, bounds in enumerate(np.array_split(np.arange(n), parts)):
        file = f"embed-images/data/emb-{k:05d}.npy"
        mine = [i for i in bounds.tolist() if i in ok_rows]
        (emb_dir / "data").mkdir(parents=True, exist_ok=True)
        np.save(run / file, vectors[[ok_rows[i] for i in mine]].astype(np.float16))
        at = {i: r for r, i in enumerate(mine)}
        ss, ee = [], []
        for i in bounds.tolist():
            ok = i in ok_rows
            w = int(areas[ok_rows[i]]) if ok else 10
            cap = captions[ok_rows[i]] if captions is not None and ok else f"caption {i}"
            src = sources[ok_rows[i]] if sources is not None and ok else "s"
            turns = conversations[ok_rows[i]] if conversations is not None and ok else None
            conv = [{"role": r, "text": t} for r, t in turns] if turns else [
                {"role": "user", "text": "<image>"}, {"role": "assistant", "text": cap}]
            ss.append({"sample_id": ids[i], "source": src, "shard": "x.tar", "key": f"k{i}", "shard_format": "tar",
                       "offset": 0, "size": 1, "image_format": "jpeg", "width": w, "height": 1, "caption": cap,
                       "category": "instruct" if turns else "caption", "n_images": 1,
                       "images": [{"file": "x.tar", "container": "tar", "offset": 0, "size": 1, "column": None,
                                   "index": -1, "format": "jpeg", "width": w, "height": 1}],
                       "conversation": conv, "turns": len(conv), "turn_ratings": None, "status": "ok", "error": None})
            ee.append({"sample_id": ids[i], "file": file if ok else None, "row": at[i] if ok else -1,
                       "status": "ok" if ok else "decode_error", "error": None if ok else "broken"})
        for rows, path, kind in ((ss, run / "ingest" / "samples", "samples"),
                                 (ee, emb_dir / "image_embeddings", "image_embeddings")):
            if row_group_rows:
                path.mkdir(parents=True, exist_ok=True)
                write_table(as_manifest_table(rows, kind), path / f"part-{k:05d}.parquet", row_group_rows)
            else:
                write_part(rows, path / f"part-{k:05d}.parquet", kind)
    cfg = EmbedImagesConfig(model="ovpipe-tiny-clip", pretrained="")
    (emb_dir / "config.json").write_text(config_json(cfg))
    (emb_dir / "executor.json").write_text(json.dumps({"step": "embed-images", "tasks": parts, "config_hash": "x",
                                                       "outputs": ["image_embeddings"]}))
    (emb_dir / "completions").mkdir(exist_ok=True)
    (emb_dir / "completions" / "finalized").touch()
    return [ids[i] for i in sorted(ok_rows)]
