"""Import a tiny Qwen3ForCausalLM saved by the test, compare logits with transformers', export back."""
import torch


def _tiny_qwen3(path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True)
    m = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # non-trivial norms, so a mis-mapped norm weight would show
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(torch.rand_like(p) * 0.5)
    m.save_pretrained(path)
    return m


def test_qwen3_import_matches_transformers_and_exports_back(megatron_single, tmp_path):
    from llava_ov.qwen3 import megatron_to_qwen3
    from pretrain.import_model import load_qwen3
    from pretrain.model.llm import LLM_SIZES, build_llm

    hf = _tiny_qwen3(tmp_path / "qwen3").eval()
    ours = build_llm(LLM_SIZES["tiny"], backend="sdpa").eval()
    size = load_qwen3(str(tmp_path / "qwen3"), ours)
    tokens = torch.randint(0, 512, (1, 24))
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens, torch.arange(24)[None], attention_mask=None)
    assert (got - ref).abs().max().item() <= 1e-4
    back = megatron_to_qwen3(ours.state_dict(), size)
    for k, v in hf.state_dict().items():
        assert torch.equal(back[k], v), k
