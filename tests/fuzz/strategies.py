"""The one place for the fuzz tests' hypothesis strategies, and the settings profiles they run under.

Profiles (chosen by the environment variable HYPOTHESIS_PROFILE, default "ci"):
- "ci": `make test` — derandomized (a fixed seed: the same examples on every run), 10 examples per test (fewer
  for a whole step run twice), no example database, so the fuzz suite stays within its time in `make test`.
- "long": the bench (`python -m bench fuzz --examples N` sets max_examples itself); random, no deadline.

Every strategy here draws *bad* inputs on purpose: a vector row that is zero, NaN, ±inf, subnormal or
duplicated; a caption that is null, a number or a huge string; a tar member that is missing or cut short.
"""
from __future__ import annotations

import functools
import os

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

settings.register_profile(
    "ci", derandomize=True, max_examples=10, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
settings.register_profile(
    "long", max_examples=2_000, deadline=None, database=None,
    suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# What a vector row can be: a real direction, or one of the values that break a norm, a dot product or a
# faiss search. "dup" repeats an earlier row exactly (identical vectors, however many).
ROW_KINDS = ("normal", "zero", "nan", "inf", "-inf", "partial_nan", "tiny", "huge", "dup")


@st.composite
def vector_rows(draw, dim: int = 8, min_rows: int = 1, max_rows: int = 40,
                kinds: tuple[str, ...] = ROW_KINDS, dtype=np.float32) -> tuple[np.ndarray, list[str]]:
    """(vectors [n, dim] of `dtype`, the kind of each row). Rows of every kind in ROW_KINDS, in any order."""
    n = draw(st.integers(min_rows, max_rows))
    row_kinds = draw(st.lists(st.sampled_from(kinds), min_size=n, max_size=n))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    out = np.empty((n, dim), dtype=np.float64)
    for i, kind in enumerate(row_kinds):
        if kind == "dup" and i > 0:
            out[i] = out[draw(st.integers(0, i - 1))]
            continue
        if kind == "dup":
            row_kinds[i] = kind = "normal"
        v = rng.standard_normal(dim)
        if kind == "zero":
            v[:] = 0.0
        elif kind == "nan":
            v[:] = np.nan
        elif kind == "inf":
            v[rng.integers(dim)] = np.inf
        elif kind == "-inf":
            v[rng.integers(dim)] = -np.inf
        elif kind == "partial_nan":
            v[rng.integers(dim)] = np.nan
        elif kind == "tiny":
            v *= float(np.finfo(dtype).tiny)
        elif kind == "huge":
            v *= float(np.finfo(dtype).max) / 4
        out[i] = v
    with np.errstate(over="ignore", invalid="ignore"):
        return out.astype(dtype), row_kinds


def float_vectors(dim: int = 8, min_rows: int = 1, max_rows: int = 40,
                  kinds: tuple[str, ...] = ROW_KINDS, dtype=np.float32):
    """Only the [n, dim] array of `vector_rows`."""
    return vector_rows(dim, min_rows, max_rows, kinds, dtype).map(lambda pair: pair[0])


def is_bad_row(v: np.ndarray) -> bool:
    """A row no cosine can be computed from: a non-finite value, or a zero norm."""
    v64 = np.asarray(v, dtype=np.float64)
    return not np.isfinite(v64).all() or not np.linalg.norm(v64) > 0


# ------------------------------------------------------------------------------------------- texts, JSON

SPECIAL_TEXTS = ("<image>", "<image><image>", "<|image_pad|>", "<|im_end|>", "<|vision_start|>", "\x00", "\ufeff",
                 "Describe the image.", "", " ", "\n", "a cat.", "\ud7ff\U0010ffff", "e\u0301", "\u202eevil",
                 "{{ 7 * 7 }}", "<script>alert(1)</script>", "' OR 1=1 --", "../../etc/passwd", "%s%n", "null",
                 "\r\n\t", "🙂" * 3, "ß" * 40, "<image>\n" * 3)


def junk_text(max_size: int = 12):
    """A text a reader may meet: short unicode, a string that is special somewhere (a placeholder or token the
    encoders treat specially, markup, a path, combining or right-to-left marks), or a huge one (200 kB)."""
    return st.one_of(st.sampled_from(SPECIAL_TEXTS), st.sampled_from(SPECIAL_TEXTS), st.text(max_size=max_size),
                     st.integers(20_000, 200_000).map(lambda n: "word " * (n // 5)))


def json_scalar():
    return st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                     junk_text())


def json_value(depth: int = 2):
    """Any JSON value (scalars, lists, objects), a few levels deep."""
    return st.recursive(json_scalar(), lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                               st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                        max_leaves=4)


def maybe(strategy, value_strategy=None):
    """``strategy``, or (sometimes) any other JSON value in its place: the wrong type for the field."""
    return st.one_of(strategy, strategy, strategy, json_value() if value_strategy is None else value_strategy)


# ------------------------------------------------------------------------------------------- images

_IMAGES: dict[str, bytes] = {}


def _image_samples() -> dict[str, bytes]:
    if not _IMAGES:
        import io

        from PIL import Image

        for name, (w, h, fmt) in {"jpg": (16, 12, "JPEG"), "png": (7, 30, "PNG"), "tiny": (1, 1, "JPEG")}.items():
            buf = io.BytesIO()
            Image.new("RGB", (w, h), (10, 200, 30)).save(buf, format=fmt)
            _IMAGES[name] = buf.getvalue()
        # a PNG header that claims 100000 × 100000 pixels (a decompression bomb by its header alone)
        import struct
        import zlib

        ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
        chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))  # noqa: E731
        _IMAGES["bomb"] = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")
    return _IMAGES


@st.composite
def image_bytes(draw) -> bytes:
    """Image bytes: a good JPEG/PNG, one cut short, a header claiming 10^10 pixels, random bytes, or none."""
    imgs = _image_samples()
    kind = draw(st.sampled_from(("jpg", "png", "tiny", "cut", "bomb", "random", "empty")))
    if kind == "cut":
        good = imgs[draw(st.sampled_from(("jpg", "png")))]
        return good[:draw(st.integers(0, len(good) - 1))]
    if kind == "random":
        return draw(st.binary(max_size=64))
    if kind == "empty":
        return b""
    return imgs[kind]


# ------------------------------------------------------------------------------------------- webdataset tars

WDS_KEYS = ("a", "b", "c", "sub/d", "e.f", "ü", "x" * 90)
WDS_EXTS = ("jpg", "png", "txt", "caption", "json", "cls", "JPG", "txt.gz", "")


@st.composite
def caption_bytes(draw) -> bytes:
    kind = draw(st.sampled_from(("text", "text", "empty", "latin1", "random")))
    if kind == "text":
        return draw(junk_text()).encode("utf-8")
    if kind == "latin1":
        return "café crème".encode("latin-1")
    if kind == "random":
        return draw(st.binary(max_size=32))
    return b""


@st.composite
def wds_members(draw, bulk: int = 0) -> list[tuple[str, bytes]]:
    """The members of a webdataset tar in file order: keys with image and caption members that may be
    missing, doubled, out of order, mismatched (an image under one key, its caption under another).
    ``bulk``: that many more samples, each a drawn member list re-keyed, its data swapped for another drawn
    member's (cheap to make: a fuzz run of many rows per input)."""
    out = []
    for _ in range(draw(st.integers(0, 8))):
        key = draw(st.sampled_from(WDS_KEYS))
        for ext in draw(st.lists(st.sampled_from(WDS_EXTS), min_size=1, max_size=3)):
            name = f"{key}.{ext}" if ext else key
            data = draw(image_bytes()) if ext.lower() in ("jpg", "png") else draw(caption_bytes())
            out.append((name, data))
    if bulk and out:
        rng = draw(st.randoms(use_true_random=True))
        exts = [n.partition(".")[2] for n, _ in out]
        for i in range(bulk):
            for ext in rng.sample(exts, rng.randint(1, min(3, len(exts)))):
                _, data = rng.choice(out)
                out.append((f"bulk{i:05d}.{ext}" if ext else f"bulk{i:05d}", data))
    return out


@st.composite
def wds_tar(draw, bulk: int = 0) -> tuple[list[tuple[str, bytes]], int | None, bytes]:
    """(members, cut: keep the tar's first ``cut`` bytes or None, bytes appended after the end blocks)."""
    members = draw(wds_members(bulk))
    cut = draw(st.one_of(st.none(), st.none(), st.integers(0, 4096)))
    tail = draw(st.sampled_from((b"", b"", b"garbage after the end")))
    return members, cut, tail


# ------------------------------------------------------------------------------------------- LLaVA / messages JSON

IMAGE_PATHS = ("img.jpg", "missing.jpg", "/dev/zero", "fifo.jpg", ".", "sub/../img.jpg", "")


def llava_turn():
    return st.one_of(st.fixed_dictionaries({"from": maybe(st.sampled_from(("human", "gpt", "system", "user",
                                                                           "assistant", "bot"))),
                                            "value": maybe(junk_text())},
                                           optional={"markdown": json_scalar(), "role": json_scalar()}),
                     json_value())


def llava_record():
    return st.one_of(
        st.fixed_dictionaries({"conversations": maybe(st.lists(llava_turn(), max_size=4))},
                              optional={"id": json_scalar(), "image": maybe(st.sampled_from(IMAGE_PATHS)),
                                        "images": maybe(st.lists(st.sampled_from(IMAGE_PATHS), max_size=3)),
                                        "data_source": json_scalar(), "category": json_scalar()}),
        json_value())


def message_part():
    return st.one_of(st.just({"type": "image"}), st.fixed_dictionaries({"type": st.just("text"),
                                                                         "text": maybe(junk_text())}),
                     json_value())


def messages_record():
    msg = st.fixed_dictionaries({"role": maybe(st.sampled_from(("user", "assistant", "system", "tool"))),
                                 "content": st.one_of(junk_text(), st.lists(message_part(), max_size=3), json_value())})
    return st.fixed_dictionaries({"messages": maybe(st.lists(msg, max_size=4))},
                                 optional={"images": maybe(st.lists(st.sampled_from(IMAGE_PATHS), max_size=3)),
                                           "id": json_scalar()})


def _mutated(rng, rec):
    """A copy of a drawn record with one field dropped, nulled or swapped for another type (bulk rows)."""
    import copy

    rec = copy.deepcopy(rec)
    if isinstance(rec, dict) and rec:
        k = rng.choice(sorted(rec))
        how = rng.randrange(4)
        if how == 0:
            del rec[k]
        elif how == 1:
            rec[k] = None
        elif how == 2:
            rec[k] = rng.choice([7, "x", [], {}, [None], True])
    return rec


@st.composite
def json_file(draw, record=None, bulk: int = 0) -> tuple[bytes, str, int | None]:
    """(file bytes, extension, records it holds — None when the text is not whole JSON): a JSON list or JSONL
    of records, possibly cut short. ``bulk``: that many more records, each a drawn one mutated."""
    import json

    recs = draw(st.lists(record if record is not None else st.one_of(llava_record(), messages_record()),
                         max_size=6))
    if bulk and recs:
        rng = draw(st.randoms(use_true_random=True))
        recs += [_mutated(rng, rng.choice(recs)) for _ in range(bulk)]
    ext = draw(st.sampled_from((".json", ".jsonl")))
    text = (json.dumps(recs) if ext == ".json" else "".join(json.dumps(r) + "\n" for r in recs)).encode()
    if draw(st.integers(0, 15)) == 0:         # nested deeper than Python's stack, as a record of its own
        deep = b"[" * 100_000
        text = deep if ext == ".json" else text + deep + b"\n"
        return text, ext, 1 if ext == ".json" else len(recs) + 1
    if draw(st.integers(0, 5)) == 0 and text:
        return text[:draw(st.integers(0, len(text) - 1))], ext, None
    return text, ext, len(recs)


# ------------------------------------------------------------------------------------------- Parquet

@st.composite
def column(draw, n: int, kinds=("binary", "string", "int", "image_struct", "list_binary", "turns", "null")):
    """An Arrow column of ``n`` rows of one drawn kind, with nulls anywhere."""
    import json

    import pyarrow as pa

    kind = draw(st.sampled_from(kinds))
    nulls = draw(st.lists(st.booleans(), min_size=n, max_size=n))

    def vals(strategy):
        return [None if null else draw(strategy) for null in nulls]

    if kind == "binary":
        return pa.array(vals(image_bytes()), pa.binary())
    if kind == "string":
        return pa.array(vals(junk_text()), pa.string())
    if kind == "json_text":
        return pa.array(vals(st.one_of(st.lists(llava_turn(), max_size=3).map(json.dumps), junk_text())), pa.string())
    if kind == "int":
        return pa.array(vals(st.integers(-2**63, 2**63 - 1)), pa.int64())
    if kind == "image_struct":
        t = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
        return pa.array(vals(st.fixed_dictionaries({"bytes": st.one_of(st.none(), image_bytes()),
                                                    "path": st.one_of(st.none(), st.sampled_from(IMAGE_PATHS))})), t)
    if kind == "list_binary":
        return pa.array(vals(st.lists(st.one_of(st.none(), image_bytes()), max_size=3)), pa.list_(pa.binary()))
    if kind == "list_image_struct":
        t = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
        return pa.array(vals(st.lists(st.fixed_dictionaries({"bytes": st.one_of(st.none(), image_bytes()),
                                                             "path": st.none()}), max_size=3)), t)
    if kind == "turns":
        t = pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))
        turn = st.fixed_dictionaries({"from": st.one_of(st.none(), st.sampled_from(("human", "gpt", "x"))),
                                      "value": st.one_of(st.none(), junk_text())})
        return pa.array(vals(st.lists(turn, max_size=4)), t)
    if kind == "texts":
        t = pa.list_(pa.struct([("user", pa.string()), ("assistant", pa.string())]))
        pair = st.fixed_dictionaries({"user": st.one_of(st.none(), junk_text()),
                                      "assistant": st.one_of(st.none(), junk_text())})
        return pa.array(vals(st.lists(pair, max_size=3)), t)
    if kind == "messages":
        t = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
        msg = st.fixed_dictionaries({"role": st.one_of(st.none(), st.sampled_from(("user", "assistant"))),
                                     "content": st.one_of(st.none(), junk_text())})
        return pa.array(vals(st.lists(msg, max_size=3)), t)
    if kind == "ratings":
        return pa.array(vals(st.lists(st.one_of(st.none(), st.integers(-5, 9)), max_size=3)), pa.list_(pa.int64()))
    return pa.nulls(n)


