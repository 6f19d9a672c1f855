"""Export a trained stage back to Hugging Face: the LLM as ``Qwen3ForCausalLM``, the tower as
``MLCDVisionModel`` (RICE-ViT), the projector as ``projector.safetensors``.

    python -m pretrain.export --run-dir RUN --stage 2 --out DIR
"""
from __future__ import annotations

import argparse
from pathlib import Path



def export(run_dir: Path, stage: str, out: Path, recipe: str = "tiny") -> Path:
    from safetensors.torch import save_file
    from transformers import MLCDVisionConfig, MLCDVisionModel, Qwen3Config, Qwen3ForCausalLM

    from pretrain.hf import megatron_to_qwen3
    from pretrain.recipes import RECIPES

    r = RECIPES[recipe]
    from pretrain.dist_ckpt import load_state_dict

    state = load_state_dict(Path(run_dir) / "pretrain" / f"stage-{stage}" / "dist_ckpt", recipe)
    llm = {k.removeprefix("llm."): v for k, v in state.items() if k.startswith("llm.") and not k.endswith("_extra_state")}
    s = r.llm
    cfg = Qwen3Config(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.ffn_hidden_size,
                      num_hidden_layers=s.num_layers, num_attention_heads=s.num_attention_heads,
                      num_key_value_heads=s.num_query_groups, head_dim=s.kv_channels, rms_norm_eps=1e-6,
                      rope_theta=s.rope_theta, tie_word_embeddings=s.tie_embeddings, max_position_embeddings=32768)
    hf = Qwen3ForCausalLM(cfg)
    hf.load_state_dict(megatron_to_qwen3(llm, s), strict=True)
    hf.save_pretrained(out / "llm")
    v = r.vit
    vcfg = MLCDVisionConfig(hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, num_hidden_layers=v.num_layers,
                            num_attention_heads=v.num_heads, patch_size=v.patch_size, layer_norm_eps=v.layer_norm_eps)
    vm = MLCDVisionModel(vcfg)
    vision = {k.removeprefix("vision."): t for k, t in state.items() if k.startswith("vision.")}
    missing, unexpected = vm.load_state_dict(vision, strict=False)
    missing = [k for k in missing if "position" not in k]
    if missing or unexpected:
        raise KeyError(f"vision export: missing {missing[:5]}, unexpected {unexpected[:5]}")
    vm.save_pretrained(out / "vision")
    save_file({k.removeprefix("projector."): t.contiguous() for k, t in state.items() if k.startswith("projector.")},
              str(out / "projector.safetensors"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--stage", default="2")
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from pretrain.train import setup_distributed

    setup_distributed(1)                 # the dist checkpoint is read into a TP=1 model
    print(export(Path(a.run_dir), a.stage, Path(a.out), a.recipe))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
