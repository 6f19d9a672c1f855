"""``import-packs``: a folder in the official LLaVA-OneVision-1.5 packed layout (its offline-packing step 4,
or ``pack-official``) → ovpipe packs: the ``packs`` manifest and packed shards (``packing.shards``) that
``ovpipe pretrain --data import-packs`` trains on, plus ``imported_packs``, one row per entry with its
status.

Each entry is read the way the official ``sample_loader`` reads it (``packing.official.parse_entry``): the
images ``img{i}.jpg`` with ``prompts[i]`` and ``captions[i]``. Sub-sample ``i`` becomes the conversation
``[user prompts[i], assistant captions[i]]`` — or, for an entry without prompts (the captioning flavour),
the caption pair ``[user "<image>", assistant captions[i]]`` with ``caption_prompt``, as ``lengths`` trains
one — tokenised by ``packing.tokens.encode_conversation``, so the trainer gets the official loader's images
and texts, tokenised as ``pack`` does. An entry that cannot be loaded keeps a row with its status
(``bad_json``, ``misaligned``, ``missing_image``, ``bad_image``, ``image_mismatch``: a prompt without
exactly one ``<image>``, ``bad_text``: a null or non-string prompt or caption, ``empty``: no images) and no
pack; one longer than ``seq_len`` under ovpipe's encoding (``tail`` tokens per sub-sample more than the
official count) is ``too_long``. A tar that cannot be read to its end keeps a row per indexed entry it did
not give, ``unreadable`` (key NULL), with the tar's error. A folder whose index is not energon's (no
``shard_counts``, a tar name outside the folder, a listed tar missing) is refused before any work, naming
``source``.

Numbering: ``pack_id`` is the entry's position in the folder, tars in path order with the entry counts
energon recorded (``.nv-meta/.info.json``, or ``.info.yaml``); source tar ``j`` becomes
``data/pack-{j:06d}.tar`` and ranks take whole tars, so the output is byte-identical for any task count.
A task holds one entry at a time (an official tar may hold thousands of packs). ``finalize`` prepares the step
folder as ovpipe's energon dataset (``packing.energon``).
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ovpipe.config import check_local_path, check_range, looks_like_local_path
from ovpipe.step import Step, TaskContext, slice_bounds


@dataclass
class ImportPacksConfig:
    source: str = ""                        # the official-layout folder (its .nv-meta/ prepared by energon)
    tokenizer: str = ""                     # HF tokenizer path or name, as `lengths` takes it
    seq_len: int = 8192  # the official packs' sequence length (each entry must fit)
    caption_prompt: str = "Describe the image."  # the user turn of an entry without prompts
    patch_size: int = 14  # the vision tower's patch side in pixels, as lengths counts it
    merge_size: int = 2  # patches merged per side into one LLM token
    min_pixels: int = 56 * 56  # an image is resized up to at least this many pixels
    max_pixels: int = 28 * 28 * 1280  # an image is resized down to at most this many pixels

    def __post_init__(self):
        if not self.source:
            raise ValueError("source: give the official-layout folder to import")
        if not self.tokenizer:
            raise ValueError("tokenizer: give a Hugging Face tokenizer path or name")
        check_range(self, "seq_len", 64)
        for name in ("patch_size", "merge_size", "min_pixels"):
            check_range(self, name, 1)
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) > max_pixels ({self.max_pixels})")

    @property
    def root(self) -> Path:
        """The source folder, ``~`` expanded."""
        return Path(self.source).expanduser()

    def check(self, run_dir: Path) -> None:
        """Before any work: the folder is an energon-prepared dataset whose index names tars inside it that
        exist, and a local tokenizer path exists."""
        from packing.official import shards

        check_local_path("source", self.source)
        if not any((self.root / ".nv-meta" / f).is_file() for f in (".info.json", ".info.yaml")):
            raise ValueError(f"source: {self.source} has no .nv-meta/.info.json (or .info.yaml) — run `energon "
                             f"prepare` on it (the official step 4 does)")
        try:
            tars = shards(self.root)
        except ValueError as e:
            raise ValueError(f"source: {e}") from None
        missing = [rel for rel, _ in tars if not (self.root / rel).is_file()]
        if missing:
            raise ValueError(f"source: {len(missing)} tar(s) of the index are missing, first {missing[0]!r} — "
                             f"re-run `energon prepare` on {self.source}")
        if looks_like_local_path(self.tokenizer):
            check_local_path("tokenizer", self.tokenizer)

    def image_cfg(self):
        from packing.tokens import ImageTokenConfig

        return ImageTokenConfig(self.patch_size, self.merge_size, self.min_pixels, self.max_pixels)


def image_size(data: bytes) -> tuple[int, int]:
    """``(height, width)`` as displayed (EXIF rotation applied), from the header; ``ValueError`` if unreadable."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
            if im.getexif().get(0x0112, 1) in (5, 6, 7, 8):   # stored rotated by 90/270 degrees
                w, h = h, w
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError) as e:
        # PIL names the buffer by its address: dropped, so a rerun is byte-identical
        raise ValueError(re.sub(r" object at 0x[0-9a-f]+", " object", f"bad_image: {type(e).__name__}: {e}")[:300]) \
            from None
    return h, w


