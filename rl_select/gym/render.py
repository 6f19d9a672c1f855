"""Observations: the board drawn with PIL (no assets). Shisen-Sho and Swap tiles are G1's coloured shapes; the
CIFAR-10 variant's tiles are procedurally drawn class pictures — a stand-in for CIFAR-10's photographs, which
cannot be fetched here: four drawings per class (pose, colours, background), told apart only by class."""
from __future__ import annotations

import io

CELL = 48
TILE_COLORS = {0: (205, 193, 180), 2: (238, 228, 218), 4: (237, 224, 200), 8: (242, 177, 121), 16: (245, 149, 99),
               32: (246, 124, 95), 64: (246, 94, 59), 128: (237, 207, 114), 256: (237, 204, 97), 512: (237, 200, 80),
               1024: (237, 197, 63), 2048: (237, 194, 46)}
# G1's tile colours (gamematch.py / gamematch3.py)
RGB = {"Red": (255, 0, 0), "Green": (0, 255, 0), "Blue": (0, 0, 255), "Yellow": (255, 255, 0),
       "Magenta": (255, 0, 255), "Cyan": (0, 255, 255)}


def draw_cifar_class(d, cls: int, variant: int, x0: float, y0: float, s: float) -> None:
    """One drawing of a CIFAR-10 class (0 airplane … 9 truck); ``variant`` 0–3 changes colours and pose."""
    body = [(200, 60, 40), (40, 90, 200), (60, 150, 60), (150, 110, 60)][variant]
    sky = [(225, 235, 250), (250, 240, 215), (220, 245, 225), (240, 225, 240)][variant]
    d.rectangle([x0, y0, x0 + s, y0 + s], fill=sky)
    f = -1 if variant % 2 else 1              # mirrored pose for odd variants
    cx, cy, u = x0 + s / 2, y0 + s / 2, s / 10
    X = lambda v: cx + f * v * u  # noqa: E731
    Y = lambda v: cy + v * u  # noqa: E731
    box = lambda a, b, c, e: [min(X(a), X(c)), min(Y(b), Y(e)), max(X(a), X(c)), max(Y(b), Y(e))]  # noqa: E731
    if cls == 0:    # airplane: fuselage, wings, tail
        d.ellipse(box(-4, -0.8, 4, 0.8), fill=body)
        d.polygon([(X(0), Y(0)), (X(-1.5), Y(-3.5)), (X(1), Y(0))], fill=body)
        d.polygon([(X(0), Y(0)), (X(-1.5), Y(3.5)), (X(1), Y(0))], fill=body)
        d.polygon([(X(-4), Y(0)), (X(-4.3), Y(-2)), (X(-3), Y(0))], fill=body)
    elif cls in (1, 9):   # automobile / truck: body, cabin, wheels
        if cls == 1:
            d.rectangle(box(-4, -0.5, 4, 1.5), fill=body)
            d.polygon([(X(-2), Y(-0.5)), (X(-1), Y(-2)), (X(1.5), Y(-2)), (X(2.5), Y(-0.5))], fill=body)
        else:
            d.rectangle(box(-4, -2.5, 1.5, 1.5), fill=body)
            d.rectangle(box(1.7, -1, 4, 1.5), fill=(90, 90, 90))
        for w in (-2.5, 2.5):
            d.ellipse(box(w - 1, 1, w + 1, 3), fill=(20, 20, 20))
    elif cls == 2:  # bird: body, head, beak, wing
        d.ellipse(box(-3, -1, 1.5, 2), fill=body)
        d.ellipse(box(1, -2.5, 3, -0.5), fill=body)
        d.polygon([(X(3), Y(-1.8)), (X(4.3), Y(-1.4)), (X(3), Y(-1))], fill=(240, 180, 0))
        d.polygon([(X(-2), Y(0)), (X(0), Y(-3)), (X(0.5), Y(0))], fill=(30, 30, 30))
    elif cls in (3, 5):   # cat (pointed ears) / dog (floppy ears): head, eyes
        d.ellipse(box(-3, -2.5, 3, 3), fill=body)
        if cls == 3:
            d.polygon([(X(-3), Y(-1)), (X(-2.5), Y(-4)), (X(-0.8), Y(-2.3))], fill=body)
            d.polygon([(X(3), Y(-1)), (X(2.5), Y(-4)), (X(0.8), Y(-2.3))], fill=body)
        else:
            d.ellipse(box(-4.2, -2, -2.2, 2), fill=(60, 40, 20))
            d.ellipse(box(2.2, -2, 4.2, 2), fill=(60, 40, 20))
            d.ellipse(box(-0.8, 0.8, 0.8, 2), fill=(20, 20, 20))
        for e in (-1.2, 1.2):
            d.ellipse(box(e - 0.5, -0.8, e + 0.5, 0.2), fill=(255, 255, 255))
    elif cls in (4, 7):   # deer (antlers) / horse (mane): body, neck, head, legs
        d.rectangle(box(-3, -0.5, 2, 1.5), fill=body)
        d.polygon([(X(1), Y(-0.5)), (X(2.5), Y(-3)), (X(3.5), Y(-2.5)), (X(2), Y(0))], fill=body)
        for leg in (-2.5, -1.5, 0.8, 1.6):
            d.rectangle(box(leg, 1.5, leg + 0.4, 4), fill=body)
        if cls == 4:
            d.line([(X(2.7), Y(-3)), (X(2), Y(-4.5)), (X(1.4), Y(-4.8))], fill=(90, 60, 30), width=2)
            d.line([(X(3.2), Y(-3)), (X(3.8), Y(-4.6))], fill=(90, 60, 30), width=2)
        else:
            d.line([(X(1.2), Y(-0.6)), (X(2.4), Y(-3.2))], fill=(30, 20, 10), width=3)
            d.line([(X(-3), Y(0)), (X(-4), Y(2))], fill=(30, 20, 10), width=3)
    elif cls == 6:  # frog: wide body, two eyes on top
        d.ellipse(box(-4, -1, 4, 3), fill=body)
        for e in (-2, 2):
            d.ellipse(box(e - 1, -2.5, e + 1, -0.5), fill=body)
            d.ellipse(box(e - 0.4, -1.9, e + 0.4, -1.1), fill=(0, 0, 0))
    else:           # ship: hull, mast, sail, sea
        d.rectangle(box(-5, 2.5, 5, 5), fill=(60, 110, 200))
        d.polygon([(X(-4), Y(1)), (X(4), Y(1)), (X(3), Y(3)), (X(-3), Y(3))], fill=body)
        d.line([(X(0), Y(1)), (X(0), Y(-4))], fill=(40, 40, 40), width=2)
        d.polygon([(X(0.2), Y(-4)), (X(3), Y(0.5)), (X(0.2), Y(0.5))], fill=(250, 250, 250))


