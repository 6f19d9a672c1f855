"""``ingest``: webdataset shards and Parquet files → the ``samples`` manifest.

One row per source sample: ``sample_id`` = xxh3-64 of the image bytes followed by the raw
caption bytes (16 hex chars), where the image lives (shard path + tar data offset/size, or
Parquet row), width/height read from the image header (no full decode unless
``verify: full``), the caption, and a status:

    ok | missing_image | empty_image | corrupt_image | too_small | missing_caption |
    empty_caption | bad_caption_encoding | duplicate

A broken sample is a row with a status and an error message, never a crash and never a
silent drop. Duplicates (same ``sample_id``) are found over the whole corpus in
``finalize``: the first occurrence in (source, shard, key) order stays ``ok``, later ones
become ``duplicate`` with the first one named in ``error`` — the rule does not depend on
how shards were split over tasks.

Shards are split over ranks by sorted file order (``files[rank::world_size]``); the merged
manifest is sorted by ``sample_id``, so it is byte-identical for any task count.
"""
from __future__ import annotations

import glob
import io
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal

from ovpipe.step import Step, TaskContext

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "gif")
CAPTION_EXTS = ("txt", "caption")


@dataclass
class IngestConfig:
    inputs: list[str] = field(default_factory=list)   # paths or globs of .tar shards / .parquet files
    source: str | None = None                          # source name; default: the input file's folder name
    image_column: str = "image"                        # Parquet: binary, or struct with a `bytes` field
    caption_column: str = "caption"
    verify: Literal["none", "header", "full"] = "header"  # header: size + end-of-image marker; full: decode
    min_side: int = 1

    def __post_init__(self):
        if not self.inputs:
            raise ValueError("inputs: give at least one shard path or glob (e.g. ['data/shards/*.tar'])")
        if self.min_side < 1:
            raise ValueError(f"min_side must be >= 1, got {self.min_side}")


def expand_inputs(patterns: list[str]) -> list[str]:
    files: list[str] = []
    for pat in patterns:
        hits = sorted(glob.glob(os.path.expanduser(pat)))
        if not hits:
            raise FileNotFoundError(f"ingest.inputs: {pat!r} matches no file")
        files.extend(hits)
    return sorted({str(Path(f).resolve()) for f in files})


def split_key(name: str) -> tuple[str, str]:
    """webdataset convention: ``dir/key.ext.more`` → (``dir/key``, ``ext.more``)."""
    d, base = os.path.split(name)
    stem, _, ext = base.partition(".")
    return (f"{d}/{stem}" if d else stem), ext.lower()


def iter_tar(path: str) -> Iterator[dict]:
    """Samples of a webdataset tar: key → {ext: (offset, size)}; consecutive members share a key."""
    current, members = None, {}
    with tarfile.open(path, "r:") as tf:
        for m in tf:
            if not m.isfile():
                continue
            key, ext = split_key(m.name)
            if key != current and current is not None:
                yield {"key": current, "members": members}
                members = {}
            current = key
            members[ext] = (m.offset_data, m.size)
    if current is not None:
        yield {"key": current, "members": members}


def _read(f, offset: int, size: int) -> bytes:
    f.seek(offset)
    return f.read(size)


def read_image_bytes(row: dict) -> bytes:
    """The image bytes of one ``samples`` row (tar member or Parquet row)."""
    if row["shard_format"] == "tar":
        with open(row["shard"], "rb") as f:
            return _read(f, row["offset"], row["size"])
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(row["shard"])
    idx = int(row["offset"])
    for rg in range(pf.num_row_groups):
        n = pf.metadata.row_group(rg).num_rows
        if idx < n:
            col = pf.read_row_group(rg, columns=[_image_col_name(pf)]).column(0)
            return _image_value(col[idx].as_py())
        idx -= n
    raise IndexError(f"{row['shard']}: row {row['offset']} out of range")


def _image_col_name(pf) -> str:
    md = pf.schema_arrow.metadata or {}
    name = md.get(b"ovpipe_image_column")
    return name.decode() if name else pf.schema_arrow.names[0]


def _image_value(v) -> bytes:
    if v is None:
        return b""
    if isinstance(v, dict):
        return v.get("bytes") or b""
    return bytes(v)


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


def decode_caption(raw: bytes | None) -> tuple[str | None, str | None, str | None]:
    """(caption, status, error); status None when the caption is fine."""
    if raw is None:
        return None, "missing_caption", "no caption member"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return raw.decode("utf-8", errors="replace"), "bad_caption_encoding", f"not UTF-8: {e}"[:300]
    if not text.strip():
        return text, "empty_caption", "caption is empty"
    return text.strip(), None, None


def _row(sample_id, source, shard, key, fmt_shard, offset, size, img_status, w, h, img_fmt, img_err,
         caption, cap_status, cap_err, min_side):
    status, error = img_status, img_err
    if status == "ok" and min(w, h) < min_side:
        status, error = "too_small", f"{w}x{h} is below min_side={min_side}"
    if status == "ok" and cap_status:
        status, error = cap_status, cap_err
    return {"sample_id": sample_id, "source": source, "shard": shard, "key": key, "shard_format": fmt_shard,
            "offset": offset, "size": size, "image_format": img_fmt, "width": w, "height": h,
            "caption": caption, "status": status, "error": error}


