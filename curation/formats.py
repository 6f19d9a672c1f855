"""Input formats of ``ingest``: one adapter per published layout, each turning one input file
into ``RawSample``s (key, turns, images with their bytes read once, category, ratings, and any
problem found while parsing). ``curation.ingest`` turns those into ``samples`` rows.

Formats (config ``format``; ``auto`` picks by extension, then by Parquet columns / JSON keys):

=================== ============ ========================================================================
format              files        layout
=================== ============ ========================================================================
webdataset          .tar         ``key.jpg`` + ``key.txt``: a caption pair (image container ``tar``)
caption-parquet     .parquet     ``image`` (binary / ``{bytes, path}``) + ``caption`` columns
llava-json          .json/.jsonl ``{"id", "image" | "images", "conversations": [{"from", "value"}]}``
llava-ov-parquet    .parquet     ``conversations`` (list<struct<from,value>> or JSON text) + image column(s)
finevision          .parquet     ``images: list<{bytes,path}>``, ``texts: list<{user,assistant}>``,
                                 ``source``, ``*_ratings: list<int>`` (kept in ``turn_ratings``)
messages            .parquet,    ``messages: [{"role", "content": str | [{"type": "image"} |
                    .json/.jsonl {"type": "text", "text"}]}]`` + ``images`` (bytes / struct / paths)
=================== ============ ========================================================================

Auto by Parquet columns: ``texts`` + ``images`` → finevision; ``messages`` → messages;
``conversations`` → llava-ov-parquet; else caption-parquet. Auto for JSON decides per record:
a ``messages`` key → messages, else llava-json.

Images: a path (JSON, or an HF ``{bytes: null, path}`` struct) is relative to ``image_root``
(default: the folder of the file naming it), container ``file``; bytes inside a Parquet cell are
addressed as container ``parquet`` with column, row and list index, so ``read_image`` finds them
again. Every image is read once here; ``ingest`` hashes and inspects those bytes.

Turns: a LLaVA turn is ``{"from", "value"}``; ``{"role", "content"}`` is accepted as the same
thing (some LLaVA-style exports spell turns that way), plus any key in config ``extra_turn_keys``.
Any other key holding a value is ``unexpected_key`` (the published LLaVA-OneVision-1.5 instruct
data has a turn with a ``markdown`` key); null-valued keys are ignored, since a Parquet struct
column gives every row every field. A messages turn is ``{"role", "content"}`` likewise.
FineVision user texts carry no ``<image>`` placeholder: one ``<image>\\n`` per image is prepended
to the first user turn (a literal ``<image>`` already in the text then makes ``image_mismatch``).
A FineVision pair whose assistant is null contributes only its user turn.

Work split: an input file is cut into units — a JSON file into chunks of ``JSON_CHUNK_ROWS``
records, a Parquet file into row groups, a tar into one unit — and ``take(unit)`` says whether
this task handles it, so one big file still spreads over tasks. Keys never depend on the split.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Iterator

from manifests.conversation import caption_turns, normalise_role
from manifests.sources import BadRow, image_cell, image_path, json_objects, unexpected_keys

FORMATS = ("auto", "webdataset", "caption-parquet", "llava-json", "llava-ov-parquet", "finevision", "messages")
JSON_EXTS = (".json", ".jsonl")
JSON_CHUNK_ROWS = 1024          # records per work unit of a JSON file
PARQUET_BATCH_ROWS = 256        # rows decoded at a time inside a row group (images are large)
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "gif")
CAPTION_EXTS = ("txt", "caption")
LLAVA_TURN_KEYS = frozenset({"from", "value", "role", "content"})
BAD_ROW_PREFIX = b"\x00ovbad\x00"  # a bad row's id hashes its raw text behind this (never a real conversation)

Take = Callable[[int], bool]


class ShardError(ValueError):
    """A whole input file that cannot be read (further): ``status`` is its ``shards`` row's status
    (``bad_shard`` | ``truncated_shard`` | ``missing_column``). Raised by an adapter after it
    yielded every sample it could read; ``ingest`` records it and goes on with the next file."""

    def __init__(self, status: str, error: str):
        super().__init__(error)
        self.status = status


@dataclass
class ImageRef:
    """One image of a sample: its address (``IMAGE_ADDRESS`` fields file/container/offset/column/
    index; ingest adds size/format/width/height) and its bytes, read once. ``data is None``: the
    image is missing (``error`` says why). ``addr is None``: nothing to point at (a tar sample
    without an image member) — counted as missing, not listed in ``images``."""

    addr: dict | None
    data: bytes | None
    error: str | None = None


@dataclass
class RawSample:
    key: str
    turns: list[tuple[str, str]]
    images: list[ImageRef] = field(default_factory=list)
    category: str | None = None                       # from the row (category / data_source / source)
    ratings: list[tuple[str, list]] | None = None     # FineVision: [(name, per-turn ratings)], sorted
    format_status: tuple[str, str] | None = None      # bad_row | unexpected_key, found while parsing
    text_status: tuple[str, str] | None = None        # caption sources: missing/empty caption, bad encoding
    encoded: bytes | None = None                      # hashed in place of the conversation (captions, bad rows)
    caption: str | None = None                        # caption sources: the decoded, stripped caption
    caption_source: bool = False
    source: str | None = None                         # the row's own source name (``data_source``), if any
    lang: str | None = None                           # the row's own language (``lang_column``), if any


# ------------------------------------------------------------------------------------------------
# Images


def image_address(file: str, container: str, offset: int = 0, column: str | None = None, index: int = -1) -> dict:
    return {"file": file, "container": container, "offset": offset, "column": column, "index": index}


def file_image(path: str, root: str) -> ImageRef:
    """An image file named by ``path`` (relative to ``root`` unless absolute)."""
    import stat

    full = image_path(path, root)
    addr = image_address(full, "file")
    try:
        # a device or a FIFO (/dev/zero, a pipe) would be read forever: only a regular file is read
        if not stat.S_ISREG(os.stat(full).st_mode):
            return ImageRef(addr, None, f"image file {full}: not a regular file")
        with open(full, "rb") as f:
            return ImageRef(addr, f.read())
    except (OSError, ValueError) as e:  # not found, a folder, unreadable, a NUL in the path: the image is missing
        return ImageRef(addr, None, f"image file {full}: {getattr(e, 'strerror', None) or e}")


def cell_image(v, path: str, row: int, column: str, index: int, root: str) -> ImageRef:
    """A Parquet image cell (``manifests.sources.image_cell``): binary, the HF ``Image`` struct
    ``{bytes, path}``, or a path string."""
    addr = image_address(path, "parquet", row, column, index)
    where = f"{column}[{index}]" if index >= 0 else column
    got = image_cell(v, where)
    if isinstance(got, bytes):
        return ImageRef(addr, got)
    if isinstance(got, str):
        return file_image(got, root)
    return ImageRef(addr, None, f"{where} is null" if v is None else f"{where}: neither bytes nor path")


def is_image_type(t) -> bool:
    """Arrow types an image column holds: binary, a struct with ``bytes``, or a list of those."""
    import pyarrow as pa

    if pa.types.is_list(t) or pa.types.is_large_list(t):
        t = t.value_type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return True
    return pa.types.is_struct(t) and t.get_field_index("bytes") >= 0


# ------------------------------------------------------------------------------------------------
# Turns


def llava_turns(convs, extra_keys: frozenset) -> tuple[list[tuple[str, str]], tuple[str, str] | None]:
    """LLaVA ``conversations`` (a list, or its JSON text) → (turns, unexpected_key problem or None)."""
    turns, problem = [], None
    for i, t in enumerate(json_objects(convs, "conversations", "a list of turns")):
        problem = problem or unexpected_keys(t, LLAVA_TURN_KEYS, extra_keys, f"conversations[{i}]", "from/value")
        role = t.get("from") if t.get("from") is not None else t.get("role")
        text = t.get("value") if t.get("value") is not None else t.get("content")
        if not isinstance(text, (str, type(None))):
            raise BadRow(f"conversations[{i}].value: expected a string, got {type(text).__name__}")
        turns.append((normalise_role(role), text or ""))
    return turns, problem


def finevision_turns(texts, n_images: int) -> list[tuple[str, str]]:
    if not isinstance(texts, list) or not texts:
        raise BadRow(f"texts: expected a non-empty list of {{user, assistant}}, got {str(texts)[:80]}")
    turns = []
    for i, t in enumerate(texts):
        if not isinstance(t, dict) or not isinstance(t.get("user"), str):
            raise BadRow(f"texts[{i}]: expected {{user: string, assistant}}, got {str(t)[:80]}")
        user = t["user"] if i else "<image>\n" * n_images + t["user"]
        turns.append(("user", user))
        if t.get("assistant") is not None:
            if not isinstance(t["assistant"], str):
                raise BadRow(f"texts[{i}].assistant: expected a string")
            turns.append(("assistant", t["assistant"]))
    return turns


def row_category(rec: dict) -> str | None:
    for k in ("category", "data_source"):
        if isinstance(rec.get(k), str) and rec[k]:
            return rec[k]
    return None


def row_source(rec: dict) -> str | None:
    """A row's own source name: its ``data_source`` (the hub datasets that mix sources name each row's)."""
    v = rec.get("data_source")
    return v if isinstance(v, str) and v else None


def row_key(rec: dict, index: int) -> str:
    """A row's key in its file: its ``id`` where it has a scalar one (the hub datasets carry one), else its
    index (``%09d``). The same id twice in one file stays two rows told apart by position (``ingest``)."""
    rid = rec.get("id")
    return f"{index:09d}" if rid is None or isinstance(rid, (dict, list, bytes, bytearray)) else str(rid)


def default_source(path: str) -> str:
    """The source name of a file when the config gives none: its folder's name — or, in the hub's layout
    (``<dataset>/data/train-0000K-of-0000N.parquet``), the dataset's: the folder above ``data/``, and in a hub
    cache (``datasets--<owner>--<name>/snapshots/<rev>/data/``) the dataset's name."""
    from pathlib import Path

    folder = Path(path).parent
    if folder.name != "data" or not folder.parent.name:
        return folder.name
    dataset = folder.parent
    if dataset.parent.name == "snapshots" and dataset.parent.parent.name.startswith("datasets--"):
        return dataset.parent.parent.name.split("--")[-1]
    return dataset.name


