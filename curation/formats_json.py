"""JSON inputs of ``ingest``: LLaVA JSON/JSONL and the chat ``messages`` layout in JSON.

A ``.jsonl`` file is streamed line by line (blank lines skipped). A ``.json`` file must be one
array of records and is parsed whole (``manifests.sources.iter_json_records``) (LLaVA-558K's 558K records are ~0.2 GB of JSON, a few GB of
Python objects at most); a file that does not parse is one ``bad_row``. A record that is not
valid JSON, not an object, or has fields of the wrong type is a ``bad_row`` whose ``sample_id``
hashes its raw text.

Keys: the record's ``id`` (as text); a record without one gets its record index (``%09d``); a key
already given earlier in the same file gets ``#<record index>`` appended, so keys are unique and
do not depend on how tasks split the file. Every task therefore reads every record of the file
(cheap), but reads images only for the chunks of ``JSON_CHUNK_ROWS`` records it owns.
"""
from __future__ import annotations

import json
import os
from typing import Iterator

from curation.formats import (JSON_CHUNK_ROWS, RawSample, Take, bad_row, file_image, llava_turns, row_category,
                              row_source)
from manifests.sources import BadRow, iter_json_records, message_turns


class KeyMaker:
    """Unique, split-independent keys for the records of one file (see the module docstring)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, rid, index: int) -> str:
        key = f"{index:09d}" if rid is None or isinstance(rid, (dict, list)) else str(rid)
        if key in self.seen:
            key = f"{key}#{index}"
        while key in self.seen:  # an id that itself looks like "<id>#<n>"
            key += "#"
        self.seen.add(key)
        return key


def _raw(rec) -> bytes:
    return json.dumps(rec, sort_keys=True, ensure_ascii=False, default=str).encode()


def json_images(value, root: str) -> list:
    """``image`` / ``images``: a path, a list of paths (or ``{"path": ...}`` objects), or null."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    refs = []
    for j, v in enumerate(items):
        if isinstance(v, dict) and isinstance(v.get("path"), str):
            v = v["path"]
        if not isinstance(v, str):
            raise BadRow(f"images[{j}]: expected an image path, got {str(v)[:80]}")
        refs.append(file_image(v, root))
    return refs


def json_sample(rec, key: str, root: str, fmt: str, extra_keys: frozenset) -> RawSample:
    if not isinstance(rec, dict):
        raise BadRow(f"expected a JSON object, got {type(rec).__name__}")
    kind = fmt if fmt in ("llava-json", "messages") else ("messages" if "messages" in rec else "llava-json")
    if kind == "messages":
        if "messages" not in rec:
            raise BadRow("no `messages` field")
        turns, problem = message_turns(rec["messages"], extra_keys)
        images = json_images(rec.get("images"), root)
    else:
        if "conversations" not in rec:
            raise BadRow("no `conversations` field")
        turns, problem = llava_turns(rec["conversations"], extra_keys)
        images = json_images(rec["images"] if rec.get("images") is not None else rec.get("image"), root)
    return RawSample(key, turns, images, category=row_category(rec), format_status=problem, source=row_source(rec))


def read_json(path: str, cfg, take: Take) -> Iterator[RawSample]:
    """LLaVA JSON/JSONL or messages JSON (``cfg.format``; ``auto`` decides per record)."""
    root = cfg.image_root or os.path.dirname(path)
    extra = frozenset(cfg.extra_turn_keys)
    make_key = KeyMaker()
    for i, rec, raw, err in iter_json_records(path):
        key = make_key(rec.get("id") if isinstance(rec, dict) else None, i)
        if not take(i // JSON_CHUNK_ROWS):
            continue
        if err is not None:
            yield bad_row(key, raw or b"", err)
            continue
        try:
            yield json_sample(rec, key, root, cfg.format, extra)
        except BadRow as e:
            yield bad_row(key, raw if raw is not None else _raw(rec), str(e))
