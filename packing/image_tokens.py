"""Image tokens at native resolution (Qwen2-VL, as LLaVA-OneVision-1.5 uses with RICE-ViT).

The image is resized to ``(h', w')``, multiples of ``patch × merge`` (28 px), inside
``[min_pixels, max_pixels]`` keeping its aspect ratio (``smart_resize``, identical to
``transformers.models.qwen2_vl.image_processing_qwen2_vl.smart_resize``, vectorised here); the ViT
sees ``(h'/patch)·(w'/patch)`` patches and the 2×2 merge hands the LLM ``(h'/14)·(w'/14)/4``
``<|image_pad|>`` tokens, between ``<|vision_start|>`` and ``<|vision_end|>``::

    image_tokens = (h'/14)·(w'/14)/4 + 2
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"


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
