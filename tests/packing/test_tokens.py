"""packing.tokens against the reference: apply_chat_template → tokenize → transformers' Qwen2-VL
processor expanding every <|image_pad|>, token for token; the batched counter against the encoder;
the loss mask against the assistant turns tokenized on their own."""
import random

import numpy as np
import pytest

from manifests.conversation import to_messages
from packing.tokens import (CAPTION_PROMPT, Conversations, ImageTokenConfig, count_conversations, encode_conversation,
                            fit_turns, image_grid, image_tokens, prompted_turns, smart_resize, smart_resize_np)

IMG = ImageTokenConfig(min_pixels=56 * 56, max_pixels=448 * 448)

CASES = {
    "caption pair": ([("user", "<image>"), ("assistant", "a red star on a white background.")], [(120, 260)]),
    "multi-turn": ([("system", "You answer briefly."), ("user", "<image>\nHow many shapes are there?"),
                    ("assistant", "There are two shapes."), ("user", "  Which colour is the left one?\n"),
                    ("assistant", "\nIt is red.  "), ("user", "And the right one?"), ("assistant", "Blue!")],
                   [(300, 200)]),
    "multi-image": ([("user", "<image><image>Are these the same shape?"), ("assistant", "No: a circle and a star."),
                     ("user", "Now this one: <image>"), ("assistant", "A teal cross."),
                     ("user", "<image>\nand <image> last"), ("assistant", "Two rings.")],
                    [(56, 56), (1000, 900), (448, 448), (30, 700), (200, 333)]),
    "text-only": ([("system", "Be kind."), ("user", "What is 2 + 2?"), ("assistant", "4"),
                   ("user", "Unicode: café, naïve — 東京 ½ ok?"), ("assistant", "Yes, café.")], []),
}
TEXTS = ["a photo of a red circle and a blue star.", "How many shapes? There are two shapes.", "Which colour is it?",
         "It is red. Blue! A teal cross, two rings.", "What is 2 + 2? Unicode café naïve", "Describe the image."]


def test_smart_resize_matches_transformers_on_a_grid():
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf

    sizes = [1, 14, 27, 28, 29, 41, 42, 56, 57, 100, 223, 224, 225, 333, 448, 500, 640, 1000, 1023, 1920, 4000]
    for h in sizes:
        for w in sizes:
            if max(h, w) / min(h, w) > 200:
                continue
            for mn, mx in [(56 * 56, 28 * 28 * 1280), (3136, 200704), (28 * 28 * 4, 28 * 28 * 16)]:
                assert smart_resize(h, w, 28, mn, mx) == hf(h, w, factor=28, min_pixels=mn, max_pixels=mx), (h, w, mn, mx)


def test_image_tokens_formula():
    cfg = ImageTokenConfig()
    # 448x448 stays 448x448: 32x32 patches, merged 2x2 → 256 pads + vision start/end
    assert image_tokens(np.array([448]), np.array([448]), cfg)[0] == 256 + 2
    h, w = smart_resize_np(np.array([100]), np.array([300]))
    assert image_tokens(np.array([100]), np.array([300]), cfg)[0] == (h[0] // 14) * (w[0] // 14) // 4 + 2


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from packing.tiny_tokenizer import build_tiny_tokenizer
    from packing.tokens import load_tokenizer

    path = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(TEXTS, path)
    return load_tokenizer(str(path))  # loaded back by path, as a real tokenizer would be


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory, tok):
    """A byte-level BPE with Qwen2's own pre-tokenizer (regex Split + ByteLevel) and NFC, the
    pipeline of the real Qwen2/2.5/3 tokenizers."""
    from packing.tiny_tokenizer import build_qwen_style_tokenizer
    from packing.tokens import load_tokenizer

    path = tmp_path_factory.mktemp("qwen-tok")
    build_qwen_style_tokenizer(TEXTS, path, 400, tok.chat_template)
    return load_tokenizer(str(path))


