"""Sample ids as numbers: xxh3-64 hex ids ↔ uint64 without a Python loop per id, and ``splitmix64``, the
seeded per-id hash that packing (which sample fills which slot), balance and mix (their seeded draws)
key on, so the same id and seed give the same draw in every step."""
from __future__ import annotations

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorised splitmix64 finaliser (a bijection on uint64 with good avalanche)."""
    with np.errstate(over="ignore"):
        z = (np.asarray(x, dtype=np.uint64) + GOLDEN).astype(np.uint64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def hex_ids_to_u64(ids) -> np.ndarray:
    """16-hex-char sample ids → uint64, without a Python loop per id."""
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = pa.array(ids) if not isinstance(ids, (pa.Array, pa.ChunkedArray)) else ids
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    lens = pc.binary_length(arr)
    if len(arr) and (pc.min(lens).as_py() != 16 or pc.max(lens).as_py() != 16):
        raise ValueError("sample_id must be 16 hex characters (xxh3-64)")
    # Every id is 16 bytes, so the ids are one contiguous run of the data buffer, starting where
    # the offsets buffer says (not at offset·16: a slice or a filtered batch may start elsewhere).
    off_type = np.int64 if pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type) else np.int32
    start = int(np.frombuffer(arr.buffers()[1], off_type)[arr.offset]) if len(arr) else 0
    raw = bytes.fromhex(arr.buffers()[2].to_pybytes()[start:start + len(arr) * 16].decode("ascii"))
    return np.frombuffer(raw, dtype=">u8").astype(np.uint64)


HEX_DIGITS = np.frombuffer(b"0123456789abcdef", np.uint8)


def u64_to_hex(u: np.ndarray):
    """uint64 → 16 lowercase hex characters each (the inverse of ``hex_ids_to_u64`` on canonical ids),
    as one Arrow string array built from its buffers."""
    import pyarrow as pa

    u = np.ascontiguousarray(u, dtype=np.uint64)
    b = u.astype(">u8").view(np.uint8).reshape(-1, 8)
    out = np.empty((len(u), 16), np.uint8)
    out[:, 0::2] = HEX_DIGITS[b >> 4]
    out[:, 1::2] = HEX_DIGITS[b & 15]
    offsets = np.arange(0, 16 * (len(u) + 1), 16, dtype=np.int32)
    return pa.StringArray.from_buffers(len(u), pa.py_buffer(offsets), pa.py_buffer(out.tobytes()))


def canonical_ids_to_u64(ids, what: str = "sample_id") -> np.ndarray:
    """``hex_ids_to_u64`` for ids that must round-trip through ``u64_to_hex``: 16 *lowercase* hex
    characters (xxh3-64 ``hexdigest``), so their uint64 order is their string (canonical) order."""
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids
    if len(arr) and pc.any(pc.match_substring_regex(arr, "[A-F]")).as_py():
        bad = arr.filter(pc.match_substring_regex(arr, "[A-F]"))[0].as_py()
        raise ValueError(f"{what} {bad!r} is not lowercase hex (ids are xxh3-64 hexdigests)")
    return hex_ids_to_u64(arr)


def id_member(ids):
    """A membership test ``batch column → bool[]`` against ``ids`` (an Arrow string array of sample ids)
    for many batches: a binary search over the ids' sorted uint64 values, so a batch tested against
    millions of ids builds no hash table; an id in a batch that is not 16 hex characters falls back to
    ``pc.is_in`` for that batch, as does the whole test when ``ids`` themselves are not all hex."""
    import pyarrow.compute as pc

    def by_set(col):
        return pc.is_in(col, value_set=ids).to_numpy(zero_copy_only=False)

    try:
        wanted = np.sort(hex_ids_to_u64(ids))
    except ValueError:
        return by_set

    def by_search(col):
        try:
            u = hex_ids_to_u64(col)
        except ValueError:
            return by_set(col)
        if not len(wanted):
            return np.zeros(len(u), bool)
        pos = np.minimum(np.searchsorted(wanted, u), len(wanted) - 1)
        return wanted[pos] == u

    return by_search
