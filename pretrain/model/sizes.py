"""The shapes of the LLM and the vision tower, as plain tables with no torch or megatron import, so that a
recipe, a config check or ``ovpipe status`` can name a model without loading the stack that builds it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LLMSize:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    rope_theta: float = 1_000_000.0
    tie_embeddings: bool = False


# Qwen3-4B / 8B as published (config.json of the released checkpoints); `tiny` for tests and the demo.
LLM_SIZES = {
    "tiny": LLMSize(2, 64, 128, 4, 2, 16, 512, tie_embeddings=True),
    "qwen3-4b": LLMSize(36, 2560, 9728, 32, 8, 128, 151936, tie_embeddings=True),
    "qwen3-8b": LLMSize(36, 4096, 12288, 32, 8, 128, 151936, tie_embeddings=False),
}


@dataclass(frozen=True)
class ViTSize:
    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int = 14
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-5


VIT_SIZES = {
    "tiny": ViTSize(2, 32, 4, 64),
    "rice-vit-l-14": ViTSize(24, 1024, 16, 4096),
}
