"""``lengths``: the exact tokens each conversation occupies in training (see ``packing.tokens``).

    text_tokens   = the conversation rendered by the tokenizer's own chat template, images excluded
    image_tokens  = Σ_images (h'/14)·(w'/14)/2² + 2     (native resolution, smart_resize, vision start/end)
    total_tokens  = text_tokens + image_tokens
    target_tokens = tokens the loss is taken on: every assistant turn's text + its end-of-turn token
    turns_kept    = turns trained on (all of them, unless ``truncate`` cut trailing pairs)
    images        = images of the turns trained on
    vit_sq        = Σ over them of (tower tokens)², tower tokens = (h'/14)·(w'/14) + 1 (a class token):
                    with the token counts, what a pack's cost needs (``packing.cost``)

computed from the ``samples`` manifests of ``samples_steps`` (concatenated in that order, each in
canonical order; this rank takes its contiguous slice) — no image is decoded, only the sizes in
``images`` are read. A caption pair (``[user "<image>", assistant caption]``) is trained as
``"<image>" + caption_prompt`` → caption, so stage 1.5 sees "<image>Describe the image." as before.

Status per row, counted in stats (``status/<s>``): ``ok``; ``bad_aspect_ratio`` (some image of the
sample beyond 200:1, which the image processor rejects); ``too_long`` (total > seq_len); with
``on_too_long: truncate`` a long conversation instead keeps the most whole leading turn pairs that
fit (a pair = the user turn(s) + the assistant turn answering them; the images of dropped turns go
with them, so no image is ever cut) and becomes ``truncated`` — ``too_long`` if not even the first
pair fits; a conversation the template cannot render as trained (``image_mismatch``, ...) gets that
status; every non-ok ``samples`` status is carried over. A ``too_long`` row keeps the token counts
of the whole conversation (how long it is) with ``turns_kept = 0``; every other non-packable row
carries zero tokens. ``pack`` packs ``ok`` and ``truncated`` rows only.

``caption_source`` (``raw`` | ``recaption:<lang>`` | ``both[:<lang>]``, ``packing.caption_source``) trains
caption pairs on the ``recaption`` step's VLM captions instead of, or as well as, the raw alt-text; every
row names the ingested sample it comes from in ``source_sample_id`` (itself unless recaptioned).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from ovpipe.config import check_local_path, check_step_folder, looks_like_local_path
from ovpipe.inputs import Input
from ovpipe.step import Step, TaskContext, slice_bounds

SAMPLE_COLUMNS = ["sample_id", "source", "status", "error", "conversation", "images"]


@dataclass
class LengthsConfig:
    tokenizer: str = ""                     # HF tokenizer path or name (Qwen's in production)
    samples_steps: list[str] = field(default_factory=lambda: ["ingest"])  # ingest step folders to read
    caption_prompt: str = "Describe the image."  # appended to a caption pair's "<image>" user turn
    seq_len: int = 8192  # tokens per packed sequence; a longer sample is handled as on_too_long says
    # drop: a too_long row; truncate: keep the leading whole turn pairs that fit
    on_too_long: Literal["drop", "truncate"] = "drop"
    patch_size: int = 14  # the vision tower's patch side in pixels (RICE-ViT: 14)
    merge_size: int = 2  # patches merged per side into one LLM token (2: a 2x2 merge)
    min_pixels: int = 56 * 56  # an image is resized up to at least this many pixels
    max_pixels: int = 28 * 28 * 1280  # an image is resized down to at most this many pixels
    # conversations per batched count: a batch's distinct words are looked up once, so larger batches
    # amortise that (32K vs 8K: +21 % samples/s on unique captions, +0.1 GiB per task)
    batch_size: int = 32768
    # Which caption a caption pair trains on (packing.caption_source): raw | recaption:<lang> | both[:<lang>]
    caption_source: str = "raw"
    recaption_step: str = "recaption"       # step folder of the `captions` manifest
    # caption_source both: the raw and the recaption as two samples, or as two turns of one
    both_as: Literal["two_samples", "two_turns"] = "two_samples"
    missing_recaption: Literal["raw", "status"] = "raw"   # a pair with no ok recaption: keep raw / no_recaption row
    recaption_prompts: dict[str, str] = field(default_factory=lambda: {
        "en": "Describe the image in detail.", "zh": "请详细描述这张图片。"})  # the user turn of a recaptioned pair

    def __post_init__(self):
        if not self.tokenizer:
            raise ValueError("tokenizer: give a Hugging Face tokenizer path or name")
        if not self.samples_steps or not all(isinstance(s, str) and s for s in self.samples_steps):
            raise ValueError(f"samples_steps must name at least one ingest step folder, got {self.samples_steps!r}")
        for s in self.samples_steps:
            check_step_folder("samples_steps", s)
        if len(set(self.samples_steps)) != len(self.samples_steps):
            raise ValueError(f"samples_steps names a step twice: {self.samples_steps!r}")
        if self.seq_len < 64:
            raise ValueError(f"seq_len must be >= 64, got {self.seq_len}")
        if self.on_too_long not in ("drop", "truncate"):
            raise ValueError(f"on_too_long must be drop or truncate, got {self.on_too_long!r}")
        for name in ("patch_size", "merge_size", "min_pixels", "batch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) > max_pixels ({self.max_pixels})")
        from packing.caption_source import parse

        mode, lang = parse(self.caption_source)
        if mode != "raw":
            check_step_folder("recaption_step", self.recaption_step)
            if lang not in self.recaption_prompts:
                raise ValueError(f"recaption_prompts has no prompt for {lang!r} (caption_source {self.caption_source!r})")
        if self.both_as not in ("two_samples", "two_turns"):
            raise ValueError(f"both_as must be two_samples or two_turns, got {self.both_as!r}")
        if self.missing_recaption not in ("raw", "status"):
            raise ValueError(f"missing_recaption must be raw or status, got {self.missing_recaption!r}")

    def check(self, run_dir: Path) -> None:
        """Before any work: a tokenizer given as a local path exists (the inputs are checked from ``STEP.inputs``)."""
        if looks_like_local_path(self.tokenizer):
            check_local_path("tokenizer", self.tokenizer)

    def image_cfg(self):
        from packing.tokens import ImageTokenConfig

        return ImageTokenConfig(self.patch_size, self.merge_size, self.min_pixels, self.max_pixels)


def slice_files(task: TaskContext, steps: list[str]) -> tuple[list, list[int], int, int]:
    """The ``samples`` parts of ``steps`` (step by step, in that order), rows per step (from the footers)
    and this rank's [lo, hi) of their concatenation."""
    import pyarrow.parquet as pq

    files, sizes = [], []
    for step in steps:
        try:
            parts = task.input_files("samples", step)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{e} (lengths.samples_steps names {step!r})") from None
        files += parts
        sizes.append(sum(pq.ParquetFile(f).metadata.num_rows for f in parts))
    lo, hi = slice_bounds(sum(sizes), task.rank, task.world_size)
    return files, sizes, lo, hi


