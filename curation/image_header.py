"""What ``ingest`` learns from an image's header, without decoding its pixels: its size as displayed,
its format, and whether the file is whole (``inspect_image``).

Width/height come from the header, as displayed — swapped when the EXIF orientation tag (5-8) says the
pixels are stored rotated by 90/270 degrees, i.e. the size ``PIL.ImageOps.exif_transpose`` gives;
whoever decodes the image for training must apply that transpose too. ``too_large``: width*height
above ``max_pixels`` (default ``DEFAULT_MAX_PIXELS``), decided from the header before any decode, so a
decompression bomb is a row. ``verify: header`` walks JPEG segments / PNG chunks to the end marker
(bytes after it, as in Motion Photos, are fine); ``verify: full`` decodes.
"""
from __future__ import annotations

import io
import re

# The pixel limit (config ``max_pixels``): 4x the largest ``max_pixels`` a Qwen2-VL-style processor
# is run with (28*28*16384 = 12.8 MP, 16384 visual tokens), i.e. 51.4 MP, about 7168x7168. Every
# image above the recipe's ``lengths.max_pixels`` is downscaled to it anyway; this limit only keeps
# decompression bombs (a 30000x30000 1-bit PNG is 109 KB) out of every step that decodes images.
DEFAULT_MAX_PIXELS = 4 * 28 * 28 * 16384
EXIF_ORIENTATION = 0x0112
SWAPPING_ORIENTATIONS = (5, 6, 7, 8)   # transpose, rotate 90/270, transverse: width and height swap


class _NoBombCheck:
    """PIL's own decompression-bomb check off while a header is read (``too_large`` is decided
    from the size against ``max_pixels``); restored after. Ingest reads images in one thread."""

    def __enter__(self):
        from PIL import Image

        self.saved = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = None

    def __exit__(self, *exc):
        from PIL import Image

        Image.MAX_IMAGE_PIXELS = self.saved


def exif_orientation(im) -> int:
    """The EXIF orientation tag from the header (1 when absent or unreadable); never decodes
    pixels (PNG's ``getexif`` would load the image to look for a late eXIf chunk: not asked)."""
    if "exif" not in im.info:
        return 1
    try:
        return int(im.getexif().get(EXIF_ORIENTATION, 1) or 1)
    except Exception:  # noqa: BLE001 — malformed EXIF: treated as no orientation, as PIL's exif_transpose would fail
        return 1


_JPEG_SCAN_END = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")   # a marker that ends a scan's entropy-coded data


def jpeg_complete(data: bytes) -> bool | None:
    """Whether a JPEG's marker segments reach an EOI: walk the segments from SOI by their lengths,
    and through each scan's entropy-coded data to the next marker (``FF`` + a byte that is not
    ``00``, ``FF`` or ``RSTn``). Bytes after the EOI (Motion Photos append a video) are not looked
    at. ``False``: the data ends first (truncated). ``None``: a structure this walk does not
    understand (the caller decodes instead)."""
    n = len(data)
    if data[:2] != b"\xff\xd8":
        return None
    pos = 2
    while True:
        if pos >= n:
            return False
        if data[pos] != 0xFF:
            return None
        while pos < n and data[pos] == 0xFF:  # fill bytes
            pos += 1
        if pos >= n:
            return False
        marker = data[pos]
        pos += 1
        if marker == 0xD9:
            return True
        if 0xD0 <= marker <= 0xD7 or marker == 0x01:  # no length field
            continue
        if pos + 2 > n:
            return False
        length = int.from_bytes(data[pos:pos + 2], "big")
        if length < 2:
            return None
        pos += length
        if marker == 0xDA:  # start of scan: entropy-coded data up to the next marker
            hit = _JPEG_SCAN_END.search(data, pos)
            if hit is None:
                return False
            pos = hit.start()


def png_complete(data: bytes) -> bool | None:
    """Whether a PNG's chunks, walked by their lengths, reach ``IEND`` (bytes after it ignored)."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    pos, n = 8, len(data)
    while pos + 8 <= n:
        if data[pos + 4:pos + 8] == b"IEND":
            return True
        pos += 12 + int.from_bytes(data[pos:pos + 4], "big")
    return False


def inspect_image(data: bytes, verify: str,
                  max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[str, int, int, str, str | None]:
    """(status, width, height, format, error) from the header; optional trailer/full check.

    Width and height are as displayed: swapped when the header's EXIF orientation says the image
    is stored rotated by 90/270 degrees (orientation 5-8, what ``PIL.ImageOps.exif_transpose``
    turns). ``too_large``: width*height above ``max_pixels``, decided from the header before any
    decode (PIL's own bomb check is off while the header is read)."""
    from PIL import Image, UnidentifiedImageError

    if len(data) == 0:
        return "empty_image", 0, 0, "", "zero-byte image"
    try:
        with _NoBombCheck(), Image.open(io.BytesIO(data)) as im:
            w, h = im.size
            fmt = (im.format or "").lower()
            if exif_orientation(im) in SWAPPING_ORIENTATIONS:
                w, h = h, w
            if w * h > max_pixels:
                return "too_large", w, h, fmt, f"{w}x{h} = {w * h} pixels is above max_pixels={max_pixels}"
            if verify == "full":
                im.load()
            elif verify == "header":
                # Cheap integrity check without decoding: a truncated file never reaches its end marker.
                complete = jpeg_complete(data) if fmt == "jpeg" else png_complete(data) if fmt == "png" else True
                if complete is None:  # a layout the marker walk does not follow: decode to decide
                    im.load()
                elif not complete:
                    what = "JPEG (no EOI marker)" if fmt == "jpeg" else "PNG (no IEND chunk)"
                    return "corrupt_image", w, h, fmt, f"truncated {what}"
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        return "too_large", 0, 0, "", f"{type(e).__name__}: {e}"[:300]
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as e:
        # PIL names the buffer by its address ("<_io.BytesIO object at 0x7f…>"): dropped, so a rerun is byte-identical
        return "corrupt_image", 0, 0, "", re.sub(r" object at 0x[0-9a-f]+", " object", f"{type(e).__name__}: {e}")[:300]
    return "ok", w, h, fmt, None