def run(cfg: ImportPacksConfig, task: TaskContext) -> None:
    from packing.official import shards
    from packing.pack import shard_name
    from packing.tokens import load_tokenizer

    tars = shards(cfg.root)
    first = np.concatenate([[0], np.cumsum([n for _, n in tars])]).astype(np.int64)
    lo, hi = slice_bounds(len(tars), task.rank, task.world_size)
    tok, img_cfg = load_tokenizer(cfg.tokenizer), cfg.image_cfg()
    with task.part_writer("packs") as packs, task.part_writer("imported_packs") as rows:
        for j in range(lo, hi):
            status_rows, pack_rows = [], []
            entries = encoded_entries(cfg, tok, img_cfg, tars[j], int(first[j]), status_rows, task)
            head = next(entries, None)   # one entry in memory at a time; a tar of none writes no shard
            if head is not None:
                from packing.shards import write_shard

                write_shard(task.data_path(shard_name(j)),
                            recorded(itertools.chain([head], entries), pack_rows, shard_name(j)))
            rows.write(table("imported_packs", status_rows))
            packs.write(table("packs", pack_rows))
            task.stats.inc("packs_written", len(pack_rows))


def encoded_entries(cfg, tok, img_cfg, tar: tuple[str, int], first: int, status_rows: list, task):
    """The ovpipe entries of one official tar, one at a time; every entry's ``imported_packs`` row goes to
    ``status_rows``, and only the loadable ones that fit ``seq_len`` are yielded."""
    rel, n = tar
    for k, (key, members) in enumerate(official_entries(cfg.root, rel, n)):
        row = {"pack_id": first + k, "source_shard": rel, "key": key, "n_samples": None, "total_tokens": None,
               "status": "ok", "error": None}
        e = None
        try:
            if isinstance(members, Unreadable):
                raise ValueError(f"unreadable: {members}")
            e = encode_entry(tok, cfg, img_cfg, members, first + k)
        except ValueError as err:
            row["status"], _, row["error"] = str(err).partition(": ")
        else:
            row["n_samples"], row["total_tokens"] = len(e["sample_ids"]), int(len(e["ids"]))
            if len(e["ids"]) > cfg.seq_len:
                row["status"], row["error"] = "too_long", f"{len(e['ids'])} tokens > seq_len {cfg.seq_len}"
        task.stats.inc(f"status/{row['status']}")
        status_rows.append(row)
        if row["status"] == "ok":
            yield e


def recorded(entries, pack_rows: list, shard: str):
    """``entries`` passed through to the shard writer, each one's ``packs`` row (with its cost under the
    default weights, ``packing.cost``) kept in ``pack_rows``."""
    from packing.cost import entry_columns

    for e in entries:
        pack_rows.append({"pack_id": e["pack_id"], "sample_ids": e["sample_ids"], "lengths": e["lengths"],
                          "offsets": e["offsets"], "total_tokens": int(len(e["ids"])), "shard": shard,
                          **entry_columns(e["lengths"], e["grids"])})
        yield e


class Unreadable(str):
    """In place of an entry's members: why the tar stopped before giving it."""


