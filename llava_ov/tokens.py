"""The token facts of a Qwen2-VL-style tokenizer folder that the model needs, read from its own files —
no tokenizer library, no tokenisation code."""
from __future__ import annotations

import json
from pathlib import Path

IMAGE_PAD = "<|image_pad|>"


def image_pad_id(folder: str | Path) -> int:
    """The id of ``<|image_pad|>`` in ``folder``'s ``tokenizer.json`` (its added tokens), which the model
    replaces by image features. A ``ValueError`` naming the folder when it has none."""
    path = Path(folder) / "tokenizer.json"
    try:
        added = json.loads(path.read_text()).get("added_tokens", [])
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer {folder}: cannot read {path} ({e})") from None
    for tok in added:
        if tok.get("content") == IMAGE_PAD:
            return int(tok["id"])
    raise ValueError(f"tokenizer {folder}: no {IMAGE_PAD} token (a Qwen2-VL-style tokenizer is needed)")
