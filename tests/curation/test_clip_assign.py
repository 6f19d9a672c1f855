import numpy as np
import pytest
import torch

torch.set_num_threads(2)


def test_tiny_checkpoint_loads_through_the_tag_code_path(tmp_path):
    import open_clip

    from curation.clip import load_clip, register_configs

    register_configs()
    net, _, _ = open_clip.create_model_and_transforms("ovpipe-tiny-clip", pretrained=None)
    ckpt = tmp_path / "tiny.pt"
    torch.save({"state_dict": net.state_dict()}, ckpt)
    loaded, preprocess, tokenizer, device = load_clip("ovpipe-tiny-clip", str(ckpt), "cpu")
    for (k, a), (_, b) in zip(net.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k
    x = preprocess(__import__("PIL.Image", fromlist=["Image"]).new("RGB", (90, 50), "red")).unsqueeze(0)
    assert x.shape == (1, 3, 64, 64)
    with torch.no_grad():
        assert loaded.encode_text(tokenizer(["a red circle"])).shape == (1, 128)


def test_default_metaclip_tag_is_registered():
    import open_clip

    from curation.clip import DEFAULT_MODEL, DEFAULT_PRETRAINED

    assert DEFAULT_PRETRAINED in open_clip.list_pretrained_tags_by_model(DEFAULT_MODEL)


TOWERS = {   # open_clip's CLIP (the demo's tiny model), a CustomTextCLIP tower, and a bidirectional one (SigLIP-like)
    "clip": None,
    "custom": {"context_length": 32, "vocab_size": 49408, "width": 64, "heads": 4, "layers": 2},
    "bidirectional": {"context_length": 32, "vocab_size": 49408, "width": 64, "heads": 4, "layers": 2,
                      "no_causal_mask": True, "pool_type": "last"},
}


@pytest.mark.parametrize("kind", list(TOWERS))
def test_a_query_runs_on_its_own_tokens_and_gives_the_padded_vector(kind):
    import open_clip
    from open_clip.model import CustomTextCLIP

    from curation.clip import encode_text_trimmed, register_configs

    register_configs()
    torch.manual_seed(0)
    if TOWERS[kind] is None:
        net = open_clip.create_model("ovpipe-tiny-clip", pretrained=None)
    else:
        net = CustomTextCLIP(64, {"image_size": 32, "layers": 1, "width": 64, "patch_size": 16}, TOWERS[kind])
    net.eval()
    tokens = open_clip.get_tokenizer("ovpipe-tiny-clip")(["handwritten receipt", "a red circle on a blue square",
                                                          "x"])
    seen = []
    blocks = net.transformer if kind == "clip" else net.text.transformer
    blocks.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    with torch.inference_mode():
        padded = torch.nn.functional.normalize(net.encode_text(tokens), dim=-1)
        seen.clear()
        trimmed = torch.nn.functional.normalize(encode_text_trimmed(net, tokens), dim=-1)
    longest = int(tokens.argmax(-1).max()) + 1                 # the longest query's tokens, end-of-text included
    assert seen == ([tokens.shape[1]] if kind == "bidirectional" else [longest]) and longest < tokens.shape[1]
    assert ((padded * trimmed).sum(-1) > 1 - 1e-6).all()


def test_the_query_tower_drops_the_image_tower_and_keeps_the_vector(tmp_path):
    import open_clip

    from curation.clip import embed_query, load_text_tower, register_configs

    register_configs()
    net, _, _ = open_clip.create_model_and_transforms("ovpipe-tiny-clip", pretrained=None)
    ckpt = tmp_path / "tiny.pt"
    torch.save({"state_dict": net.state_dict()}, ckpt)
    tok = open_clip.get_tokenizer("ovpipe-tiny-clip")
    with torch.inference_mode():
        ref = torch.nn.functional.normalize(net.eval().encode_text(tok(["a red circle"])), dim=-1)[0].numpy()
    for precision in ("fp32", "bf16"):
        tower, tokenizer = load_text_tower("ovpipe-tiny-clip", str(ckpt), precision)
        v = embed_query(tower, tokenizer, "a red circle")
        assert tower.visual is None and v.dtype == np.float32 and abs(np.linalg.norm(v) - 1) < 1e-5
        assert v @ ref > (1 - 1e-6 if precision == "fp32" else 0.999)


def _unit(rng, n, d):
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("tiles", [(7, 13), (64, 1000), (10_000, 100_000)])
def test_faiss_and_tiled_torch_agree(tiles):
    from curation.assign import topk_faiss, topk_torch

    rng = np.random.default_rng(0)
    X, C = _unit(rng, 300, 32), _unit(rng, 2000, 32)
    s1, i1 = topk_torch(X, C, 10, image_tile=tiles[0], concept_tile=tiles[1])
    s2, i2 = topk_faiss(X, C, 10)
    ref = np.argsort(-(X @ C.T), axis=1)[:, :10]
    # identical ids except where two scores tie within float error
    gap = np.abs(np.sort(X @ C.T, axis=1)[:, ::-1][:, :11] - np.roll(np.sort(X @ C.T, axis=1)[:, ::-1][:, :11], -1, 1))
    ties = (gap[:, :10] < 1e-6).any(axis=1)
    assert (i1[~ties] == ref[~ties]).all() and (i2[~ties] == ref[~ties]).all()
    assert np.allclose(s1, s2, atol=1e-5)