# The columns each Parquet flavour reads, and the kinds a fuzzed one may hold (its right kind among wrong ones).
PARQUET_FLAVOURS = {
    "caption-parquet": {"image": ("binary", "image_struct", "string", "int", "null"),
                        "caption": ("string", "string", "binary", "int", "null")},
    "llava-ov-parquet": {"conversations": ("turns", "json_text", "int", "null"),
                         "image": ("binary", "image_struct", "list_binary", "null")},
    "finevision": {"images": ("list_image_struct", "list_binary", "binary", "null"),
                   "texts": ("texts", "texts", "string", "null"), "source": ("string", "int", "null"),
                   "relevance_ratings": ("ratings", "string", "null")},
    "messages": {"messages": ("messages", "json_text", "int", "null"), "images": ("list_binary", "binary", "null")},
}


@st.composite
def parquet_table(draw, flavour: str, bulk: int = 0):
    """A table for one Parquet flavour: each of its columns of a drawn kind (mostly the right one), sometimes
    left out, plus an unrelated column. ``bulk``: that many more rows, each a drawn row's cells recombined."""
    import pyarrow as pa

    n = draw(st.integers(0, 6))
    cols = {}
    for name, kinds in PARQUET_FLAVOURS[flavour].items():
        if draw(st.integers(0, 7)) == 0:
            continue                                       # a required column missing
        cols[name] = draw(column(n, kinds))
    if draw(st.booleans()):
        cols["extra"] = draw(column(n, ("int", "string")))
    if not cols:
        return pa.table({"extra": pa.nulls(n)})
    table = pa.table(cols)
    if bulk and n:
        rng = draw(st.randoms(use_true_random=True))
        table = pa.table({c: pa.concat_arrays([col.combine_chunks(), col.combine_chunks().take(
            pa.array([rng.randrange(n) for _ in range(bulk)]))]) for c, col in zip(table.column_names, table.columns)})
    return table


