"""The official LLaVA-OneVision-1.5 packed layout: what its offline-packing step 4
(``4_convert_packedsample_to_wds.py``) writes and its trainer (``aiak_training_llm``) reads, and how that
trainer's task encoder tokenises it. ``pack-official`` writes it, ``import-packs`` reads it.

A folder in the layout is a webdataset with one tar entry per pack (``docs/packing.md`` has the fields)::

    <key>.img0.jpg … <key>.img{n-1}.jpg   the pack's images, one per sub-sample, in sub-sample order
    <key>.json                            {"prompts": [n], "captions": [n], "images": [n]}
    .nv-meta/dataset.yaml                 sample_type aiak_training_llm.data.multimodal.PackedCaptioningSample,
                                          sample_loader / part_filter from sample_loader.py
    .nv-meta/sample_loader.py             json + img{i}.jpg → {images, prompts, captions}
    .nv-meta/split.yaml, .info.json, index.*   energon's own ``prepare``

The trainer encodes each sub-sample ``i`` alone (``OFFLINE_PACKING_VQA=1``: its ``encode_vqa4packing``): the
tokenizer's chat template over ``[user: prompts[i], assistant: captions[i]]`` rendered as text, ``<image>``
replaced by ``<|vision_start|><|image_pad|><|vision_end|>``, **one trailing newline stripped**, tokenised,
and each ``<|image_pad|>`` expanded to the image's ``(h'/14)·(w'/14)/4`` pads at the recipe's
min/max pixels. The loss is on the caption's tokens and the closing end-of-turn token. So with a template
that ends every turn with ``<|im_end|>\\n`` (Qwen's), a sub-sample is exactly one token shorter than
ovpipe's count of the same conversation (``packing.tokens``), which keeps that newline::

    official_tokens = ovpipe_tokens − tail         tail = tokens of the stripped newline (1 for Qwen's template)

``official_encode`` is that encoding, written from the rule above; ``tail_tokens`` measures ``tail`` for a
tokenizer. A sub-sample carries exactly one image and one prompt/answer pair; anything else
(``carry_status``) cannot be written in this flavour.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from manifests.conversation import IMAGE_TOKEN
from packing.image_tokens import IMAGE_PAD, VISION_END, VISION_START, ImageTokenConfig, image_pad_tokens

SAMPLE_MODULE = "aiak_training_llm.data.multimodal"     # where the official trainer defines its sample types
PACKED_CLASS = "PackedCaptioningSample"                 # images, prompts, captions
IMAGE_TAGS = VISION_START + IMAGE_PAD + VISION_END

# The loader energon imports from .nv-meta/sample_loader.py: the entry's members → PackedCaptioningSample fields.
SAMPLE_LOADER = '''\
"""Written by ovpipe pack-official: one pack's members -> PackedCaptioningSample fields."""


def sample_loader(raw: dict) -> dict:
    meta = raw["json"]
    return dict(
        __key__=raw["__key__"],
        __restore_key__=raw["__restore_key__"],
        images=[raw[f"img{i}.jpg"] for i in range(len(meta["images"]))],
        prompts=meta["prompts"],
        captions=meta["captions"],
    )


def part_filter(part: str) -> bool:
    return True
