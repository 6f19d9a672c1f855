"""Map → reduce → apply: the pieces a three-phase step is built from (``Step(reduce=..., apply=...)``).

A global step (concept counts, the packing solution, duplicates) must not hold the corpus in every
task. Its shape::

    map     rank r of N: streams its share of the input (``iter_share``: a contiguous row range of
            the parts in file order, read row group by row group — partials are sums, so the order
            does not matter) and writes a small partial (``TaskContext.write_partial``: a bincount,
            a histogram) — memory O(batch + partial)
    reduce  once: sums the partials into a small global artifact (``TaskContext.write_reduced``);
            where it truly needs per-sample values (a normaliser summed over samples in canonical
            order) it streams only the columns it needs in canonical order
            (``manifests.io.iter_manifest``: the parts as they lie when their footers show canonical
            order, else a DuckDB ``ORDER BY`` under a memory limit) — memory O(batch + artifact)
    apply   rank r of N: streams its canonical slice (``iter_canonical_share``), applies the artifact
            row by row and writes its manifest part batch by batch (``PartWriter``) — memory
            O(batch + artifact)
    finalize once: reports and merged stats, as for any step

An applied row depends only on the row and the artifact, so the result is the same for any task count.

``pairwise_sum`` reproduces numpy's summation order (``np.sum`` of a float64 vector is a pairwise
sum whose split points depend only on the length), streamed: a global float sum over the canonical
order comes out bit-identical to ``np.sum`` over the whole vector, without holding the vector.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

BATCH_ROWS = 65_536          # rows per streamed batch and per row group of a streamed part
PAIRWISE_LEAF = 1 << 16      # largest run summed in one np.add.reduce (a node of numpy's own tree)


# ------------------------------------------------------------------------------------ shares

def slice_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Contiguous, balanced [lo, hi) of ``n`` items for ``rank`` of ``world_size``."""
    base, extra = divmod(n, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def share_ranges(files: list[Path], rank: int, world_size: int) -> list[tuple[Path, int, int]]:
    """``[(file, lo, hi)]``: rank ``rank``'s contiguous, balanced row range of the concatenation of
    ``files`` (in the given order), from the Parquet footers alone."""
    import pyarrow.parquet as pq

    counts = [pq.ParquetFile(f).metadata.num_rows for f in files]
    lo, hi = slice_bounds(sum(counts), rank, world_size)
    out, base = [], 0
    for f, n in zip(files, counts):
        a, b = max(lo - base, 0), min(hi - base, n)
        if a < b:
            out.append((Path(f), a, b))
        base += n
    return out


def iter_share(files: list[Path], kind: str, columns: list[str], rank: int, world_size: int,
               batch_rows: int = BATCH_ROWS) -> Iterator:
    """This rank's share of manifest ``kind`` (``share_ranges``), as record batches of ``columns``,
    read one row group at a time (pyarrow decodes every row group it is handed before the first
    batch comes out: handing it all of them would hold the whole share). Checks the columns' types."""
    import numpy as np
    import pyarrow.parquet as pq

    from manifests.schemas import ManifestSchemaError, schema_for

    expected = schema_for(kind)
    for path, lo, hi in share_ranges(files, rank, world_size):
        pf = pq.ParquetFile(path, pre_buffer=False)
        for name in columns:
            got = pf.schema_arrow.field(name).type if name in pf.schema_arrow.names else None
            if got != expected.field(name).type:
                raise ManifestSchemaError(f"{path}: column {name!r} has type {got}, manifest {kind!r} expects "
                                          f"{expected.field(name).type}")
        md = pf.metadata
        starts = np.cumsum([0] + [md.row_group(i).num_rows for i in range(md.num_row_groups)])
        for g in range(md.num_row_groups):
            if not (starts[g] < hi and starts[g + 1] > lo):
                continue
            pos = int(starts[g])
            for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[g], columns=columns, use_threads=False):
                a, b = max(lo - pos, 0), min(hi - pos, batch.num_rows)
                if a < b:
                    yield batch.slice(a, b - a)
                pos += batch.num_rows


