"""``ingest``: the recipe's data layouts → the ``samples`` manifest, one conversation per row.

Inputs (``format``, default ``auto``; the adapters are in ``curation/formats*.py``): webdataset
tars and caption Parquet (caption pairs), LLaVA JSON/JSONL (LLaVA-558K, the instruct sets),
LLaVA-OneVision-style Parquet, FineVision Parquet, and the chat ``messages`` layout.

One row per source sample:

- ``sample_id``: xxh3-64 of the images' bytes in order + the conversation's canonical encoding
  (``manifests/conversation.py``). A caption pair from a tar or caption Parquet hashes the image
  bytes + the caption bytes exactly as stored — the id every earlier run gave it. A ``bad_row``
  (no conversation to hash) hashes its raw text.
- ``conversation`` (role, text with ``<image>`` placeholders), ``turns``, ``n_images`` and
  ``images``: every image's address (tar data offset/size, Parquet row + column + list index, or
  image file) with its format and width/height from the header (no full decode unless
  ``verify: full``). Images are read once, for the hash and the header.
- ``category``: config ``category``, else the row's (``category`` / ``data_source`` / FineVision
  ``source``), else ``caption`` for a caption pair, else the source name.
- ``turn_ratings``: FineVision's per-turn ``*_ratings`` (null elsewhere).
- legacy columns: ``shard`` = the file the sample was read from (tar, Parquet, JSON), ``key`` = its
  key there, ``shard_format`` = ``tar`` | ``parquet`` | ``json``; ``offset``/``size``/
  ``image_format``/``width``/``height`` = the first image's (``-1``/0/""/0/0 without one);
  ``caption`` = the caption of a caption source, else the first assistant turn's text.
- ``status``/``error``, first problem found in this order:

    bad_row | unexpected_key                                        (parsing the record)
    missing_image | empty_image | corrupt_image | too_small         (each image, in order)
    missing_caption | empty_caption | bad_caption_encoding          (caption sources)
    unknown_role | no_assistant | bad_last_turn | empty_turn | image_mismatch   (check_conversation)
    duplicate                                                       (finalize)

A broken sample is a row with a status and an error message, never a crash and never a silent
drop; ``stats`` count ``status/<status>``. Duplicates (same ``sample_id``) are found over the whole
corpus in ``finalize``: the first occurrence in (source, shard, key) order keeps its status, later
ones become ``duplicate`` with the first one named in ``error`` — whatever the task split.

Work is split in units (a tar; a Parquet row group; ``JSON_CHUNK_ROWS`` JSON records): unit ``u``
of the ``i``-th input file (sorted) goes to rank ``(i + u) % world_size``. Each part is sorted by
``SORT_KEYS``, so the merged manifest is byte-identical for any task count.
"""
from __future__ import annotations

import glob
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from curation.formats import FORMATS, RawSample, adapter, detect_format
from ovpipe.step import Step, TaskContext


@dataclass
class IngestConfig:
    inputs: list[str] = field(default_factory=list)   # paths or globs: .tar / .parquet / .json / .jsonl
    source: str | None = None                          # source name; default: the input file's folder name
    format: str = "auto"                               # one of curation.formats.FORMATS
    category: str | None = None                        # the whole step's category; default: per row (see above)
    image_root: str | None = None                      # image paths are relative to it; default: the file's folder
    image_column: str = "image"                        # caption Parquet: binary, or struct with a `bytes` field
    caption_column: str = "caption"                    # caption Parquet
    image_columns: list[str] = field(default_factory=list)  # LLaVA-OV Parquet; default: every image-typed column
    extra_turn_keys: list[str] = field(default_factory=list)  # turn keys tolerated besides from/value, role/content
    verify: Literal["none", "header", "full"] = "header"  # header: size + end-of-image marker; full: decode
    min_side: int = 1

    def __post_init__(self):
        if not self.inputs:
            raise ValueError("inputs: give at least one path or glob (e.g. ['data/shards/*.tar'])")
        if self.format not in FORMATS:
            raise ValueError(f"format: {self.format!r} is not one of {', '.join(FORMATS)}")
        if self.min_side < 1:
            raise ValueError(f"min_side must be >= 1, got {self.min_side}")
        if self.category is not None and not self.category.strip():
            raise ValueError("category: give a name or leave it out (null: per row)")
        if self.image_root is not None and not os.path.isdir(os.path.expanduser(self.image_root)):
            raise ValueError(f"image_root: {self.image_root!r} is not a folder")


