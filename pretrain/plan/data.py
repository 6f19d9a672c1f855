"""What the stage's data is, and what one micro-batch of it costs in three forms.

The data comes as a run's ``lengths`` step (every sample's tokens and image tokens), a run's ``pack`` step (its
packs and the lengths of the samples in them), or a sample count with a token distribution (``--samples``,
``--tokens-per-sample`` mean, ``--tokens-sigma`` of a log-normal; 0: every sample the mean). A bounded draw of
lengths (``DRAW``, seeded) stands for the distribution, so the plan's memory does not grow with the corpus.

The three forms of the same samples (``FORMS``), as one micro-batch of ``micro_batch`` slots:

- ``packed``: ovpipe's packs, ``seq_len`` tokens each, ``PACK_FILL`` of them samples (the rest padding), causal
  attention per sample;
- ``unpacked``: the official trainer without offline packing (``OFFLINE_PACKED_DATA`` unset): its task
  encoder's ``batch`` pads the micro-batch's samples to the longest of them, capped at ``seq_len``, and megatron
  runs it with variable sequence lengths. At micro-batch 1 that is one sample at its own length, no padding;
  at micro-batch m, m × the longest of m samples;
- ``padded``: every sample padded to ``seq_len`` (a fixed-length trainer: megatron with
  ``variable_seq_lengths`` off, as TP communication overlap requires), causal attention over the whole length.

``padding_share``: the share of the micro-batch's model FLOPs spent on positions that are not samples.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pretrain.plan.shapes import IMAGE_SHARE, PACK_FILL, PATCHES_PER_IMAGE

DRAW = 20_000
FORMS = ("packed", "unpacked", "padded")


@dataclass(frozen=True)
class Data:
    samples: float             # samples in one pass
    lengths: np.ndarray        # a draw of sample lengths in tokens
    image_share: float         # image tokens / tokens
    source: str
    packs: int | None = None   # a pack step's own pack count

    @property
    def mean(self) -> float:
        return float(self.lengths.mean())

    def slots(self, form: str, seq_len: int) -> float:
        """Global-batch slots one pass fills: packs, or samples."""
        if form != "packed":
            return self.samples
        return self.packs if self.packs else math.ceil(self.samples * self.mean / (seq_len * PACK_FILL))

    def micro(self, form: str, seq_len: int, micro_batch: int) -> tuple[dict, float]:
        """(``BatchPrep.stats`` of one micro-batch, its tokens that are samples)."""
        lens = np.minimum(self.lengths, seq_len).astype(float)
        if form == "packed":
            tokens = micro_batch * seq_len
            useful = tokens * PACK_FILL
            attn_sq = useful * float((lens ** 2).mean() / lens.mean())
        elif form == "unpacked":
            groups = lens[:len(lens) // micro_batch * micro_batch].reshape(-1, micro_batch)
            longest = groups.max(axis=1)
            tokens = micro_batch * float(longest.mean())
            useful = float(groups.sum(axis=1).mean())
            attn_sq = micro_batch * float((longest ** 2).mean())
        elif form == "padded":
            tokens = micro_batch * seq_len
            useful = micro_batch * float(lens.mean())
            attn_sq = micro_batch * float(seq_len) ** 2
        else:
            raise ValueError(f"form must be one of {FORMS}, got {form!r}")
        merged = self.image_share * useful
        return ({"tokens": tokens, "attn_sq": attn_sq, "vit_tokens": 4 * merged,
                 "vit_sq": 4 * merged * PATCHES_PER_IMAGE, "merged": merged}, useful)

    def padding_share(self, recipe, trainable: str, form: str, seq_len: int, micro_batch: int) -> float:
        """Share of a micro-batch's model FLOPs spent on padding: against the same samples' FLOPs alone."""
        from pretrain.trainer.flops import model_flops

        stats, useful = self.micro(form, seq_len, micro_batch)
        lens = np.minimum(self.lengths, seq_len).astype(float)
        bare = dict(stats, tokens=useful, attn_sq=useful * float((lens ** 2).mean() / lens.mean()))
        return 1.0 - model_flops(recipe, trainable, bare, "none")[0] / model_flops(recipe, trainable, stats, "none")[0]


def from_samples(samples: float, mean: float, sigma: float = 0.0, image_share: float = IMAGE_SHARE) -> Data:
    """``samples`` of a log-normal length distribution with this mean and log-space ``sigma``."""
    if samples <= 0 or mean <= 0 or sigma < 0:
        raise ValueError(f"samples and tokens per sample must be > 0 and sigma >= 0, got {samples}, {mean}, {sigma}")
    if sigma == 0:
        lengths = np.full(DRAW, float(mean))
    else:
        rng = np.random.default_rng(0)
        lengths = rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma, DRAW)
        lengths *= mean / lengths.mean()
    return Data(float(samples), np.maximum(lengths, 1.0), image_share,
                f"{samples:,.0f} samples of {mean:,.0f} tokens on average" + (f" (log-normal, σ {sigma})" if sigma
                                                                               else ""))


def from_run(run_dir, step: str, image_share: float | None = None) -> Data:
    """A run's ``lengths`` step (its ok samples) or ``pack`` step (its packs and their samples): counts summed
    over every part, lengths drawn from at most ``DRAW`` rows spread over the parts."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from manifests.io import manifest_files

    try:
        files, kind = manifest_files(run_dir, "packs", step), "packs"
    except FileNotFoundError:
        try:
            files, kind = manifest_files(run_dir, "lengths", step), "lengths"
        except FileNotFoundError:
            raise FileNotFoundError(f"{run_dir}/{step}: neither a 'packs' nor a 'lengths' manifest — give a pack "
                                    f"or lengths step (--data)") from None
    per_file = max(1, DRAW // len(files))
    samples = packs = 0
    tokens = images = 0.0
    draw = []
    for f in files:
        if kind == "packs":
            t = pq.read_table(f, columns=["lengths"])
            lens = pc.list_flatten(t.column("lengths")).to_numpy(zero_copy_only=False)
            packs += t.num_rows
        else:
            t = pq.read_table(f, columns=["total_tokens", "image_tokens", "status"])
            t = t.filter(pc.equal(t.column("status"), "ok"))
            lens = t.column("total_tokens").to_numpy(zero_copy_only=False)
            images += float(pc.sum(t.column("image_tokens")).as_py() or 0)
        samples += len(lens)
        tokens += float(lens.sum())
        draw.append(lens[:: max(1, len(lens) // per_file)][:per_file])
    if not samples:
        raise ValueError(f"{run_dir}/{step}: no samples in its {kind} manifest")
    share = image_share if image_share is not None else (images / tokens if kind == "lengths" and tokens else
                                                         IMAGE_SHARE)
    return Data(float(samples), np.concatenate(draw).astype(float), share,
                f"{run_dir}/{step}: {samples:,} samples" + (f" in {packs:,} packs" if packs else ""),
                packs or None)