# ------------------------------------------------------------------------------------------- official layout

PROMPTS = ("<image>Describe the image.", "<image>", "no placeholder", "<image><image>two", "<image>\nWhat is it?")


@st.composite
def official_meta(draw, n: int):
    """An official entry's json for ``n`` images: aligned prompts/captions/images (half the time), or a field
    null, of the wrong type, of another length, missing; sometimes not an object at all."""
    good = {"prompts": [draw(st.sampled_from(PROMPTS[:2])) for _ in range(n)],
            "captions": [draw(st.sampled_from(("a cat.", "a dog on a mat.", "word " * 50))) for _ in range(n)],
            "images": [f"{i}.jpg" for i in range(n)]}
    if draw(st.booleans()):
        return good if draw(st.booleans()) else {**good, "prompts": draw(st.sampled_from((None, [])))}
    meta = {"prompts": draw(maybe(st.one_of(st.lists(maybe(st.sampled_from(PROMPTS), json_scalar()),
                                                       min_size=n, max_size=n), st.none(), st.just([])))),
            "captions": draw(maybe(st.lists(maybe(junk_text(), json_scalar()), min_size=n, max_size=n))),
            "images": draw(maybe(st.lists(st.text(max_size=4), min_size=n, max_size=n + draw(st.integers(0, 1)))))}
    for k in list(meta):
        if draw(st.integers(0, 9)) == 0:
            del meta[k]
    return draw(st.one_of(st.just(meta), st.just(meta), st.just(meta), json_value()))