def bad_row(key: str, raw: bytes, error: str) -> RawSample:
    return RawSample(key, [], format_status=("bad_row", error[:300]), encoded=BAD_ROW_PREFIX + raw)


# ------------------------------------------------------------------------------------------------
# Format detection and the adapter table


def detect_format(path: str, fmt: str, caption_column: str = "caption") -> str:
    """The adapter for ``path``: ``fmt`` checked against the file type, or picked when ``auto``
    (``json-auto``: decided per JSON record)."""
    ext = os.path.splitext(path)[1].lower()
    kind = "tar" if ext == ".tar" else "parquet" if ext == ".parquet" else "json" if ext in JSON_EXTS else None
    if kind is None:
        raise ValueError(f"ingest: {path}: unknown input type {ext!r} (expected .tar, .parquet, .json or .jsonl)")
    fits = {"webdataset": ("tar",), "caption-parquet": ("parquet",), "llava-json": ("json",),
            "llava-ov-parquet": ("parquet",), "finevision": ("parquet",), "messages": ("parquet", "json")}
    if fmt != "auto":
        if kind not in fits[fmt]:
            raise ValueError(f"ingest: format={fmt} cannot read {path} (a {kind} file)")
        return fmt
    if kind == "tar":
        return "webdataset"
    if kind == "json":
        return "json-auto"
    names = set(parquet_schema(path).names)
    if {"texts", "images"} <= names:
        return "finevision"
    if "messages" in names:
        return "messages"
    if "conversations" in names:
        return "llava-ov-parquet"
    if caption_column in names:
        return "caption-parquet"
    raise ShardError("missing_column",
                     f"ingest: {path}: cannot tell the format from its columns {sorted(names)}; set `format` "
                     f"(or `caption_column` for caption Parquet: no column {caption_column!r})")