def ingest_tar(path: str, source: str, cfg: IngestConfig, stats) -> list[dict]:
    import xxhash

    rows = []
    with open(path, "rb") as f:
        for s in iter_tar(path):
            mem = s["members"]
            img_ext = next((e for e in IMAGE_EXTS if e in mem), None)
            cap_ext = next((e for e in CAPTION_EXTS if e in mem), None)
            img = _read(f, *mem[img_ext]) if img_ext else b""
            raw_cap = _read(f, *mem[cap_ext]) if cap_ext else None
            if img_ext is None:
                img_status, w, h, fmt, err = "missing_image", 0, 0, "", f"no image member ({'/'.join(IMAGE_EXTS)})"
                offset, size = -1, 0
            else:
                img_status, w, h, fmt, err = inspect_image(img, cfg.verify)
                offset, size = mem[img_ext]
            caption, cap_status, cap_err = decode_caption(raw_cap)
            sid = xxhash.xxh3_64(img + (raw_cap or b"")).hexdigest()
            rows.append(_row(sid, source, path, s["key"], "tar", offset, size, img_status, w, h, fmt, err,
                             caption, cap_status, cap_err, cfg.min_side))
            stats.inc("samples")
    return rows


def ingest_parquet(path: str, source: str, cfg: IngestConfig, stats) -> list[dict]:
    import pyarrow.parquet as pq
    import xxhash

    pf = pq.ParquetFile(path)
    for col in (cfg.image_column, cfg.caption_column):
        if col not in pf.schema_arrow.names:
            raise ValueError(f"{path}: no column {col!r} (columns: {pf.schema_arrow.names}); "
                             f"set image_column/caption_column in the ingest config")
    rows, idx = [], 0
    for batch in pf.iter_batches(columns=[cfg.image_column, cfg.caption_column], batch_size=4096):
        imgs = batch.column(0).to_pylist()
        caps = batch.column(1).to_pylist()
        for img_v, cap_v in zip(imgs, caps):
            img = _image_value(img_v)
            raw_cap = cap_v.encode() if isinstance(cap_v, str) else cap_v
            img_status, w, h, fmt, err = inspect_image(img, cfg.verify)
            caption, cap_status, cap_err = decode_caption(raw_cap)
            sid = xxhash.xxh3_64(img + (raw_cap or b"")).hexdigest()
            rows.append(_row(sid, source, path, f"{idx:09d}", "parquet", idx, len(img), img_status, w, h, fmt,
                             err, caption, cap_status, cap_err, cfg.min_side))
            stats.inc("samples")
            idx += 1
    return rows


def run(cfg: IngestConfig, task: TaskContext) -> None:
    files = expand_inputs(cfg.inputs)
    mine = files[task.rank::task.world_size]
    rows: list[dict] = []
    from tqdm import tqdm

    for path in tqdm(mine, desc=f"ingest[{task.rank}]", unit="shard", disable=True):
        source = cfg.source or Path(path).parent.name
        with task.stats.timer("read"):
            if path.endswith(".parquet"):
                rows.extend(ingest_parquet(path, source, cfg, task.stats))
            else:
                rows.extend(ingest_tar(path, source, cfg, task.stats))
        task.stats.inc("shards")
    for r in rows:
        task.stats.inc(f"status/{r['status']}")
    task.write_part("samples", rows)


def finalize(cfg: IngestConfig, task: TaskContext) -> None:
    """Mark duplicate sample_ids over the whole corpus; rewrite only the parts that change."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from manifests.io import manifest_files, read_part, write_part

    files = manifest_files(task.run_dir, "samples", step=task.step)
    tables = [read_part(f, "samples") for f in files]
    allrows = pa.concat_tables([t.append_column("_part", pa.array([i] * t.num_rows, pa.int32()))
                                for i, t in enumerate(tables)])
    # First occurrence per sample_id in (source, shard, key) order.
    order = allrows.sort_by([("sample_id", "ascending"), ("source", "ascending"),
                             ("shard", "ascending"), ("key", "ascending")])
    sid = order.column("sample_id").to_pylist()
    dups: dict[tuple[int, str, str], str] = {}
    for i in range(1, len(sid)):
        if sid[i] == sid[i - 1]:
            j = i - 1
            while j > 0 and sid[j - 1] == sid[i]:
                j -= 1
            first = f"{Path(order['shard'][j].as_py()).name}/{order['key'][j].as_py()}"
            dups[(order["_part"][i].as_py(), order["shard"][i].as_py(), order["key"][i].as_py())] = first
    task.stats.inc("duplicates", len(dups))
    touched = sorted({p for p, _, _ in dups})
    for p in touched:
        t = tables[p]
        status = t.column("status").to_pylist()
        error = t.column("error").to_pylist()
        for i, (shard, key) in enumerate(zip(t.column("shard").to_pylist(), t.column("key").to_pylist())):
            first = dups.get((p, shard, key))
            if first is not None:
                status[i], error[i] = "duplicate", f"duplicate of {first}"
        t = t.set_column(t.schema.get_field_index("status"), "status", pa.array(status, pa.string()))
        t = t.set_column(t.schema.get_field_index("error"), "error", pa.array(error, pa.string()))
        write_part(t, files[p], "samples", sort=True)
    merged = pc.value_counts(pa.concat_tables([read_part(f, "samples") for f in files]).column("status"))
    lines = ["| status | samples |", "| --- | ---: |"]
    for item in sorted(merged.to_pylist(), key=lambda d: -d["counts"]):
        lines.append(f"| {item['values']} | {item['counts']} |")
    (task.step_dir / "report.md").write_text(
        f"{sum(t.num_rows for t in tables)} samples ingested from {len(expand_inputs(cfg.inputs))} files; "
        f"{len(dups)} duplicate(s) marked.\n\n" + "\n".join(lines) + "\n")


STEP = Step("ingest", IngestConfig, run, inputs=(), outputs=("samples",), finalize=finalize,
            description="webdataset / Parquet shards → samples manifest")
