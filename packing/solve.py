"""``pack``'s reduce at corpus scale: exactly ``binpack.pack``'s packing, with the items on disk.

``binpack.pack`` holds every item (its id, length, key and several N-long sort permutations): 9.8 GiB
at 40M items, an out-of-memory kill at the recipe's 85M. The packing itself needs much less:

* the **bins** depend only on the length histogram (``binpack.bin_layout``: BFD + refine), and the bin
  order only on the seed (``binpack.bin_permutation``);
* the **item → slot assignment** is "the j-th slot of length L, in bin order, gets the j-th item of
  length L in (key, item index) order" — a global sort of the items by ``(L, key, index)``.

So the reduce streams ``lengths`` once in canonical order (only the columns it needs, one batch at a
time: ``TaskContext.iter_input_canonical``), drops non-packable rows and repeated ``sample_id``s,
expands ``balanced`` / ``mixed`` copies (looked up by ``source_sample_id`` in a sorted id array),
computes each copy's key, and appends one 48-byte record per item to a spill file, counting the
histogram as it goes. Then it sorts out of core by **partitioning**: every partition is a range of
whole lengths, or — for a length with more items than fit one partition — one length and a range of
the key's top bits (keys are seeded hashes, so the ranges split it evenly). Partitions in order are
the global ``(L, key)`` order, and within one the records keep their stream (= item index) order, so
two stable sorts inside it give exactly ``pack``'s tie-breaks. One pass scatters the spill into the
partition files; each partition is then loaded alone, sorted, and its items are written to their
final slots (``slot_fill_order`` composed with the bin permutation).

Once placed, every bin's cost (``packing.cost``) is summed from its slots, and with ``balance_dp`` the bins
are put in the balanced order (``packing.compute_balance``) before the slots are written, so ``pack_id`` is the
position in the trainer's stream.

Memory: the per-slot results (``sample_id``, ``source_sample_id``, length, turns kept, the cost's counts) and
the slot → position map (then the balanced order's slot index), 48 bytes per item (4.1 GB at 85M), plus one
partition (``OVPIPE_PACK_PART_ITEMS``, default 4M items, ~200 MB sorted) and per-bin arrays. Disk: 2 × 48
bytes per item under ``reduced/``,
removed at the end. The output is identical to ``binpack.pack`` on the same items
(``tests/packing/test_pack_solve.py``).
"""
from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# per item, besides its length and ids, what its cost needs (packing.cost): image tokens, images, Σ tower tokens²
ITEM = np.dtype([("L", "<u4"), ("turns", "<i4"), ("key", "<u8"), ("sid", "<u8"), ("src", "<u8"),
                 ("itok", "<u4"), ("img", "<u4"), ("vsq", "<u8")])
SLOT = np.dtype([("L", "<u4"), ("turns", "<i4"), ("sid", "<u8"), ("src", "<u8"), ("itok", "<u4"), ("img", "<u4"),
                 ("vsq", "<u8")])
PART_ITEMS = 1 << 22       # items per partition (OVPIPE_PACK_PART_ITEMS)
CHUNK = 1 << 18            # records per scatter / position chunk (8 MB of records)


def part_items() -> int:
    return max(int(os.environ.get("OVPIPE_PACK_PART_ITEMS", PART_ITEMS)), 1)


@dataclass
class Solution:
    counts: np.ndarray       # int64[capacity + 1]: items per length
    bin_start: np.ndarray    # int64[n_bins + 1], pack_id order
    bin_load: np.ndarray     # int64[n_bins], pack_id order
    report_lengths: np.ndarray  # lengths of the (report_max) items of smallest (key, index), in that order

    @property
    def n_items(self) -> int:
        return int(self.counts.sum())

    @property
    def tokens(self) -> int:
        return int(np.dot(np.arange(len(self.counts), dtype=np.int64), self.counts))


# --------------------------------------------------------------------------------- item stream

