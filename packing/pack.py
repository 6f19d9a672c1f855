"""``pack``: the ``lengths`` manifest (optionally weighted by ``balanced`` or ``mixed`` copies) →
``packs`` manifest + packed webdataset shards (``packing.shards``). Algorithm: ``packing.binpack``
(hash buckets + exact BFD), optionally ``packing.refine`` (``refine_passes``: gap consolidation +
ejection chains after BFD).

Items: every ``lengths`` row with status ``ok`` or ``truncated``, one per distinct ``sample_id``
(the same conversation ingested by two steps is one sample), times its copies: 1
(``copies_from: none``), ``balanced.copies`` (curation's concept balancing) or the sum of
``mixed.copies`` of the ``mix_step`` folder (the instruction mix); a sample missing there gets 0.

Reduce → apply (a reduce-first step, ``docs/scale.md``): the reduce solves the global packing once, out of core
(``packing.solve``: the items stream to disk and are sorted a partition at a time; ~48 bytes of memory
per item) and writes the solution — per bin its slot range and load, per slot its sample id, length,
turns kept and source sample — under ``reduced/``; each apply rank reads only its contiguous
``pack_id`` range of it, a chunk of bins at a time, and writes those packs — manifest part and tar
shards — so the expensive part (reading images, tokenising into shards) is parallel over ranks and the
result is identical for any task count. (No map phase: the item → slot assignment is a global sort
by key within each length, so the solve is not a sum of per-slice partials.) Shards are
named by ``pack_id`` range, never by rank: shard ``j`` is ``pack-{j:06d}.tar`` and holds pack_ids
``[j·packs_per_shard, (j+1)·packs_per_shard)``, and the rank split is over whole shards
(``shard_bounds``), so every shard is written by exactly one rank and the tars, their names and the
``packs.shard`` column are byte-identical for any task count. The shard writer (``ShardWriter``)
streams the ``samples`` manifests the lengths step read (its ``samples_steps``) once, keeping only its
samples' rows, encodes each with ``packing.tokens.encode_conversation`` (cut to the turns ``lengths``
kept) and checks the length against the manifest; it writes all of the sample's images (0..n) in
order, with their grids.
``count_for`` names the trainer whose token count fills the bins. ``ovpipe`` (the default): ``lengths``.
``llava-ov``: the official LLaVA-OneVision-1.5 task encoder's, ``lengths − tail`` for every item (the chat
template's last newline, which that encoder drops: ``packing.official``), so ``pack-official`` writes entries
full to ``seq_len`` as that trainer counts them. The bins, loads and report are then in that count, while the
``packs`` manifest and shards keep ovpipe's encoding (``lengths``, ``total_tokens`` = Σ lengths, up to one tail
per item over ``seq_len``) — which is why ovpipe's trainer refuses such a step (``pretrain.data.check_pack_step``).
The tail is taken off every item, carriable by the official flavour or not: one ``pack-official`` leaves out
of its entry has no official count, so the entry's official sum stays ≤ the bin's load ≤ ``seq_len``.
Every pack has a cost (``packing.cost``: its forward + backward FLOPs under ``cost_weights``, with the counts
they come from: ``attn_sq``, ``images``, ``vit_tokens``, ``vit_sq``). With ``balance_dp`` (and
``balance_micro_batch``, ``balance_grad_accum``: the trainer's layout) the reduce puts the bins in the balanced
order of ``packing.compute_balance`` before writing the solution, so ``pack_id`` order — the trainer's stream — gives
every DP rank of a step about the same cost; the packs themselves are the unbalanced run's.
``finalize`` writes the packing report (``report.md``, ``fill_histogram.png``): bins vs the lower
bound ⌈Σ lengths / seq_len⌉, fill rate, padding tokens, and padding compression against padding
every sample to ``seq_len`` and against an online rolling-buffer packer (B = 64, 512, 4096); then, with
shards, runs ``energon prepare`` so the step folder is a Megatron-Energon dataset (``packing.energon``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from ovpipe.config import HASHED_UNLESS_DEFAULT, check_range, check_step_folder
from ovpipe.inputs import Input
from ovpipe.step import Step, TaskContext, slice_bounds

PACKABLE = ("ok", "truncated")
APPLY_BINS = 8192           # packs an apply rank builds at once (≈ 10 slots each) and rows per row group
COUNT_FOR = ("ovpipe", "llava-ov")


@dataclass
class PackConfig:
    seq_len: int = 8192                         # tokens per pack: the lengths step's seq_len (checked)
    seed: int = 0                               # the seeded pack order (and the shuffle when balance_dp is 0)
    lengths_step: str = "lengths"               # step folder of the lengths manifest to pack
    copies_from: Literal["none", "balanced", "mixed"] = "none"  # copies per sample: one, balance's or mix's
    mix_step: str = "mix"                       # step folder of the `mixed` manifest (copies_from: mixed)
    write_shards: bool = True                   # false: the packs manifest only, no packed .tar shards
    packs_per_shard: int = 256                  # packs per packed .tar shard
    report_buffers: list[int] = field(default_factory=lambda: [64, 512, 4096])  # online-buffer sizes the report compares
    report_max_samples: int = 1_000_000          # the online-buffer baselines run on at most this many
    refine_passes: int = 0                       # post-BFD gap consolidation + ejection (packing.refine)
    # the trainer whose token count fills the bins: ovpipe's (`lengths`), or the official LLaVA-OV-1.5 task
    # encoder's (`lengths` − the template tail it drops: packs for `pack-official`, refused by ovpipe's trainer)
    count_for: Literal["ovpipe", "llava-ov"] = field(default="ovpipe", metadata=HASHED_UNLESS_DEFAULT)
    # the `packs.cost` column (packing.cost): RECIPE/STAGE of packing/cost_weights.json, or a fitted weights file
    cost_weights: str = field(default="llava-ov-1.5-4b/1.5", metadata=HASHED_UNLESS_DEFAULT)
    # balanced steps (packing.compute_balance): pack_id order balanced for this trainer layout; 0 = the seeded shuffle
    balance_dp: int = field(default=0, metadata=HASHED_UNLESS_DEFAULT)
    balance_micro_batch: int = field(default=1, metadata=HASHED_UNLESS_DEFAULT)    # packs per micro-batch
    balance_grad_accum: int = field(default=1, metadata=HASHED_UNLESS_DEFAULT)     # micro-batches per step
    balance_window: int = field(default=32, metadata=HASHED_UNLESS_DEFAULT)        # steps balanced together
    balance_method: Literal["kk", "lpt"] = field(default="kk", metadata=HASHED_UNLESS_DEFAULT)  # Karmarkar-Karp or LPT

    def __post_init__(self):
        if self.seq_len < 64:
            raise ValueError(f"seq_len must be >= 64, got {self.seq_len}")
        if self.packs_per_shard < 1:
            raise ValueError("packs_per_shard must be >= 1")
        if self.copies_from not in ("none", "balanced", "mixed"):
            raise ValueError(f"copies_from must be none, balanced or mixed, got {self.copies_from!r}")
        if self.copies_from == "mixed" and not self.mix_step:
            raise ValueError("copies_from=mixed requires mix_step (the mix step folder)")
        if self.count_for not in COUNT_FOR:
            raise ValueError(f"count_for must be one of {list(COUNT_FOR)}, got {self.count_for!r}")
        if self.refine_passes < 0:
            raise ValueError(f"refine_passes must be >= 0, got {self.refine_passes}")
        check_range(self, "seed", 0, 2**64 - 1)
        check_range(self, "report_max_samples", 1)
        check_range(self, "balance_dp", 0)
        for name in ("balance_micro_batch", "balance_grad_accum", "balance_window"):
            check_range(self, name, 1)
        if self.balance_method not in ("kk", "lpt"):
            raise ValueError(f"balance_method must be kk or lpt, got {self.balance_method!r}")
        from packing.cost import weights

        try:
            weights(self.cost_weights)
        except ValueError as e:
            raise ValueError(f"cost_weights: {e}") from None
        if any(b < 1 for b in self.report_buffers):
            raise ValueError(f"report_buffers must all be >= 1, got {self.report_buffers}")
        check_step_folder("lengths_step", self.lengths_step)
        if self.copies_from == "mixed":
            check_step_folder("mix_step", self.mix_step)


def check(cfg: PackConfig, run_dir) -> None:
    """Before any work: ``seq_len`` is the one its lengths step measured against (``too_long``, truncation
    and the turns kept are decided at that length, so packing at another one is wrong in a way no later
    check sees). A lengths step not prepared yet is ``check_inputs``' to report."""
    from ovpipe.inputs import upstream_config
    from packing.lengths import STEP as LENGTHS

    try:
        _, lcfg = upstream_config(run_dir, cfg.lengths_step, LENGTHS)
    except (OSError, ValueError, KeyError):
        return
    if getattr(lcfg, "seq_len", cfg.seq_len) != cfg.seq_len:
        raise ValueError(f"seq_len: {cfg.seq_len} differs from the seq_len {lcfg.seq_len} its lengths step "
                         f"{cfg.lengths_step!r} measured at; set seq_len: {lcfg.seq_len}, or rerun lengths at "
                         f"{cfg.seq_len}")


