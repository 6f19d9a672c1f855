import io
import shutil

import numpy as np
import pytest


@pytest.fixture(scope="session")
def megatron_single():
    """One process with megatron's model-parallel state (TP=PP=CP=1), set up the way training does it
    (``setup_distributed``: CPU compat applied, a private loopback gloo store)."""
    import torch
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain.trainer.build import setup_distributed

    torch.set_num_threads(2)
    setup_distributed(1)
    model_parallel_cuda_manual_seed(1234)
    yield


@pytest.fixture(scope="session")
def packed_demo(ingested_run, tmp_path_factory):
    """The demo's caption samples through ``lengths`` and ``pack`` twice: ``pack`` (stage 1.5's data)
    and ``pack-align`` (stage 1's; in the demo the same caption pairs stand in for LLaVA-558K)."""
    from ovpipe.cli import main
    from packing.tiny_tokenizer import main as build_tok

    run = tmp_path_factory.mktemp("pt")
    shutil.copytree(ingested_run / "ingest", run / "ingest")
    assert build_tok(["--out", str(run / "tokenizer"), "--run-dir", str(run)]) == 0
    assert main(["lengths", "--set", f"tokenizer={run / 'tokenizer'}", "--set", "seq_len=512", "--run-dir", str(run),
                 "--quiet"]) == 0
    assert main(["pack", "--set", "seq_len=512", "--run-dir", str(run), "--quiet"]) == 0
    assert main(["pack", "--name", "pack-align", "--set", "seq_len=512", "--run-dir", str(run), "--quiet"]) == 0
    return run


# --------------------------------------------------------------------------------------------
# Conversation packs made here, token by token, so the tests know which token is what.

CONVERSATIONS = {   # name: (turns, image sizes (h, w)); sizes are multiples of 28, so smart_resize keeps them
    "cap1": ([("user", "<image>"), ("assistant", "A red circle on a white field.")], [(56, 56)]),
    "cap2": ([("user", "<image>"), ("assistant", "Two blue squares.")], [(56, 84)]),
    "multi": ([("user", "<image>\nHow many circles are there?"), ("assistant", "There are two circles."),
               ("user", "What colour are they?"), ("assistant", "They are red.")], [(56, 56)]),
    "two_img": ([("system", "You compare pictures."), ("user", "Image one <image> and two <image>. Which is bigger?"),
                 ("assistant", "The second one.")], [(56, 56), (84, 56)]),
    "text1": ([("user", "What is two plus two?"), ("assistant", "Four.")], []),
    "text2": ([("user", "Name a colour."), ("assistant", "Blue."), ("user", "Another one?"),
               ("assistant", "Green.")], []),
    "text3": ([("user", "Say hello."), ("assistant", "Hello there.")], []),
}
# Six packs; micro-batches of one pack alternate text-only / with images, starting text-only (the
# first step is the one megatron's DDP takes its reference gradient count from).
PACKS = [["text1", "text2"], ["cap1", "multi"], ["text3"], ["two_img", "text1"], ["text2", "text3"], ["cap2"]]


def _png(h: int, w: int, colour) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, format="PNG")
    return buf.getvalue()


