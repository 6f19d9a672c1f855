"""Our VLM ⇄ the published ``LLaVAOneVision1_5_ForConditionalGeneration`` (lmms-lab's released
stage-0 / instruct checkpoints): state-dict names, ``config.json``, and the recipe check.

On disk (safetensors) the published model is::

    visual.patch_embed.proj.weight            ← vision.embeddings.patch_embedding.weight
    visual.class_embedding, visual.class_pos_emb
    visual.pre_layernorm.*                    ← vision.pre_layrnorm.*         (MLCD's spelling)
    visual.blocks.<i>.norm1 / norm2           ← vision.encoder.layers.<i>.layer_norm1 / 2
    visual.blocks.<i>.attn.qkv.{weight,bias}  ← [q_proj; k_proj; v_proj] stacked on the output dim
    visual.blocks.<i>.attn.proj               ← self_attn.out_proj
    visual.blocks.<i>.mlp.fc1 / fc2           ← mlp.fc1 / fc2
    visual.merger.{ln_q, mlp.0, mlp.2}        ← projector.{ln_q, mlp.0, mlp.2}
    model.{embed_tokens, layers.<i>.*, norm}  ← llm.* through llava_ov.qwen3 (Qwen3 names)
    lm_head.weight                            ← the output layer (the word embedding when tied)

The official class holds them as ``model.visual.*`` / ``model.language_model.*`` in memory and maps
with its ``_checkpoint_conversion_mapping`` (transformers < 5.9 applies it on load and reverses it on
save; later transformers ignore it for remote code, so ``save_pretrained`` there writes the
in-memory names). ``to_ours`` accepts either layout.
"""
from __future__ import annotations

import re

import torch

from llava_ov.qwen3 import megatron_to_qwen3, qwen3_to_megatron

MODEL_TYPE = "llavaonevision1_5"
ARCHITECTURE = "LLaVAOneVision1_5_ForConditionalGeneration"
_IN_MEMORY = [(re.compile(r"^model\.visual\."), "visual."), (re.compile(r"^model\.language_model\."), "model.")]

_VIT_LAYER = {"layer_norm1": "norm1", "layer_norm2": "norm2", "self_attn.out_proj": "attn.proj",
              "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}


def _vision_names(recipe):
    """(our name, published name) of every tower and merger tensor that maps one to one (the fused
    ``attn.qkv`` is the one that does not): one table for both directions."""
    yield "vision.embeddings.patch_embedding.weight", "visual.patch_embed.proj.weight"
    yield "vision.embeddings.class_embedding", "visual.class_embedding"
    yield "vision.class_pos_emb", "visual.class_pos_emb"
    for p in ("weight", "bias"):
        yield f"vision.pre_layrnorm.{p}", f"visual.pre_layernorm.{p}"
        for i in range(recipe.vit.num_layers):
            for a, b in _VIT_LAYER.items():
                yield f"vision.encoder.layers.{i}.{a}.{p}", f"visual.blocks.{i}.{b}.{p}"
        for m in ("ln_q", "mlp.0", "mlp.2"):
            yield f"projector.{m}.{p}", f"visual.merger.{m}.{p}"


def published_state_dict(ours: dict[str, torch.Tensor], recipe) -> dict[str, torch.Tensor]:
    """Our full (TP=1) VLM state dict → the published on-disk names (every tensor contiguous)."""
    out = {pub: ours[mine] for mine, pub in _vision_names(recipe)}
    for p in ("weight", "bias"):
        for i in range(recipe.vit.num_layers):
            out[f"visual.blocks.{i}.attn.qkv.{p}"] = torch.cat(
                [ours[f"vision.encoder.layers.{i}.self_attn.{x}_proj.{p}"] for x in "qkv"])
    llm = {k.removeprefix("llm."): v for k, v in ours.items()
           if k.startswith("llm.") and not k.endswith("_extra_state")}
    out.update(megatron_to_qwen3(llm, recipe.llm))
    if recipe.llm.tie_embeddings:       # written out in full, as the released checkpoints do
        out["lm_head.weight"] = out["lm_head.weight"].clone()
    return {k: v.detach().contiguous() for k, v in out.items()}


def to_ours(hf: dict[str, torch.Tensor], recipe) -> dict[str, torch.Tensor]:
    """Published (or the official class's in-memory) names → our VLM state dict (strict: a missing
    tensor raises ``KeyError`` naming it; ``lm_head.weight`` may be absent when embeddings are tied)."""
    def rename(k: str) -> str:
        for pat, rep in _IN_MEMORY:
            k = pat.sub(rep, k, count=1)
        return k

    hf = {rename(k): v for k, v in hf.items()}
    missing = [k for k in ("visual.patch_embed.proj.weight", "model.embed_tokens.weight") if k not in hf]
    if missing:
        raise KeyError(f"not a LLaVA-OneVision-1.5 checkpoint: no {missing}")
    out = {mine: hf[pub] for mine, pub in _vision_names(recipe)}
    for p in ("weight", "bias"):
        for i in range(recipe.vit.num_layers):
            for x, t in zip("qkv", hf[f"visual.blocks.{i}.attn.qkv.{p}"].chunk(3)):
                out[f"vision.encoder.layers.{i}.self_attn.{x}_proj.{p}"] = t
    text = {k: v for k, v in hf.items() if k.startswith("model.") or k == "lm_head.weight"}
    if recipe.llm.tie_embeddings and "lm_head.weight" in text and \
            not torch.equal(text["lm_head.weight"], text["model.embed_tokens.weight"]):
        raise ValueError("text_config.tie_word_embeddings: the recipe ties the output layer to the word "
                         "embedding, but the checkpoint's lm_head.weight differs from model.embed_tokens.weight")
    if not recipe.llm.tie_embeddings and "lm_head.weight" not in text:
        raise ValueError("text_config.tie_word_embeddings: the recipe has its own output layer, the checkpoint "
                         "has no lm_head.weight")
    out.update({f"llm.{k}": v for k, v in qwen3_to_megatron(text, recipe.llm).items()})
    return out


def config_dict(recipe, tok, dtype: str = "float32") -> dict:
    """``config.json`` of the published model for ``recipe``, token ids from the training tokenizer
    ``tok`` (None: token ids null — what ``check_config`` compares shapes against) (field names and values as the released checkpoints write them). Tying lives in the text
    config only: a top-level ``tie_word_embeddings`` makes transformers 5 expand the official class's
    list-style ``_tied_weights_keys`` and fail; ``lm_head.weight`` is always written, so the output
    layer is right whether a loader ties it or not. ``pad_token_id: null`` in the text config lets the
    official modeling file build under transformers 5."""
    v, s = recipe.vit, recipe.llm

    def tid(t):
        if tok is None:
            return None
        i = tok.convert_tokens_to_ids(t)
        return None if i is None or i == tok.unk_token_id else int(i)

    text = {"model_type": "LLaVAOneVision1_5_text", "vocab_size": s.vocab_size, "hidden_size": s.hidden_size,
            "intermediate_size": s.ffn_hidden_size, "num_hidden_layers": s.num_layers,
            "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_query_groups,
            "head_dim": s.kv_channels, "hidden_act": "silu", "max_position_embeddings": 32768,
            "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
            "tie_word_embeddings": s.tie_embeddings, "rope_theta": s.rope_theta, "rope_scaling": None,
            "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": s.num_layers, "layer_types": ["full_attention"] * s.num_layers,
            "pad_token_id": None, "bos_token_id": None, "eos_token_id": tid("<|im_end|>")}
    vision = {"model_type": "rice_vit", "depth": v.num_layers, "embed_dim": v.hidden_size,
              "hidden_size": v.hidden_size, "hidden_act": "gelu", "intermediate_size": v.intermediate_size,
              "num_heads": v.num_heads, "in_channels": 3, "patch_size": v.patch_size, "spatial_merge_size": 2,
              "temporal_patch_size": 1, "initializer_range": 0.02, "layer_norm_eps": v.layer_norm_eps,
              "text_hidden_size": s.hidden_size}
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "text_config": text, "vision_config": vision,
            "image_token_id": tid("<|image_pad|>"), "video_token_id": tid("<|video_pad|>"),
            "vision_start_token_id": tid("<|vision_start|>"), "vision_end_token_id": tid("<|vision_end|>"),
            "vocab_size": s.vocab_size, "torch_dtype": dtype}


