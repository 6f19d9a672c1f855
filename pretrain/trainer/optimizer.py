"""The trainer's optimizer: megatron-core's DDP and optimizer around the VLM, the stage's learning-rate
schedule, and the two CUDA adaptations of megatron's no-TE/no-Apex fallbacks that ``on_cuda`` applies.

- ``build_optimizer``: the model in ``DistributedDataParallel`` (grads reduced over DP×CP with
  ``overlap_grad_reduce``) and ``get_megatron_optimizer`` (Adam with the stage's β2 and weight decay, clip 1.0;
  the distributed optimizer on GPU).
- ``fused_adam``: torch's fused AdamW kernel under megatron's optimizer.
- ``foreach_optimizer``: the gradient norm, the clipping and the buffers' per-token scaling on torch's
  ``_foreach`` kernels.
- ``lr_at``: linear warmup, then cosine to ``min_lr`` (the schedule of every stage).

What each saves on the 4B recipe's optimizer step: docs/pretrain.md (figures in ``bench/results/h200.md``).
"""
from __future__ import annotations

import math

import torch


def lr_at(step: int, total: int, peak: float, min_lr: float = 1e-6, warmup_frac: float = 0.002) -> float:
    warm = max(1, int(round(total * warmup_frac)))
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return min_lr + 0.5 * (peak - min_lr) * (1 + math.cos(math.pi * min(t, 1.0)))


def build_optimizer(model, stage, lr: float, bf16: bool, dtype: torch.dtype, distributed_optimizer: bool,
                    offload: float = 0.0):
    """``(ddp, opt)``: the model in megatron's ``DistributedDataParallel`` and ``get_megatron_optimizer``
    over it, wired into the model config for megatron's schedules (``finalize_model_grads``, ``no_sync``).

    ``offload`` > 0: megatron-core's ``HybridDeviceOptimizer`` keeps that share of the trained parameters'
    fp32 master copy and Adam moments on the host and steps them there (torch's CPU AdamW; the rest on the
    GPU with torch's AdamW: neither needs Transformer Engine or Apex). megatron offloads through its
    precision-aware distributed optimizer, so the GPU keeps no fp32 master copy of the offloaded share
    (``pretrain.trainer.memory``).

    ``overlap_grad_reduce`` on CPU (gloo) too: the async all-reduce / reduce-scatter and megatron's
    bucket-readiness bookkeeping are device-independent, so CI runs the production code path;
    text-only micro-batches keep every bucket complete through ``VLM.embed``'s zero-valued dummy image."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = model.config
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer, overlap_grad_reduce=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=lr, min_lr=stage.min_lr, weight_decay=stage.weight_decay, adam_beta1=0.9,
        adam_beta2=stage.adam_beta2, adam_eps=stage.adam_eps, clip_grad=1.0, bf16=bf16, params_dtype=dtype,
        use_distributed_optimizer=distributed_optimizer, optimizer_cpu_offload=offload > 0,
        optimizer_offload_fraction=offload, use_precision_aware_optimizer=offload > 0), [ddp])
    # megatron leaves norms and biases undecayed through each group's wd_mult, which its
    # OptimizerParamScheduler multiplies in; this trainer sets the lr itself (lr_at), so it applies
    # the (constant) decay here, once
    for g in opt.param_groups:
        g["weight_decay"] = stage.weight_decay * g.get("wd_mult", 1.0)
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.no_sync_func = ddp.no_sync
    return ddp, opt


def fused_adam(opt) -> int:
    """Switch the torch ``AdamW`` under megatron's optimizer (its fallback without TE or Apex, which
    runs the ``foreach`` implementation) to torch's fused CUDA kernel: the param groups' ``fused``
    flag, which ``AdamW.step`` reads on every step; step counters already loaded on the CPU (a
    resumed run) move to the parameters' device, where the fused kernel wants them. Returns the
    number of param groups switched (none when TE/Apex's FusedAdam is in use)."""
    n = 0
    for o in getattr(opt, "chained_optimizers", [opt]):
        inner = getattr(o, "optimizer", None)
        if not isinstance(inner, torch.optim.AdamW) or type(inner).__module__.split(".")[0] != "torch":
            continue
        for g in inner.param_groups:
            if not all(p.is_cuda and p.is_floating_point() for p in g["params"]):
                continue
            g["fused"], g["foreach"] = True, False
            for p in g["params"]:
                st = inner.state.get(p, {})
                if "step" in st and torch.is_tensor(st["step"]) and st["step"].device != p.device:
                    st["step"] = st["step"].to(p.device, torch.float32)
            n += 1
    return n


def on_cuda(opt) -> None:
    """Both adaptations, for a run on CUDA (the CPU keeps megatron's code paths, which the parity tests
    compare against)."""
    fused_adam(opt)
    foreach_optimizer()


def foreach_optimizer() -> bool:
    """Replace megatron's no-Apex/TE fallbacks for the gradient norm, the clipping and the buffers'
    per-token scaling with torch's ``_foreach`` kernels (process-wide; the trainer calls it on CUDA).

    Why: without Apex or TE, megatron computes the norm with one ``torch.norm`` per tensor and then
    builds a host tensor from the ~400 CUDA scalars (a device sync per tensor) before a final
    ``.item()``; it clips with ``dst.copy_(src * scale)`` per tensor (twice the traffic, two launches
    each); and ``finalize_model_grads`` divides the 16 GB fp32 gradient buffer of the 4B recipe by
    a 0-dim CUDA tensor, which runs torch's non-vectorised broadcast kernel (a profiled 4B step:
    ``bench/results/h200.md``). Here the norm is ``_foreach_norm`` of all tensors, reduced on
    the device (no sync), which lets megatron take its tensor path (``multi_tensor_scale_tensor``:
    the clip coefficient stays on the device, clamped at 1, so an unclipped step multiplies by
    exactly 1.0), and both scalings are one ``_foreach_mul_``. The results are the fallbacks' up to
    the rounding of the final norm-of-norms. Returns False (nothing changed) where megatron found
    Apex's or TE's kernels."""
    from megatron.core import utils as mc_utils
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is not mc_utils.local_multi_tensor_l2_norm:
        return False
    clip_grads.l2_norm_impl = foreach_l2_norm
    clip_grads.multi_tensor_scale_tensor_impl = foreach_scale_tensor
    param_and_grad_buffer._ParamAndGradBuffer.scale_gradients = foreach_scale_buffer
    return True


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``amp_C.multi_tensor_l2norm``'s contract: ([1] fp32 norm of all tensors, None)."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def foreach_scale_tensor(chunk_size, noop_flag, tensor_lists, scale: torch.Tensor):
    """``multi_tensor_scale_tensor``'s contract: ``dst = src * scale`` with a one-element tensor."""
    src, dst = tensor_lists
    scale = scale.reshape(())
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


_SPLIT = 1 << 28        # elements per view: well inside 32-bit indexing for any kernel that wants it


def foreach_scale_buffer(self, scaling_factor) -> None:
    """``_ParamAndGradBuffer.scale_gradients``: the flat gradient buffer (and its extra main grads)
    times ``scaling_factor`` (a float or a one-element tensor)."""
    tensors = list(self.grad_data.view(-1).split(_SPLIT)) + list(self.extra_main_grads)
    if torch.is_tensor(scaling_factor):
        scaling_factor = scaling_factor.reshape(())
    torch._foreach_mul_(tensors, scaling_factor)
