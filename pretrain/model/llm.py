"""The LLM of the recipe from megatron-core building blocks: a Qwen3-style decoder (GQA, qk-norm,
RMSNorm, SwiGLU, RoPE) as ``GPTModel`` built from a layer spec.

Spec choice (``layer_spec``): Transformer Engine's spec where TE is installed (its fused attention
runs THD packed sequences on GPU); otherwise megatron's local spec with the core attention swapped
for ``SDPACoreAttention`` (``pretrain.model.attention``), which honours ``PackedSeqParams`` on any device.
Swapping through the spec is megatron's supported extension route — no flag, no patch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


from pretrain.model.sizes import LLM_SIZES, LLMSize  # noqa: F401  (the tables live with no torch import)


def transformer_config(size: LLMSize, tp: int = 1, dtype: torch.dtype = torch.float32, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=size.num_layers, hidden_size=size.hidden_size, ffn_hidden_size=size.ffn_hidden_size,
        num_attention_heads=size.num_attention_heads, num_query_groups=size.num_query_groups,
        kv_channels=size.kv_channels, normalization="RMSNorm", layernorm_epsilon=1e-6, qk_layernorm=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        use_cpu_initialization=not torch.cuda.is_available(), params_dtype=dtype,
        bf16=dtype == torch.bfloat16, **{"pipeline_dtype": dtype, **overrides})


class TorchRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` in megatron's norm-builder interface that also works with sequence
    parallelism. megatron's ``WrappedTorchNorm`` refuses SP because a norm then sees only this TP
    rank's share of the sequence, so its weight gradient is partial; marking the weight
    ``sequence_parallel`` makes ``finalize_model_grads`` sum it over the TP group (as TE's norms do).
    Same parameter names as ``WrappedTorchNorm``, so checkpoints and HF conversion are unchanged."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in self.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pretrain.model import fused

        return fused.rms_norm(x, self.weight, self.eps)      # one kernel each way with kernels = "fused"


def layer_spec(backend: str = "auto", rope_theta: float | None = None):
    """``te`` (GPU, THD via TE fused attention) | ``sdpa`` (local spec + SDPA THD core attention).
    ``rope_theta``: the local spec's core attention applies the rotary embedding itself (one op over
    all tokens from per-micro-batch tables, ``pretrain.model.attention``); the GPT model is then built
    without megatron's rotary (``build_llm``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    if backend in ("auto", "te"):
        try:
            import transformer_engine  # noqa: F401
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
        except ImportError:
            if backend == "te":
                raise
    from pretrain.model.attention import SDPACoreAttention

    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    sub = spec.submodules
    sub.self_attention.submodules.core_attention = ModuleSpec(module=SDPACoreAttention,
                                                              params={"rope_theta": rope_theta})
    sub.input_layernorm = sub.pre_mlp_layernorm = TorchRMSNorm
    sub.self_attention.submodules.q_layernorm = sub.self_attention.submodules.k_layernorm = TorchRMSNorm
    return spec


def block_spec(cfg, backend: str = "auto", rope_theta: float | None = None):
    """The decoder block of this pipeline stage: ``layer_spec`` × its layer count, and the final
    norm (``TorchRMSNorm`` on the local spec, so sequence parallelism works without TE)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    spec = layer_spec(backend, rope_theta)
    if spec.submodules.input_layernorm is not TorchRMSNorm:      # TE spec: megatron's default block
        return spec
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(cfg), layer_norm=TorchRMSNorm)


def build_llm(size: LLMSize, tp: int = 1, backend: str = "auto", max_seq_len: int = 32768,
              pre_process: bool = True, post_process: bool = True, **overrides):
    """``pre_process`` / ``post_process``: this pipeline stage holds the embedding / the output layer.
    ``overrides`` are ``TransformerConfig`` fields (``sequence_parallel``, ``context_parallel_size``,
    ``pipeline_model_parallel_size``, ``recompute_granularity`` …). The embedding never scatters for
    sequence parallelism: the VLM scatters after merging image embeddings (``pretrain.model.vlm``)."""
    from megatron.core.models.gpt import GPTModel

    cfg = transformer_config(size, tp, **overrides)
    spec = block_spec(cfg, backend, size.rope_theta)
    local = hasattr(spec, "layer_specs")
    # the local spec's core attention applies the rotary embedding (layer_spec); TE's spec keeps megatron's
    return GPTModel(cfg, spec, vocab_size=size.vocab_size, max_sequence_length=max_seq_len,
                    position_embedding_type="none" if local else "rope", rotary_base=int(size.rope_theta),
                    share_embeddings_and_output_weights=size.tie_embeddings,
                    pre_process=pre_process, post_process=post_process,
                    scatter_embedding_sequence_parallel=False)


def packed_seq_params(cu_seqlens: torch.Tensor, max_seqlen: int, rotary: tuple | None = None):
    """THD ``PackedSeqParams`` (``PackedRotaryParams``: with the micro-batch's rotary tables when given)."""
    from pretrain.model.attention import PackedRotaryParams

    cu = cu_seqlens.to(torch.int32)
    cos, sin = rotary if rotary is not None else (None, None)
    return PackedRotaryParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=int(max_seqlen),
                              max_seqlen_kv=int(max_seqlen), rotary_cos=cos, rotary_sin=sin)