def render(state: dict) -> bytes:
    from PIL import Image, ImageDraw

    from rl_select.gym.games import SHISEN_COLORS, SHISEN_SHAPES, SWAP_COLORS, SWAP_SHAPES
    from rl_select.gym.shapes import draw_shape

    b, game = state["board"], state["game"]
    H, W = len(b), len(b[0])
    im = Image.new("RGB", (W * CELL + 8, H * CELL + 8), (187, 173, 160) if game == "2048" else (255, 255, 255))
    d = ImageDraw.Draw(im)
    for r in range(H):
        for c in range(W):
            v = b[r][c]
            x0, y0 = 4 + c * CELL, 4 + r * CELL
            box = [x0 + 2, y0 + 2, x0 + CELL - 2, y0 + CELL - 2]
            if game == "2048":
                d.rectangle(box, fill=TILE_COLORS.get(v, (60, 58, 50)))
                if v:
                    d.text((x0 + CELL / 2 - 3 * len(str(v)), y0 + CELL / 2 - 6), str(v), fill=(30, 30, 30))
                continue
            d.rectangle(box, outline=(200, 200, 200))
            if v == 0:
                continue
            if game == "shisen-sho-cifar10":
                draw_cifar_class(d, (v - 1) % 10, (v - 1) // 10, x0 + 3, y0 + 3, CELL - 6)
                continue
            colors, shapes = (SWAP_COLORS, SWAP_SHAPES) if game == "swap" else (SHISEN_COLORS, SHISEN_SHAPES)
            color, shape = colors[(v - 1) // len(shapes)], shapes[(v - 1) % len(shapes)]
            draw_shape(d, shape, RGB[color], x0 + CELL / 2, y0 + CELL / 2, CELL * 0.34)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()
