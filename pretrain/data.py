"""Packed shards (``packing.shards``) → THD micro-batches for megatron-core, and the data plan of a
stage (how many packs and samples a run consumes).

A micro-batch is ``micro_batch`` packs concatenated into one THD sequence: megatron sees
``tokens [1, T]`` with ``PackedSeqParams(cu_seqlens)`` over *all samples of all packs*, so
micro-batch > 1 costs nothing special (block-diagonal attention keeps samples apart) — the
published code is stuck at 1 when packing. Labels are the next token *within the same sample*;
the loss mask is the target mask of that next token, 0 on each sample's last position. The
packed target mask is 1 exactly on assistant-turn tokens and the end token closing each assistant
turn (``packing``), so in a multi-turn conversation every assistant turn is a target and no user
text, system prompt, ``<|image_pad|>`` or vision marker ever is. Position ids restart at every
sample. A sample holds 0..n images (flattened over the pack in placeholder order); a micro-batch
may hold none at all (text-only data), which the model handles (``pretrain.model.vlm``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from llava_ov.export import CLIP_MEAN, CLIP_STD


@dataclass
class PackedBatch:
    tokens: torch.Tensor        # [1, T]
    labels: torch.Tensor        # [1, T]
    loss_mask: torch.Tensor     # [1, T] float
    position_ids: torch.Tensor  # [1, T]
    cu_seqlens: torch.Tensor    # [n_samples + 1] int32
    max_seqlen: int
    n_images: int
    images: list = None          # [3, H, W] float tensors, H = grid_h·14, W = grid_w·14 (CLIP-normalised)
    cp_index: torch.Tensor | None = None   # context parallel: this rank's token positions (pretrain.model.parallel)
    n_packs: int = 0             # packs in this micro-batch
    n_samples: int = 0           # source samples inside them
    pack_ids: list | None = None  # the packs, in stream order
    vision: object = None        # pretrain.model.vision.VisionInputs (BatchPrep): the tower's inputs, prepared
    rotary: tuple | None = None  # (cos, sin) [T, head_dim] fp32: the LLM's rotary tables (BatchPrep)
    stats: dict | None = None    # FLOP counts' inputs: Σ sample², tower tokens, Σ image² (BatchPrep)

    def pin_memory(self) -> "PackedBatch":
        """Page-locked copies (``DataLoader(pin_memory=True)`` calls this), so the step's host→device
        copies are asynchronous."""
        import dataclasses

        pin = (lambda x: None if x is None else x.pin_memory())
        return dataclasses.replace(
            self, tokens=pin(self.tokens), labels=pin(self.labels), loss_mask=pin(self.loss_mask),
            position_ids=pin(self.position_ids), cu_seqlens=pin(self.cu_seqlens), cp_index=pin(self.cp_index),
            vision=None if self.vision is None else self.vision.pin_memory(),
            rotary=None if self.rotary is None else tuple(pin(x) for x in self.rotary))




def pixels(image_bytes: bytes, grid_h: int, grid_w: int, patch: int = 14) -> torch.Tensor:
    """Decode, apply the EXIF orientation (ingest records the sizes as displayed, so the grid
    ``packing`` counted tokens for is the upright image's), resize to that grid, normalise."""
    import io

    from PIL import Image

    from manifests.conversation import upright_rgb

    with Image.open(io.BytesIO(image_bytes)) as im:
        im = upright_rgb(im).resize((grid_w * patch, grid_h * patch), Image.BICUBIC)
        x = torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0).permute(2, 0, 1)
    mean = torch.tensor(CLIP_MEAN)[:, None, None]
    std = torch.tensor(CLIP_STD)[:, None, None]
    return (x - mean) / std