# the fields that fix the model's shapes: a checkpoint whose values differ from config_dict's cannot load
SHAPE_FIELDS = ("model_type", *(f"vision_config.{k}" for k in (
    "depth", "hidden_size", "num_heads", "intermediate_size", "patch_size", "layer_norm_eps", "spatial_merge_size",
    "text_hidden_size")), *(f"text_config.{k}" for k in (
    "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "rope_theta")))


def check_config(cfg: dict, recipe, path: str) -> None:
    """A published ``config.json`` against the recipe: every ``SHAPE_FIELDS`` value against what
    ``config_dict`` writes for it; raises ``ValueError`` naming every field that differs
    (``text_config.hidden_size=32 (recipe: 64)``)."""
    def get(c: dict, field: str):
        *sections, name = field.split(".")
        for sec in sections:
            c = c.get(sec) or {}
        if name == "rope_theta":      # transformers 5 writes it under rope_parameters
            rope = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta")
            return None if rope is None else float(rope)
        return c.get(name)

    ref = config_dict(recipe, None)
    bad = [f"{f}={get(cfg, f)} (recipe: {get(ref, f)})" for f in SHAPE_FIELDS if get(cfg, f) != get(ref, f)]
    if bad:
        raise ValueError(f"LLaVA-OneVision-1.5 checkpoint {path} does not match the recipe {recipe.name!r}: "
                         + ", ".join(bad))


def patchify(image: torch.Tensor, patch: int = 14, merge: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """One normalised image ``[3, H, W]`` (our loader's ``pretrain.data.pixels``) → the official
    model's inputs: ``pixel_values [gh·gw, 3·patch²]`` in 2×2-window order (what transformers'
    ``Qwen2VLImageProcessor`` emits with ``temporal_patch_size=1``) and ``image_grid_thw [1, 3]``."""
    c, h, w = image.shape
    gh, gw = h // patch, w // patch
    x = image.reshape(c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(1, 4, 2, 5, 0, 3, 6).reshape(gh * gw, c * patch * patch)
    return x, torch.tensor([[1, gh, gw]])
