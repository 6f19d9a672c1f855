"""Observations: the board drawn with PIL (no assets); picture tiles are procedurally drawn shapes."""
from __future__ import annotations

import io

CELL = 48
TILE_COLORS = {0: (205, 193, 180), 2: (238, 228, 218), 4: (237, 224, 200), 8: (242, 177, 121), 16: (245, 149, 99),
               32: (246, 124, 95), 64: (246, 94, 59), 128: (237, 207, 114), 256: (237, 204, 97), 512: (237, 200, 80),
               1024: (237, 197, 63), 2048: (237, 194, 46)}


def render(state: dict) -> bytes:
    from PIL import Image, ImageDraw

    from rl_select.gym.shapes import COLORS, SHAPES, draw_shape

    b = state["board"]
    H, W = len(b), len(b[0])
    im = Image.new("RGB", (W * CELL + 8, H * CELL + 8), (187, 173, 160))
    d = ImageDraw.Draw(im)
    palette = list(COLORS.values())
    for r in range(H):
        for c in range(W):
            v = b[r][c]
            x0, y0 = 4 + c * CELL, 4 + r * CELL
            box = [x0 + 2, y0 + 2, x0 + CELL - 2, y0 + CELL - 2]
            if state["game"] == "2048":
                d.rectangle(box, fill=TILE_COLORS.get(v, (60, 58, 50)))
                if v:
                    d.text((x0 + CELL / 2 - 4 * len(str(v)), y0 + CELL / 2 - 6), str(v), fill=(30, 30, 30))
            elif v == 0:
                d.rectangle(box, fill=(187, 173, 160))
            elif state["game"] == "shisen-sho-pictures":
                d.rectangle(box, fill=(250, 248, 240))
                draw_shape(d, SHAPES[(v - 1) % len(SHAPES)], palette[(v * 7) % len(palette)], x0 + CELL / 2,
                           y0 + CELL / 2, CELL * 0.32)
            else:
                d.rectangle(box, fill=(250, 248, 240))
                label = chr(ord("A") + v - 1) if state["game"].startswith("shisen") else str(v)
                d.text((x0 + CELL / 2 - 4 * len(label), y0 + CELL / 2 - 6), label, fill=(20, 20, 20))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()