def _check_pack(s) -> None:
    """What the trainer relies on, checked per pack with a message that says where it broke."""
    n = len(s.input_ids)
    if len(s.loss_mask) != n or int(s.cu_seqlens[-1]) != n:
        raise ValueError(f"pack {s.pack_id}: {n} token ids but {len(s.loss_mask)} mask entries and "
                         f"cu_seqlens ending at {int(s.cu_seqlens[-1])} — a broken packed shard, re-run "
                         "`ovpipe pack`")
    if len(s.images) != len(s.image_grids):
        raise ValueError(f"pack {s.pack_id}: {len(s.images)} images but {len(s.image_grids)} image grids")
    per_sample = getattr(s, "images_per_sample", None)   # newer shards record it; older ones do not
    if per_sample and (len(per_sample) != len(s.cu_seqlens) - 1 or sum(per_sample) != len(s.images)):
        raise ValueError(f"pack {s.pack_id}: images_per_sample {list(per_sample)} does not match "
                         f"{len(s.cu_seqlens) - 1} samples holding {len(s.images)} images")


def collate(seqs, with_images: bool = True) -> PackedBatch:
    for s in seqs:
        _check_pack(s)
    ids = np.concatenate([s.input_ids for s in seqs]).astype(np.int64)
    mask = np.concatenate([s.loss_mask for s in seqs]).astype(np.float32)
    pos = np.concatenate([s.position_ids for s in seqs]).astype(np.int64)
    lens = np.concatenate([np.diff(s.cu_seqlens) for s in seqs])
    cu = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=cu[1:])
    labels = np.zeros_like(ids)
    labels[:-1] = ids[1:]
    # position i is trained iff its target, token i + 1, is a target token (assistant turn / its end)
    lmask = np.zeros_like(mask)
    lmask[:-1] = mask[1:]
    lmask[cu[1:] - 1] = 0.0   # a sample's last token predicts nothing (the next token is another sample)
    images = [pixels(img, int(g[0]), int(g[1])) for s in seqs for img, g in zip(s.images, s.image_grids)] \
        if with_images else []
    return PackedBatch(torch.from_numpy(ids)[None], torch.from_numpy(labels)[None], torch.from_numpy(lmask)[None],
                       torch.from_numpy(pos)[None], torch.from_numpy(cu).to(torch.int32), int(lens.max()),
                       sum(len(s.images) for s in seqs), images, n_packs=len(seqs),
                       n_samples=int(sum(len(s.cu_seqlens) - 1 for s in seqs)),
                       pack_ids=[int(s.pack_id) for s in seqs])


@dataclass(frozen=True)
class BatchPrep:
    """What the loader computes for the step, on the CPU (in its worker processes): the
    context/sequence-parallel split (``pretrain.model.parallel.shard_batch``), the LLM's rotary tables,
    and the vision tower's inputs (``pretrain.model.vision.prepare_images``) with the LLM positions of
    the image pads — so the step hands them down and does no per-sample or per-image work."""

    vit: object                 # pretrain.model.vision.ViTSize
    rope_dim: int
    rope_theta: float
    image_pad_id: int
    dtype: torch.dtype = torch.float32
    tp: int = 1
    cp: int = 1
    cp_rank: int = 0
    sequence_parallel: bool = False

    def __call__(self, b: PackedBatch) -> PackedBatch:
        import dataclasses

        from pretrain.model.attention import rotary_tables
        from pretrain.model.parallel import shard_batch
        from pretrain.model.vision import prepare_images

        lens = np.diff(b.cu_seqlens.numpy()).astype(np.int64)
        stats = {"tokens": int(lens.sum()), "attn_sq": int((lens ** 2).sum())}
        b = shard_batch(b, self.tp, self.cp, self.cp_rank, self.sequence_parallel)
        pos = b.position_ids[0] if b.cp_index is None else b.position_ids[0, b.cp_index]
        vi = prepare_images(b.images or [], self.vit, dtype=self.dtype)
        where = torch.from_numpy(np.flatnonzero(b.tokens[0].numpy() == self.image_pad_id))
        if len(where) != vi.patches.shape[0] // 4:
            raise ValueError(f"packs {b.pack_ids}: {len(where)} <|image_pad|> tokens but {vi.patches.shape[0] // 4} "
                             "image tokens from the grids — packing and the vision tower disagree on the image grid")
        vi.token_index = where
        tower = np.asarray(list(vi.spans), dtype=np.int64)
        stats.update(vit_tokens=int(tower.sum()), vit_sq=int((tower ** 2).sum()), merged=len(where))
        return dataclasses.replace(b, vision=vi, images=None, rotary=rotary_tables(pos, self.rope_dim, self.rope_theta),
                                   stats=stats)


