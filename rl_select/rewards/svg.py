"""SVG reward: 0.5 · SSIM of the rendered images + 0.25 · token Jaccard + 0.25 · structure.

Rendering is sandboxed by construction: documents over ``MAX_SVG_BYTES``, with a DOCTYPE or
ENTITY, or referencing anything outside themselves (``href``/``xlink:href``/``url(…)`` that is
not a ``#fragment``, ``<image>``, ``<foreignObject>``, ``<script>``, CSS ``@import``,
``<?xml-stylesheet?>``) are rejected before
rendering; cairosvg runs with ``unsafe=False`` (no external files, no XML entities) and renders to a fixed 128×128 canvas. Structure = similarity of the element-tag sequences.
"""
from __future__ import annotations

import difflib
import io
import re

MAX_SVG_BYTES = 200_000
SIZE = 128
_EXTERNAL = re.compile(r"""(?:href|src)\s*=\s*["'](?!#)|url\(\s*['"]?(?!#)|<\s*(?:image|foreignObject|script)\b|<!DOCTYPE|<!ENTITY|@import|<\?xml-stylesheet""", re.I)


class UnsafeSVG(ValueError):
    pass


def extract_svg(text: str) -> str:
    m = re.search(r"<svg\b.*?</svg>", text or "", re.S | re.I) or re.search(r"<svg\b[^>]*/>", text or "", re.I)
    if not m:
        raise ValueError("no <svg>…</svg> in the response")
    return m.group(0)


def check_svg(svg: str) -> None:
    if len(svg.encode()) > MAX_SVG_BYTES:
        raise UnsafeSVG(f"SVG larger than {MAX_SVG_BYTES} bytes")
    if _EXTERNAL.search(svg):
        raise UnsafeSVG("SVG references external resources")


def render(svg: str):
    import cairosvg
    import numpy as np
    from PIL import Image

    check_svg(svg)
    png = cairosvg.svg2png(bytestring=svg.encode(), output_width=SIZE, output_height=SIZE, unsafe=False,
                           background_color="white")
    return np.asarray(Image.open(io.BytesIO(png)).convert("L"), dtype=np.float64) / 255.0


def tags(svg: str) -> list[str]:
    return [t.lower() for t in re.findall(r"<\s*([a-zA-Z][\w:-]*)", svg)]


def svg_reward(response: str, gt: str, extra: dict):
    from skimage.metrics import structural_similarity

    from rl_select.rewards.extract import parse_response
    from rl_select.rewards.rules import jaccard

    gold = extract_svg(gt)
    gold_img = render(gold)                      # a broken reference is an error, not the response's fault
    pred = parse_response(extract_svg, response)
    pred_img = parse_response(render, pred)      # unsafe, oversized or malformed → bad_response
    ssim = float(structural_similarity(pred_img, gold_img, data_range=1.0))
    tok = jaccard(set(re.findall(r"[\w.#-]+", pred)), set(re.findall(r"[\w.#-]+", gold)))
    struct = difflib.SequenceMatcher(a=tags(pred), b=tags(gold)).ratio()
    score = 0.5 * max(ssim, 0.0) + 0.25 * tok + 0.25 * struct
    return score, score >= 0.9