@st.composite
def official_members(draw) -> dict:
    """The members of one official entry (undecoded bytes, as webdataset gives them): ``n`` images (good
    ones most of the time, some member sometimes missing) and a json for them, or json bytes that do not
    parse, nest 100,000 deep, or are missing."""
    import json

    n = draw(st.integers(0, 3))
    out = {}
    kind = draw(st.sampled_from(("json", "json", "json", "json", "bytes", "none", "deep")))
    if kind == "json":
        out["json"] = json.dumps(draw(official_meta(n))).encode()
    elif kind == "bytes":
        out["json"] = draw(st.binary(max_size=32))
    elif kind == "deep":
        out["json"] = b"[" * 100_000
    good = draw(st.booleans())
    for i in range(n + draw(st.integers(0, 1))):
        if good:
            out[f"img{i}.jpg"] = _image_samples()["jpg"]
        elif draw(st.integers(0, 5)):
            out[f"img{i}.jpg"] = draw(image_bytes())
    return out


@st.composite
def official_tars(draw) -> dict:
    """Official tars (name → members): entries from ``official_members``."""
    tars = {}
    for t in range(draw(st.integers(1, 2))):
        members = []
        for k in range(draw(st.integers(0, 3))):
            key = f"e{t}{k}"
            m = draw(official_members())
            members += [(f"{key}.{name}", data) for name, data in m.items()]
        tars[f"data/pack-{t}.tar"] = members
    return tars


