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

Hardware FLOPs (HFU) add the forward work that activation recompute repeats, wherever a backward
runs through it: ``full`` every LLM layer (not the output layer; megatron's reentrant checkpoint reruns
each layer whole) and every tower layer but its MLP's down projection; ``selective`` each LLM layer's
MLP and core attention, and each tower layer's MLP up projection; ``mlp`` each LLM layer's MLP (and the
tower as ``selective``). The tower's mode can be set apart (``vision_recompute``). The tower's recompute is torch's
non-reentrant checkpoint, which stops once every tensor the backward needs is back, so the down
projection, whose output no backward reads, is not rerun (measured with ``FlopCounterMode`` in
``tests/pretrain/test_flops.py``). A frozen tower with nothing trained before it has no backward, so
nothing of it is recomputed.
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
            "llm_output": h * llm.vocab_size, "vit_layer_mlp": 2 * D * I,              # fc1 and fc2, D·I each
            "vit_layers": vit.num_layers * (4 * D * D + 2 * D * I), "patch_embed": 3 * vit.patch_size ** 2 * D,
            "projector": 16 * D * D + 4 * D * h}                   # 2×2 merge: Linear(4D, 4D), Linear(4D, h)


def forward_flops(recipe, stats: dict) -> dict:
    """Forward FLOPs of one micro-batch by part, from its ``BatchPrep.stats``: ``tokens`` (LLM
    tokens), ``attn_sq`` (Σ sample length²), ``vit_tokens`` (tower tokens: patches + one class token
    per image), ``vit_sq`` (Σ image tower tokens²), ``merged`` (image tokens in the LLM; 4 patches each)."""
    llm, vit = recipe.llm, recipe.vit
    n = matmul_params(recipe)
    return {"llm_layers": 2 * n["llm_layers"] * stats["tokens"],
            "llm_attn": 2 * stats["attn_sq"] * llm.num_attention_heads * llm.kv_channels * llm.num_layers,
            "llm_mlp": 2 * llm.num_layers * n["llm_layer_mlp"] * stats["tokens"],
            "llm_output": 2 * n["llm_output"] * stats["tokens"],
            "vit_layers": 2 * n["vit_layers"] * stats["vit_tokens"],
            "vit_attn": 4 * stats["vit_sq"] * vit.hidden_size * vit.num_layers,
            "vit_mlp": 2 * vit.num_layers * n["vit_layer_mlp"] * stats["vit_tokens"],
            "vit_fc": vit.num_layers * n["vit_layer_mlp"] * stats["vit_tokens"],     # one of the MLP's two
            "patch_embed": 2 * n["patch_embed"] * 4 * stats["merged"],
            "projector": 2 * n["projector"] * stats["merged"]}