def iter_slice_batches(task: TaskContext, steps: list[str], columns: list[str] | None = None,
                       batch_rows: int = 65536):
    """This rank's contiguous slice of the ``samples`` manifests of ``steps`` concatenated in that
    order (each in canonical order), streamed as record batches (``manifests.io.iter_parts`` in
    ``folders`` order: row counts from the footers, only the slice's row groups read), so a task never
    holds the corpus (reading every manifest whole and then slicing it would cost every task the whole
    corpus; the per-task figures are in docs/scale_bench.md)."""
    from manifests.io import iter_parts

    files, _, lo, hi = slice_files(task, steps)
    return iter_parts(files, "samples", columns, lo, hi, order="folders", batch_rows=batch_rows,
                      spill_dir=task.step_dir)


def read_samples(task: TaskContext, steps: list[str], columns: list[str] | None = None):
    """This rank's contiguous slice of the ``samples`` manifests of ``steps`` concatenated in that order
    (each in canonical order), as one table (``iter_slice_batches``)."""
    import pyarrow as pa

    from manifests.schemas import schema_for

    schema = schema_for("samples")
    out = pa.schema([schema.field(c) for c in (columns or schema.names)])
    return pa.Table.from_batches(list(iter_slice_batches(task, steps, columns)), schema=out)


def training_samples(task: TaskContext, cfg: LengthsConfig, columns: list[str] | None = None):
    """``read_samples`` of ``cfg.samples_steps`` with ``cfg.caption_source`` applied (recaptioned caption
    pairs, ``packing.caption_source``) and a ``source_sample_id`` column — what ``lengths`` measures and
    ``pack``'s shard writer encodes, so the two read the same conversations."""
    from packing import caption_source

    return caption_source.apply(task, read_samples(task, cfg.samples_steps, columns), cfg)