TAR_NAMES = ("data/pack-0.tar", "data/pack-1.tar", "/etc/passwd", "../x.tar", "data/../../x.tar", "", "data/",
             "a\\b.tar", "data/./pack-0.tar", "nul\x00.tar")


@st.composite
def official_layout(draw) -> tuple[dict, bytes | None, dict | None]:
    """(tars, ``.nv-meta/.info.json`` bytes or None for energon's own counts, {tar: bytes kept} or None)."""
    import json

    tars = draw(official_tars())
    info = None
    kind = draw(st.sampled_from(("energon", "energon", "counts", "junk", "bytes")))
    if kind == "counts":
        counts = draw(st.dictionaries(st.sampled_from(TAR_NAMES), st.one_of(st.integers(-1, 4), json_scalar()),
                                      max_size=3))
        info = json.dumps({"shard_counts": counts}).encode()
    elif kind == "junk":
        info = json.dumps(draw(json_value())).encode()
    elif kind == "bytes":
        info = draw(st.binary(max_size=40))
    cut = None
    if draw(st.integers(0, 3)) == 0:
        cut = {name: draw(st.integers(0, 3000)) for name in tars}
    return tars, info, cut


# ------------------------------------------------------------------------------------------- config values

WRONG_VALUES = st.one_of(st.sampled_from(("not-a-number", "1e3", "true", "", "~", "-1")), st.integers(-10, 10**12),
                         st.floats(allow_nan=True, allow_infinity=True).filter(lambda f: f == f), st.booleans(),
                         st.lists(st.one_of(st.integers(), st.text(max_size=3)), max_size=2),
                         st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.none())


