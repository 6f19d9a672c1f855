"""float8 training of the LLM's linear layers (``precision: fp8-tensorwise | fp8-rowwise``) with torchao.

torchao's ``convert_to_float8_training`` swaps ``torch.nn.Linear`` modules for its ``Float8Linear``. The LLM
here is megatron-core's ``GPTModel`` on the local spec, whose linear layers (``linear_qkv``, ``linear_proj``,
``linear_fc1``, ``linear_fc2``) are megatron's ``ColumnParallelLinear`` / ``RowParallelLinear``: plain
``torch.nn.Module``s that keep their weight under megatron's own names (checkpoints, HF conversion, the DDP
gradient buffers) and multiply in ``_forward_impl``, megatron's per-layer hook (the frozen-weight and the
gradient-accumulation variants are chosen there). A swap would find none of them. So ``convert`` keeps each
megatron module and points its ``_forward_impl`` at a torchao ``Float8Linear`` (``Float8Linear.from_float``
over the same ``Parameter``: torchao's casts, scales and ``_scaled_mm`` forward and backward), not registered
as a submodule, so the parameter names and the state dict are unchanged. The weight's gradient then
arrives in ``param.grad`` through autograd, which megatron's DDP hook adds to ``main_grad`` as it does for
its own layers without gradient-accumulation fusion. A layer whose weight is frozen (stage 1's LLM) keeps
megatron's path. At TP > 1 megatron's linears all-gather and reduce-scatter inside their autograd function,
which the float8 one replaces, so the config allows fp8 at tp = 1 only (``TrainConfig``).

Which layers: torchtitan's ``auto_filter_small_kn``, i.e. torchao's ``_auto_filter_for_recipe``, asked about
an ``nn.Linear`` of the megatron layer's shape (on the meta device): shapes whose float8 matmul and casts
measured slower than bf16 on an H100 stay bf16, and so does every dimension not a multiple of 16. The output
layer, the embedding, the tower and the projector stay bf16 (torchtitan leaves its output layer out too).

On CUDA each ``Float8Linear`` runs ``torch.compile``'d (``dynamic=True``: the packed token count changes
every micro-batch): torchao's casts are several elementwise kernels eager, one fused kernel compiled.
"""
from __future__ import annotations

import torch

RECIPES = {"fp8-tensorwise": "tensorwise", "fp8-rowwise": "rowwise"}
KEEP_BF16 = ["output_layer"]        # torchtitan's filter_fqns: the output layer stays in bf16


def _shell(mod) -> torch.nn.Linear:
    """An ``nn.Linear`` of the megatron layer's (out, in) shape on the meta device: what torchao's filter and
    ``Float8Linear.from_float`` read (``weight.shape``, ``in_features``, ``out_features``)."""
    n, k = mod.weight.shape
    with torch.device("meta"):
        return torch.nn.Linear(k, n, bias=False)


def linears(llm):
    """``(name, module)`` of every megatron linear layer in the LLM that holds its weight (``ColumnParallelLinear``
    / ``RowParallelLinear``; a tied output layer borrows the embedding's), in module order."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return [(n, m) for n, m in llm.named_modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.weight is not None]


def selected(llm, precision: str) -> list[str]:
    """Names of the LLM's linear layers that ``precision`` runs in float8 (torchao's filter for its recipe)."""
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    keep = _auto_filter_for_recipe(RECIPES[precision], filter_fqns=KEEP_BF16)
    return [n for n, m in linears(llm) if keep(_shell(m), n)]


def convert(llm, precision: str, compile: bool | None = None) -> list[str]:
    """Run the layers ``selected`` picks through torchao's ``Float8Linear`` (module docstring); returns their
    names. ``compile``: ``torch.compile`` each one (default: on CUDA)."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    if precision not in RECIPES:
        raise ValueError(f"precision must be one of {sorted(RECIPES)} for float8, got {precision!r}")
    config = Float8LinearConfig.from_recipe_name(RECIPES[precision])
    modules = dict(linears(llm))
    names = selected(llm, precision)
    compile = bool(names) and (modules[names[0]].weight.is_cuda if compile is None else compile)
    if compile:
        import torch._dynamo

        # one compiled Float8Linear.forward serves every layer, recompiled per weight shape (4 in a Qwen3 layer),
        # each forward and backward: past dynamo's default limit of 8 the rest would run eager
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for name in names:
        mod = modules[name]
        shell = _shell(mod)
        shell.weight = mod.weight                      # the same Parameter: megatron's name, buffers, main_grad
        f8 = Float8Linear.from_float(shell, config=config)
        run = torch.compile(f8, dynamic=True) if compile else f8
        mod.__dict__["_forward_impl"] = _forward_impl(mod._forward_impl, f8, run)
    return names


def _forward_impl(megatron_impl, f8, run):
    """The megatron layer's ``_forward_impl`` in float8: the same arguments, megatron's own for a frozen weight."""
    def impl(input, weight, bias=None, *args, **kwargs):
        if not weight.requires_grad:                   # frozen: megatron's forward-only path
            return megatron_impl(input, weight, bias, *args, **kwargs)
        if weight is not f8.weight:
            raise RuntimeError("float8 linear called with another weight than its own (a shared weight)")
        out = run(input)
        return out if bias is None else out + bias
    impl.float8 = f8                                   # for inspection (tests, the bench)
    return impl


def converted(llm) -> list[str]:
    """Names of the LLM's linear layers currently running in float8."""
    return [n for n, m in linears(llm) if hasattr(m.__dict__.get("_forward_impl"), "float8")]
