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