def config_value(fields):
    """(step, field, type, a value for it) over ``fields`` = ``targets.config_fields()``."""
    return st.tuples(st.sampled_from(fields), WRONG_VALUES).map(lambda p: (*p[0], p[1]))


# ------------------------------------------------------------------------------------------- SQL statements

SQL_WRITES = ("INSERT INTO samples VALUES (1)", "CREATE TABLE t AS SELECT 1", "COPY (SELECT 1) TO '{run}/x.parquet'",
              "COPY (SELECT 1) TO '{outside}/x.csv'", "ATTACH '{run}/x.db' AS x", "ATTACH ':memory:' AS m",
              "DETACH x", "DROP VIEW samples", "SET threads = 1", "SET enable_external_access = true",
              "RESET allowed_directories", "PRAGMA enable_profiling", "INSTALL httpfs", "LOAD httpfs",
              "CALL pragma_version()", "EXPORT DATABASE '{outside}/exp'", "UPDATE samples SET status = 'x'",
              "DELETE FROM samples", "CREATE MACRO m() AS 1", "CHECKPOINT", "VACUUM", "USE memory", "BEGIN",
              "CREATE SECRET s (TYPE s3)", "SET GLOBAL memory_limit = '1TB'", "PREPARE p AS SELECT 1",
              "COPY samples FROM '{secret}'", "IMPORT DATABASE '{outside}'")
SQL_OUTSIDE = ("SELECT * FROM read_csv('{secret}')", "SELECT * FROM read_text('{secret}')",
               "SELECT * FROM read_blob('{secret}')", "SELECT * FROM glob('{outside}/*')",
               "SELECT * FROM '{secret}'", "SELECT * FROM read_parquet('{run}/../*.parquet')",
               "SELECT * FROM read_csv('{run}/../secret.txt')", "SELECT * FROM read_text('/etc/hostname')",
               "SELECT getenv('HOME')", "SELECT current_setting('allowed_directories')",
               "SELECT * FROM read_json_auto('{secret}')", "SELECT * FROM sniff_csv('{secret}')")
SQL_LONG = ("SELECT count(*) FROM range(10000000000000)", "SELECT repeat('x', 50000000) AS s",
            "SELECT list(repeat('y', 2000)) FROM range(5000)",
            "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT count(*) FROM r",
            "SELECT count(*) FROM range(100000) a, range(100000) b")
SQL_READS = ("SELECT count(*) FROM samples", "SELECT * FROM samples LIMIT 2", "DESCRIBE samples", "SHOW TABLES",
             "EXPLAIN SELECT 1", "SELECT * FROM steps", "SELECT status, count(*) FROM samples GROUP BY 1",
             "SUMMARIZE samples", "EXPLAIN ANALYZE SELECT 1")