'''


def carry_status(turns: Sequence[tuple[str, str]], n_images: int) -> str:
    """``ok`` when a conversation fits one sub-sample of a ``PackedCaptioningSample`` (one user turn with
    its one image, one assistant answer), else why not: ``text_only``, ``multi_image`` or ``multi_turn``
    (more than one pair, or a system turn: the flavour has no field for it)."""
    if n_images == 0:
        return "text_only"
    if n_images > 1:
        return "multi_image"
    if [r for r, _ in turns] != ["user", "assistant"] or turns[0][1].count(IMAGE_TOKEN) != 1:
        return "multi_turn"
    return "ok"


def official_text(tok, prompt: str, caption: str) -> str:
    """The text the official encoder tokenises for one sub-sample (see the module docstring)."""
    text = tok.apply_chat_template([{"role": "user", "content": prompt}, {"role": "assistant", "content": caption}],
                                   tokenize=False)
    text = text.replace(IMAGE_TOKEN, IMAGE_TAGS)
    return text[:-1] if text.endswith("\n") else text


def official_encode(tok, prompt: str, caption: str, image_size: tuple[int, int],
                    img_cfg: ImageTokenConfig = ImageTokenConfig()) -> tuple[np.ndarray, np.ndarray]:
    """``(ids: int32[n], loss_mask: uint8[n])`` of one sub-sample as the official trainer encodes it: the
    chat text, tokenised, the image's pad expanded; the loss on the caption's tokens and the last token."""
    ids = np.asarray(tok(official_text(tok, prompt, caption), add_special_tokens=False)["input_ids"], np.int64)
    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    at = np.flatnonzero(ids == pad)
    if len(at) != 1:
        raise ValueError(f"image_mismatch: the prompt renders {len(at)} {IMAGE_PAD} tokens, one image was given")
    n = int(image_pad_tokens(np.array([image_size[0]]), np.array([image_size[1]]), img_cfg)[0])
    ids = np.concatenate([ids[:at[0]], np.full(n, pad, np.int64), ids[at[0] + 1:]]).astype(np.int32)
    mask = np.zeros(len(ids), np.uint8)
    answer = len(tok.tokenize(caption))
    mask[len(ids) - answer - 1:] = 1
    return ids, mask


def tail_tokens(tok) -> int:
    """Tokens the official encoder strips from the end of a rendered conversation (its trailing newline)."""
    probe = tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                    tokenize=False)
    return len(tok("\n", add_special_tokens=False)["input_ids"]) if probe.endswith("\n") else 0


def entry(key: str, prompts: list[str], captions: list[str], names: list[str], images: list[bytes]) -> dict:
    """One pack as the official step 4 writes it: ``img{i}.jpg`` members (the ingested bytes; PIL opens them
    by content) and the ``json`` of aligned prompts, captions and image names."""
    if not (len(prompts) == len(captions) == len(names) == len(images)):
        raise ValueError(f"pack {key}: {len(prompts)} prompts, {len(captions)} captions, {len(names)} names, "
                         f"{len(images)} images — they must align")
    sample = {"__key__": key, "json": json.dumps({"prompts": prompts, "captions": captions, "images": names},
                                                 ensure_ascii=False).encode("utf-8")}
    for i, img in enumerate(images):
        sample[f"img{i}.jpg"] = img
    return sample


def write_shard(path: Path, entries: list[dict]) -> None:
    """A tar of official entries, written whole under a temporary name, then renamed."""
    import webdataset as wds

    from manifests.io import atomic_write

    with atomic_write(path) as tmp, wds.TarWriter(str(tmp), mtime=0, encoder=False) as tw:
        for e in entries:
            tw.write(e)


def write_meta(root: Path) -> None:
    """``.nv-meta/dataset.yaml`` and ``sample_loader.py`` as the official step 4 defines them."""
    import yaml

    meta = Path(root) / ".nv-meta"
    meta.mkdir(parents=True, exist_ok=True)
    definition = {"sample_type": {"__module__": SAMPLE_MODULE, "__class__": PACKED_CLASS},
                  "part_filter": "sample_loader.py:part_filter", "sample_loader": "sample_loader.py:sample_loader"}
    (meta / "dataset.yaml").write_text(yaml.safe_dump(definition, sort_keys=False))
    (meta / "sample_loader.py").write_text(SAMPLE_LOADER)


# ------------------------------------------------------------------------------------------- reading

def shards(root: str | Path) -> list[tuple[str, int]]:
    """The tars of an official folder, relative to it, with the number of entries energon counted in each
    (``.nv-meta/.info.json``; ``.info.yaml`` from the energon the official release pins), in path order: pack
    numbering follows it, whatever the task count. ``ValueError`` naming what is wrong with an index that is
    not one energon writes: no ``shard_counts`` mapping, a count that is not a whole number ≥ 0, or a tar
    name that would leave the folder (absolute, or with a ``..`` part)."""
    import yaml

    meta = Path(root) / ".nv-meta"
    info = next((p for p in (meta / ".info.json", meta / ".info.yaml") if p.is_file()), None)
    if info is None:
        raise FileNotFoundError(f"{meta} has no .info.json or .info.yaml: an official folder is energon-prepared "
                                f"(`energon prepare {root}`, as its step 4 does)")
    try:
        counts = yaml.safe_load(info.read_text())      # JSON is YAML
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"{info} does not parse: {type(e).__name__}") from None
    counts = counts.get("shard_counts") if isinstance(counts, dict) else None
    if not isinstance(counts, dict):
        raise ValueError(f"{info} has no shard_counts mapping (tar → entries): re-run `energon prepare {root}`")
    for name, n in counts.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{info}: shard_counts[{name!r}] = {n!r} is not a count of entries")
        if not isinstance(name, str) or not safe_relative(name):
            raise ValueError(f"{info}: shard {name!r} is not a path inside {root} (absolute, or with a '..' part)")
    return sorted(counts.items())


def safe_relative(name: str) -> bool:
    """``name`` is a relative path that stays inside the folder it is joined to (lexically: no root, drive,
    ``..`` part, NUL or backslash)."""
    from pathlib import PurePosixPath

    p = PurePosixPath(name)
    return bool(name) and not p.is_absolute() and ".." not in p.parts and "\\" not in name and "\0" not in name


def iter_entries(path: str | Path) -> Iterator[tuple[str, dict]]:
    """``(key, members)`` of every entry of one tar, in file order, members undecoded (bytes)."""
    import webdataset as wds

    keep_all = lambda urls: urls  # noqa: E731  (one shard, read whole: the caller splits the work)
    for s in wds.WebDataset(str(path), shardshuffle=False, empty_check=False, nodesplitter=keep_all,
                            workersplitter=keep_all):
        yield s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}


def parse_entry(members: dict) -> tuple[list[str], list[str], list[bytes]]:
    """An entry's ``(prompts, captions, images)`` as the official loader reads them; ``ValueError`` naming what
    is wrong with an entry it could not load: ``bad_json`` (no json member, not JSON, not an object, or
    ``captions`` / ``images`` / ``prompts`` not a list), ``bad_text`` (a null or non-string prompt or caption),
    ``misaligned``, ``empty`` (no sub-sample: nothing to train on) or ``missing_image``."""
    if "json" not in members:
        raise ValueError("bad_json: the entry has no json member")
    try:
        meta = json.loads(members["json"])
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"bad_json: {type(e).__name__}: {e}"[:300]) from None
    if not isinstance(meta, dict):
        raise ValueError(f"bad_json: the json is {type(meta).__name__}, not an object")
    fields = {"captions": meta.get("captions"), "images": meta.get("images"), "prompts": meta.get("prompts") or []}
    for name, v in fields.items():
        if not isinstance(v, list):
            raise ValueError(f"bad_json: {name} is {_kind(v)}, not a list")
    captions, names, prompts = fields["captions"], fields["images"], fields["prompts"]
    for name in ("prompts", "captions"):
        bad = next((i for i, v in enumerate(fields[name]) if not isinstance(v, str)), None)
        if bad is not None:
            raise ValueError(f"bad_text: {name}[{bad}] is {_kind(fields[name][bad])}, not a string")
    if len(captions) != len(names) or (prompts and len(prompts) != len(names)):
        raise ValueError(f"misaligned: {len(names)} images, {len(captions)} captions, {len(prompts)} prompts")
    if not names:
        raise ValueError("empty: the entry has no images, so no sub-sample to train on")
    missing = [i for i in range(len(names)) if not isinstance(members.get(f"img{i}.jpg"), bytes)]
    if missing:
        raise ValueError(f"missing_image: no img{missing[0]}.jpg member ({len(missing)} of {len(names)} missing)")
    return prompts, captions, [members[f"img{i}.jpg"] for i in range(len(names))]


def _kind(v) -> str:
    return "null" if v is None else f"a {type(v).__name__}"


def count_shift(run_dir, count_for: str, lengths_step: str) -> int:
    """Tokens the target trainer counts fewer than ``lengths`` per sample: 0 for ovpipe's; for ``llava-ov`` the
    template tail its task encoder drops (``tail_tokens`` of the lengths step's tokenizer)."""
    if count_for == "ovpipe":
        return 0
    from ovpipe.inputs import upstream_config
    from packing.lengths import STEP as LENGTHS
    from packing.tokens import load_tokenizer

    return tail_tokens(load_tokenizer(upstream_config(run_dir, lengths_step, LENGTHS)[1].tokenizer))