def compute_lengths(samples, cfg: LengthsConfig, tok, stats=None, progress=None) -> dict:
    """``samples`` (pyarrow Table with ``SAMPLE_COLUMNS``) → columns of the ``lengths`` manifest."""
    from packing.tokens import Conversations, aspect_ok, codec_for

    n = samples.num_rows
    img_cfg = cfg.image_cfg()
    status = samples.column("status").to_pylist()
    error = samples.column("error").to_pylist()
    convs = Conversations.from_arrow(samples.column("conversation"), samples.column("images"))
    codec = codec_for(tok)
    cols = {k: np.zeros(n, np.int64) for k in ("text", "image", "total", "target", "kept")}
    image_hi = np.asarray(convs.image_hi, np.int64).copy()     # a truncated row keeps its kept turns' images

    ok = np.array([s == "ok" for s in status], bool)
    bad_img = ~aspect_ok(convs.heights, convs.widths, img_cfg)
    n_img = convs.image_hi - convs.image_lo
    owner = np.repeat(np.arange(n), n_img)
    bad_rows = np.zeros(n, bool)
    bad_rows[owner[bad_img]] = True
    for i in np.flatnonzero(ok & bad_rows):
        k = int(np.flatnonzero(bad_img[convs.image_lo[i]:convs.image_hi[i]])[0])
        h, w = convs.heights[convs.image_lo[i] + k], convs.widths[convs.image_lo[i] + k]
        status[i], error[i] = "bad_aspect_ratio", f"image {k}: {w}x{h} is beyond {img_cfg.max_aspect_ratio:g}:1"
    todo = np.flatnonzero(ok & ~bad_rows)
    for s in range(0, len(todo), cfg.batch_size):
        rows = todo[s:s + cfg.batch_size]
        c = codec.count(convs, img_cfg, cfg.caption_prompt, rows=rows)
        _store(cols, rows, c)
        cols["kept"][rows] = (convs.turn_hi - convs.turn_lo)[rows]
        for j in np.flatnonzero([x is not None for x in c.status]):
            status[rows[j]], error[rows[j]] = c.status[j], c.error[j]
        long = rows[np.array([x is None for x in c.status], bool) & (c.total > cfg.seq_len)]
        for i in long:
            status[i], error[i] = "too_long", f"{cols['total'][i]} tokens > seq_len {cfg.seq_len}"
        if cfg.on_too_long == "truncate" and len(long):
            kept = codec.fit(convs, long, cfg.seq_len, img_cfg, cfg.caption_prompt)
            fits = kept > 0
            for i in long[~fits]:
                error[i] += "; not even the first turn pair fits"
            if fits.any():
                rows_t, kept_t = long[fits], kept[fits]
                i_hi = convs.image_lo[rows_t] + np.array(
                    [sum(t.count("<image>") for t in convs.texts[convs.turn_lo[i]:convs.turn_lo[i] + k])
                     for i, k in zip(rows_t.tolist(), kept_t.tolist())], np.int64)
                c2 = codec.count(convs, img_cfg, cfg.caption_prompt, convs.turn_lo[rows_t] + kept_t, i_hi, rows_t)
                _store(cols, rows_t, c2)
                image_hi[rows_t] = i_hi
                for i, k in zip(rows_t.tolist(), kept_t.tolist()):
                    n_turns = int(convs.turn_hi[i] - convs.turn_lo[i])
                    status[i] = "truncated"
                    error[i] = f"kept {k} of {n_turns} turns (whole turn pairs) to fit seq_len {cfg.seq_len}"
                    cols["kept"][i] = k
                if stats is not None:
                    stats.inc("turns/dropped", int(((convs.turn_hi - convs.turn_lo)[rows_t] - kept_t).sum()))
        if progress is not None:
            progress(len(rows))
    if progress is not None:
        progress(n - len(todo))
    measured = np.array([s in ("ok", "truncated", "too_long") for s in status], bool)
    cols["images"], cols["vit_sq"] = tower_counts(convs, image_hi, img_cfg)
    for k in cols:
        cols[k][~measured] = 0
    cols["kept"][np.array([s == "too_long" for s in status], bool)] = 0  # nothing of it is trained on
    if stats is not None:  # tokens of what will be trained on
        for s in status:
            stats.inc(f"status/{s}")
        packable = np.array([s in ("ok", "truncated") for s in status], bool)
        for k in ("text", "image", "target"):
            stats.inc(f"tokens/{k}", int(cols[k][packable].sum()))
    source_ids = samples.column("source_sample_id") if "source_sample_id" in samples.column_names \
        else samples.column("sample_id")
    return {"sample_id": samples.column("sample_id").to_pylist(), "source_sample_id": source_ids.to_pylist(),
            "source": samples.column("source").to_pylist(),
            "text_tokens": cols["text"].astype(np.int32), "image_tokens": cols["image"].astype(np.int32),
            "total_tokens": cols["total"].astype(np.int32), "target_tokens": cols["target"].astype(np.int32),
            "turns_kept": cols["kept"].astype(np.int32), "images": cols["images"].astype(np.int32),
            "vit_sq": cols["vit_sq"], "status": status, "error": error}