def encode_conversation(tok, turns, pads_per_image):
    """The chat template's tokens with each image's pads expanded, the target mask (assistant text
    + the ``<|im_end|>`` closing each assistant turn) and a tag per token: user / system /
    assistant text, header, image (pads), marker (vision start/end), end-<role>, newline."""
    special = {t: tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                                                          "<|image_pad|>")}
    ids, mask, tags = [], [], []

    def add(xs, target, tag):
        ids.extend(xs)
        mask.extend([int(target)] * len(xs))
        tags.extend([tag] * len(xs))

    img = 0
    for role, text in turns:
        add(tok(f"<|im_start|>{role}\n", add_special_tokens=False)["input_ids"], 0, "header")
        for j, part in enumerate(text.split("<image>")):
            if j:
                add([special["<|vision_start|>"]], 0, "marker")
                add([special["<|image_pad|>"]] * pads_per_image[img], 0, "image")
                add([special["<|vision_end|>"]], 0, "marker")
                img += 1
            if part:
                add(tok(part, add_special_tokens=False)["input_ids"], role == "assistant", role)
        add([special["<|im_end|>"]], role == "assistant", f"end-{role}")
        add(tok("\n", add_special_tokens=False)["input_ids"], 0, "newline")
    # the fixture's own check: exactly what the tokenizer's chat template renders (one pad per image there)
    msgs = [{"role": r, "content": _content(t)} for r, t in turns]
    ref = tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]
    pad = special["<|image_pad|>"]
    assert [x for x in ids if x != pad] == [x for x in ref if x != pad] and ref.count(pad) == len(pads_per_image)
    return np.asarray(ids, np.int32), np.asarray(mask, np.uint8), tags


def _content(text: str) -> list[dict]:
    """Chat content parts of a turn: ``<image>`` placeholders become image parts, in order."""
    parts = []
    for j, part in enumerate(text.split("<image>")):
        if j:
            parts.append({"type": "image"})
        if part:
            parts.append({"type": "text", "text": part})
    return parts


@pytest.fixture(scope="session")
def conversation_run(tmp_path_factory):
    """A run folder with the tiny tokenizer and one pack step, ``pack-conv``: ``PACKS`` of
    ``CONVERSATIONS`` written as packed shards (``packing.shards.write_shard``) plus its ``packs``
    manifest. Returns ``(run, info)``; ``info[pack_id]`` lists ``(name, tags)`` per sample."""
    from manifests.io import write_part
    from packing.shards import write_shard
    from packing.tiny_tokenizer import build_tiny_tokenizer
    from packing.tokens import image_grid

    run = tmp_path_factory.mktemp("conv")
    texts = [t.replace("<image>", "") for turns, _ in CONVERSATIONS.values() for _, t in turns]
    tok = build_tiny_tokenizer(texts, run / "tokenizer")
    colours = iter([(200, 30, 30), (30, 30, 200), (30, 160, 30), (220, 220, 40), (120, 40, 160)] * 4)
    enc = {}
    for name, (turns, sizes) in CONVERSATIONS.items():
        gh, gw = image_grid(np.array([h for h, _ in sizes], np.int64), np.array([w for _, w in sizes], np.int64))
        grids = [(int(a), int(b)) for a, b in zip(gh, gw)]
        ids, mask, tags = encode_conversation(tok, turns, [a * b // 4 for a, b in grids])
        enc[name] = (ids, mask, tags, [_png(h, w, next(colours)) for h, w in sizes], grids)
    entries, rows, info = [], [], {}
    for pid, names in enumerate(PACKS):
        lengths = [len(enc[n][0]) for n in names]
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int).tolist()
        sids = [f"{list(CONVERSATIONS).index(n):016x}" for n in names]
        entries.append({"pack_id": pid, "sample_ids": sids, "lengths": lengths, "offsets": offsets, "seq_len": 256,
                        "ids": np.concatenate([enc[n][0] for n in names]),
                        "mask": np.concatenate([enc[n][1] for n in names]),
                        "images": [b for n in names for b in enc[n][3]],
                        "exts": ["png" for n in names for _ in enc[n][3]],
                        "grids": [g for n in names for g in enc[n][4]],
                        "image_counts": [len(enc[n][3]) for n in names]})
        rows.append({"pack_id": pid, "sample_ids": sids, "lengths": lengths, "offsets": offsets,
                     "total_tokens": sum(lengths), "shard": "pack-00000-00000.tar"})
        info[pid] = [(n, enc[n][2]) for n in names]
    write_shard(run / "pack-conv" / "data" / "pack-00000-00000.tar", entries)
    write_part(rows, run / "pack-conv" / "packs" / "part-00000.parquet", "packs")
    return run, info
