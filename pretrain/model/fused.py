"""Fused kernels for the trainer's non-GEMM work on CUDA, from kept libraries, switched per run.

``kernels = "fused"`` (``TrainConfig.kernels``; the default on CUDA):

- **rotary** (the LLM's THD rotary in ``pretrain.model.attention.apply_rotary``, the tower's 2D rotary in
  ``pretrain.model.vision``) and **RMSNorm** (``pretrain.model.TorchRMSNorm``: the LLM's input, pre-MLP,
  q/k and final norms) run as ``torch.compile``'d functions: inductor emits one Triton kernel for the
  forward and one for the backward of each, where eager torch launches 5–10 elementwise kernels that
  each read and write the whole [tokens, heads, dim] tensor (fp32 casts, ``chunk``, ``cat``, two
  multiplies and an add for a rotary). Compiled once per shape class (``dynamic=True``: the token
  count changes every micro-batch without a recompile);
- **SwiGLU**: megatron's own fused implementation (``TransformerConfig.bias_activation_fusion``:
  ``megatron.core.fusions.fused_bias_swiglu``, which also keeps only the MLP's input for backward).

``loss_kernel = "liger"`` (``TrainConfig.loss_kernel``; chosen by ``recompute: auto`` where its memory
lets less be recomputed, else a choice): the output
layer and the cross-entropy as
one liger-kernel ``LigerFusedLinearCrossEntropyLoss`` call (chunked over tokens, so the
[tokens × 151,936] fp32 logits and their gradient never exist at once), through megatron's
``GPTModel`` ``output_processor`` hook. It needs the whole vocabulary on the rank (TP = 1).
``"torch"`` is the same hook with a plain ``linear`` + ``cross_entropy`` (the reference the tests
compare with megatron's own loss on the CPU); ``"megatron"`` is megatron's output layer and
``vocab_parallel_cross_entropy``.

On the CPU and with ``kernels = "eager"`` the same expressions run eagerly: the math is the same, so
the CPU parity tests see exactly the code they always did.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

KERNELS = ("eager", "fused")
LOSS_KERNELS = ("megatron", "liger", "torch")

_state = {"fused": False}


def set_kernels(kernels: str) -> None:
    """Process-wide: the trainer sets it once, before the first step (``pretrain.trainer.build``)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    _state["fused"] = kernels == "fused"


def fused_on(x: torch.Tensor) -> bool:
    return _state["fused"] and x.is_cuda


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True, fullgraph=True)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rotary_eager(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [t, heads, d] rotated by per-token tables [t, d] (megatron's non-interleaved rotary,
    tables cast to ``x``'s dtype)."""
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return x * c + rotate_half(x) * s


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _compiled(rotary_eager)(x, cos, sin) if fused_on(x) else rotary_eager(x, cos, sin)


def rotary_acc_eager(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The tower's rotary: ``x`` [t, heads, d] rotated in the tables' precision (fp32 at least, as HF
    does) by [t, 1, d] tables, cast back to ``x``'s dtype."""
    acc = x.to(cos.dtype)
    return (acc * cos + rotate_half(acc) * sin).to(x.dtype)


def rotary_acc(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _compiled(rotary_acc_eager)(x, cos, sin) if fused_on(x) else rotary_acc_eager(x, cos, sin)


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    return _compiled(rms_norm_eager)(x, weight, eps) if fused_on(x) else rms_norm_eager(x, weight, eps)


# ------------------------------------------------------------------------------------- the loss

def liger_available() -> bool:
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception:         # not installed, or no triton (CPU-only torch)
        return False
    return True


def resolve_loss_kernel(loss_kernel: str | None) -> str:
    """None: megatron's (a run with ``recompute: auto`` leaves it unset instead, and
    ``pretrain.trainer.memory`` picks liger's only where its 4.7 GiB lets less be recomputed, as for the
    4B on one H200, where it keeps the LLM whole). At equal recompute liger's measures within a few
    percent of megatron's, mostly slower (figures: docs/pretrain.md, ``bench/results/h200.md``). (The
    value and its TP = 1 rule are ``TrainConfig``'s checks.)"""
    if loss_kernel is None:
        return "megatron"
    if loss_kernel == "liger" and not liger_available():
        raise ValueError("loss_kernel='liger' needs liger-kernel (and triton): pip install liger-kernel")
    return loss_kernel


def output_processor(kind: str):
    """The ``GPTModel.forward(output_processor=...)`` of a loss kernel: per-token losses [b, s] from the
    final hidden states [s, b, h] and the labels [b, s], as ``compute_language_model_loss`` returns
    them; None for megatron's own path."""
    if kind == "megatron":
        return None
    if kind == "liger":
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        # fp32 accumulation of the weight gradient over the token chunks (bf16 would round it per chunk)
        fn = LigerFusedLinearCrossEntropyLoss(reduction="none", accum_dtype=torch.float32)
    else:
        def fn(w, x, y):
            return F.cross_entropy(F.linear(x, w).float(), y, reduction="none")

    def process(hidden_states, output_layer, output_weight, labels, **_):
        w = output_weight if output_weight is not None else output_layer.weight
        s, b, h = hidden_states.shape
        x = hidden_states.transpose(0, 1).reshape(b * s, h)
        return fn(w, x, labels.reshape(-1)).view(b, s)

    return process