def tower_counts(convs, image_hi: np.ndarray, img_cfg) -> tuple[np.ndarray, np.ndarray]:
    """Per conversation, over its images ``image_lo .. image_hi`` (the trained ones): how many, and
    Σ (tower tokens)² — the vision tower's attention count for ``packing.cost``. An image without a size
    counts 0 (its row is ``bad_aspect_ratio``, zeroed by the caller)."""
    from packing.cost import image_stats
    from packing.tokens import image_grid

    n = len(image_hi)
    lo = np.asarray(convs.image_lo, np.int64)
    per = np.maximum(np.asarray(image_hi, np.int64) - lo, 0)
    idx = np.repeat(lo - (np.cumsum(per) - per), per) + np.arange(int(per.sum()), dtype=np.int64)
    h, w = np.asarray(convs.heights, np.int64)[idx], np.asarray(convs.widths, np.int64)[idx]
    sized = np.minimum(h, w) > 0
    gh, gw = image_grid(np.where(sized, h, 28), np.where(sized, w, 28), img_cfg)
    return image_stats(np.where(sized, gh * gw, 0), np.repeat(np.arange(n), per), n)


def _store(cols: dict, rows: np.ndarray, c) -> None:
    cols["text"][rows], cols["image"][rows] = c.text, c.image
    cols["total"][rows], cols["target"][rows] = c.total, c.target


def run(cfg: LengthsConfig, task: TaskContext) -> None:
    """This rank's slice → its ``lengths`` part. When the slice lies in one ``samples`` step and captions
    are raw, its rows come in canonical order, so the part is streamed out batch by batch
    (``PartWriter``: ``write_part``'s bytes) and the task holds one batch, not its slice's output
    (4.5 GiB per task at 85M / 8 tasks). Otherwise (a slice over two steps, or recaptions, whose derived
    ids are not in order) the rows are kept as Arrow tables and sorted once at the end."""
    import pyarrow as pa

    from manifests.io import as_manifest_table
    from packing import caption_source
    from packing.tokens import load_tokenizer

    tok = load_tokenizer(cfg.tokenizer)
    _, sizes, lo, hi = slice_files(task, cfg.samples_steps)
    raw = caption_source.parse(cfg.caption_source)[0] == "raw"
    if not raw:                                                # recaptions are joined over the slice
        batches = [training_samples(task, cfg, SAMPLE_COLUMNS)]
    else:                                                      # raw: one batch of samples at a time
        batches = (caption_source.apply(task, pa.Table.from_batches([b]), cfg)
                   for b in iter_slice_batches(task, cfg.samples_steps, SAMPLE_COLUMNS))
    starts = np.cumsum([0, *sizes])
    one_step = raw and any(a <= lo and hi <= b for a, b in zip(starts[:-1], starts[1:]))
    n, kept = 0, []
    with task.stats.timer("lengths"), task.progress(hi - lo, unit="samples") as bar, \
            (task.part_writer("lengths") if one_step else contextlib.nullcontext()) as out:
        for samples in batches:
            got = as_manifest_table(compute_lengths(samples, cfg, tok, task.stats, progress=bar.update), "lengths")
            if out is not None:
                out.write(got)
            else:
                kept.append(got)
            n += samples.num_rows
    task.stats.inc("samples", n)
    if not one_step:
        task.write_part("lengths", pa.concat_tables(kept) if kept else as_manifest_table(
            compute_lengths(caption_source.apply(task, read_samples(task, cfg.samples_steps, SAMPLE_COLUMNS), cfg),
                            cfg, tok, task.stats), "lengths"))


STEP = Step("lengths", LengthsConfig, run, outputs=("lengths",), check=LengthsConfig.check,
            inputs={"samples": "samples_steps",
                    "captions": Input("recaption_step", when=lambda c: c.caption_source != "raw")},
            description="exact multimodal token length and loss tokens per conversation")