@st.composite
def sql_statement(draw, long: bool = True) -> str:
    """A statement the SQL box or ``ovpipe sql`` may be given: a write, an attach, a read outside the run, a
    long one (``long``), a plain read; sometimes two joined, wrapped, commented or cased oddly."""
    families = [SQL_WRITES, SQL_OUTSIDE, SQL_READS] + ([SQL_LONG] if long else [])
    q = draw(st.sampled_from(draw(st.sampled_from(families))))
    shape = draw(st.sampled_from(("plain", "plain", "two", "wrapped", "comment", "case", "explain", "junk")))
    if shape == "two":
        q = f"{q}; {draw(st.sampled_from(SQL_WRITES + SQL_READS))}"
    elif shape == "wrapped" and q.startswith("SELECT"):
        q = f"SELECT * FROM ({q}) t"
    elif shape == "comment":
        q = f"/* x */ {q} -- y"
    elif shape == "case":
        q = q.lower()
    elif shape == "explain":
        q = f"EXPLAIN ANALYZE {q}"
    elif shape == "junk":
        q = q + draw(st.text(max_size=6))
    return q


# ------------------------------------------------------------------------------------------- viewer routes

def app_routes() -> tuple[str, ...]:
    """Every path of the viewer app, from the app itself (so a new route cannot be left out of the fuzzing), with
    its path parameters as ``{s}`` (a string) or ``{i}`` (a whole number); a mount as ``<mount>/{s}``; and
    ``/{s}``, a path no route has."""
    return _app_routes()


@functools.cache
def _app_routes() -> tuple[str, ...]:
    import re
    import tempfile

    from starlette.routing import Mount

    from viewer.app import create_app

    with tempfile.TemporaryDirectory(prefix="ovpipe-fuzz-routes-") as empty:
        app = create_app(empty)
        out = []
        for r in app.routes:
            path = re.sub(r"\{([^}:]+)(:[^}]+)?\}", lambda m: "{i}" if m.group(2) == ":int" else "{s}", r.path)
            out.append(path + "/{s}" if isinstance(r, Mount) else path)
        app.state.catalog.interrupt_all()
    return tuple(out) + ("/{s}",)


# Every query parameter a viewer route reads (tests/fuzz/test_routes.py checks this list against what the app's
# routes read), with values drawn to break it: huge, negative, not a number, SQL, a lasso of ±1e308.
QUERY_KEYS = ("page", "px", "step", "source", "status", "concept", "copies", "pack", "q", "dp", "mb", "ga", "at",
              "k", "box", "lasso", "colour", "sort")
HOSTS = ("127.0.0.1", "127.0.0.1:8765", "localhost", "localhost:1", "[::1]:8765", "evil.example",
         "evil.example:8765", "127.0.0.1.evil.example", "", "[::2]", "a b", "localhost:99999")


@st.composite
def route_request(draw) -> tuple[str, dict, str, dict]:
    """(path, query parameters, Host header, other headers) for the viewer."""
    from urllib.parse import quote

    seg = st.one_of(st.text(max_size=12), st.sampled_from(("..", "%2e%2e", "..%2F..%2Fetc%2Fpasswd", "ingest",
                                                           "ingest/report.md", "0" * 200, "x.parquet")))
    path = draw(st.sampled_from(app_routes())).replace("{s}", quote(draw(seg), safe="/%")).replace(
        "{i}", str(draw(st.integers(-5, 10**20))))
    value = st.one_of(st.integers(-10, 10**25).map(str), st.text(max_size=10),
                      st.sampled_from(("a&b+c", "ok", "", "200000", "1e308", "0,0;1e308,1;-1e308,2", "0,1,0,1",
                                       "0,0;1,0;0,1", "nan,0;1,1;0,1", "size", "cosine", "status", "cluster", "pack")),
                      sql_statement(long=True))
    params = draw(st.dictionaries(st.sampled_from(QUERY_KEYS), value, max_size=3))
    headers = draw(st.dictionaries(st.sampled_from(("X-Forwarded-Host", "Origin", "Referer", "Accept")),
                                   st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=20),
                                   max_size=2))
    return path, params, draw(st.sampled_from(HOSTS)), headers