def solve_once(cfg: PackConfig, task: TaskContext) -> None:
    """Reduce: the whole packing, once, streamed (``packing.solve``: memory ~48 bytes per item, the
    items themselves on disk). Writes ``reduced/bin_start.npy`` and ``bin_load.npy`` (per bin, pack_id
    order), ``reduced/slots.parquet`` (sample_id, length, turns_kept, source_sample_id of every slot,
    bin after bin), so an apply rank reads only its pack range, and ``reduced/summary.npz`` (the length
    histogram and the report's key-order sample) for ``finalize``."""
    from manifests.io import atomic_write
    from ovpipe.mapreduce import save_arrays
    from packing.solve import solve

    rdir = task.reduced_path("")
    rdir.mkdir(parents=True, exist_ok=True)
    shift = count_shift(task, cfg)
    if shift:
        task.stats.info.update(count_for=cfg.count_for, count_shift=shift)
    with task.stats.timer("solve"):
        sol = solve(task, cfg, PACKABLE, rdir / "slots.parquet", shift=shift)
    lb = -(-sol.tokens // cfg.seq_len)
    task.stats.inc("items", sol.n_items)
    task.stats.inc("bins", len(sol.bin_load))
    task.stats.inc("lower_bound", lb)
    task.stats.inc("tokens", sol.tokens)
    for name, arr in (("bin_start.npy", sol.bin_start), ("bin_load.npy", sol.bin_load)):
        with atomic_write(rdir / name) as tmp:
            np.save(tmp, np.asarray(arr, np.int64))
    save_arrays(rdir / "summary.npz", counts=sol.counts, report_lengths=sol.report_lengths)


def count_shift(task: TaskContext, cfg: PackConfig) -> int:
    """Tokens the target trainer counts fewer than ``lengths`` per sample (``packing.official.count_shift``)."""
    from packing.official import count_shift as shift

    return shift(task.run_dir, cfg.count_for, cfg.lengths_step)


def write_packs(cfg: PackConfig, task: TaskContext) -> None:
    """Apply: this rank's whole shards of pack_ids → its ``packs`` part and tars, reading only its
    bins' rows of the solution, a chunk of bins at a time (whole shards per chunk), so the manifest
    part streams out in ``APPLY_BINS``-row row groups."""
    import pyarrow.parquet as pq

    from packing.cost import cost_of, pack_stats, weights

    w = weights(cfg.cost_weights)
    # a pack's cost is the target trainer's, as the balancer costed its bin (``solve.bin_costs``): with
    # ``count_for`` another trainer's, each sub-sample counts ``shift`` tokens fewer than the pack holds
    shift = count_shift(task, cfg) if cfg.count_for != "ovpipe" else 0
    pps = cfg.packs_per_shard if cfg.write_shards else None
    start = np.load(task.reduced_path("bin_start.npy"), mmap_mode="r")
    load = np.load(task.reduced_path("bin_load.npy"), mmap_mode="r")
    lo, hi = shard_bounds(len(start) - 1, pps, task.rank, task.world_size)
    pf = pq.ParquetFile(task.reduced_path("slots.parquet"))
    shards = None
    if cfg.write_shards and hi > lo:   # the conversations of this rank's samples: one streamed pass
        shards = ShardWriter(task, cfg, read_slots(pf, int(start[lo]), int(start[hi])))
    chunk = APPLY_BINS if not pps else max(APPLY_BINS // pps, 1) * pps
    with task.part_writer("packs", row_group_rows=APPLY_BINS) as out:
        for c_lo in range(lo, hi, chunk):
            c_hi = min(c_lo + chunk, hi)
            a, b = int(start[c_lo]), int(start[c_hi])
            slots = read_slots(pf, a, b, ["sample_id", "length", "image_tokens", "images", "vit_sq"])
            lens, offs, tot = slots.column("length").to_numpy(), np.asarray(start[c_lo:c_hi + 1]) - a, load[c_lo:c_hi]
            if cfg.count_for != "ovpipe":   # the bins' loads are the target trainer's count; a pack holds ovpipe's
                tot = np.add.reduceat(lens.astype(np.int64), offs[:-1])
            counts = [slots.column(c).to_numpy() for c in ("image_tokens", "images", "vit_sq")]
            stats = pack_stats(lens, *counts, offs)
            cost = cost_of(pack_stats(lens - shift, *counts, offs) if shift else stats, w)
            table = packs_rows(slots.column("sample_id").combine_chunks(), lens, offs, np.asarray(tot), c_lo, c_hi,
                               pps, stats, cost)
            if shards is not None:
                with task.stats.timer("write_shards"):
                    shards.write(table)
            out.write(table)
    task.stats.inc("packs_written", hi - lo)


def read_slots(pf, a: int, b: int, columns: list[str] | None = None):
    """Rows ``[a, b)`` of the solution's slots (``reduced/slots.parquet``), reading only their row groups."""
    import pyarrow as pa

    parts, row = [], 0
    for g in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if row < b and row + n > a:
            t = pf.read_row_group(g, columns=columns)
            parts.append(t.slice(max(a - row, 0), min(b, row + n) - max(a, row)))
        row += n
    empty = pf.schema_arrow.empty_table()
    return pa.concat_tables(parts) if parts else (empty.select(columns) if columns else empty)


def shard_name(j: int) -> str:
    """File name of shard ``j`` (pack_ids ``[j·packs_per_shard, (j+1)·packs_per_shard)``): zero-padded,
    so names sort in pack_id order (``packing.shards.packed_shards`` also sorts numerically)."""
    return f"pack-{j:06d}.tar"


def shard_bounds(n_packs: int, packs_per_shard: int | None, rank: int, world_size: int) -> tuple[int, int]:
    """This rank's contiguous ``[lo, hi)`` of pack_ids. With shards, the split is over whole shards
    (a contiguous, balanced range of shard indices), so no shard is split between two ranks and
    every tar is written by exactly one rank, whatever the task count; without, over packs."""
    if not packs_per_shard:
        return slice_bounds(n_packs, rank, world_size)
    n_shards = -(-n_packs // packs_per_shard)
    s_lo, s_hi = slice_bounds(n_shards, rank, world_size)
    return min(s_lo * packs_per_shard, n_packs), min(s_hi * packs_per_shard, n_packs)


def packs_table(sid, L, idx, P, lo: int, hi: int, packs_per_shard: int | None, images: dict | None = None,
                cost_weights: str | None = None):
    """The ``packs`` rows of bins [lo, hi) of a whole ``Packing`` (bench, tests). ``images``: per sample
    ``image_tokens``, ``images``, ``vit_sq`` (as ``lengths``) for the cost; None: text only."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from packing.cost import cost_of, pack_stats, weights

    a, b = int(P.start[lo]), int(P.start[hi])
    items = idx[P.item[a:b]]
    offs = P.start[lo:hi + 1] - a
    stats = cost = None
    if images is not None:
        stats = pack_stats(L[items], *(np.asarray(images[k])[items] for k in ("image_tokens", "images", "vit_sq")),
                           offs)
        cost = cost_of(stats, weights(cost_weights or PackConfig.cost_weights))
    return packs_rows(pc.take(sid, pa.array(items)), L[items], offs, P.load[lo:hi], lo, hi, packs_per_shard,
                      stats, cost)


def packs_rows(slot_sids, slot_lens, offs, load, lo: int, hi: int, packs_per_shard: int | None,
               stats: dict | None = None, cost=None):
    """The ``packs`` rows of bins [lo, hi) from their slots (sample ids and lengths, bin after bin), the
    bins' slot offsets (``offs[0] = 0``) and loads — built with Arrow list arrays, no loop per bin. ``stats``
    / ``cost``: the bins' ``packing.cost.pack_stats`` and cost; None: text only, the default weights."""
    import pyarrow as pa

    from packing.cost import cost_of, pack_stats, weights

    if stats is None:
        z = np.zeros(len(slot_lens), np.int64)
        stats = pack_stats(slot_lens, z, z, z, offs)
        cost = cost_of(stats, weights())

    offs = np.asarray(offs).astype(np.int32)
    lens = np.asarray(slot_lens).astype(np.int32)
    n_in_bin = np.diff(offs)
    bin_start_tok = np.zeros(len(lens), np.int64)
    if len(lens):
        csum = np.cumsum(lens, dtype=np.int64)
        first = np.repeat(offs[:-1], n_in_bin)
        bin_base = np.where(first > 0, csum[np.maximum(first - 1, 0)], 0)
        bin_start_tok = (csum - lens) - bin_base
    off_arr = pa.array(offs)
    shard = None
    if packs_per_shard:  # named by pack_id range: the same for any [lo, hi) split
        j = np.arange(lo, hi, dtype=np.int64) // packs_per_shard
        first = int(j[0]) if len(j) else 0
        names = np.array([shard_name(k) for k in range(first, int(j[-1]) + 1)] if len(j) else [], dtype=object)
        shard = pa.array(names[j - first] if len(j) else [], pa.string())
    else:
        shard = pa.nulls(hi - lo, pa.string())
    return pa.table({
        "pack_id": pa.array(np.arange(lo, hi, dtype=np.int64)),
        "sample_ids": pa.ListArray.from_arrays(off_arr, slot_sids),
        "lengths": pa.ListArray.from_arrays(off_arr, pa.array(lens)),
        "offsets": pa.ListArray.from_arrays(off_arr, pa.array(bin_start_tok.astype(np.int32))),
        "total_tokens": pa.array(np.asarray(load).astype(np.int32)),
        "shard": shard,
        "attn_sq": pa.array(np.asarray(stats["attn_sq"], np.int64)),
        "images": pa.array(np.asarray(stats["images"]).astype(np.int32)),
        "vit_tokens": pa.array(np.asarray(stats["vit_tokens"], np.int64)),
        "vit_sq": pa.array(np.asarray(stats["vit_sq"], np.int64)),
        "cost": pa.array(np.asarray(cost, np.float64)),
    })


def needed_samples(task: TaskContext, lcfg, need: set, sources) -> dict:
    """``{sample_id: samples row}`` for the ids in ``need``: the ``samples`` manifests of
    ``lcfg.samples_steps`` streamed a batch at a time, keeping only the rows of ``sources`` (the needed
    samples' ``source_sample_id``s: a recaptioned sample is made from its source row), then
    ``caption_source`` applied to those rows — what ``training_samples`` gives for these ids, holding
    this rank's samples only."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from manifests.schemas import schema_for
    from packing import caption_source
    from manifests.ids import id_member

    cols = ["sample_id", "status", "conversation", "images"]
    member = id_member(pc.unique(sources.combine_chunks() if isinstance(sources, pa.ChunkedArray) else sources))
    picked = []
    for step in lcfg.samples_steps:
        try:
            for batch in task.iter_input_canonical("samples", cols, step=step):
                hit = member(batch.column("sample_id"))
                if hit.any():
                    picked.append(batch.filter(pa.array(hit)))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{e} (lengths.samples_steps names {step!r})") from None
    schema = pa.schema([schema_for("samples").field(c) for c in cols])
    table = caption_source.apply(task, pa.Table.from_batches(picked, schema=schema), lcfg, count=False)
    rows = {}
    for r in table.filter(pc.equal(table.column("status"), "ok")).to_pylist():
        if r["sample_id"] in need:
            rows.setdefault(r["sample_id"], r)
    return rows


class ShardWriter:
    """The tars of a rank's pack range, fed a ``packs`` chunk at a time (chunks of whole shards). Each
    sample's conversation comes from ``needed_samples`` (read once for the range), is encoded with
    ``packing.tokens.encode_conversation`` cut to the turns ``lengths`` kept, and its length is checked
    against the manifest; all of the sample's images (0..n) follow in order, with their grids."""

    def __init__(self, task: TaskContext, cfg: PackConfig, slots):
        from ovpipe.inputs import upstream_config
        from packing.lengths import STEP as LENGTHS
        from packing.tokens import load_tokenizer

        self.task, self.cfg = task, cfg
        self.lcfg = upstream_config(task.run_dir, cfg.lengths_step, LENGTHS)[1]
        self.img_cfg = self.lcfg.image_cfg()
        self.tok = load_tokenizer(self.lcfg.tokenizer)
        self.kept_turns = dict(zip(slots.column("sample_id").to_pylist(), slots.column("turns_kept").to_pylist()))
        self.rows = needed_samples(task, self.lcfg, set(self.kept_turns), slots.column("source_sample_id"))

    def write(self, packs) -> None:
        from manifests.conversation import read_image
        from packing.shards import write_shard
        from packing.tokens import encode_conversation, image_grid

        task, cfg, lcfg, img_cfg, tok, rows, kept_turns = (self.task, self.cfg, self.lcfg, self.img_cfg, self.tok,
                                                           self.rows, self.kept_turns)
        entries, shard = [], None
        for p in packs.to_pylist():
            ids, mask, images, exts, grids, counts = [], [], [], [], [], []
            for s, want in zip(p["sample_ids"], p["lengths"]):
                r = rows.get(s)
                if r is None:
                    raise RuntimeError(f"sample {s}: no ok row in the samples manifests of {lcfg.samples_steps} — "
                                       f"were the ingest steps re-run after `{cfg.lengths_step}`?")
                turns = [(t["role"], t["text"] or "") for t in r["conversation"]]
                addrs = r["images"] or []
                a, m, pads, kept = encode_conversation(tok, turns, [(x["height"], x["width"]) for x in addrs], img_cfg,
                                                       max_tokens=want, caption_prompt=lcfg.caption_prompt)
                if len(a) != want or kept != kept_turns.get(s, kept):
                    raise RuntimeError(f"sample {s}: encoded {len(a)} tokens ({kept} turns) but lengths says {want} "
                                       f"({kept_turns.get(s)} turns) — tokenizer or template changed since "
                                       f"`lengths` ran?")
                ids.append(a)
                mask.append(m)
                addrs = addrs[:len(pads)]  # the images of the kept turns, in placeholder order
                counts.append(len(addrs))
                for x in addrs:
                    images.append(read_image(x))
                    exts.append({"jpeg": "jpg"}.get(x["format"], x["format"] or "bin"))
                if addrs:
                    gh, gw = image_grid(np.array([x["height"] for x in addrs]), np.array([x["width"] for x in addrs]),
                                        img_cfg)
                    grids.extend((int(h), int(w)) for h, w in zip(gh, gw))
            e = {"pack_id": p["pack_id"], "sample_ids": p["sample_ids"], "lengths": p["lengths"],
                 "offsets": p["offsets"], "seq_len": cfg.seq_len, "ids": np.concatenate(ids),
                 "mask": np.concatenate(mask), "images": images, "exts": exts, "grids": grids, "image_counts": counts}
            if shard is not None and p["shard"] != shard:
                write_shard(task.data_path(shard), entries)
                entries = []
            shard = p["shard"]
            entries.append(e)
        if entries:
            write_shard(task.data_path(shard), entries)


def finalize(cfg: PackConfig, task: TaskContext) -> None:
    """The packing report, then the shards as a prepared Megatron-Energon dataset (``packing.energon``):
    energon's own ``prepare`` writes ``.nv-meta/`` into the step folder."""
    from packing.report import packing_report

    packing_report(cfg, task)
    n_shards = len(list(task.step_dir.glob("data/pack-*.tar")))
    if cfg.write_shards and n_shards:  # no packs, no dataset: energon refuses a folder without tars
        from packing.energon import prepare

        with task.stats.timer("energon_prepare"):
            prepare(task.step_dir, n_shards, task.step_dir / "logs" / "energon_prepare.log")


# Every manifest pack reads: the lengths it packs, the copies (mixed / balanced, as copies_from says),
# and — for the shards — the samples and recaptions its lengths step measured.
INPUTS = {
    "lengths": "lengths_step",
    "mixed": Input("mix_step", when=lambda c: c.copies_from == "mixed"),
    "balanced": Input(when=lambda c: c.copies_from == "balanced"),
    "samples": Input(via="lengths_step", when=lambda c: c.write_shards),
    "captions": Input(via="lengths_step", when=lambda c: c.write_shards),
}

STEP = Step("pack", PackConfig, inputs=INPUTS, outputs=("packs",), reduce=solve_once, check=check,
            apply=write_packs, finalize=finalize,
            description="offline hash-bucket BFD packing into fixed-length sequences")
