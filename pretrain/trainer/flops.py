"""The FLOPs of a micro-batch, counted the way MFU is defined (PaLM, appendix B): the model's matmul
work, from the recipe's shapes and the loader's per-micro-batch counts (``BatchPrep.stats``).

Model FLOPs (MFU):

- 2·N_llm forward per LLM token; N_llm: the LLM's matmul weights (attention q/k/v/o, the SwiGLU
  MLP's three matrices, the output layer once; the input embedding is a lookup and is not counted);
- per tower token 2·N_vit-layers, per image patch the patch embedding (2·3·p²·D; the tower sees 4
  patches per merged image token, and one class token per image), per merged image token 2·N_proj;
- attention per sample, not per pack: a causal sample of s tokens 2·s²·(heads·head_dim) per LLM layer
  forward (QKᵀ and AV over half of the square), an image of n tower tokens 4·n²·D per tower layer
  (non-causal: the whole square);
- backward: 2× forward for a trained part (input and weight gradients); a frozen part that a trained
  part lies before still passes the input gradient back (1× forward: the LLM in stage 1, where the
  projector trains), and a frozen part with nothing trained before it runs its forward only (the tower
  in stage 1). Stage 1 thus counts the frozen LLM 4·N per token (forward + input gradient) and the tower
  2·N; stages 1.5 and 2 count every part 6·N.

Hardware FLOPs (HFU) add the forward passes that activation recompute repeats, wherever a backward
runs through them: ``full`` every LLM layer (not the output layer) and every tower layer (not the patch
embedding); ``selective`` each LLM layer's MLP and core attention and each tower layer's MLP. A frozen
tower with nothing trained before it has no backward, so nothing of it is recomputed.
"""
from __future__ import annotations


def matmul_params(recipe) -> dict:
    """Matmul weights of the recipe's parts (biases, norms and the input embedding not counted)."""
    llm, vit = recipe.llm, recipe.vit
    h = llm.hidden_size
    attn = h * llm.kv_channels * (llm.num_attention_heads * 2 + llm.num_query_groups * 2)   # q, o; k, v
    mlp = 3 * h * llm.ffn_hidden_size                                                    # gate, up, down
    D, I = vit.hidden_size, vit.intermediate_size
    return {"llm_layer_attn": attn, "llm_layer_mlp": mlp, "llm_layers": llm.num_layers * (attn + mlp),
            "llm_output": h * llm.vocab_size, "vit_layer_mlp": 2 * D * I,
            "vit_layers": vit.num_layers * (4 * D * D + 2 * D * I), "patch_embed": 3 * vit.patch_size ** 2 * D,
            "projector": 16 * D * D + 4 * D * h}                   # 2×2 merge: Linear(4D, 4D), Linear(4D, h)


def model_flops(recipe, trainable: str, stats: dict, recompute: str) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one micro-batch from its ``BatchPrep.stats``."""
    llm, vit = recipe.llm, recipe.vit
    h, f, layers = llm.hidden_size, llm.ffn_hidden_size, llm.num_layers
    attn_w = h * llm.kv_channels * (llm.num_attention_heads * 2 + llm.num_query_groups * 2)
    mlp_w = 3 * h * f
    n_llm_layers = layers * (attn_w + mlp_w)
    n_llm = n_llm_layers + h * llm.vocab_size
    D, L, I = vit.hidden_size, vit.num_layers, vit.intermediate_size
    n_vit_mlp = 2 * D * I
    n_vit_layers = L * (4 * D * D + n_vit_mlp)
    n_vit = n_vit_layers + 3 * vit.patch_size ** 2 * D
    n_proj = 16 * D * D + 4 * D * h
    llm_attn = 2 * stats["attn_sq"] * llm.num_attention_heads * llm.kv_channels * layers
    vit_attn = 4 * stats["vit_sq"] * D * L
    fwd_llm = 2 * n_llm * stats["tokens"] + llm_attn
    fwd_vit = 2 * n_vit * stats["vit_tokens"] + vit_attn
    fwd_proj = 2 * n_proj * stats["merged"]
    trains_all = trainable == "all"
    mult_vit, mult_proj, mult_llm = (3, 3, 3) if trains_all else (1, 3, 2)
    mf = mult_vit * fwd_vit + mult_proj * fwd_proj + mult_llm * fwd_llm
    extra = 0.0
    if recompute == "full":
        extra = fwd_llm - 2 * h * llm.vocab_size * stats["tokens"] + fwd_vit
    elif recompute == "selective":
        extra = 2 * layers * mlp_w * stats["tokens"] + llm_attn + 2 * L * n_vit_mlp * stats["vit_tokens"]
    return float(mf), float(mf + extra)
