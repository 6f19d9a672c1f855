"""``manifests.conversation.upright_rgb``: the pixels of ``exif_transpose(im).convert("RGB")`` for every
mode and orientation the corpora hold, without a copy where nothing needs doing."""
import io

import numpy as np
import pytest
from PIL import Image, ImageOps

from manifests.conversation import upright_rgb


def _encoded(mode: str, fmt: str, orientation: int | None = None) -> bytes:
    rng = np.random.default_rng(0)
    px = rng.integers(0, 256, (24, 40, 4), dtype=np.uint8)
    im = Image.fromarray(px, "RGBA").convert(mode)
    buf = io.BytesIO()
    kw = {}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kw["exif"] = exif.tobytes()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("mode, fmt, orientation", [
    ("RGB", "JPEG", None), ("RGB", "JPEG", 1), ("RGB", "JPEG", 3), ("RGB", "JPEG", 6), ("RGB", "JPEG", 8),
    ("L", "JPEG", None), ("L", "JPEG", 6), ("CMYK", "JPEG", None), ("P", "PNG", None), ("RGBA", "PNG", None),
    ("LA", "PNG", None),
])
def test_same_pixels_as_exif_transpose_then_convert(mode, fmt, orientation):
    data = _encoded(mode, fmt, orientation)
    with Image.open(io.BytesIO(data)) as im:
        want = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
    with Image.open(io.BytesIO(data)) as im:
        got = upright_rgb(im)
        assert got.mode == "RGB"
        np.testing.assert_array_equal(np.asarray(got), want)
    if orientation in (6, 8):
        assert want.shape[:2] == (40, 24)          # rotated: the displayed size


def test_an_upright_rgb_image_is_not_copied():
    with Image.open(io.BytesIO(_encoded("RGB", "JPEG"))) as im:
        assert upright_rgb(im) is im