def official_entries(root: Path, rel: str, n: int):
    """The ``(key, members)`` of one official tar's ``n`` indexed entries. Where the tar cannot be read to its
    end (cut short, not a tar, two members of one name in an entry), each entry it did not give is
    ``(None, Unreadable(why))``. More entries than energon's index counts stop the task: every later pack id
    would collide with the next tar's."""
    import tarfile

    from packing.official import iter_entries

    k, why = 0, None
    try:
        for k, item in enumerate(iter_entries(Path(root) / rel), 1):
            if k > n:
                break
            yield item
    except (tarfile.TarError, OSError, ValueError, EOFError) as e:
        why = f"{rel}: {type(e).__name__}: {e}"[:300]
    if k > n:
        raise RuntimeError(f"{root}/{rel}: more entries than energon's .nv-meta/.info counts ({n}) — "
                           f"re-run `energon prepare`")
    for _ in range(k, n):
        yield None, Unreadable(why or f"{rel}: the tar ends after {k} of its {n} indexed entries")


def encode_entry(tok, cfg: ImportPacksConfig, img_cfg, members: dict, pack_id: int) -> dict:
    """One official entry → a ``packing.shards.write_shard`` entry; ``ValueError("status: why")`` if it
    cannot be loaded."""
    from manifests.conversation import IMAGE_TOKEN, caption_turns, sample_id
    from packing.official import parse_entry
    from packing.tokens import encode_conversation, image_grid, prompted_turns

    prompts, captions, images = parse_entry(members)
    sizes = [image_size(b) for b in images]
    ids, mask, sids, lengths = [], [], [], []
    for i, (caption, img, hw) in enumerate(zip(captions, images, sizes)):
        turns = ([("user", prompts[i]), ("assistant", caption)] if prompts else
                 prompted_turns([("user", IMAGE_TOKEN), ("assistant", caption)], 1, cfg.caption_prompt))
        if turns[0][1].count(IMAGE_TOKEN) != 1:
            raise ValueError(f"image_mismatch: sub-sample {i}'s prompt holds {turns[0][1].count(IMAGE_TOKEN)} "
                             f"{IMAGE_TOKEN} placeholders, it has one image")
        a, m, _, _ = encode_conversation(tok, turns, [hw], img_cfg, caption_prompt=cfg.caption_prompt)
        ids.append(a)
        mask.append(m)
        lengths.append(len(a))
        # a caption pair keeps the id ingest gives it (the caption bytes), so its lineage joins back
        pair = not prompts or prompts[i] == IMAGE_TOKEN + cfg.caption_prompt
        sids.append(sample_id([img], caption_turns(caption) if pair else turns))
    gh, gw = image_grid(np.array([h for h, _ in sizes]), np.array([w for _, w in sizes]), img_cfg)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int).tolist() if lengths else []
    return {"pack_id": pack_id, "sample_ids": sids, "lengths": lengths, "offsets": offsets, "seq_len": cfg.seq_len,
            "ids": np.concatenate(ids) if ids else np.zeros(0, np.int32),
            "mask": np.concatenate(mask) if mask else np.zeros(0, np.uint8), "images": images,
            "exts": ["jpg"] * len(images), "grids": [(int(h), int(w)) for h, w in zip(gh, gw)],
            "image_counts": [1] * len(images)}


def table(kind: str, rows: list[dict]):
    import pyarrow as pa

    from manifests.schemas import schema_for

    return pa.Table.from_pylist(rows, schema=schema_for(kind))


def finalize(cfg: ImportPacksConfig, task: TaskContext) -> None:
    """The imported shards as ovpipe's energon dataset (``packing.energon``), as ``pack`` leaves its own."""
    n_shards = len(list(task.step_dir.glob("data/pack-*.tar")))
    if n_shards:
        from packing.energon import prepare

        with task.stats.timer("energon_prepare"):
            prepare(task.step_dir, n_shards, task.step_dir / "logs" / "energon_prepare.log")


STEP = Step("import-packs", ImportPacksConfig, run, outputs=("packs", "imported_packs"), finalize=finalize,
            check=ImportPacksConfig.check,
            description="official-layout packs → ovpipe packs")