def expand_inputs(patterns: list[str]) -> list[str]:
    files: list[str] = []
    for pat in patterns:
        hits = sorted(glob.glob(os.path.expanduser(pat)))
        if not hits:
            raise FileNotFoundError(f"ingest.inputs: {pat!r} matches no file")
        files.extend(hits)
    return sorted({str(Path(f).resolve()) for f in files})


def read_image_bytes(row: dict) -> bytes:
    """The bytes of a ``samples`` row's first image (what the curation steps embed), from its
    ``images`` address; rows read without that column fall back on the legacy tar/Parquet columns.
    A text-only sample has none: ``ValueError`` (callers skip ``n_images == 0`` rows)."""
    from manifests.conversation import read_image

    if "images" in row:
        if not row["images"]:
            raise ValueError(f"sample {row.get('sample_id')} has no image (a text-only sample)")
        return read_image(row["images"][0])
    if row["shard_format"] == "tar" and int(row["offset"]) >= 0:
        with open(row["shard"], "rb") as f:
            f.seek(int(row["offset"]))
            return f.read(int(row["size"]))
    if row["shard_format"] == "parquet":
        import pyarrow.parquet as pq

        from curation.formats import is_image_type

        # Legacy rows name no column: the file's first image-typed column holds the image.
        col = next((f.name for f in pq.read_schema(row["shard"]) if is_image_type(f.type)), None)
        if col is not None:
            return read_image({"file": row["shard"], "container": "parquet", "offset": row["offset"],
                               "column": col, "index": -1})
    raise ValueError(f"sample {row.get('sample_id')}: read it with its `images` column")


def inspect_image(data: bytes, verify: str) -> tuple[str, int, int, str, str | None]:
    """(status, width, height, format, error) from the header; optional trailer/full check."""
    from PIL import Image, UnidentifiedImageError

    if len(data) == 0:
        return "empty_image", 0, 0, "", "zero-byte image"
    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
            fmt = (im.format or "").lower()
            if verify == "full":
                im.load()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        return "corrupt_image", 0, 0, "", f"{type(e).__name__}: {e}"[:300]
    if verify == "header":
        # Cheap integrity check without decoding: a truncated file lacks its end marker.
        tail = data[-64:]
        if fmt == "jpeg" and b"\xff\xd9" not in tail:
            return "corrupt_image", w, h, fmt, "truncated JPEG (no EOI marker)"
        if fmt == "png" and b"IEND" not in tail:
            return "corrupt_image", w, h, fmt, "truncated PNG (no IEND chunk)"
    return "ok", w, h, fmt, None


def sample_row(raw: RawSample, source: str, shard: str, shard_format: str, cfg: IngestConfig) -> dict:
    """One ``samples`` row from an adapter's ``RawSample`` (status order: module docstring)."""
    from manifests.conversation import CAPTION_CATEGORY, check_conversation, is_caption_pair, sample_id

    problem = raw.format_status
    images = []
    for k, ref in enumerate(raw.images):
        if ref.data is None:
            st, w, h, fmt, err = "missing_image", 0, 0, "", ref.error or "image not found"
        else:
            st, w, h, fmt, err = inspect_image(ref.data, cfg.verify)
            if st == "ok" and min(w, h) < cfg.min_side:
                st, err = "too_small", f"{w}x{h} is below min_side={cfg.min_side}"
        if ref.addr is not None:
            images.append({**ref.addr, "size": len(ref.data or b""), "format": fmt, "width": w, "height": h})
        if problem is None and st != "ok":
            problem = st, (f"image {k}: {err}" if len(raw.images) > 1 else err)
    problem = problem or raw.text_status
    if problem is None:
        problem = check_conversation(raw.turns, len(images))
    image_bytes = [ref.data or b"" for ref in raw.images]
    sid = sample_id(image_bytes, raw.turns, encoded=raw.encoded)
    first = images[0] if images else None
    if raw.caption_source:
        caption = raw.caption
    else:
        caption = next((t for r, t in raw.turns if r == "assistant"), None)
    category = cfg.category or raw.category or (
        CAPTION_CATEGORY if raw.caption_source or is_caption_pair(raw.turns, len(images)) else source)
    return {"sample_id": sid, "source": source, "shard": shard, "key": raw.key, "shard_format": shard_format,
            "offset": first["offset"] if first else -1, "size": first["size"] if first else 0,
            "image_format": first["format"] if first else "", "width": first["width"] if first else 0,
            "height": first["height"] if first else 0, "caption": caption, "category": category,
            "n_images": len(images), "images": images,
            "conversation": [{"role": r, "text": t} for r, t in raw.turns], "turns": len(raw.turns),
            "turn_ratings": raw.ratings, "status": problem[0] if problem else "ok",
            "error": problem[1] if problem else None}


