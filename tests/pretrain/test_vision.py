"""RICE-ViT against transformers' MLCDVisionModel, merge-window order, per-image attention, projector."""
import torch

from pretrain.model.vision import Projector, RiceViT, VIT_SIZES, load_mlcd, merge_window_order


def _tiny_mlcd(path):
    from transformers import MLCDVisionConfig, MLCDVisionModel

    torch.manual_seed(0)
    cfg = MLCDVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=56, patch_size=14)
    m = MLCDVisionModel(cfg).eval()
    m.save_pretrained(path)
    return m


def test_merge_window_order():
    o = merge_window_order(2, 4).tolist()
    # row-major 2×4 grid: window 0 = (0,0),(0,1),(1,0),(1,1) = 0,1,4,5; window 1 = 2,3,6,7
    assert o == [0, 1, 4, 5, 2, 3, 6, 7]


def test_matches_mlcd_vision_model(tmp_path):
    hf = _tiny_mlcd(tmp_path / "mlcd")
    ours = load_mlcd(str(tmp_path / "mlcd")).eval()
    img = torch.randn(3, 56, 56)
    with torch.no_grad():
        ref = hf(pixel_values=img[None]).last_hidden_state[0]
        (got,), _ = ours([img], merge_order=False)
        (merged,), _ = ours([img], merge_order=True)
    assert (got - ref).abs().max().item() <= 1e-4
    order = merge_window_order(4, 4)
    assert (merged[1:] - ref[1:][order]).abs().max().item() <= 1e-4   # same tokens, window order
    assert (merged[0] - ref[0]).abs().max().item() <= 1e-4


def test_images_do_not_attend_to_each_other():
    torch.manual_seed(0)
    vit = RiceViT(VIT_SIZES["tiny"]).eval()
    a, b = torch.randn(3, 28, 56), torch.randn(3, 56, 28)
    with torch.no_grad():
        (oa, ob), cu = vit([a, b])
        (sa,), _ = vit([a])
    assert cu.tolist() == [0, 9, 18]
    assert torch.allclose(oa, sa, atol=1e-5)


def test_projector_merges_2x2():
    """The published merger's layout: LayerNorm(ε 1e-5) → 2×2 merge → Linear(4D, 4D) → GELU →
    Linear(4D, LLM)."""
    p = Projector(32, 64)
    out = p(torch.randn(16, 32))
    assert out.shape == (4, 64)
    assert p.ln_q.eps == 1e-5 and p.mlp[0].weight.shape == (128, 128) and p.mlp[2].weight.shape == (64, 128)


def test_tower_has_no_final_norm_and_mlcd_post_layernorm_is_dropped(tmp_path):
    """The published tower hands its last layer to the merger (no post-LayerNorm); MLCD's is not imported."""
    hf = _tiny_mlcd(tmp_path / "mlcd")
    assert any("post_layernorm" in k for k in hf.state_dict())
    ours = load_mlcd(str(tmp_path / "mlcd"))
    assert not any("post_layernorm" in k for k in ours.state_dict())