def processor_ids(tok, turns, sizes):
    """The reference: the template rendered by apply_chat_template, then transformers' Qwen2-VL
    processor tokenizes it and expands each <|image_pad|> for PIL images of the given sizes."""
    from PIL import Image
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    # transformers 5 requires a video processor argument; it plays no part for images.
    proc = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=IMG.min_pixels, max_pixels=IMG.max_pixels),
                            tokenizer=tok, video_processor=Qwen2VLVideoProcessor(), chat_template=tok.chat_template)
    text = tok.apply_chat_template(to_messages(turns), tokenize=False)
    images = [Image.new("RGB", (w, h), (200, 30, 30)) for h, w in sizes] or None
    out = proc(text=[text], images=images, return_tensors="np")
    grids = out["image_grid_thw"][:, 1:].tolist() if sizes else []
    return out["input_ids"][0].tolist(), grids


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("which", ["tiny", "qwen2-pretokenizer"])
def test_encode_conversation_equals_processor(tok, qwen_tok, case, which):
    t = tok if which == "tiny" else qwen_tok
    turns, sizes = CASES[case]
    ids, mask, pads, kept = encode_conversation(t, turns, sizes, IMG, caption_prompt=CAPTION_PROMPT)
    ref, grids = processor_ids(t, prompted_turns(turns, len(sizes), CAPTION_PROMPT), sizes)
    assert ids.tolist() == ref
    assert kept == len(turns) and len(mask) == len(ids)
    gh, gw = image_grid(np.array([h for h, _ in sizes], np.int64), np.array([w for _, w in sizes], np.int64), IMG)
    assert [[int(a), int(b)] for a, b in zip(gh, gw)] == grids
    assert pads.tolist() == [a * b // 4 for a, b in grids]
    # the batched counter gives the same lengths
    c = count_conversations(t, Conversations.from_lists([turns], [sizes]), IMG, CAPTION_PROMPT)
    assert c.status == [None]
    assert c.total[0] == len(ids) and c.target[0] == mask.sum()
    pad = t.convert_tokens_to_ids("<|image_pad|>")
    assert c.image[0] == (ids == pad).sum() + 2 * len(sizes)


def test_caption_pair_gets_the_prompt(tok):
    turns, sizes = CASES["caption pair"]
    assert prompted_turns(turns, 1, CAPTION_PROMPT)[0] == ("user", "<image>Describe the image.")
    plain, _, _, _ = encode_conversation(tok, turns, sizes, IMG)
    prompted, _, _, _ = encode_conversation(tok, turns, sizes, IMG, caption_prompt=CAPTION_PROMPT)
    assert len(prompted) == len(plain) + len(tok(CAPTION_PROMPT, add_special_tokens=False)["input_ids"])
    # only an exact "<image>" user turn is a caption pair
    other = [("user", "<image> what?"), ("assistant", "x")]
    assert prompted_turns(other, 1, CAPTION_PROMPT) == other


@pytest.mark.parametrize("case", list(CASES))
def test_loss_mask_is_the_assistant_turns(tok, case):
    turns, sizes = CASES[case]
    ids, mask, _, _ = encode_conversation(tok, turns, sizes, IMG, caption_prompt=CAPTION_PROMPT)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    expect = []  # each assistant text tokenized on its own + the end-of-turn token
    for role, text in turns:
        if role == "assistant":
            expect += tok(text, add_special_tokens=False)["input_ids"] + [end]
    assert int(mask.sum()) == len(expect)
    assert ids[mask.astype(bool)].tolist() == expect
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert not mask[ids == pad].any()


def test_counter_is_exact_on_awkward_text(tok, qwen_tok):
    """Random texts with runs of spaces, tabs, newlines, punctuation, digits, accents, CJK and
    combining marks: the word-cached count equals the tokenizer's own count."""
    rng = random.Random(0)
    alphabet = list("ab cd  ef\n\t.,!?'s 12 345 é e\u0301 東京 — ½ ' \r\n   x_y (z) \x01\x1c\x0b\x85")
    alphabet += [" \n ", "'ll", "  ", "\u00a0"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(400)]
    for t in (tok, qwen_tok):
        from packing.chat_codec import codec_for

        assert codec_for(t).words.cuttable  # the word-cached path, not the whole-text fallback
        got = codec_for(t).count_texts(texts).tolist()
        assert got == [len(x) for x in t(texts, add_special_tokens=False)["input_ids"]]


def test_counts_in_a_batch_match_one_by_one(tok):
    names = list(CASES)
    convs = Conversations.from_lists([CASES[n][0] for n in names] * 3, [CASES[n][1] for n in names] * 3)
    c = count_conversations(tok, convs, IMG, CAPTION_PROMPT)
    for j in range(len(convs)):
        ids, mask, _, _ = encode_conversation(tok, *CASES[names[j % len(names)]], IMG, caption_prompt=CAPTION_PROMPT)
        assert (c.total[j], c.target[j]) == (len(ids), mask.sum())
        assert c.text[j] + c.image[j] == c.total[j]


def test_bad_conversations_get_a_status(tok):
    convs = Conversations.from_lists([[("user", "<image>")], [("user", "hi"), ("assistant", "<image>")],
                                      [("user", "<image>"), ("assistant", "x")], [("bot?", "x"), ("assistant", "y")]],
                                     [[(50, 50)], [(50, 50)], [], []])
    c = count_conversations(tok, convs, IMG)
    assert c.status == ["no_assistant", "image_mismatch", "image_mismatch", "unknown_role"]
    assert (c.total == 0).all()


def test_truncation_keeps_whole_turn_pairs(tok):
    turns, sizes = CASES["multi-image"]
    full, _, _, _ = encode_conversation(tok, turns, sizes, IMG)
    first2, _, _, _ = encode_conversation(tok, turns[:4], sizes[:3], IMG)
    # room for two pairs but not three: the third pair goes, with its two images
    ids, mask, pads, kept = encode_conversation(tok, turns, sizes, IMG, max_tokens=len(first2) + 5)
    assert kept == 4 and len(pads) == 3 and ids.tolist() == first2.tolist()
    convs = Conversations.from_lists([turns], [sizes])
    assert fit_turns(tok, convs, [0], len(first2) + 5, IMG).tolist() == [4]
    assert fit_turns(tok, convs, [0], len(full) - 1, IMG).tolist() == [4]
    first1, _, _, _ = encode_conversation(tok, turns[:2], sizes[:2], IMG)
    assert fit_turns(tok, convs, [0], len(first1), IMG).tolist() == [2]
    assert fit_turns(tok, convs, [0], len(first1) - 1, IMG).tolist() == [0]
    with pytest.raises(ValueError, match="first turn pair"):
        encode_conversation(tok, turns, sizes, IMG, max_tokens=len(first1) - 1)


def test_template_that_strips_texts_is_rejected(tmp_path):
    from packing.tiny_tokenizer import CHAT_TEMPLATE, build_tiny_tokenizer

    t = build_tiny_tokenizer(TEXTS, tmp_path)
    t.chat_template = CHAT_TEMPLATE.replace("part['text']", "part['text'] | trim")
    with pytest.raises(ValueError, match="verbatim"):
        encode_conversation(t, *CASES["text-only"])
