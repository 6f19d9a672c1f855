"""The one function that says how many tokens a sample occupies — shared by ``lengths``,
the packed-shard writer and ``pretrain``'s loader, so packing and training cannot disagree.

Image tokens (Qwen2-VL-style native resolution, as LLaVA-OneVision-1.5 uses with RICE-ViT):
the image is resized to ``(h', w')``, multiples of ``patch × merge`` (28 px), inside
``[min_pixels, max_pixels]`` while keeping its aspect ratio (``smart_resize``, identical to
``transformers.models.qwen2_vl.image_processing_qwen2_vl.smart_resize``, vectorised here);
the ViT sees ``(h'/patch)·(w'/patch)`` patches and the 2×2 merge hands the LLM
``(h'/patch)·(w'/patch)/merge²`` ``<|image_pad|>`` tokens, between ``<|vision_start|>`` and
``<|vision_end|>``::

    image_tokens = (h'/14)·(w'/14)/4 + 2

Text tokens: the conversation rendered by the tokenizer's own chat template, minus the image
tokens above. The template is rendered once with a sentinel caption and split into a prefix
and a suffix, so a sample's ids are ``prefix + tokenize(caption) + suffix`` with the image pads
expanded — one batched tokenizer call per slice instead of one template render per sample
(``tests/packing/test_tokens.py`` checks the result equals ``apply_chat_template`` exactly).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Sequence

import numpy as np

VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
SENTINEL = "\u2063OVPIPE_TEXT\u2063"

# Stage 1/1.5 use captions; stage 2 uses instruction data. The demo's instruct template turns
# the caption into a QA turn; real instruction data carries its own question/answer.
CAPTION_PROMPT = "Describe the image."
INSTRUCT_PROMPT = "What objects are in the image? Answer with a short sentence."


@dataclass(frozen=True)
class ImageTokenConfig:
    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    max_aspect_ratio: float = 200.0

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """Scalar version (same arithmetic as transformers' Qwen2-VL image processor)."""
    h, w = smart_resize_np(np.array([height]), np.array([width]), factor, min_pixels, max_pixels)
    return int(h[0]), int(w[0])


def smart_resize_np(height: np.ndarray, width: np.ndarray, factor: int = 28, min_pixels: int = 56 * 56,
                    max_pixels: int = 28 * 28 * 1280) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised ``smart_resize``: np.round is round-half-to-even, like Python's ``round``."""
    height = np.asarray(height, dtype=np.float64)
    width = np.asarray(width, dtype=np.float64)
    h_bar = np.round(height / factor) * factor
    w_bar = np.round(width / factor) * factor
    too_big = h_bar * w_bar > max_pixels
    too_small = (h_bar * w_bar < min_pixels) & ~too_big
    with np.errstate(divide="ignore", invalid="ignore"):
        beta_big = np.sqrt(height * width / max_pixels)
        beta_small = np.sqrt(min_pixels / (height * width))
        hb = np.maximum(factor, np.floor(height / beta_big / factor) * factor)
        wb = np.maximum(factor, np.floor(width / beta_big / factor) * factor)
        hs = np.ceil(height * beta_small / factor) * factor
        ws = np.ceil(width * beta_small / factor) * factor
    h_bar = np.where(too_big, hb, np.where(too_small, hs, h_bar))
    w_bar = np.where(too_big, wb, np.where(too_small, ws, w_bar))
    return h_bar.astype(np.int64), w_bar.astype(np.int64)


def image_grid(height, width, cfg: ImageTokenConfig = ImageTokenConfig()) -> tuple[np.ndarray, np.ndarray]:
    """Patch grid ``(h'/patch, w'/patch)`` the ViT sees for each image."""
    h, w = smart_resize_np(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    return h // cfg.patch_size, w // cfg.patch_size


def image_pad_tokens(height, width, cfg: ImageTokenConfig = ImageTokenConfig()) -> np.ndarray:
    """``<|image_pad|>`` tokens per image: (h'/patch)·(w'/patch)/merge²."""
    gh, gw = image_grid(height, width, cfg)
    return (gh * gw) // (cfg.merge_size ** 2)


def image_tokens(height, width, cfg: ImageTokenConfig = ImageTokenConfig()) -> np.ndarray:
    """Tokens an image occupies in the LLM sequence, vision start/end included."""
    return image_pad_tokens(height, width, cfg) + 2


def aspect_ok(height, width, cfg: ImageTokenConfig = ImageTokenConfig()) -> np.ndarray:
    h = np.asarray(height, dtype=np.float64)
    w = np.asarray(width, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.maximum(h, w) / np.minimum(h, w)
    return (np.minimum(h, w) > 0) & (r <= cfg.max_aspect_ratio)


# ---------------------------------------------------------------------------------------
# Text: the chat template, rendered once per (tokenizer, template) and split at the sentinel.

Template = Literal["caption", "instruct"]


def conversation(template: Template, text: str) -> list[dict]:
    prompt = CAPTION_PROMPT if template == "caption" else INSTRUCT_PROMPT
    return [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]},
        {"role": "assistant", "content": [{"type": "text", "text": text}]},
    ]


def load_tokenizer(path_or_name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path_or_name)


@dataclass(frozen=True)
class TemplateParts:
    """Token ids around the target text; the image sits at ``image_at`` inside ``prefix`` as
    one ``<|image_pad|>`` id, expanded to the image's pad count per sample."""

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    image_at: int          # index of the single <|image_pad|> in prefix
    image_pad_id: int
    target_suffix: int     # how many suffix ids are trained on (e.g. <|im_end|>)


@lru_cache(maxsize=16)
def _template_parts_cached(tok_id: int, template: str, tok) -> TemplateParts:
    msgs = conversation(template, SENTINEL)
    rendered = tok.apply_chat_template(msgs, tokenize=False)
    if SENTINEL not in rendered:
        raise ValueError("the tokenizer's chat template dropped the assistant text")
    pre, post = rendered.split(SENTINEL)
    if rendered.count(IMAGE_PAD) != 1:
        raise ValueError(f"chat template must render one {IMAGE_PAD} per image, got {rendered.count(IMAGE_PAD)}")
    prefix = tok(pre, add_special_tokens=False)["input_ids"]
    suffix = tok(post, add_special_tokens=False)["input_ids"]
    pad_id = tok.convert_tokens_to_ids(IMAGE_PAD)
    # Train on the end-of-turn token that closes the assistant turn (the model must learn to stop).
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    target_suffix = 1 if suffix and suffix[0] == end_id else 0
    return TemplateParts(tuple(prefix), tuple(suffix), prefix.index(pad_id), pad_id, target_suffix)


def template_parts(tok, template: Template) -> TemplateParts:
    return _template_parts_cached(id(tok), template, tok)


def text_token_counts(tok, texts: Sequence[str], template: Template) -> np.ndarray:
    """Text tokens of each sample (template included, image pads excluded), batched."""
    parts = template_parts(tok, template)
    ids = tok(list(texts), add_special_tokens=False)["input_ids"]
    # The image pad and the vision start/end markers are counted as image tokens.
    base = len(parts.prefix) - 1 - fixed_image_markers() + len(parts.suffix)
    return np.fromiter((base + len(x) for x in ids), dtype=np.int64, count=len(ids))


def fixed_image_markers() -> int:
    return 2  # <|vision_start|>, <|vision_end|> live in the template text; counted as image tokens


def encode_sample(tok, text: str, height: int, width: int, template: Template,
                  img_cfg: ImageTokenConfig = ImageTokenConfig(), max_tokens: int | None = None):
    """Token ids and loss mask of one sample, image pads expanded — what the trainer sees.

    Returns ``(ids: np.int32[n], loss_mask: np.uint8[n], n_image_pads)``. If ``max_tokens``
    is given and the sample is longer, the target text is truncated from the right so the
    sample is exactly ``max_tokens`` long (the ``lengths`` step's ``truncate`` policy).
    """
    parts = template_parts(tok, template)
    n_pad = int(image_pad_tokens(np.array([height]), np.array([width]), img_cfg)[0])
    text_ids = tok(text, add_special_tokens=False)["input_ids"]
    pre = list(parts.prefix)
    pre = pre[: parts.image_at] + [parts.image_pad_id] * n_pad + pre[parts.image_at + 1:]
    if max_tokens is not None:
        over = len(pre) + len(text_ids) + len(parts.suffix) - max_tokens
        if over > 0:
            if over > len(text_ids):
                raise ValueError("sample does not fit even with its text removed")
            text_ids = text_ids[: len(text_ids) - over]
    ids = np.array(pre + list(text_ids) + list(parts.suffix), dtype=np.int32)
    mask = np.zeros(len(ids), dtype=np.uint8)
    mask[len(pre): len(pre) + len(text_ids) + parts.target_suffix] = 1
    return ids, mask, n_pad
