import numpy as np
import pytest

from packing.tokens import (ImageTokenConfig, conversation, encode_sample, image_tokens, smart_resize,
                            smart_resize_np, text_token_counts)


def test_smart_resize_matches_transformers_on_a_grid():
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf

    sizes = [1, 14, 27, 28, 29, 41, 42, 56, 57, 100, 223, 224, 225, 333, 448, 500, 640, 1000, 1023, 1920, 4000]
    hs, ws, ref = [], [], []
    for h in sizes:
        for w in sizes:
            if max(h, w) / min(h, w) > 200:
                continue
            for mn, mx in [(56 * 56, 28 * 28 * 1280), (3136, 200704), (28 * 28 * 4, 28 * 28 * 16)]:
                hs.append((h, w, mn, mx))
                ref.append(hf(h, w, factor=28, min_pixels=mn, max_pixels=mx))
    for (h, w, mn, mx), r in zip(hs, ref):
        assert smart_resize(h, w, 28, mn, mx) == r, (h, w, mn, mx)


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
    build_tiny_tokenizer(["a photo of a red circle and a blue star.", "an image showing a teal cross."], path)
    return load_tokenizer(str(path))  # loaded back by path, as a real tokenizer would be


@pytest.mark.parametrize("template", ["caption", "instruct"])
@pytest.mark.parametrize("text", ["a red star.", "an image showing a teal cross and a lime ring!", "x"])
def test_encode_sample_equals_chat_template(tok, template, text):
    ids, mask, n_pad = encode_sample(tok, text, 120, 260, template)
    ref = tok.apply_chat_template(conversation(template, text), tokenize=True)
    ref = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    j = ref.index(pad)
    ref = ref[:j] + [pad] * n_pad + ref[j + 1:]
    assert ids.tolist() == ref
    # lengths' batched count agrees with the encoder, token for token
    total = text_token_counts(tok, [text], template)[0] + image_tokens(np.array([120]), np.array([260]))[0]
    assert total == len(ids)
    # loss only on the assistant text and its end-of-turn token
    target = tok(text, add_special_tokens=False)["input_ids"]
    assert mask.sum() == len(target) + 1
    assert ids[mask.astype(bool)].tolist()[:-1] == target


def test_truncation_to_max_tokens(tok):
    ids, mask, _ = encode_sample(tok, "a red star " * 50, 56, 56, "caption")
    cut, cmask, _ = encode_sample(tok, "a red star " * 50, 56, 56, "caption", max_tokens=len(ids) - 20)
    assert len(cut) == len(ids) - 20
    assert cut[-2:].tolist() == ids[-2:].tolist()  # the end of turn survives
