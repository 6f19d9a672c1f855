"""Hugging Face ⇄ megatron-core weights for the Qwen3 LLM (import before stage 1, export after stage 2).

``size`` is any object with the LLM's shape fields (``pretrain.model.llm.LLMSize``): this package sits
below the trainer and never imports it.

Layout differences handled here:
* megatron fuses Q, K and V into ``linear_qkv`` grouped by query group: for each of the ``ng`` KV
  groups, its ``np/ng`` query heads, then its key head, then its value head (``hn`` rows each);
* SwiGLU's ``linear_fc1`` is ``[gate; up]`` (megatron applies the activation to the first half);
* RMSNorm weights map one to one (``input_layernorm``, ``pre_mlp_layernorm``, ``q/k_layernorm``,
  ``final_layernorm``); ``output_layer`` is absent when embeddings are tied.
"""
from __future__ import annotations

import torch


def _qkv_fuse(q, k, v, heads: int, groups: int, hn: int) -> torch.Tensor:
    h = q.shape[1]
    q = q.view(groups, heads // groups, hn, h)
    k = k.view(groups, 1, hn, h)
    v = v.view(groups, 1, hn, h)
    return torch.cat([q, k, v], dim=1).reshape(-1, h)


def _qkv_split(w, heads: int, groups: int, hn: int):
    h = w.shape[1]
    w = w.view(groups, heads // groups + 2, hn, h)
    q = w[:, : heads // groups].reshape(-1, h)
    k = w[:, heads // groups].reshape(-1, h)
    v = w[:, heads // groups + 1].reshape(-1, h)
    return q, k, v


def qwen3_to_megatron(hf: dict[str, torch.Tensor], size) -> dict[str, torch.Tensor]:
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not size.tie_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(size.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = _qkv_fuse(
            hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.k_proj.weight"], hf[p + "self_attn.v_proj.weight"],
            size.num_attention_heads, size.num_query_groups, size.kv_channels)
        out[m + "self_attention.q_layernorm.weight"] = hf[p + "self_attn.q_norm.weight"]
        out[m + "self_attention.k_layernorm.weight"] = hf[p + "self_attn.k_norm.weight"]
        out[m + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        out[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
    return out


def megatron_to_qwen3(mc: dict[str, torch.Tensor], size) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": mc["embedding.word_embeddings.weight"],
           "model.norm.weight": mc["decoder.final_layernorm.weight"],
           "lm_head.weight": mc["embedding.word_embeddings.weight"] if size.tie_embeddings else mc["output_layer.weight"]}
    for i in range(size.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = _qkv_split(mc[m + "self_attention.linear_qkv.weight"], size.num_attention_heads,
                             size.num_query_groups, size.kv_channels)
        out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
                    p + "input_layernorm.weight": mc[m + "input_layernorm.weight"],
                    p + "self_attn.q_norm.weight": mc[m + "self_attention.q_layernorm.weight"],
                    p + "self_attn.k_norm.weight": mc[m + "self_attention.k_layernorm.weight"],
                    p + "self_attn.o_proj.weight": mc[m + "self_attention.linear_proj.weight"],
                    p + "post_attention_layernorm.weight": mc[m + "pre_mlp_layernorm.weight"]})
        gate, up = mc[m + "mlp.linear_fc1.weight"].chunk(2)
        out.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                    p + "mlp.down_proj.weight": mc[m + "mlp.linear_fc2.weight"]})
    return out