def balanced_group(run_dir: str | Path, step: str) -> int:
    """The packs of one balanced group of the pack step's stream (``packing.compute_balance``, **Epochs**) as its
    config says; 1 for a step that did not balance (its stream is the plain repetition) or no ovpipe step wrote."""
    from ovpipe.inputs import upstream_config
    from packing.compute_balance import balanced_group as group_of

    try:
        return group_of(upstream_config(run_dir, step)[1])
    except (OSError, ValueError, KeyError):
        return 1


def stream_shape(run_dir: str | Path, step: str) -> tuple[int, int]:
    """(packs of the step, its balanced group): what the balanced stream is a function of. The count is the
    ``packs`` manifest's Parquet footers (no rows read), else the shards' entries."""
    import tarfile

    import pyarrow.parquet as pq

    from manifests.io import manifest_files
    from packing.shards import packed_shards

    try:
        n = sum(pq.ParquetFile(f).metadata.num_rows for f in manifest_files(run_dir, "packs", step))
    except FileNotFoundError:                    # shards copied without their manifest
        n = 0
        for sh in packed_shards(run_dir, step):
            with tarfile.open(sh) as tf:
                n += sum(1 for m in tf if m.name.endswith(".json"))
    return n, balanced_group(run_dir, step)


def iter_batches(run_dir: str | Path, pack_step: str, micro_batch: int, epochs: int | None = None,
                 rank: int = 0, world: int = 1, skip: int = 0, start_pack: int = 0, prep=None,
                 workers: int = 1, worker: int = 0, shape: tuple[int, int] | None = None) -> Iterator[PackedBatch]:
    """Deterministic order: the pack step's balanced stream (``packing.compute_balance.stream_packs``: shards
    sorted, packs in file order, ``epochs`` epochs (None: forever), each epoch its whole balanced groups and the
    leftover packs carried until they fill one) — micro-batch ``k`` is positions ``[P + k·micro_batch,
    P + (k+1)·micro_batch)`` of that stream (``P = start_pack``: packs already consumed, a resumed run's loader
    state), running across epoch boundaries, so ``S`` steps of global batch ``G`` consume exactly ``S·G`` packs
    and no step of a later epoch straddles two balanced groups. ``rank`` / ``world``: a data-parallel rank
    keeps micro-batches ``rank, rank + world, …`` and decodes only those; ``skip``: this rank's first
    micro-batches to pass over without decoding. ``workers`` / ``worker``: of this rank's micro-batches, this
    loader worker builds every ``workers``-th (``DataLoader`` hands them out in that order). ``prep``: a
    ``BatchPrep`` applied to each micro-batch. ``shape``: ``stream_shape``'s (packs, group), read once by the
    caller (``PackStream`` in the trainer's process, so its workers import no Parquet or config code).

    Each epoch reads the shards once, in order: a pack of a whole group is used where it is read; of the leftover
    packs, those a carried group of this epoch hands to this worker are kept (at most one group's) and used
    after the epoch's last whole group."""
    from packing.compute_balance import epoch_of, epoch_start, stream_packs
    from packing.shards import iter_packed, packed_shards

    shards = packed_shards(run_dir, pack_step)
    n, group = shape or stream_shape(run_dir, pack_step)
    if n == 0:
        raise ValueError(f"the packed shards of {pack_step!r} hold no packs — did `ovpipe pack` pack anything?")
    whole = n // group * group                   # packs in the epoch's whole groups

    def mine(q: int) -> bool:                    # position q goes to this rank's loader worker
        if q < start_pack:
            return False
        k = (q - start_pack) // micro_batch
        m = k // world
        return k % world == rank and m >= skip and (m - skip) % workers == worker

    buf = []

    def take(q: int, seq):
        buf.append(seq)
        if len(buf) == micro_batch:
            b = collate(buf)
            buf.clear()
            return b if prep is None else prep(b)
        return None

    e = int(epoch_of(start_pack, n, group))     # the epoch holding the first unread position
    while epochs is None or e < epochs:
        lo, hi = int(epoch_start(e, n, group)) * group, int(epoch_start(e + 1, n, group)) * group
        tail = range(lo + whole, hi)              # the carried group ending this epoch, if one fills
        carried = [(q, int(t)) for q, t in zip(tail, stream_packs(n, group, tail.start, len(tail))) if mine(q)]
        keep = {t for _, t in carried}
        kept, i = {}, 0
        for sh in shards:
            for seq in iter_packed(sh):
                if i < whole:
                    if mine(lo + i) and (b := take(lo + i, seq)) is not None:
                        yield b
                elif i in keep:
                    kept[i] = seq
                i += 1
        if i != n:
            raise ValueError(f"the packed shards of {pack_step!r} hold {i} packs, its packs manifest {n} — "
                             f"re-run `ovpipe pack --name {pack_step} --overwrite`")
        for q, t in carried:
            if (b := take(q, kept[t])) is not None:
                yield b
        e += 1


