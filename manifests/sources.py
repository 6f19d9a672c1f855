"""Source records as public sets ship them, parsed once for every reader of them: ``ingest``'s format
adapters (``curation/formats*.py``), ``rl-ingest`` (``rl_select/ingest.py``) and the generation
backends' ``file`` rows (``inference/backends.py``).

* ``iter_json_records``: the records of a ``.jsonl`` file (one per non-blank line) or a ``.json`` file
  (one array, parsed whole), each with its raw text and, for a record that does not parse, the error —
  a bad record is the caller's row with a status, never a crash; ``iter_jsonl_lines`` gives a JSONL
  file's lines with their byte offsets.
* ``image_cell``: an image cell as Hugging Face ``datasets`` stores one — binary, the ``Image`` struct
  ``{bytes, path}`` (bytes when not null, else the path) or a path string — as its bytes, its path, or
  ``None`` (missing); any other value is a ``BadRow``. ``image_path`` resolves a path against the
  folder it is relative to.
* ``message_turns``: chat ``messages`` (``[{"role", "content": str | [{"type": "image"} | {"type":
  "text", "text"}]}]``, or their JSON text) as ``(role, text)`` turns, an image part becoming
  ``<image>`` in place and text parts concatenated as chat templates render them.

Each raises ``BadRow`` (a ``ValueError``) naming the field for a record it cannot read; the caller
gives the row its status (``bad_row`` in both ingests) and keeps going.
"""
from __future__ import annotations

import json
import os
from typing import Iterator

from manifests.conversation import IMAGE_TOKEN, normalise_role

MESSAGE_KEYS = frozenset({"role", "content"})


class BadRow(ValueError):
    """A record that cannot be read as a conversation (malformed JSON, wrong types)."""


def iter_jsonl_lines(path: str) -> Iterator[tuple[int, object, bytes, str | None]]:
    """``(byte offset, record or None, raw bytes, parse error or None)`` of each non-blank line of a JSONL
    file, one at a time: what ``iter_json_records`` reads a ``.jsonl`` file with, and, with the offset, an
    index a reader can seek back to (``inference.backends.index_jsonl``)."""
    with open(path, "rb") as f:
        pos = 0
        for line in f:
            at, pos = pos, pos + len(line)
            if not line.strip():
                continue
            try:
                yield at, json.loads(line), line.rstrip(b"\r\n"), None
            except (ValueError, RecursionError) as e:    # RecursionError: nested deeper than Python's stack
                yield at, None, line.rstrip(b"\r\n"), f"not valid JSON: {e}"


def iter_json_records(path: str, lines: bool | None = None) -> Iterator[tuple[int, object, bytes | None, str | None]]:
    """``(record index, record, raw bytes or None, parse error or None)`` of a JSON file: one record per
    non-blank line (``lines``; by default when ``path`` ends in ``.jsonl``), else one JSON array of
    records (a file that does not parse, or is not an array, is one record with the error)."""
    if lines if lines is not None else path.endswith(".jsonl"):
        for i, (_, rec, raw, err) in enumerate(iter_jsonl_lines(path)):
            yield i, rec, raw, err
        return
    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:        # RecursionError: nested deeper than Python's stack
        yield 0, None, raw[:4096], f"{os.path.basename(path)} is not valid JSON: {e}"
        return
    if not isinstance(data, list):
        name = os.path.basename(path)
        yield 0, None, raw[:4096], f"{name}: expected a JSON array of records, got {type(data).__name__}"
        return
    for i, rec in enumerate(data):
        yield i, rec, None, None


def image_cell(v, where: str = "image") -> bytes | str | None:
    """An image cell's bytes, or the path it names, or ``None`` (null, or a struct with neither);
    ``BadRow`` naming ``where`` for any other value."""
    if isinstance(v, dict):
        if v.get("bytes") is not None:
            if not isinstance(v["bytes"], (bytes, bytearray, memoryview)):
                raise BadRow(f"{where}.bytes: expected binary, got {type(v['bytes']).__name__}")
            return bytes(v["bytes"])
        return v["path"] if v.get("path") else None
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    if isinstance(v, str) or v is None:
        return v
    raise BadRow(f"{where}: an image cell of type {type(v).__name__}")


def image_path(path: str, root: str | os.PathLike) -> str:
    """``path`` as given when absolute, else relative to the folder ``root``."""
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(root, path))


def unexpected_keys(d: dict, allowed: frozenset, extra: frozenset, where: str, expected: str) -> tuple[str, str] | None:
    """``("unexpected_key", message)`` when ``d`` holds a value under a key neither allowed nor extra."""
    bad = sorted(str(k) for k, v in d.items() if v is not None and k not in allowed and k not in extra)
    if bad:
        return "unexpected_key", f"{where} has key(s) {bad} (expected {expected})"
    return None


def json_objects(value, name: str, expected: str) -> list[dict]:
    """A list of objects, given as such or as its JSON text; anything else is a ``BadRow``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:
            raise BadRow(f"{name}: not valid JSON ({e})") from None
    if not isinstance(value, list):
        raise BadRow(f"{name}: expected {expected}, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise BadRow(f"{name}[{i}]: expected an object, got {type(item).__name__}")
    return value


def message_turns(messages, extra_keys: frozenset = frozenset()) -> tuple[list[tuple[str, str]], tuple[str, str] | None]:
    """Chat ``messages`` → (turns, problem): image parts become ``<image>`` in place, text parts
    are concatenated as the chat templates render them (no separator). ``problem``: a message key
    outside role/content and ``extra_keys`` (``unexpected_keys``)."""
    turns, problem = [], None
    for i, m in enumerate(json_objects(messages, "messages", "a list")):
        problem = problem or unexpected_keys(m, MESSAGE_KEYS, extra_keys, f"messages[{i}]", "role/content")
        content = m.get("content")
        if content is None or isinstance(content, str):
            text = content or ""
        elif isinstance(content, list):
            pieces = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image":
                    pieces.append(IMAGE_TOKEN)
                elif kind == "text" and isinstance(part.get("text"), str):
                    pieces.append(part["text"])
                else:
                    raise BadRow(f"messages[{i}].content[{j}]: expected {{type: image}} or {{type: text, text}}, "
                                 f"got {str(part)[:80]}")
            text = "".join(pieces)
        else:
            raise BadRow(f"messages[{i}].content: expected a string or a list of parts, got {type(content).__name__}")
        turns.append((normalise_role(m.get("role")), text))
    return turns, problem