def model_flops(recipe, trainable: str, stats: dict, recompute: str,
                vision_recompute: str | None = None) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one micro-batch (``forward_flops``'s ``stats``).
    ``trainable``: ``all`` | ``projector`` (stage 1); ``recompute`` (the LLM's): ``full`` | ``selective`` |
    ``mlp`` | ``none``; ``vision_recompute`` (the tower's): ``full`` | ``selective`` | ``none``, None: as
    ``vision_recompute_of`` derives it."""
    f = forward_flops(recipe, stats)
    fwd_llm = f["llm_layers"] + f["llm_attn"] + f["llm_output"]
    fwd_vit = f["vit_layers"] + f["vit_attn"] + f["patch_embed"]
    trains_all = trainable == "all"
    # forward + backward: trained 3× (input + weight gradients); frozen 2× behind a trained part, else 1×
    mult_vit, mult_proj, mult_llm = (3, 3, 3) if trains_all else (1, 3, 2)
    mf = mult_vit * fwd_vit + mult_proj * f["projector"] + mult_llm * fwd_llm
    vision = vision_recompute or vision_recompute_of(recompute)
    extra = {"full": f["llm_layers"] + f["llm_attn"], "selective": f["llm_mlp"] + f["llm_attn"],
             "mlp": f["llm_mlp"]}.get(recompute, 0)
    if trains_all:
        extra += {"full": f["vit_layers"] - f["vit_fc"] + f["vit_attn"], "selective": f["vit_fc"]}.get(vision, 0)
    return float(mf), float(mf + extra)


def vision_recompute_of(recompute: str) -> str:
    """The tower's mode when only the LLM's is given: ``mlp`` recomputes the tower's MLPs (``selective``)."""
    return "selective" if recompute == "mlp" else recompute


# The FLOP model is linear in the five per-micro-batch counts, so it splits into one weight per count: the
# weight of ``k`` is the FLOPs of a micro-batch holding one unit of ``k`` and nothing else. A pack's cost
# (``packing.cost``) is the dot product of its counts with these weights — the accounting MFU uses, not a copy.
STAT_TERMS = ("tokens", "attn_sq", "vit_tokens", "vit_sq", "merged")


def term_weights(recipe, trainable: str, recompute: str = "none", vision_recompute: str | None = None,
                 hardware: bool = False) -> dict:
    """FLOPs per unit of each of ``STAT_TERMS`` (forward + backward, ``model_flops``'s arguments):
    ``Σ_k weights[k]·stats[k]`` equals ``model_flops(...)[hardware]`` for any ``stats``."""
    unit = dict.fromkeys(STAT_TERMS, 0)
    return {k: model_flops(recipe, trainable, {**unit, k: 1}, recompute, vision_recompute)[int(hardware)]
            for k in STAT_TERMS}


def cost_weights_table() -> dict:
    """The default pack-cost weights of ``packing/cost_weights.json``: model FLOPs per unit count, for every
    recipe × stage (``python -m pretrain.trainer.flops > packing/cost_weights.json`` rewrites it)."""
    from pretrain.recipes import RECIPES, STAGES

    return {f"{name}/{stage}": term_weights(r, st.trainable) for name, r in RECIPES.items()
            for stage, st in STAGES.items()}


def flops_by_part(recipe, trainable: str, stats: dict, recompute: str,
                  vision_recompute: str | None = None) -> dict:
    """``model_flops`` split where the trainer runs each part: ``vision`` (the tower, its patch embedding and the
    projector: whole on the first pipeline stage, on every TP and CP rank), ``llm_layers`` (the decoder layers'
    matmuls, split over TP and the pipeline), ``llm_attn`` (their causal attention) and ``llm_output`` (the
    output layer, split over TP and CP). Each a (model FLOPs, hardware FLOPs) pair; the pairs sum to
    ``model_flops``'s."""
    f = forward_flops(recipe, stats)
    trains_all = trainable == "all"
    mult_vit, mult_proj, mult_llm = (3, 3, 3) if trains_all else (1, 3, 2)
    vision = vision_recompute or vision_recompute_of(recompute)
    vit = mult_vit * (f["vit_layers"] + f["vit_attn"] + f["patch_embed"]) + mult_proj * f["projector"]
    vit_extra = ({"full": f["vit_layers"] - f["vit_fc"] + f["vit_attn"], "selective": f["vit_fc"]}.get(vision, 0)
                 if trains_all else 0)
    layers, attn = mult_llm * f["llm_layers"], mult_llm * f["llm_attn"]
    layers_extra = {"full": f["llm_layers"], "selective": f["llm_mlp"], "mlp": f["llm_mlp"]}.get(recompute, 0)
    attn_extra = f["llm_attn"] if recompute in ("full", "selective") else 0
    out = mult_llm * f["llm_output"]
    return {"vision": (float(vit), float(vit + vit_extra)), "llm_layers": (float(layers), float(layers + layers_extra)),
            "llm_attn": (float(attn), float(attn + attn_extra)), "llm_output": (float(out), float(out))}


if __name__ == "__main__":
    import json

    print(json.dumps(cost_weights_table(), indent=1, sort_keys=True))