def iter_canonical_share(run_dir: Path, kind: str, columns: list[str], rank: int, world_size: int,
                         step: str | None = None, batch_rows: int = BATCH_ROWS) -> Iterator:
    """Rank ``rank``'s contiguous slice of ``kind`` in canonical order (``read_manifest(...).slice``),
    streamed. Parts already in canonical order are read as they lie, a row group at a time (each batch
    checked to be sorted); otherwise ``manifests.io.iter_manifest`` sorts them with DuckDB."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from manifests.io import iter_manifest, manifest_files, parts_in_canonical_order
    from manifests.schemas import SORT_KEYS, ManifestSchemaError

    files = manifest_files(run_dir, kind, step)
    key = SORT_KEYS[kind][0]
    if not parts_in_canonical_order(files, kind):
        n = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
        lo, hi = slice_bounds(n, rank, world_size)
        yield from iter_manifest(run_dir, kind, step=step, columns=columns, lo=lo, hi=hi, batch_rows=batch_rows)
        return
    read = columns if key in columns else [*columns, key]
    last = None
    for batch in iter_share(files, kind, read, rank, world_size, batch_rows):
        k = batch.column(key)
        if len(k) and ((last is not None and pc.less(k[0], last).as_py())
                       or (len(k) > 1 and pc.any(pc.less(k.slice(1), k.slice(0, len(k) - 1))).as_py())):
            raise ManifestSchemaError(f"{kind}: a part's rows are not in {key} order — parts must be written sorted "
                                      f"(manifests.io.write_part(sort=True))")
        if len(k):
            last = k[-1]
        yield batch.select(columns)


def prefetch(it: Iterator, depth: int = 2) -> Iterator:
    """``it``'s items, in order, produced by a background thread up to ``depth`` ahead: a one-process
    reduce decodes the next Parquet batch (pyarrow releases the GIL) while it works on this one, so
    it uses a second core. The producer's exception is raised here; closing this generator early
    stops the producer at its next item."""
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()
    done = object()

    def produce():           # a put blocked on a full queue is freed by the consumer's drain below
        try:
            for item in it:
                q.put((item, None))
                if stop.is_set():
                    return
            q.put((done, None))
        except BaseException as e:  # noqa: BLE001 — handed to the consumer, raised there
            q.put((done, e))

    t = threading.Thread(target=produce, name="ovpipe-prefetch", daemon=True)
    t.start()
    try:
        while True:
            item, err = q.get()
            if item is done:
                if err is not None:
                    raise err
                return
            yield item
    finally:
        stop.set()
        while t.is_alive():            # free a producer blocked on a full queue; it then sees `stop`
            try:
                q.get(timeout=0.1)
            except queue.Empty:
                pass
        t.join()


# ---------------------------------------------------------------------------- small artifacts

def save_arrays(path: Path, **arrays) -> Path:
    """A partial or reduced artifact: ``.npz`` written to a temp name and renamed."""
    import numpy as np

    from manifests.io import atomic_write

    path = Path(path)
    with atomic_write(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)
    return path


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    import numpy as np

    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


# ------------------------------------------------------------------------------ exact sums

def pairwise_sum(n: int, values: Callable[[int, int], np.ndarray], leaf: int | None = None) -> float:
    """``np.sum`` of a float64 vector of length ``n`` whose rows ``[lo, hi)`` are ``values(lo, hi)``,
    bit for bit, holding at most ``leaf`` values at once. numpy sums a contiguous float64 vector
    pairwise: a run of ≤ 128 in eight interleaved accumulators, a longer one split at
    ``n2 = n//2 − (n//2) % 8`` and the halves' sums added — split points that depend only on the
    length. So any node of that tree that fits in ``leaf`` is summed by ``np.add.reduce`` itself, and
    the nodes above it are added here in the same order (``tests/ovpipe/test_map_reduce.py``)."""
    import numpy as np

    leaf = max(leaf or PAIRWISE_LEAF, 128)   # numpy splits only runs longer than its block of 128
    if n <= 0:
        return 0.0
    if n <= leaf:
        return float(np.add.reduce(np.ascontiguousarray(values(0, n), dtype=np.float64)))

    def node(lo: int, m: int) -> float:
        if m <= leaf:
            return float(np.add.reduce(np.ascontiguousarray(values(lo, lo + m), dtype=np.float64)))
        m2 = m // 2
        m2 -= m2 % 8
        return node(lo, m2) + node(lo + m2, m - m2)

    return node(0, n)


def vmhwm_bytes() -> int | None:
    """Peak resident memory of this process (``VmHWM``), or None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
