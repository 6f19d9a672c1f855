"""``lengths``: the exact tokens each sample occupies in training (see ``packing.tokens``).

    text_tokens  = chat-template tokens around and of the target text (tokenizer's own template)
    image_tokens = (h'/14)·(w'/14)/2² + 2     (native resolution, smart_resize, vision start/end)
    total_tokens = text_tokens + image_tokens

computed from width/height in ``samples`` — no image is decoded. Status per row: ``ok``;
``too_long`` (total > seq_len; with ``on_too_long: truncate`` the target text is cut so the
sample is exactly ``seq_len`` and the status is ``truncated``; a sample whose image alone
does not fit stays ``too_long``); ``bad_aspect_ratio`` (> 200:1, which the image processor
rejects); and every non-ok ``samples`` status carried over with zero tokens. Counted in stats.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from ovpipe.step import Step, TaskContext


@dataclass
class LengthsConfig:
    tokenizer: str = ""                     # HF tokenizer path or name (Qwen3's in production)
    template: Literal["caption", "instruct"] = "caption"
    seq_len: int = 8192
    on_too_long: Literal["drop", "truncate"] = "drop"
    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    batch_size: int = 8192

    def __post_init__(self):
        if not self.tokenizer:
            raise ValueError("tokenizer: give a Hugging Face tokenizer path or name")
        if self.seq_len < 64:
            raise ValueError(f"seq_len must be >= 64, got {self.seq_len}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) > max_pixels ({self.max_pixels})")

    def image_cfg(self):
        from packing.tokens import ImageTokenConfig

        return ImageTokenConfig(self.patch_size, self.merge_size, self.min_pixels, self.max_pixels)


def compute_lengths(samples, cfg: LengthsConfig, tok, stats=None) -> dict:
    """``samples`` (pyarrow Table) → columns of the ``lengths`` manifest."""
    from packing.tokens import aspect_ok, image_tokens, text_token_counts

    n = samples.num_rows
    sid = samples.column("sample_id").to_pylist()
    src = samples.column("source").to_pylist()
    status = samples.column("status").to_pylist()
    error = samples.column("error").to_pylist()
    w = samples.column("width").to_numpy(zero_copy_only=False).astype(np.int64)
    h = samples.column("height").to_numpy(zero_copy_only=False).astype(np.int64)
    caps = samples.column("caption").to_pylist()
    text_t = np.zeros(n, np.int64)
    img_t = np.zeros(n, np.int64)
    ok = np.array([s == "ok" for s in status], dtype=bool)
    okasp = aspect_ok(h, w, cfg.image_cfg())
    for i in np.flatnonzero(ok & ~okasp):
        status[i], error[i] = "bad_aspect_ratio", f"{w[i]}x{h[i]} exceeds 200:1"
    todo = np.flatnonzero(ok & okasp)
    img_t[todo] = image_tokens(h[todo], w[todo], cfg.image_cfg())
    for s in range(0, len(todo), cfg.batch_size):
        idx = todo[s:s + cfg.batch_size]
        text_t[idx] = text_token_counts(tok, [caps[i] for i in idx], cfg.template)
    total = text_t + img_t
    for i in todo[total[todo] > cfg.seq_len]:
        if cfg.on_too_long == "truncate" and img_t[i] + (text_t[i] - _target_len(tok, caps[i])) < cfg.seq_len:
            text_t[i] = cfg.seq_len - img_t[i]
            total[i] = cfg.seq_len
            status[i], error[i] = "truncated", "target text truncated to fit seq_len"
        else:
            status[i], error[i] = "too_long", f"{total[i]} tokens > seq_len {cfg.seq_len}"
    if stats is not None:
        for s in status:
            stats.inc(f"status/{s}")
        okm = np.array([s in ("ok", "truncated") for s in status])
        stats.inc("tokens/text", int(text_t[okm].sum()))
        stats.inc("tokens/image", int(img_t[okm].sum()))
    return {"sample_id": sid, "source": src, "text_tokens": text_t.astype(np.int32),
            "image_tokens": img_t.astype(np.int32), "total_tokens": total.astype(np.int32),
            "status": status, "error": error}


def _target_len(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


def run(cfg: LengthsConfig, task: TaskContext) -> None:
    from packing.tokens import load_tokenizer

    samples = task.read_input_slice("samples", columns=["sample_id", "source", "width", "height", "caption",
                                                        "status", "error"])
    tok = load_tokenizer(cfg.tokenizer)
    with task.stats.timer("lengths"):
        cols = compute_lengths(samples, cfg, tok, task.stats)
    task.stats.inc("samples", samples.num_rows)
    task.write_part("lengths", cols)


STEP = Step("lengths", LengthsConfig, run, inputs=("samples",), outputs=("lengths",),
            description="exact multimodal token length per sample")
