"""Parquet inputs of ``ingest``: caption pairs, LLaVA-OneVision-style conversations, FineVision,
and the chat ``messages`` layout.

A file is read one row group at a time (the work unit ``take`` decides on), ``PARQUET_BATCH_ROWS``
rows decoded at once, only the columns the layout needs. Keys are the row's ``id`` column where the file
has one (the hub's datasets do), else the row index in the file (``%09d``, as caption Parquet always had).
A conversation row's ``data_source`` names its source when the config sets none (``ingest``). Image
bytes in a cell are addressed as container ``parquet`` (column, row, list index); an HF
``{bytes: null, path}`` struct as the image file it names, relative to ``image_root`` (default: the
Parquet file's folder).

- caption-parquet: ``image_column`` + ``caption_column``; a null image cell is ``empty_image``
  (as before conversations existed); ids keep the image bytes + raw caption bytes rule. An image
  cell that is not binary (a string, a number) or a caption that is not text is a ``bad_row``.

A file that is not Parquet is a ``bad_shard``, one without the columns its layout needs a
``missing_column`` shard (``ShardError``; ``ingest`` records it in the ``shards`` manifest).
- llava-ov-parquet: ``conversations`` + image columns (config ``image_columns``; default: every
  column whose type holds images — binary, a struct with ``bytes``, or a list of those — in schema
  order). A null scalar image cell means "no image" (text-only rows); a null list element is a
  missing image. Category: the ``category`` or ``data_source`` column.
- finevision: ``images``, ``texts``, ``source`` (→ category), every ``*_ratings`` column kept in
  ``turn_ratings`` under its name without ``_ratings``.
- messages: ``messages`` + ``images``.
"""
from __future__ import annotations

import os
from typing import Iterator

from curation.formats import (PARQUET_BATCH_ROWS, BadRow, ImageRef, RawSample, ShardError, Take, bad_row,
                              caption_sample, cell_image, finevision_turns, image_address, is_image_type, llava_turns,
                              parquet_schema, row_category, row_key, row_source)
from manifests.sources import message_turns


def iter_rows(path: str, columns: list[str], take: Take) -> Iterator[tuple[int, dict]]:
    """``(row index in the file, {column: value})`` of the row groups ``take`` accepts."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    base = 0
    for rg in range(pf.num_row_groups):
        n = pf.metadata.row_group(rg).num_rows
        if take(rg):
            idx = base
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[rg], columns=columns):
                cols = {name: batch.column(name).to_pylist() for name in columns}
                for j in range(batch.num_rows):
                    yield idx, {name: cols[name][j] for name in columns}
                    idx += 1
        base += n


def _require(path: str, names: list[str], have: list[str], hint: str) -> None:
    """Columns the layout needs; a file without them is a ``missing_column`` shard (every task
    reading the file finds it before reading any row)."""
    missing = [n for n in names if n not in have]
    if missing:
        raise ShardError("missing_column", f"{path}: no column(s) {missing} (columns: {have}); {hint}")


def _raw(row: dict) -> bytes:
    """A bad row's id source: the row as JSON, image bytes by their hash."""
    import json

    import xxhash

    def enc(o):
        return xxhash.xxh3_64_hexdigest(bytes(o)) if isinstance(o, (bytes, bytearray, memoryview)) else repr(o)

    return json.dumps(row, sort_keys=True, default=enc).encode()


def _cell_images(v, path: str, row: int, column: str, root: str, scalar_null_is_none: bool) -> list[ImageRef]:
    if isinstance(v, list):
        return [cell_image(x, path, row, column, j, root) for j, x in enumerate(v)]
    if v is None and scalar_null_is_none:
        return []
    return [cell_image(v, path, row, column, -1, root)]


