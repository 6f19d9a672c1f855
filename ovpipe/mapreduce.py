"""Map → reduce → apply: the pieces a three-phase step is built from (``Step(reduce=..., apply=...)``).

A global step (concept counts, the packing solution, duplicates) must not hold the corpus in every
task. Its shape::

    map     rank r of N: streams its share of the input (``TaskContext.iter_input_share``: a contiguous
            row range of the parts in file order — partials are sums, so the order does not matter)
            and writes a small partial (``TaskContext.write_partial``: a bincount, a histogram) —
            memory O(batch + partial)
    reduce  once: sums the partials into a small global artifact (``TaskContext.write_reduced``);
            where it truly needs per-sample values (a normaliser summed over samples in canonical
            order) it streams only the columns it needs in canonical order
            (``TaskContext.iter_input_canonical``: the parts as they lie when their footers show
            canonical order, else a DuckDB ``ORDER BY`` under a memory limit) — memory O(batch + artifact)
    apply   rank r of N: streams its canonical slice (``TaskContext.iter_input_slice``), applies the
            artifact row by row and writes its manifest part batch by batch (``PartWriter``) — memory
            O(batch + artifact)
    finalize once: reports and merged stats, as for any step

Each phase streams through the one reader, ``manifests.io.iter_parts`` (one row group decoded at a time).

An applied row depends only on the row and the artifact, so the result is the same for any task count.

``pairwise_sum`` reproduces numpy's summation order (``np.sum`` of a float64 vector is a pairwise
sum whose split points depend only on the length), streamed: a global float sum over the canonical
order comes out bit-identical to ``np.sum`` over the whole vector, without holding the vector.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

BATCH_ROWS = 65_536          # rows per row group of a streamed part (an apply's, ingest's shuffle) and per reduce batch
PAIRWISE_LEAF = 1 << 16      # largest run summed in one np.add.reduce (a node of numpy's own tree)


# ------------------------------------------------------------------------------------ shares

def slice_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Contiguous, balanced [lo, hi) of ``n`` items for ``rank`` of ``world_size``."""
    base, extra = divmod(n, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


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
