"""A trained stage exports to transformers models that reproduce our forward passes."""
import shutil

import torch


def test_export_roundtrip(megatron_single, packed_demo, tmp_path):
    from transformers import MLCDVisionModel, Qwen3ForCausalLM

    from pretrain.export import export
    from pretrain.recipes import RECIPES
    from pretrain.train import image_pad_id, train
    from pretrain.vlm import VLM

    run = tmp_path / "run"
    shutil.copytree(packed_demo, run)
    out = train(run, "tiny", "1.5", steps=2, micro_batch=1, lr=1e-2, log=lambda *_: None)
    export(run, "1.5", tmp_path / "hf")
    ours = VLM(RECIPES["tiny"], image_pad_id(run, None), backend="sdpa").eval()
    from pretrain.dist_ckpt import load_model

    load_model(out["checkpoint"], ours)
    tokens = torch.randint(0, 512, (1, 20))
    with torch.no_grad():
        mine = ours.llm(tokens, torch.arange(20)[None], attention_mask=None)
        theirs = Qwen3ForCausalLM.from_pretrained(tmp_path / "hf" / "llm").eval()(tokens).logits
        assert (mine - theirs).abs().max().item() <= 1e-4
        img = torch.randn(3, 56, 56)
        (v,), _ = ours.vision([img], merge_order=False)
        ref = MLCDVisionModel.from_pretrained(tmp_path / "hf" / "vision").eval()(pixel_values=img[None]).last_hidden_state[0]
        assert (v - ref).abs().max().item() <= 1e-4
    assert (tmp_path / "hf" / "projector.safetensors").exists()