def copies_lookup(task, kind: str, step: str | None):
    """``(ids, copies)``: the ``sample_id``s of ``kind`` (``balanced`` / ``mixed``) with a nonzero sum of
    ``copies``, as ascending uint64, streamed (a sample's rows are adjacent in canonical order)."""
    import pyarrow.compute as pc

    from manifests.ids import canonical_ids_to_u64

    ids, cps = [], []
    for batch in task.iter_input_canonical(kind, ["sample_id", "copies"], step=step):
        c = pc.fill_null(batch.column("copies"), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        nz = np.flatnonzero(c)
        if len(nz):
            u = canonical_ids_to_u64(batch.column("sample_id"), f"{kind}.sample_id")
            ids.append(u[nz])
            cps.append(c[nz])
    if not ids:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    u, c = np.concatenate(ids), np.concatenate(cps)
    starts = np.flatnonzero(np.r_[True, u[1:] != u[:-1]])
    u, c = u[starts], np.add.reduceat(c, starts)
    keep = c != 0
    return u[keep], c[keep]


def iter_items(task, cfg, packable: tuple[str, ...], shift: int = 0):
    """The items to pack, in item-index order (canonical ``lengths`` order, copies side by side), as
    ``ITEM`` record arrays — one ``lengths`` batch at a time. ``shift``: tokens taken off every length (the
    count of the trainer the packs are for, ``PackConfig.count_for``)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from manifests.ids import GOLDEN, canonical_ids_to_u64, splitmix64

    lookup = None
    if cfg.copies_from != "none":
        kind, step = ("balanced", None) if cfg.copies_from == "balanced" else ("mixed", cfg.mix_step)
        lookup = copies_lookup(task, kind, step)
    last, dups = None, 0
    seed = np.uint64(cfg.seed)
    cols = ["sample_id", "source_sample_id", "total_tokens", "turns_kept", "status", "image_tokens", "images", "vit_sq"]
    for batch in task.iter_input_canonical("lengths", cols, step=cfg.lengths_step):
        batch = batch.filter(pc.is_in(batch.column("status"), value_set=pa.array(packable)))
        if not batch.num_rows:
            continue
        sid = batch.column("sample_id")
        first = np.ones(len(sid), bool)     # canonical order puts equal ids side by side: keep the first
        if len(sid) > 1:
            first[1:] = pc.not_equal(sid.slice(1), sid.slice(0, len(sid) - 1)).to_numpy(zero_copy_only=False)
        if last is not None and sid[0].as_py() == last:
            first[0] = False
        last = sid[-1].as_py()
        if not first.all():
            dups += int((~first).sum())
            batch = batch.filter(pa.array(first))
            sid = batch.column("sample_id")
        u = canonical_ids_to_u64(sid)
        src = canonical_ids_to_u64(batch.column("source_sample_id"), "source_sample_id")
        L = batch.column("total_tokens").to_numpy(zero_copy_only=False).astype(np.int64)
        if shift:
            L = L - shift
            if len(L) and L.min() < 1:
                raise ValueError(f"count_for: a sample of {int(L.min()) + shift} tokens is no longer than the "
                                 f"{shift}-token tail the target trainer drops")
        turns = pc.fill_null(batch.column("turns_kept"), 0).to_numpy(zero_copy_only=False)
        if lookup is None:
            copies = np.ones(len(u), np.int64)
        else:                               # a recaptioned sample gets its source's copies
            ids, cps = lookup
            copies = np.zeros(len(u), np.int64)
            if len(ids):
                pos = np.minimum(np.searchsorted(ids, src), len(ids) - 1)
                hit = ids[pos] == src
                copies[hit] = cps[pos[hit]]
        idx = np.repeat(np.arange(len(u)), copies)
        copy_no = np.arange(len(idx)) - np.repeat(np.cumsum(copies) - copies, copies)
        rec = np.empty(len(idx), ITEM)
        rec["L"], rec["turns"], rec["sid"], rec["src"] = L[idx], turns[idx], u[idx], src[idx]
        for name, col in (("itok", "image_tokens"), ("img", "images"), ("vsq", "vit_sq")):
            rec[name] = pc.fill_null(batch.column(col), 0).to_numpy(zero_copy_only=False)[idx]
        with np.errstate(over="ignore"):
            rec["key"] = splitmix64(u[idx] ^ splitmix64(seed + copy_no.astype(np.uint64) * GOLDEN))
        yield rec
    if dups:
        task.stats.inc("items/duplicate_sample_ids", dups)


class SmallestKeys:
    """The ``k`` items of smallest ``(key, index)`` seen so far, and their lengths (the report's sample
    of items in key order), kept in O(k) memory."""

    def __init__(self, k: int):
        self.k = k
        self.thr = None                   # the k-th smallest key at the last prune: nothing above it enters
        self.key = np.zeros(0, np.uint64)
        self.index = np.zeros(0, np.int64)
        self.L = np.zeros(0, np.int64)

    def add(self, key: np.ndarray, index: np.ndarray, L: np.ndarray) -> None:
        if self.thr is not None:
            keep = key <= self.thr
            key, index, L = key[keep], index[keep], L[keep]
        self.key = np.concatenate([self.key, key])
        self.index = np.concatenate([self.index, index])
        self.L = np.concatenate([self.L, L])
        if len(self.key) >= 2 * self.k:
            o = np.lexsort((self.index, self.key))[: self.k]
            self.key, self.index, self.L = self.key[o], self.index[o], self.L[o]
            self.thr = self.key[-1]

    def lengths(self) -> np.ndarray:
        o = np.lexsort((self.index, self.key))[: self.k]
        return self.L[o]


# ------------------------------------------------------------------------------------ partitions

def partition_plan(counts: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Per length, ``(base, bits)``: its items go to partition ``base[L] + (key >> (64 − bits[L]))``.
    Consecutive lengths share a partition up to ``budget`` items; a length with more gets
    ``2^bits ≥ count/budget`` partitions of its own, by the key's top bits. Returns (base, bits, count)."""
    base = np.zeros(len(counts), np.int64)
    bits = np.zeros(len(counts), np.int64)
    nxt, open_fill = 0, None             # next free partition id; items in the open shared one
    for L in np.flatnonzero(counts):
        c = int(counts[L])
        if c > budget:
            b = int(np.ceil(np.log2(-(-c // budget))))
            if open_fill is not None:
                open_fill = None
            base[L], bits[L] = nxt, b
            nxt += 1 << b
        else:
            if open_fill is None or open_fill + c > budget:
                open_fill = 0
                nxt += 1
            base[L] = nxt - 1
            open_fill += c
    return base, bits, nxt


def partition_of(rec: np.ndarray, base: np.ndarray, bits: np.ndarray) -> np.ndarray:
    L = rec["L"].astype(np.int64)
    b = bits[L]
    sub = rec["key"] >> np.minimum(64 - b, 63).astype(np.uint64)
    return base[L] + np.where(b > 0, sub, 0).astype(np.int64)


# ------------------------------------------------------------------------------------------ solve

def solve(task, cfg, packable: tuple[str, ...], out_path: Path, shift: int = 0) -> Solution:
    """Stream the items, solve the packing and write ``out_path`` (Parquet: per slot, bin after bin in
    ``pack_id`` order: sample_id, length, turns_kept, source_sample_id, 64K-row row groups). ``shift``: the
    bins are solved on ``lengths − shift`` (``iter_items``; the histogram, loads and report are in that
    count), while ``out_path`` keeps each sample's ``lengths`` count, the tokens its shard entry holds."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ovpipe.mapreduce import prefetch
    from manifests.ids import u64_to_hex
    from manifests.io import atomic_write
    from packing.binpack import bin_layout, bin_permutation, slot_fill_order

    C = cfg.seq_len
    work = out_path.parent / f".solve-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        counts = np.zeros(C + 1, np.int64)
        small = SmallestKeys(cfg.report_max_samples)
        n = 0
        prog = task.progress(None, unit="items", desc="pack: stream items")
        with open(work / "items.bin", "wb") as f:
            for rec in iter_items(task, cfg, packable, shift):
                if len(rec):
                    lo, hi = int(rec["L"].min()), int(rec["L"].max())
                    if lo < 1 or hi > C:
                        raise ValueError(f"lengths must be in [1, {C}], got [{lo}, {hi}]")
                counts += np.bincount(rec["L"].astype(np.int64), minlength=C + 1)
                small.add(rec["key"], np.arange(n, n + len(rec), dtype=np.int64), rec["L"].astype(np.int64))
                rec.tofile(f)
                n += len(rec)
                prog.update(len(rec))
        prog.close()

        with task.stats.timer("solve/layout"):
            bin_size, slot_len = bin_layout(counts, C, cfg.refine_passes)
            n_bins = len(bin_size)
            start = np.zeros(n_bins + 1, np.int64)
            np.cumsum(bin_size, out=start[1:])
            load = np.add.reduceat(slot_len, start[:-1]) if n_bins else np.zeros(0, np.int64)
            dest = slot_fill_order(slot_len, C)          # k-th item in (L, key) order → its slot (bin order)
            del slot_len
            perm = bin_permutation(n_bins, cfg.seed)
            if perm is not None:                         # … → its position once bins are in pack_id order
                new_start = np.zeros(n_bins + 1, np.int64)
                np.cumsum(bin_size[perm], out=new_start[1:])
                inv = np.empty(n_bins, np.int64)
                inv[perm] = np.arange(n_bins)
                for a in range(0, n, CHUNK):
                    s = dest[a:a + CHUNK]
                    b = np.searchsorted(start, s, side="right") - 1
                    dest[a:a + CHUNK] = new_start[inv[b]] + (s - start[b])
                start, load = new_start, load[perm]
            del bin_size

        out = np.empty(n, SLOT)                          # per slot, in pack_id order
        with task.stats.timer("solve/partitions"):
            # at most ~3 × 256 partition files open at once, whatever OVPIPE_PACK_PART_ITEMS says
            base, bits, n_parts = partition_plan(counts, max(part_items(), -(-n // 256)))
            task.stats.info["pack_partitions"] = n_parts
            # read, not memory-mapped: mapped file pages count in the reduce's RSS until unmapped
            files = [open(work / f"part-{p:05d}.bin", "wb") for p in range(n_parts)]
            try:
                spill = open(work / "items.bin", "rb")
                for a in range(0, n, CHUNK):
                    rec = np.fromfile(spill, dtype=ITEM, count=min(CHUNK, n - a))
                    pid = partition_of(rec, base, bits)
                    o = np.argsort(pid, kind="stable")
                    bounds = np.searchsorted(pid[o], np.arange(n_parts + 1))
                    rec = rec[o]
                    for p in np.flatnonzero(np.diff(bounds)):
                        rec[bounds[p]:bounds[p + 1]].tofile(files[p])
                spill.close()
            finally:
                for fh in files:
                    fh.close()
            os.remove(work / "items.bin")
            ltype = np.uint16 if C < 1 << 16 else np.int64

            def sorted_partitions():
                """Each partition's items and their (L, key) order — read and sorted a partition ahead in
                a background thread (numpy sorts without the GIL) while the last one is placed."""
                for p in range(n_parts):
                    path = work / f"part-{p:05d}.bin"
                    rec = np.fromfile(path, dtype=ITEM)
                    os.remove(path)
                    o = np.argsort(rec["key"], kind="stable")
                    yield rec, o[np.argsort(rec["L"][o].astype(ltype), kind="stable")]

            k0 = 0
            prog = task.progress(n_parts, unit="partitions", desc="pack: place items")
            for rec, o in prefetch(sorted_partitions(), depth=1):
                d = dest[k0:k0 + len(rec)]
                for name in SLOT.names:
                    out[name][d] = rec[name][o]
                k0 += len(rec)
                prog.update(1, items=k0)
            prog.close()
            assert k0 == n, (k0, n)
            del dest

        with task.stats.timer("solve/balance"):
            src, start, load = balanced_bins(task, cfg, out, start, load)

        with task.stats.timer("solve/write_slots"):
            schema = pa.schema([("sample_id", pa.string()), ("length", pa.int32()), ("turns_kept", pa.int32()),
                                ("source_sample_id", pa.string()), ("image_tokens", pa.int32()),
                                ("images", pa.int32()), ("vit_sq", pa.int64())])
            # one writer thread encodes and compresses a row group (pyarrow releases the GIL) while this
            # one builds the next: FIFO on one worker, so the file is the same; at most 2 tables pending
            with atomic_write(out_path) as tmp, pq.ParquetWriter(tmp, schema, compression="zstd") as w, \
                    ThreadPoolExecutor(1) as pool:
                pending: list = []
                for a in range(0, n, 1 << 16):
                    r = out[a:a + (1 << 16)] if src is None else out[src[a:a + (1 << 16)]]
                    t = pa.table({"sample_id": u64_to_hex(r["sid"]),
                                  "length": pa.array((r["L"] + shift if shift else r["L"]).astype(np.int32)),
                                  "turns_kept": pa.array(r["turns"]), "source_sample_id": u64_to_hex(r["src"]),
                                  "image_tokens": pa.array(r["itok"].astype(np.int32)),
                                  "images": pa.array(r["img"].astype(np.int32)),
                                  "vit_sq": pa.array(r["vsq"].astype(np.int64))}, schema=schema)
                    pending.append(pool.submit(w.write_table, t))
                    if len(pending) > 2:
                        pending.pop(0).result()
                for f in pending:
                    f.result()
        return Solution(counts, start, np.asarray(load, np.int64), small.lengths())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bin_costs(out: np.ndarray, start: np.ndarray, w: dict) -> np.ndarray:
    """Each bin's cost (``packing.cost``) from its slots' counts, a chunk of bins at a time."""
    from packing.cost import cost_of, pack_stats

    n_bins = len(start) - 1
    cost = np.zeros(n_bins)
    for b0 in range(0, n_bins, CHUNK):
        b1 = min(b0 + CHUNK, n_bins)
        a, b = int(start[b0]), int(start[b1])
        r = out[a:b]
        cost[b0:b1] = cost_of(pack_stats(r["L"], r["itok"], r["img"], r["vsq"], start[b0:b1 + 1] - a), w)
    return cost


def balanced_bins(task, cfg, out: np.ndarray, start: np.ndarray, load: np.ndarray):
    """With ``cfg.balance_dp``: the bins in ``packing.compute_balance.order`` (its straggler loss before and after in
    the step's stats) as (slot index of each new slot, new bin starts, new loads); without: (None, start, load)."""
    if not getattr(cfg, "balance_dp", 0):
        return None, start, load
    from packing.compute_balance import displacement_steps, epoch_straggler_losses, order, straggler_loss
    from packing.cost import weights

    layout = (cfg.balance_dp, cfg.balance_micro_batch, cfg.balance_grad_accum)
    cost = bin_costs(out, start, weights(cfg.cost_weights))
    perm = order(cost, *layout, window=cfg.balance_window, seed=cfg.seed, method=cfg.balance_method)
    before, after = straggler_loss(cost, *layout), straggler_loss(cost[perm], *layout)
    # after: epoch 1 of the stream; by epoch: the trainer's stream carries the leftover packs into later epochs
    task.stats.info.update(straggler_loss_before=before, straggler_loss_after=after,
                           straggler_loss_after_by_epoch=epoch_straggler_losses(cost[perm], *layout),
                           balance_max_displacement_steps=displacement_steps(perm, *layout))
    size = np.diff(start)[perm]
    new_start = np.zeros(len(start), np.int64)
    np.cumsum(size, out=new_start[1:])
    src = np.repeat(start[:-1][perm] - new_start[:-1], size) + np.arange(int(new_start[-1]), dtype=np.int64)
    return src, new_start, np.asarray(load)[perm]