def read_caption_parquet(path: str, cfg, take: Take) -> Iterator[RawSample]:
    from manifests.conversation import image_value_bytes

    have = parquet_schema(path).names
    _require(path, [cfg.image_column, cfg.caption_column], have, "set image_column/caption_column in the ingest config")
    ids = ["id"] if "id" in have and "id" not in (cfg.image_column, cfg.caption_column) else []
    # the row's source / language from columns the config names (``source_column``, ``lang_column``)
    named = {"source": getattr(cfg, "source_column", None), "lang": getattr(cfg, "lang_column", None)}
    _require(path, [c for c in named.values() if c], have, "set source_column/lang_column in the ingest config")
    meta = [c for c in dict.fromkeys(named.values()) if c and c not in (cfg.image_column, cfg.caption_column, *ids)]
    for idx, row in iter_rows(path, [cfg.image_column, cfg.caption_column, *ids, *meta], take):
        key = row_key(row, idx)
        cap = row[cfg.caption_column]
        raw_cap = cap.encode() if isinstance(cap, str) else cap
        try:
            if raw_cap is not None and not isinstance(raw_cap, (bytes, bytearray, memoryview)):
                raise TypeError(f"{cfg.caption_column}: expected a string, got {type(cap).__name__}")
            img = image_value_bytes(row[cfg.image_column])
            if not isinstance(img, (bytes, bytearray, memoryview)):
                raise TypeError(f"{cfg.image_column}.bytes: expected binary, got {type(img).__name__}")
        except TypeError as e:
            yield bad_row(key, _raw({"caption": cap}), f"{cfg.image_column}: {e}"
                          if str(e).startswith("image cell") else str(e))
            continue
        raw_cap = bytes(raw_cap) if raw_cap is not None else None
        img = bytes(img)
        image = ImageRef(image_address(path, "parquet", idx, cfg.image_column, -1), img)
        sample = caption_sample(key, image, raw_cap)
        for what, column in named.items():
            if column and isinstance(row[column], str) and row[column]:
                setattr(sample, what, row[column])
        yield sample


def read_llava_parquet(path: str, cfg, take: Take) -> Iterator[RawSample]:
    schema = parquet_schema(path)
    image_cols = list(cfg.image_columns) or [f.name for f in schema if is_image_type(f.type)]
    _require(path, ["conversations", *image_cols], schema.names, "set image_columns in the ingest config")
    meta = [c for c in ("category", "data_source", "id") if c in schema.names and c not in image_cols]
    root = cfg.image_root or os.path.dirname(path)
    extra = frozenset(cfg.extra_turn_keys)
    for idx, row in iter_rows(path, ["conversations", *image_cols, *meta], take):
        key = row_key(row, idx)
        try:
            turns, problem = llava_turns(row["conversations"], extra)
            images = [ref for c in image_cols for ref in _cell_images(row[c], path, idx, c, root, True)]
        except BadRow as e:
            yield bad_row(key, _raw(row), str(e))
            continue
        yield RawSample(key, turns, images, category=row_category(row), format_status=problem,
                        source=row_source(row))


def read_finevision(path: str, cfg, take: Take) -> Iterator[RawSample]:
    schema = parquet_schema(path)
    _require(path, ["images", "texts"], schema.names, "a FineVision file has images and texts columns")
    ratings = sorted(n for n in schema.names if n.endswith("_ratings"))
    meta = ["source"] if "source" in schema.names else []
    root = cfg.image_root or os.path.dirname(path)
    for idx, row in iter_rows(path, ["images", "texts", *meta, *ratings], take):
        key = f"{idx:09d}"
        try:
            images = _cell_images(row["images"], path, idx, "images", root, True)
            turns = finevision_turns(row["texts"], len(images))
            kept = [(n[: -len("_ratings")], _ratings(row[n], n)) for n in ratings if row[n] is not None]
        except BadRow as e:
            yield bad_row(key, _raw(row), str(e))
            continue
        source = row.get("source")
        yield RawSample(key, turns, images, category=source if isinstance(source, str) and source else None,
                        ratings=kept or None)


def _ratings(v, name: str) -> list:
    """A ``*_ratings`` cell: a list of whole numbers (or nulls); ``BadRow`` for anything else (a string column
    of that name would otherwise be read character by character)."""
    import math

    ok = lambda x: x is None or (isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
                                 and math.isfinite(x) and x == int(x))
    if not isinstance(v, list) or not all(ok(x) for x in v):
        raise BadRow(f"{name}: expected a list of whole numbers, got {str(v)[:80]}")
    return [None if x is None else int(x) for x in v]


def read_messages_parquet(path: str, cfg, take: Take) -> Iterator[RawSample]:
    schema = parquet_schema(path)
    _require(path, ["messages"], schema.names, "the messages layout has a messages column (+ images)")
    cols = ["messages"] + [c for c in ("images", "category", "data_source", "id") if c in schema.names]
    root = cfg.image_root or os.path.dirname(path)
    extra = frozenset(cfg.extra_turn_keys)
    for idx, row in iter_rows(path, cols, take):
        key = row_key(row, idx)
        try:
            turns, problem = message_turns(row["messages"], extra)
            images = _cell_images(row.get("images"), path, idx, "images", root, True)
        except BadRow as e:
            yield bad_row(key, _raw(row), str(e))
            continue
        yield RawSample(key, turns, images, category=row_category(row), format_status=problem,
                        source=row_source(row))
