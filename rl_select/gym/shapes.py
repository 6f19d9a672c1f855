"""Coloured shapes drawn with PIL, no assets: the picture tiles of the VLM-Gym boards and the concepts of
the demo corpus (15 colours × 15 shapes)."""
from __future__ import annotations

import math

COLORS = {
    "red": (220, 40, 40), "orange": (245, 140, 20), "yellow": (235, 210, 30), "lime": (150, 220, 40),
    "green": (30, 150, 60), "teal": (20, 150, 150), "cyan": (60, 210, 230), "blue": (40, 80, 220),
    "navy": (20, 30, 110), "purple": (130, 50, 180), "magenta": (220, 40, 190), "pink": (250, 160, 190),
    "brown": (130, 80, 40), "black": (20, 20, 20), "gray": (128, 128, 128),
}
SHAPES = ["circle", "square", "triangle", "diamond", "pentagon", "hexagon", "octagon", "star", "cross",
          "ring", "bar", "pillar", "crescent", "semicircle", "arrow"]


def _regular_polygon(cx, cy, r, n, rot=0.0):
    return [(cx + r * math.cos(rot + 2 * math.pi * i / n), cy + r * math.sin(rot + 2 * math.pi * i / n))
            for i in range(n)]


def draw_shape(draw, shape: str, color, cx: float, cy: float, r: float) -> None:
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color)
    elif shape == "square":
        draw.rectangle([cx - r * 0.8, cy - r * 0.8, cx + r * 0.8, cy + r * 0.8], fill=color)
    elif shape == "triangle":
        draw.polygon(_regular_polygon(cx, cy, r, 3, -math.pi / 2), fill=color)
    elif shape == "diamond":
        draw.polygon(_regular_polygon(cx, cy, r, 4, 0), fill=color)
    elif shape == "pentagon":
        draw.polygon(_regular_polygon(cx, cy, r, 5, -math.pi / 2), fill=color)
    elif shape == "hexagon":
        draw.polygon(_regular_polygon(cx, cy, r, 6, 0), fill=color)
    elif shape == "octagon":
        draw.polygon(_regular_polygon(cx, cy, r, 8, math.pi / 8), fill=color)
    elif shape == "star":
        pts = []
        for i in range(10):
            rr = r if i % 2 == 0 else r * 0.42
            a = -math.pi / 2 + math.pi * i / 5
            pts.append((cx + rr * math.cos(a), cy + rr * math.sin(a)))
        draw.polygon(pts, fill=color)
    elif shape == "cross":
        w = r * 0.32
        draw.rectangle([cx - r, cy - w, cx + r, cy + w], fill=color)
        draw.rectangle([cx - w, cy - r, cx + w, cy + r], fill=color)
    elif shape == "ring":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], outline=color, width=max(2, int(r * 0.3)))
    elif shape == "bar":
        draw.rectangle([cx - r, cy - r * 0.3, cx + r, cy + r * 0.3], fill=color)
    elif shape == "pillar":
        draw.rectangle([cx - r * 0.3, cy - r, cx + r * 0.3, cy + r], fill=color)
    elif shape == "crescent":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color)
        draw.ellipse([cx - r * 0.4, cy - r * 1.05, cx + r * 1.4, cy + r * 0.95], fill=(235, 235, 230))
    elif shape == "semicircle":
        draw.pieslice([cx - r, cy - r, cx + r, cy + r], 180, 360, fill=color)
    elif shape == "arrow":
        w = r * 0.25
        draw.rectangle([cx - r, cy - w, cx + r * 0.2, cy + w], fill=color)
        draw.polygon([(cx + r * 0.2, cy - r * 0.7), (cx + r, cy), (cx + r * 0.2, cy + r * 0.7)], fill=color)
    else:
        raise ValueError(f"unknown shape {shape!r}")
