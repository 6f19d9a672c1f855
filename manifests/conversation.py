"""The sample model: a sample is a conversation.

A sample is an ordered list of turns ``(role, text)`` whose texts hold ``<image>`` placeholders,
plus an ordered list of image addresses (0..n images, in placeholder order), a ``source`` and a
``category``. A caption pair is the two-turn case ``[user: "<image>", assistant: caption]``.

Roles are ``system`` | ``user`` | ``assistant`` (LLaVA's ``human``/``gpt`` map to user/assistant).
A conversation is trainable when it has at least one assistant turn, ends with an assistant
turn, has no empty assistant turn, and its placeholder count equals its image count; otherwise
``check_conversation`` names the status (``image_mismatch``, ``empty_turn``, ``bad_last_turn``,
``unknown_role``, ``no_assistant``), and ingest writes the row with that status.

``sample_id`` (16 lowercase hex chars) is xxh3-64 over, in order:

* each image's encoded bytes, exactly as stored in the source (never re-encoded), then
* the conversation's canonical encoding:
  - a **caption pair** (one image, turns exactly ``[("user", "<image>"), ("assistant", c)]``)
    encodes as the caption's bytes alone — for webdataset / caption-Parquet sources the
    caption bytes *as the source stores them* (before whitespace stripping, even when they are
    not UTF-8), which is the rule every earlier ovpipe run used, so existing ids do not change;
  - any other conversation encodes as ``b"\\x00ovconv1\\x00"`` + compact JSON of
    ``[[role, text], ...]`` (UTF-8, ``ensure_ascii=False``, separators ``,`` and ``:``). The
    leading NUL keeps the two encodings from colliding with any caption text.

So the same conversation over the same image bytes has the same id whichever format it came in.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Iterable, Sequence

import pyarrow as pa

IMAGE_TOKEN = "<image>"
ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant",
                "system": "system", "bot": "assistant", "model": "assistant"}
CONV_PREFIX = b"\x00ovconv1\x00"
CAPTION_CATEGORY = "caption"

# One image of a sample: where its bytes are and how large it is (from the header).
IMAGE_ADDRESS = pa.struct([
    ("file", pa.string()),          # the tar shard, Parquet file or image file holding the bytes
    ("container", pa.string()),     # "tar" | "parquet" | "file"
    ("offset", pa.int64()),         # tar: byte offset of the member data; parquet: row index; file: 0
    ("size", pa.int64()),           # encoded byte size
    ("column", pa.string()),        # parquet: the column holding the image; else null
    ("index", pa.int32()),          # parquet: position inside a list<image> column; -1 for a scalar column
    ("format", pa.string()),        # "jpeg" | "png" | ... ("" when unreadable)
    ("width", pa.int32()),
    ("height", pa.int32()),
])
TURN = pa.struct([("role", pa.string()), ("text", pa.string())])


def canonical_bytes(turns: Sequence[tuple[str, str]]) -> bytes:
    """The conversation's canonical encoding (see the module docstring)."""
    turns = [(r, t) for r, t in turns]
    if is_caption_pair(turns, 1):
        return turns[1][1].encode("utf-8")
    return CONV_PREFIX + json.dumps([[r, t] for r, t in turns], ensure_ascii=False,
                                    separators=(",", ":")).encode("utf-8")


def is_caption_pair(turns: Sequence[tuple[str, str]], n_images: int) -> bool:
    return (n_images == 1 and len(turns) == 2 and turns[0][0] == "user" and turns[0][1] == IMAGE_TOKEN
            and turns[1][0] == "assistant")


def sample_id(images: Iterable[bytes], turns: Sequence[tuple[str, str]] | None = None,
              encoded: bytes | None = None) -> str:
    """xxh3-64 hex of the images' bytes in order + the conversation's canonical encoding
    (or ``encoded``: the caption bytes exactly as a caption source stores them)."""
    import xxhash

    h = xxhash.xxh3_64()
    for b in images:
        h.update(b)
    h.update(encoded if encoded is not None else canonical_bytes(turns or []))
    return h.hexdigest()


def caption_turns(caption: str) -> list[tuple[str, str]]:
    return [("user", IMAGE_TOKEN), ("assistant", caption)]


