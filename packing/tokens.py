"""The one place that says which tokens a conversation occupies and which of them carry the
loss — shared by ``lengths`` (batched counts), the packed-shard writer (``encode_conversation``)
and through the shards the trainer, so packing and training cannot disagree.

Tokens of a conversation = the tokenizer's own chat template applied to
``manifests.conversation.to_messages(turns)`` (content parts; a Qwen2-VL-style template renders
each image part as ``<|vision_start|><|image_pad|><|vision_end|>``), tokenized, with each image's
single ``<|image_pad|>`` expanded to its native-resolution pad count (``packing.image_tokens``) —
exactly what ``apply_chat_template`` followed by transformers' Qwen2-VL processor gives
(``tests/packing/test_tokens.py`` checks this token for token)::

    image_tokens = Σ_images (h'/14)·(w'/14)/4 + 2      (vision start/end count as image tokens)
    text_tokens  = total − image_tokens                 (turn texts + template scaffolding)
    target       = Σ_assistant turns (text tokens + the <|im_end|> that closes the turn)

Loss mask: 1 on every assistant turn's text tokens and the end-of-turn token that closes it,
0 on everything else (system and user turns, images, role headers, template scaffolding).

A caption pair whose user turn is exactly ``<image>`` is trained with ``caption_prompt``
appended to that turn (``"<image>Describe the image."`` → caption), as stage 1.5 always was.

Counting stays one batched tokenizer call per slice — no template render per sample: the template
is rendered once per conversation *shape* and split into fixed pieces and variable text segments,
whose words are counted through a cache (``packing.chat_codec``). ``truncate`` keeps the most
whole leading turn pairs that fit (``fit_turns``); ``encode_conversation`` makes the same choice.

Public: ``Conversations`` (a batch as flat arrays, ``from_arrow`` / ``from_lists``),
``count_conversations`` → ``TokenCounts``, ``fit_turns``, ``encode_conversation``,
``prompted_turns``, ``turn_pairs``, ``load_tokenizer``, and the image arithmetic re-exported from
``packing.image_tokens``.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from manifests.conversation import IMAGE_TOKEN
from packing.chat_codec import END_OF_TURN, Conversations, TokenCounts, codec_for, shape_key, turn_pairs
from packing.image_tokens import (IMAGE_PAD, VISION_END, VISION_START, ImageTokenConfig, aspect_ok, image_grid,
                                  image_pad_tokens, image_tokens, smart_resize, smart_resize_np)

__all__ = ["CAPTION_PROMPT", "END_OF_TURN", "IMAGE_PAD", "VISION_END", "VISION_START", "Conversations",
           "ImageTokenConfig", "TokenCounts", "aspect_ok", "count_conversations", "encode_conversation", "fit_turns",
           "image_grid", "image_pad_tokens", "image_tokens", "load_tokenizer", "prompted_turns", "smart_resize",
           "smart_resize_np", "turn_pairs"]

# Stage 1 / 1.5 caption pairs are trained as "<image>Describe the image." → caption (the lengths
# config's caption_prompt); instruction conversations carry their own prompts.
CAPTION_PROMPT = "Describe the image."


def load_tokenizer(path_or_name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path_or_name)


def prompted_turns(turns: Sequence[tuple[str, str]], n_images: int, caption_prompt: str) -> list[tuple[str, str]]:
    """A caption pair whose user turn is exactly ``<image>`` gets ``caption_prompt`` appended to
    that turn (``"<image>Describe the image."``); any other conversation is returned as is."""
    turns = [(r, t) for r, t in turns]
    roles, texts = [r for r, _ in turns], [t for _, t in turns]
    if shape_key(roles, texts, caption_prompt, n_images)[0] != shape_key(roles, texts)[0]:   # the rule applied
        turns[0] = ("user", IMAGE_TOKEN + caption_prompt)
    return turns


def count_conversations(tok, convs: Conversations, img_cfg: ImageTokenConfig = ImageTokenConfig(),
                        caption_prompt: str = "") -> TokenCounts:
    """Batched text / image / target tokens of every conversation (see the module docstring)."""
    return codec_for(tok).count(convs, img_cfg, caption_prompt)


def fit_turns(tok, convs: Conversations, rows, max_tokens: int, img_cfg: ImageTokenConfig = ImageTokenConfig(),
              caption_prompt: str = "") -> np.ndarray:
    """Turns to keep for each of ``rows`` so it fits ``max_tokens`` (0: not even one pair fits)."""
    return codec_for(tok).fit(convs, rows, max_tokens, img_cfg, caption_prompt)


def encode_conversation(tok, turns: Sequence[tuple[str, str]], image_sizes: Sequence[tuple[int, int]],
                        img_cfg: ImageTokenConfig = ImageTokenConfig(), max_tokens: int | None = None,
                        caption_prompt: str = ""):
    """Token ids and loss mask of one conversation, image pads expanded — what the trainer sees.

    ``turns``: ``(role, text)`` with ``<image>`` placeholders; ``image_sizes``: ``(height, width)``
    of each image in placeholder order. A caption pair gets ``caption_prompt`` (see
    ``prompted_turns``). With ``max_tokens``, a longer conversation keeps the most whole leading
    turn pairs that fit (the ``lengths`` step's ``truncate`` policy, same search); the images of
    dropped turns go with them. Returns ``(ids: int32[n], loss_mask: uint8[n],
    n_pads_per_image: int64[kept images], turns_kept)``; raises ``ValueError`` when the
    conversation cannot be rendered or not even its first turn pair fits.
    """
    codec = codec_for(tok)
    placeholders = sum((t or "").count(IMAGE_TOKEN) for _, t in turns)
    if placeholders != len(image_sizes):
        raise ValueError(f"image_mismatch: {placeholders} {IMAGE_TOKEN} placeholder(s) but {len(image_sizes)} image(s)")
    convs = Conversations.from_lists([list(turns)], [list(image_sizes)])
    kept = len(turns)
    if max_tokens is not None:
        c = codec.count(convs, img_cfg, caption_prompt)
        if c.status[0] is not None:
            raise ValueError(f"{c.status[0]}: {c.error[0]}")
        if c.total[0] > max_tokens:
            kept = int(codec.fit(convs, np.array([0]), max_tokens, img_cfg, caption_prompt)[0])
            if kept == 0:
                raise ValueError(f"{c.total[0]} tokens > {max_tokens} and not even the first turn pair fits")
    turns = [(r, t) for r, t in turns[:kept]]
    n_img = sum(t.count(IMAGE_TOKEN) for _, t in turns)
    sizes = np.array(list(image_sizes[:n_img]), np.int64).reshape(-1, 2)
    key, holes = shape_key([r for r, _ in turns], [t for _, t in turns], caption_prompt, n_img)
    shape = codec.shape(key)
    if shape.status is not None:
        raise ValueError(f"{shape.status[0]}: {shape.status[1]}")
    if shape.n_images != len(sizes):
        raise ValueError(f"image_mismatch: {shape.n_images} {IMAGE_TOKEN} placeholder(s) but {len(sizes)} image size(s)")
    pads = image_pad_tokens(sizes[:, 0], sizes[:, 1], img_cfg) if len(sizes) else np.zeros(0, np.int64)
    ids, mask = codec.assemble(shape, holes, pads)
    return ids, mask, pads.astype(np.int64), kept