class PackStream(torch.utils.data.IterableDataset):
    """``iter_batches`` split over ``DataLoader`` worker processes: worker ``w`` of ``W`` builds this
    rank's micro-batches ``w, w + W, …`` and the loader yields them in stream order, so the order
    does not depend on the number of workers."""

    def __init__(self, run_dir, pack_step: str, micro_batch: int, rank: int = 0, world: int = 1,
                 start_pack: int = 0, prep=None):
        self.args = (run_dir, pack_step, micro_batch)
        self.rank, self.world, self.start_pack, self.prep = rank, world, start_pack, prep
        self.shape = stream_shape(run_dir, pack_step)       # here, once, not in every worker

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        if info is not None:
            torch.set_num_threads(1)
        return iter_batches(*self.args, rank=self.rank, world=self.world, start_pack=self.start_pack,
                            prep=self.prep, workers=workers, worker=worker, shape=self.shape)


def _as_is(x):
    return x


# what the loader's forkserver imports once, before it forks a worker: the modules a worker needs to unpickle
# PackStream and decode (by installed name: Python 3.12's server imports these before it applies the parent's
# sys.path)
WORKER_PRELOAD = ["torch", "pretrain.data"]


def _worker_context():
    """The workers' start method: forkserver, not fork — a forked worker inherits whatever lock a thread of the
    trainer (torch's, pyarrow's, a gloo store's) held at that instant, and waits on it forever. The server is
    single-threaded and imports ``WORKER_PRELOAD`` once, so each worker, a fork of it, starts without importing
    torch again (about 2 CPU-s a worker; the preload applies when this process starts its server, the first
    time)."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(WORKER_PRELOAD)
    return ctx


def loader(run_dir, pack_step: str, micro_batch: int, rank: int = 0, world: int = 1, start_pack: int = 0,
           prep=None, workers: int = 0, pin_memory: bool = False, prefetch: int = 2):
    """This rank's micro-batches through a ``torch.utils.data.DataLoader``: decoding, resizing and
    ``prep`` run in ``workers`` processes (0: in this one), each keeping ``prefetch`` micro-batches
    ready, copied to page-locked memory when ``pin_memory``."""
    ds = PackStream(run_dir, pack_step, micro_batch, rank, world, start_pack, prep)
    kw = {"prefetch_factor": prefetch, "persistent_workers": False,
          "multiprocessing_context": _worker_context()} if workers else {}
    return torch.utils.data.DataLoader(ds, batch_size=None, collate_fn=_as_is, num_workers=workers,
                                       pin_memory=pin_memory, **kw)


@dataclass(frozen=True)
class DataPlan:
    """What a stage reads: the pack step, its size (from the ``packs`` manifest) and how much of it
    ``steps`` optimizer steps of ``gbs`` packs consume."""

    step: str
    packs: int | None           # packs in the step (None: no manifest, e.g. shards copied alone)
    samples: int | None         # source samples inside them (a sample balanced to k copies counts k times)
    gbs: int                    # packs per optimizer step: micro_batch × grad_accum × dp
    steps: int
    epochs_asked: float | None = None
    straggler_loss: float | None = None     # over the run's steps at this layout (None: no costs, no whole step)
    balanced_for: tuple | None = None       # (dp, micro_batch, grad_accum) the pack step ordered its packs for

    @property
    def epochs(self) -> float | None:
        return self.steps * self.gbs / self.packs if self.packs else None

    def describe(self) -> str:
        seen = self.steps * self.gbs
        if self.packs is None:
            return (f"data {self.step}: no packs manifest; GBS {self.gbs} packs × {self.steps} steps "
                    f"= {seen:,} packs")
        ep = self.epochs
        frac = f"{100 * ep:.1f}% of the packs seen" if ep < 1 else f"each pack seen ~{ep:.2f}×"
        asked = f" (--epochs {self.epochs_asked:g})" if self.epochs_asked is not None else ""
        samples = "?" if self.samples is None else f"{self.samples:,}"
        return (f"data {self.step}: {samples} samples → {self.packs:,} packs; "
                f"GBS {self.gbs} packs × {self.steps:,} steps{asked} = {seen:,} packs ≈ {ep:.2f} epochs, "
                f"{frac} (GBS × steps decides what is seen){self.describe_balance()}")

    def describe_balance(self) -> str:
        if self.straggler_loss is None:
            return ""
        how = ("packs in the seeded shuffle" if self.balanced_for is None else
               "packs balanced for DP {} × {} micro-batches of {}".format(self.balanced_for[0], self.balanced_for[2],
                                                                          self.balanced_for[1]))
        return (f"; straggler loss {100 * self.straggler_loss:.2f}% a step over the run's {self.steps:,} steps "
                f"({how}, packing.compute_balance)")


def check_pack_step(run_dir: str | Path, step: str) -> None:
    """A pack step made for another trainer is refused, in one line: under ``count_for: llava-ov`` its bins
    fill ``seq_len`` under the official task encoder's count, so its packs run up to one template tail per
    sample over ``seq_len`` in ovpipe's own encoding (``packing.pack``)."""
    from ovpipe.inputs import upstream_config

    try:
        count_for = getattr(upstream_config(run_dir, step)[1], "count_for", "ovpipe")
    except (OSError, ValueError, KeyError):     # no such step yet (the stage's input check names it) or not ovpipe's
        return
    if count_for != "ovpipe":
        raise ValueError(f"data: the pack step {step!r} was packed for the {count_for} trainer (count_for: "
                         f"{count_for}; its packs exceed seq_len in ovpipe's encoding) — train on a pack step with "
                         f"count_for: ovpipe, or hand {step!r} to `ovpipe pack-official`")


