"""The viewer's file access: which folders it may read, images from where they live, the run's steps.

Allowed roots are the run folder and the inputs its steps declared (each ``config.json``'s ``inputs``
globs, cut at their first wildcard, and ``image_root``; a relative one is taken from the current folder,
as the step that read it did). Every path is resolved (``..`` and symlinks followed) before the check, so a
symlink inside the run that points outside it is refused like ``../`` or an absolute path.

Images are read in place (``manifests.conversation.read_image``: a tar member by offset and size, a file,
a Parquet cell); thumbnails are made on request and kept in a bounded LRU cache (``THUMB_CACHE`` entries of
a few kB), so nothing is written anywhere.
"""
from __future__ import annotations

import glob as globlib
import io
import json
import os
from functools import lru_cache
from pathlib import Path

THUMB_CACHE = 2048           # entries; a 160 px JPEG is ~5-10 kB, so ~20 MB at most
SERVED_SUFFIXES = {".png": "image/png", ".md": "text/plain; charset=utf-8", ".json": "application/json",
                   ".log": "text/plain; charset=utf-8", ".txt": "text/plain; charset=utf-8"}


class Refused(PermissionError):
    """A path outside the run folder and its declared inputs."""


def _static_prefix(pattern: str) -> str:
    """``data/shards/*.tar`` → ``data/shards``: the folder part before the first wildcard."""
    parts = Path(pattern).parts
    keep = []
    for p in parts:
        if globlib.has_magic(p):
            break
        keep.append(p)
    prefix = Path(*keep) if keep else Path(".")
    return str(prefix if keep and len(keep) < len(parts) else prefix.parent)


def allowed_roots(run_dir: Path) -> list[Path]:
    """The run folder, then every input folder its steps' configs declare (resolved, deduplicated)."""
    run_dir = Path(run_dir).resolve()
    roots = [run_dir]
    for cfg in sorted([*run_dir.glob("*/config.json"), *run_dir.glob("*/*/config.json")]):
        try:
            c = json.loads(cfg.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(c, dict):
            continue
        found = [c["inputs"]] if isinstance(c.get("inputs"), str) else c.get("inputs") or []
        # An entry with no folder part ("ingest-instruct": mix names a step; "x.tar" in the current folder)
        # declares no folder: the whole current folder is never a root.
        dirs = [d for d in (_static_prefix(p) for p in found if isinstance(p, str)) if d not in ("", ".")]
        if isinstance(c.get("image_root"), str):
            dirs.append(c["image_root"])
        for d in dirs:
            r = Path(os.path.realpath(d))
            if r.is_dir() and r != Path("/") and r not in roots:
                roots.append(r)
    return roots


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def check_path(path: str | os.PathLike, roots: list[Path]) -> Path:
    """``path`` resolved (symlinks followed) if it lies under one of ``roots``, else ``Refused``."""
    real = Path(os.path.realpath(path))
    if not any(_inside(real, r) for r in roots):
        raise Refused(f"{path}: outside the run folder and its declared inputs")
    return real


def run_file(run_dir: Path, rel: str) -> Path:
    """A file of the run folder named by its run-relative path (a step's plot, report or log): no absolute
    path, no ``..``, no symlink out, and only the suffixes in ``SERVED_SUFFIXES``."""
    if not rel or rel.startswith(("/", "\\")) or ".." in Path(rel).parts or "\x00" in rel:
        raise Refused(f"{rel!r}: not a path inside the run folder")
    real = check_path(Path(run_dir) / rel, [Path(run_dir).resolve()])
    if real.suffix not in SERVED_SUFFIXES or not real.is_file():
        raise FileNotFoundError(rel)
    return real


def image_bytes(addr: dict, roots: list[Path]) -> bytes:
    """The encoded image at ``addr`` (a ``samples.images`` entry), read where it lives after the path check."""
    from manifests.conversation import read_image

    check_path(addr["file"], roots)
    return read_image(addr)


def _thumbnail(data: bytes, px: int) -> bytes:
    from PIL import Image

    from manifests.conversation import upright_rgb

    im = upright_rgb(Image.open(io.BytesIO(data)))
    im.thumbnail((px, px))
    out = io.BytesIO()
    im.save(out, "JPEG", quality=85)
    return out.getvalue()


@lru_cache(maxsize=THUMB_CACHE)
def _address_thumbnail(key: tuple, px: int, roots: tuple) -> bytes:
    addr = dict(key)
    return _thumbnail(image_bytes(addr, list(roots)), px)


def thumbnail(addr: dict, px: int, roots: list[Path]) -> bytes:
    """A JPEG of at most ``px``×``px`` of the image at ``addr``, cached by address (never written to disk)."""
    return _address_thumbnail(tuple(sorted(addr.items())), px, tuple(roots))


def blob_thumbnail(data: bytes, px: int) -> bytes:
    """A thumbnail of image bytes held in a manifest cell (``rl_prompts.images``)."""
    return _thumbnail(bytes(data), px)


# ------------------------------------------------------------------------------ steps
def step_overview(run_dir: Path) -> list[dict]:
    """Every step folder in pipeline order with its status (done | running | failed | stale | incomplete),
    its key figures (``ovpipe summary``'s), its plots and reports (run-relative paths)."""
    from ovpipe.runfolder.status import pipeline_order, step_status
    from ovpipe.runfolder.upstream import stale_inputs
    from ovpipe.summary import key_figures

    run_dir = Path(run_dir).resolve()
    seen: dict = {}
    out = []
    for sdir in pipeline_order(run_dir):
        label = sdir.relative_to(run_dir).as_posix()
        meta = json.loads((sdir / "executor.json").read_text())
        st = step_status(sdir)
        why = stale_inputs(run_dir, label, seen)
        red = (st.get("phases") or {}).get("reduce", "done")
        if st["failed"] or red == "failed":
            status = "failed"
        elif st["running"] or red.startswith("running"):
            status = "running"
        elif st["stale"] or red == "stale" or (why and st["finalized"]):
            status = "stale"
        elif st["finalized"]:
            status = "done"
        else:
            status = "incomplete"
        try:
            counters = json.loads((sdir / "stats.json").read_text()).get("counters", {})
        except (OSError, ValueError):
            counters = {}
        files = sorted(p.relative_to(run_dir).as_posix() for p in [*sdir.glob("*.png"), *sdir.glob("*.md")])
        out.append({"folder": label, "step": meta.get("step"), "status": status, "tasks": st["tasks"],
                    "done": st["done"], "why": why, "figures": key_figures(meta.get("step") or "", counters)
                    if counters else "", "plots": [f for f in files if f.endswith(".png")],
                    "reports": [f for f in files if f.endswith(".md")]})
    return out