def check_conversation(turns: Sequence[tuple[str, str]], n_images: int) -> tuple[str, str] | None:
    """``(status, error)`` of a conversation that cannot be trained on, else None."""
    for i, (role, _text) in enumerate(turns):
        if role not in ROLES:
            return "unknown_role", f"turn {i}: role {role!r} is not one of {'/'.join(ROLES)}"
    if not any(r == "assistant" for r, _ in turns):
        return "no_assistant", "no assistant turn"
    if turns[-1][0] != "assistant":
        return "bad_last_turn", f"the conversation ends with a {turns[-1][0]!r} turn, not the assistant's"
    for i, (role, text) in enumerate(turns):
        if role == "assistant" and not (text or "").strip():
            return "empty_turn", f"turn {i}: empty assistant turn"
    placeholders = sum((t or "").count(IMAGE_TOKEN) for _, t in turns)
    if placeholders != n_images:
        return "image_mismatch", f"{placeholders} {IMAGE_TOKEN} placeholder(s) but {n_images} image(s)"
    for i, (role, text) in enumerate(turns):
        if role == "assistant" and IMAGE_TOKEN in text:
            return "image_mismatch", f"turn {i}: {IMAGE_TOKEN} inside an assistant turn"
    return None


_SPLIT = re.compile(f"({re.escape(IMAGE_TOKEN)})")


def split_images(text: str) -> list[str]:
    """``"<image>\\nWhat is it?"`` → ``["<image>", "\\nWhat is it?"]`` (empty pieces dropped)."""
    return [p for p in _SPLIT.split(text) if p]


def to_messages(turns: Sequence[tuple[str, str]]) -> list[dict]:
    """Hugging Face chat ``messages`` (content parts), the form ``apply_chat_template`` and the
    Qwen2-VL processor take: each ``<image>`` becomes ``{"type": "image"}`` in place."""
    out = []
    for role, text in turns:
        parts = [{"type": "image"} if p == IMAGE_TOKEN else {"type": "text", "text": p} for p in split_images(text)]
        out.append({"role": role, "content": parts})
    return out


def normalise_role(role) -> str:
    """LLaVA ``human``/``gpt`` → ``user``/``assistant``; anything unknown is returned as is
    (``check_conversation`` then gives the row ``unknown_role``)."""
    if not isinstance(role, str):
        return repr(role)
    return ROLE_ALIASES.get(role.strip().lower(), role)


def read_image(addr: dict) -> bytes:
    """The encoded bytes of one image address (``IMAGE_ADDRESS``)."""
    container = addr["container"]
    if container == "tar":
        with open(addr["file"], "rb") as f:
            f.seek(int(addr["offset"]))
            return f.read(int(addr["size"]))
    if container == "file":
        with open(addr["file"], "rb") as f:
            return f.read()
    if container == "parquet":
        rg, idx = _row_group_of(addr["file"], int(addr["offset"]))
        v = _row_group_column(addr["file"], rg, addr["column"])[idx].as_py()
        if int(addr.get("index", -1)) >= 0:
            v = v[int(addr["index"])]
        return image_value_bytes(v)
    raise ValueError(f"unknown image container {container!r}")


def upright_rgb(im):
    """A PIL image as every step reads it: its EXIF orientation applied (ingest records the displayed
    size) and RGB. The same pixels as ``ImageOps.exif_transpose(im).convert("RGB")`` without that
    expression's two whole-image copies when nothing needs doing (an upright RGB image, most of a
    corpus). Transposes ``im`` in place."""
    from PIL import ImageOps

    ImageOps.exif_transpose(im, in_place=True)
    return as_rgb(im)


def as_rgb(im):
    """``im.convert("RGB")`` where it changes something: PIL's copies an RGB image whole."""
    return im if im.mode == "RGB" else im.convert("RGB")


@lru_cache(maxsize=64)
def _row_group_starts(path: str) -> tuple[int, ...]:
    import pyarrow.parquet as pq

    md = pq.ParquetFile(path).metadata
    starts, n = [], 0
    for rg in range(md.num_row_groups):
        starts.append(n)
        n += md.row_group(rg).num_rows
    return tuple(starts) + (n,)


def _row_group_of(path: str, row: int) -> tuple[int, int]:
    import bisect

    starts = _row_group_starts(path)
    if not 0 <= row < starts[-1]:
        raise IndexError(f"{path}: row {row} out of range (0..{starts[-1] - 1})")
    rg = bisect.bisect_right(starts, row) - 1
    return rg, row - starts[rg]


# Readers go through a source in row order (the shard writer, embedding), so the last row groups
# read stay cached: one Parquet read per row group, not one per image. Two keep memory bounded
# (a FineVision row group of images can be hundreds of MB).
@lru_cache(maxsize=2)
def _row_group_column(path: str, rg: int, column: str):
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).read_row_group(rg, columns=[column]).column(0)


def image_value_bytes(v) -> bytes:
    """A Parquet image cell as bytes: binary, or the HF ``Image`` struct ``{bytes, path}``."""
    if v is None:
        return b""
    if isinstance(v, dict):
        return v.get("bytes") or b""
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    raise TypeError(f"image cell of type {type(v).__name__} (expected binary or a struct with `bytes`)")