def plan_data(run_dir: str | Path, step: str, micro_batch: int, grad_accum: int, dp: int,
              steps: int | None = None, epochs: float | None = None, count_samples: bool = True) -> DataPlan:
    """Exactly one of ``steps`` / ``epochs``; with ``epochs``, ``steps = ceil(epochs × packs / gbs)``
    (the last step may run into the next epoch: the stream is continuous, see ``iter_batches``).

    Pack counts come from the Parquet footers of the ``packs`` manifest (no rows read, cheap on
    every rank); ``count_samples`` (rank 0, for the report) reads only the int32 ``lengths`` lists,
    one part at a time, so a 85M-sample manifest never sits whole in memory."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from manifests.io import manifest_files

    if (steps is None) == (epochs is None):
        raise ValueError(f"give exactly one of --steps and --epochs (got steps={steps}, epochs={epochs}): "
                         "--steps fixes the optimizer steps, --epochs derives them from the pack count")
    if epochs is not None and not epochs > 0:
        raise ValueError(f"--epochs must be > 0, got {epochs}")
    if steps is not None and steps < 0:
        raise ValueError(f"--steps must be >= 0, got {steps}")
    check_pack_step(run_dir, step)
    gbs = micro_batch * grad_accum * dp
    try:
        files = manifest_files(run_dir, "packs", step)
    except FileNotFoundError as e:
        if epochs is not None:
            raise FileNotFoundError(f"--epochs needs the pack count of {step!r}: {e}") from None
        return DataPlan(step, None, None, gbs, steps)
    packs = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    samples = None
    if count_samples:
        samples = sum(int(pc.sum(pc.list_value_length(pq.read_table(f, columns=["lengths"]).column("lengths")))
                          .as_py() or 0) for f in files)
    if epochs is not None:
        if packs == 0:
            raise ValueError(f"--epochs: the pack step {step!r} holds no packs")
        steps = math.ceil(round(epochs * packs / gbs, 9))   # round: 0.1 × 30 is 3.0000000000000004, not 4 steps
    loss, balanced_for = (balance_of(run_dir, step, dp, grad_accum, micro_batch, files, steps) if count_samples
                          else (None, None))
    return DataPlan(step, packs, samples, gbs, steps, epochs, loss, balanced_for)


def balance_of(run_dir, step: str, dp: int, grad_accum: int, micro_batch: int, files,
               steps: int | None = None) -> tuple:
    """(straggler loss of the run's ``steps`` steps (None: one epoch's) of the step's balanced stream at this
    layout, every epoch they reach, the layout ``pack`` balanced them for): (None, …) when its manifest has no
    ``cost`` column (an older pack step) or no whole step."""
    from packing.compute_balance import pack_costs, run_straggler_loss

    cost = pack_costs(files)
    if cost is None:                             # no costs, or a pack without one: the loss is undefined, not 0
        return None, None
    from ovpipe.inputs import upstream_config

    try:
        cfg = upstream_config(run_dir, step)[1]
    except (OSError, ValueError, KeyError):
        cfg = None
    dp_for = getattr(cfg, "balance_dp", 0)
    layout = (dp_for, cfg.balance_micro_batch, cfg.balance_grad_accum) if dp_for else None
    return run_straggler_loss(cost, balanced_group(run_dir, step), dp, micro_batch, grad_accum, steps), layout


def pack_shape(run_dir: str | Path, step: str) -> tuple[int, float]:
    """(tokens of the step's longest pack, Σ sample length² of its densest) — what sizes a micro-batch's
    activations and attention FLOPs for ``recompute: auto``. The length is the pack step's ``seq_len``
    (its config, read as the framework reads an upstream's), else the longest pack's; Σ length² comes from
    the first ``packs`` part, a sample bounded whatever the corpus, since every rank reads it."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from manifests.io import manifest_files
    from ovpipe.inputs import upstream_config

    files = manifest_files(run_dir, "packs", step)      # none: FileNotFoundError naming the folder
    t = pq.read_table(files[0], columns=["lengths", "total_tokens"])
    lengths = pc.list_flatten(t.column("lengths")).cast("int64")
    squares = pc.list_parent_indices(t.column("lengths"))
    per_pack = np.bincount(squares.to_numpy(), weights=pc.multiply(lengths, lengths).to_numpy().astype(float),
                           minlength=t.num_rows)
    try:
        seq_len = getattr(upstream_config(run_dir, step)[1], "seq_len", None)
    except (OSError, ValueError, KeyError):     # a packs folder no ovpipe step wrote
        seq_len = None
    return int(seq_len or pc.max(t.column("total_tokens")).as_py()), float(per_pack.max(initial=0.0))
