"""HF Qwen3 + MLCD checkpoints → stage-0 dist checkpoint → stage 1 starts from them (and, the
projector aside, leaves them as they were)."""
import shutil

import pytest
import torch


def _save_hf(tmp_path, hidden=64):
    from transformers import MLCDVisionConfig, MLCDVisionModel, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(3)
    llm = Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True))
    llm.save_pretrained(tmp_path / "qwen3")
    vit = MLCDVisionModel(MLCDVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=56, patch_size=14))
    vit.save_pretrained(tmp_path / "mlcd")
    return llm, vit


def test_stage1_starts_from_imported_weights(megatron_single, packed_demo, tmp_path):
    from pretrain.trainer.checkpoint import load_state_dict
    from llava_ov.qwen3 import qwen3_to_megatron
    from pretrain.import_model import import_hf
    from pretrain.model.llm import LLM_SIZES
    from pretrain.train import train
    from pretrain.trainer.config import TrainConfig

    llm, vit = _save_hf(tmp_path)
    run = tmp_path / "run"
    shutil.copytree(packed_demo, run)
    ck = import_hf(run, "tiny", str(tmp_path / "qwen3"), str(tmp_path / "mlcd"))
    assert ck == run / "pretrain" / "stage-0" / "dist_ckpt" and (ck / "iter_0000000" / "step.json").exists()
    out = train(TrainConfig(run_dir=run, recipe="tiny", stage="1", steps=2, micro_batch=1, lr=1e-2),
                log=lambda *_: None)
    after = load_state_dict(out["checkpoint"], "tiny")
    want_llm = qwen3_to_megatron(llm.state_dict(), LLM_SIZES["tiny"])
    for k, v in want_llm.items():                          # frozen in stage 1: still the HF weights
        assert torch.equal(after[f"llm.{k}"], v), k
    for k, v in vit.state_dict().items():
        k = k.removeprefix("vision_model.")
        if f"vision.{k}" in after:
            assert torch.equal(after[f"vision.{k}"], v), k
    assert sum(k.startswith("vision.") for k in after) >= 10
    start = load_state_dict(ck, "tiny")
    assert any(not torch.equal(after[k], start[k]) for k in after if k.startswith("projector."))


def test_mismatched_checkpoint_names_the_field(megatron_single, tmp_path):
    from pretrain.import_model import import_hf

    _save_hf(tmp_path, hidden=32)
    with pytest.raises(ValueError, match=r"hidden_size=32 \(recipe: 64\)"):
        import_hf(tmp_path / "run", "tiny", str(tmp_path / "qwen3"))


def test_stage_1_5_starts_from_an_imported_llava_ov_checkpoint(megatron_single, packed_demo, tmp_path):
    """A LLaVA-OneVision-1.5 folder saved by the official class, imported as ``stage-1``: stage 1.5
    starts from exactly its weights (one step at lr 0 leaves them as they were)."""
    from llava_ov.official import files, load

    if files() is None:
        pytest.skip("lmms-engine is not installed (make install adds it, --no-deps)")
    from packing.tokens import load_tokenizer
    from pretrain.trainer.checkpoint import load_state_dict
    from pretrain.import_model import import_llava_ov, read_safetensors
    from llava_ov.convert import config_dict, to_ours
    from pretrain.recipes import RECIPES
    from pretrain.train import train
    from pretrain.trainer.config import TrainConfig

    official = load()
    run = tmp_path / "run"
    shutil.copytree(packed_demo, run)
    torch.manual_seed(11)
    tok = load_tokenizer(str(run / "tokenizer"))
    cfg = official.configuration.Llavaonevision1_5Config(**config_dict(RECIPES["tiny"], tok))
    m = official.LLaVAOneVision1_5_ForConditionalGeneration(cfg)
    m.lm_head.weight = m.model.language_model.embed_tokens.weight                  # the tiny recipe ties them
    m._tied_weights_keys = {"lm_head.weight": "model.language_model.embed_tokens.weight"}   # transformers 5's form
    m.save_pretrained(str(tmp_path / "release"))
    ck = import_llava_ov(run, "tiny", str(tmp_path / "release"), stage="1")
    assert ck == run / "pretrain" / "stage-1" / "dist_ckpt"
    out = train(TrainConfig(run_dir=run, recipe="tiny", stage="1.5", steps=1, micro_batch=1, lr=0.0),
                log=lambda *_: None)
    after = load_state_dict(out["checkpoint"], "tiny")
    want = to_ours(read_safetensors(tmp_path / "release"), RECIPES["tiny"])
    assert len(want) > 40 and all(torch.equal(after[k], v) for k, v in want.items())