SHARD_FORMAT = {"webdataset": "tar", "json-auto": "json", "llava-json": "json"}


def run(cfg: IngestConfig, task: TaskContext) -> None:
    files = expand_inputs(cfg.inputs)
    rows: list[dict] = []
    with task.progress(None, unit="sample") as bar:
        for i, path in enumerate(files):
            fmt = detect_format(path, cfg.format, cfg.caption_column)
            source = cfg.source or Path(path).parent.name
            shard_format = SHARD_FORMAT.get(fmt) or ("parquet" if path.endswith(".parquet") else "json")
            n0 = len(rows)

            def take(unit: int, i=i) -> bool:
                return (i + unit) % task.world_size == task.rank

            with task.stats.timer("read"):
                for raw in adapter(fmt, path)(path, cfg, take):
                    rows.append(sample_row(raw, source, path, shard_format, cfg))
                    if len(rows) % 256 == 0:
                        bar.update(256, file=i)
            task.stats.inc("samples", len(rows) - n0)
            if i % task.world_size == task.rank:  # each file counted once, whatever the split
                task.stats.inc("files")
                task.stats.inc(f"format/{fmt}")
    for r in rows:
        task.stats.inc(f"status/{r['status']}")
        task.stats.inc("images", r["n_images"])
    task.write_part("samples", rows)


def finalize(cfg: IngestConfig, task: TaskContext) -> None:
    """Mark duplicate sample_ids over the whole corpus; rewrite only the parts that change."""
    import pyarrow as pa

    from manifests.io import manifest_files, read_part, write_part

    files = manifest_files(task.run_dir, "samples", step=task.step)
    cols = ["sample_id", "source", "shard", "key"]
    tables = [read_part(f, "samples").select(cols) for f in files]
    allrows = pa.concat_tables([t.append_column("_part", pa.array([i] * t.num_rows, pa.int32()))
                                for i, t in enumerate(tables)])
    # First occurrence per sample_id in (source, shard, key) order.
    order = allrows.sort_by([("sample_id", "ascending"), ("source", "ascending"),
                             ("shard", "ascending"), ("key", "ascending")])
    sid = order.column("sample_id").to_pylist()
    dups: dict[tuple[int, str, str], str] = {}
    j = 0
    for i in range(1, len(sid)):
        if sid[i] != sid[i - 1]:
            j = i
            continue
        first = f"{Path(order['shard'][j].as_py()).name}/{order['key'][j].as_py()}"
        dups[(order["_part"][i].as_py(), order["shard"][i].as_py(), order["key"][i].as_py())] = first
    task.stats.inc("duplicates", len(dups))
    for p in sorted({p for p, _, _ in dups}):
        t = read_part(files[p], "samples")
        status = t.column("status").to_pylist()
        error = t.column("error").to_pylist()
        for i, (shard, key) in enumerate(zip(t.column("shard").to_pylist(), t.column("key").to_pylist())):
            first = dups.get((p, shard, key))
            if first is not None:  # keep stats' status/<x> equal to the manifest's counts
                task.stats.inc(f"status/{status[i]}", -1)
                task.stats.inc("status/duplicate")
                status[i], error[i] = "duplicate", f"duplicate of {first}"
        t = t.set_column(t.schema.get_field_index("status"), "status", pa.array(status, pa.string()))
        t = t.set_column(t.schema.get_field_index("error"), "error", pa.array(error, pa.string()))
        write_part(t, files[p], "samples", sort=True)
    merged = pa.concat_tables([read_part(f, "samples").select(["status", "category"]) for f in files])
    tables = [_count_table(merged.column(c), c) for c in ("status", "category")]
    (task.step_dir / "report.md").write_text(
        f"{merged.num_rows} samples ingested from {len(expand_inputs(cfg.inputs))} files; "
        f"{len(dups)} duplicate(s) marked.\n\n" + "\n\n".join(tables) + "\n")


def _count_table(column, name: str) -> str:
    import pyarrow.compute as pc

    lines = [f"| {name} | samples |", "| --- | ---: |"]
    for item in sorted(pc.value_counts(column).to_pylist(), key=lambda d: (-d["counts"], str(d["values"]))):
        lines.append(f"| {item['values']} | {item['counts']} |")
    return "\n".join(lines)


STEP = Step("ingest", IngestConfig, run, inputs=(), outputs=("samples",), finalize=finalize,
            description="webdataset / caption Parquet / LLaVA JSON / LLaVA-OV Parquet / FineVision / messages "
                        "→ samples manifest")