def parquet_schema(path: str):
    """A Parquet file's schema; a file that is not Parquet is ``ShardError("bad_shard")``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_schema(path)
    except pa.ArrowInvalid as e:  # not Parquet, empty, bad footer (an I/O error still raises)
        raise ShardError("bad_shard", f"{path}: not a readable Parquet file ({e})") from None


# ------------------------------------------------------------------------------------------------
# webdataset tar: caption pairs


def split_key(name: str) -> tuple[str, str]:
    """webdataset convention: ``dir/key.ext.more`` → (``dir/key``, ``ext.more``)."""
    d, base = os.path.split(name)
    stem, _, ext = base.partition(".")
    return (f"{d}/{stem}" if d else stem), ext.lower()


@dataclass
class TarMember:
    """A member of a sample: its data's ``offset``/``size``, or ``problem`` (a link or special file,
    whose data is not read; a member cut by the end of the file keeps its offset and is flagged
    by ``read_webdataset``)."""

    name: str
    offset: int = -1
    size: int = 0
    problem: str | None = None


def iter_tar(path: str) -> Iterator[dict]:
    """Samples of a webdataset tar: ``{"key", "members": {ext: TarMember}}``; consecutive members
    share a key (a repeated extension starts a new sample: the same key twice in a row is two
    samples). Folders are skipped; links and special files are kept as members with a problem.

    A file that is not a tar raises ``ShardError("bad_shard")``. A tar cut short or with garbage
    after its members yields every sample up to the cut, then raises ``ShardError("truncated_shard")``;
    so does a tar without its end-of-archive blocks (probably cut at a member boundary)."""
    import tarfile

    current, members = None, {}
    try:
        tf = tarfile.open(path, "r:")
    except (tarfile.ReadError, EOFError) as e:
        raise ShardError("bad_shard", f"{path}: not a readable tar ({e})") from None
    problem = None
    with tf:
        it = iter(tf)
        while True:
            try:
                m = next(it)
            except StopIteration:
                break
            except (tarfile.ReadError, EOFError) as e:  # e.g. 'unexpected end of data': a member cut short
                problem = f"{path}: the tar is cut or damaged after member offset {tf.offset} ({e})"
                break
            if m.isdir():
                continue
            key, ext = split_key(m.name)
            if current is not None and (key != current or ext in members):
                yield {"key": current, "members": members}
                members = {}
            current = key
            if m.isfile():
                members[ext] = TarMember(m.name, m.offset_data, m.size)
            elif m.issym() or m.islnk():
                kind = "symlink" if m.issym() else "hard link"
                members[ext] = TarMember(m.name, problem=f"member {m.name} is a {kind} to {m.linkname!r} "
                                                           f"(links in a tar are not followed)")
            else:
                members[ext] = TarMember(m.name, problem=f"member {m.name} is not a regular file (tar type {m.type!r})")
        if problem is None:  # tarfile stops silently at a cut or garbled header: check how the archive ends
            tf.fileobj.seek(tf.offset)
            end = tf.fileobj.read(tarfile.BLOCKSIZE)
            if len(end) < tarfile.BLOCKSIZE or end.strip(b"\0"):
                what = "no end-of-archive blocks (cut at a member boundary?)" if not end else \
                    "unreadable data where the next member header should be (cut or damaged)"
                problem = f"{path}: {what} at offset {tf.offset}"
    if current is not None:
        yield {"key": current, "members": members}
    if problem is not None:
        raise ShardError("truncated_shard", problem)


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


def caption_sample(key: str, image: ImageRef, raw_cap: bytes | None, cap_problem: str | None = None) -> RawSample:
    """A caption pair; its id hashes the caption bytes exactly as stored (the pre-conversation rule)."""
    caption, status, error = decode_caption(raw_cap)
    if cap_problem is not None and status == "missing_caption":
        error = cap_problem
    return RawSample(key, caption_turns(caption or ""), [image], text_status=(status, error) if status else None,
                     encoded=raw_cap or b"", caption=caption, caption_source=True)


def read_webdataset(path: str, cfg, take: Take) -> Iterator[RawSample]:
    if not take(0):
        return
    file_size = os.path.getsize(path)

    def cut(mem: TarMember) -> str | None:
        if mem.problem is None and mem.offset + mem.size > file_size:
            have = max(file_size - mem.offset, 0)
            return f"member {mem.name}: {have} of {mem.size} bytes before the end of the file (the tar is cut)"
        return None

    with open(path, "rb") as f:
        def data(mem: TarMember) -> bytes:
            f.seek(mem.offset)
            return f.read(mem.size)

        for s in iter_tar(path):
            mem = s["members"]
            img_ext = next((e for e in IMAGE_EXTS if e in mem), None)
            cap_ext = next((e for e in CAPTION_EXTS if e in mem), None)
            raw_cap, cap_problem = None, None
            if cap_ext:
                if mem[cap_ext].problem is None:
                    raw_cap = data(mem[cap_ext])
                else:
                    cap_problem = mem[cap_ext].problem
            if img_ext is None:
                image = ImageRef(None, None, f"no image member ({'/'.join(IMAGE_EXTS)})")
            elif mem[img_ext].problem is not None:
                image = ImageRef(None, None, mem[img_ext].problem)
            else:
                image = ImageRef(image_address(path, "tar", mem[img_ext].offset), data(mem[img_ext]))
            sample = caption_sample(s["key"], image, raw_cap, cap_problem)
            truncated = next((c for c in map(cut, mem.values()) if c), None)
            if truncated:
                sample.format_status = ("truncated_shard", truncated)
            yield sample
