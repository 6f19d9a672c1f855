"""Writers of the on-disk inputs the fuzz tests and the defect tests feed the readers: tars whose members are
given byte for byte (so a member can be missing, cut short, doubled or huge), official-layout folders with
any ``.nv-meta/.info.json``, and a tiny tokenizer made once per process."""
from __future__ import annotations

import io
import json
import tarfile
from functools import lru_cache
from pathlib import Path


def jpeg(w: int = 16, h: int = 12, color=(200, 40, 40)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="JPEG")
    return buf.getvalue()


def write_tar(path: Path, members: list[tuple[str, bytes]], cut: int | None = None) -> Path:
    """A tar of ``members`` (name, bytes) in that order, mtime 0; ``cut``: keep only its first ``cut`` bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tf.addfile(info, io.BytesIO(data))
    data = buf.getvalue()
    path.write_bytes(data[:cut] if cut is not None else data)
    return path


def official_entry(key: str, meta, images: list[bytes] | None = None, raw_json: bytes | None = None):
    """The members of one official entry: ``key.json`` (``meta`` dumped, or ``raw_json`` as given; neither:
    no json member) and ``key.img{i}.jpg``."""
    out = []
    if raw_json is not None or meta is not None:
        out.append((f"{key}.json", raw_json if raw_json is not None else json.dumps(meta).encode()))
    out += [(f"{key}.img{i}.jpg", b) for i, b in enumerate(images or [])]
    return out


def official_folder(root: Path, tars: dict[str, list[tuple[str, bytes]]], counts=None, cut: dict | None = None,
                    info: bytes | None = None) -> Path:
    """An official-layout folder: each tar of ``tars`` (name relative to ``root`` → members), and
    ``.nv-meta/.info.json`` holding ``{"shard_counts": counts}`` (default: the keys in each tar), or ``info``
    byte for byte."""
    root.mkdir(parents=True, exist_ok=True)
    for name, members in tars.items():
        write_tar(root / name, members, (cut or {}).get(name))
    if counts is None:
        counts = {name: len(dict.fromkeys(m.split(".", 1)[0] for m, _ in members)) for name, members in tars.items()}
    meta = root / ".nv-meta"
    meta.mkdir(exist_ok=True)
    (meta / ".info.json").write_bytes(info if info is not None else json.dumps({"shard_counts": counts}).encode())
    return root


@lru_cache(maxsize=None)
def tiny_tokenizer(folder: str) -> str:
    """A tiny Qwen-style tokenizer saved under ``folder`` (made once per process); its path."""
    from packing.tiny_tokenizer import build_tiny_tokenizer

    out = Path(folder) / "tokenizer"
    if not (out / "tokenizer.json").is_file():
        build_tiny_tokenizer(["a cat on a mat.", "a dog.", "Describe the image."], out)
    return str(out)
