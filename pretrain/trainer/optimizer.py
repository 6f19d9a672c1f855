"""The trainer's optimizer: megatron-core's DDP and optimizer around the VLM, the stage's learning-rate
schedule, and the two CUDA adaptations of megatron's no-TE/no-Apex fallbacks that ``on_cuda`` applies.

- ``ddp_config``: megatron-core's ``DistributedDataParallelConfig`` of a stage — the one place that decides
  the gradient-reduce dtype (fp32 unless ``grad_reduce_dtype: bf16``), the overlap of the gradient reduce with
  the backward (always) and of the parameter all-gather with the forward (with the distributed optimizer), and
  the bucket size (megatron's rule, max(40M, 1M × DP) parameters). The trainer builds its DDP from it and
  ``pretrain.plan`` reads its DP traffic from it.
- ``build_optimizer``: the model in ``DistributedDataParallel`` (grads reduced over DP×CP) and
  ``get_megatron_optimizer`` (Adam with the stage's β2 and weight decay, clip 1.0; the distributed optimizer
  on GPU).
- ``params_gathered``: every parameter whole on every rank for a while (a checkpoint save), where the
  all-gather otherwise waits for the next forward.
- ``fused_adam``: torch's fused AdamW kernel under megatron's optimizer.
- ``foreach_optimizer``: the gradient norm, the clipping and the buffers' per-token scaling on torch's
  ``_foreach`` kernels.
- ``lr_at``: linear warmup, then cosine to ``min_lr`` (the schedule of every stage).

What each saves on the 4B recipe's optimizer step: docs/pretrain.md (figures in ``bench/results/h200.md``).
"""
from __future__ import annotations

import contextlib
import math

import torch

from pretrain.trainer.config import GRAD_REDUCE_DTYPES


def lr_at(step: int, total: int, peak: float, min_lr: float = 1e-6, warmup_frac: float = 0.002) -> float:
    warm = max(1, int(round(total * warmup_frac)))
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return min_lr + 0.5 * (peak - min_lr) * (1 + math.cos(math.pi * min(t, 1.0)))


BUCKET_MIN = 40_000_000        # parameters per bucket: megatron-core's default, max(40M, 1M × DP)
BUCKET_PER_DP = 1_000_000


def bucket_size(dp: int) -> int:
    """Parameters per DDP bucket at DP size ``dp``: megatron-core's own default (larger DP, larger buckets, so
    each rank's piece of a ring collective stays bandwidth-bound), written here so the plan reads the same."""
    return max(BUCKET_MIN, BUCKET_PER_DP * dp)


def ddp_config(cfg, dp: int = 1):
    """megatron-core's ``DistributedDataParallelConfig`` for the stage ``cfg`` at DP size ``dp``. ``cfg``: a
    ``TrainConfig``, resolved or not, or anything with its ``distributed_optimizer`` and ``grad_reduce_dtype``
    (missing or None: the GPU defaults, the distributed optimizer on and an fp32 reduce).

    - ``grad_reduce_in_fp32``: ``cfg.grad_reduce_dtype`` (None: fp32). With bf16 parameters, fp32 doubles the
      gradient bytes on the wire and in the buffer; with fp32 parameters the reduce is fp32 either way.
    - ``overlap_grad_reduce``: on — each bucket's reduce-scatter (all-reduce without the distributed optimizer)
      starts in the backward as soon as its gradients are ready.
    - ``overlap_param_gather``: with the distributed optimizer — the step updates this rank's shard only, and
      each bucket's all-gather runs at the next forward, dispatched by megatron's forward pre-hooks one bucket
      ahead of the layer that needs it (``params_gathered`` gathers them at once for a save).
      ``overlap_param_gather_with_optimizer_step`` is not used: megatron-core supports it only with an
      interleaved (virtual) pipeline, which this trainer does not build.
    - ``bucket_size``: ``bucket_size(dp)``."""
    from megatron.core.distributed import DistributedDataParallelConfig

    dist_opt = getattr(cfg, "distributed_optimizer", None)
    dist_opt = True if dist_opt is None else bool(dist_opt)
    reduce = getattr(cfg, "grad_reduce_dtype", None) or "fp32"
    if reduce not in GRAD_REDUCE_DTYPES:
        raise ValueError(f"grad_reduce_dtype must be one of {list(GRAD_REDUCE_DTYPES)}, got {reduce!r}")
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=reduce == "fp32", overlap_grad_reduce=True, overlap_param_gather=dist_opt,
        use_distributed_optimizer=dist_opt, bucket_size=bucket_size(dp))


@contextlib.contextmanager
def params_gathered(ddp):
    """Every parameter whole on every rank inside the block. With ``overlap_param_gather`` a step leaves each
    rank's shard updated and the rest stale until the next forward's all-gathers; megatron's
    ``disable_forward_pre_hook`` runs them now (synchronously), and the hooks come back after. The next
    forward then finds the buckets already gathered and gathers nothing again."""
    if not getattr(ddp, "use_forward_hook", False):
        yield
        return
    ddp.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        ddp.enable_forward_pre_hook()


def build_optimizer(model, stage, lr: float, bf16: bool, dtype: torch.dtype, ddp_cfg, offload: float = 0.0):
    """``(ddp, opt)``: the model in megatron's ``DistributedDataParallel`` and ``get_megatron_optimizer``
    over it, wired into the model config for megatron's schedules (``finalize_model_grads``, ``no_sync``).

    ``ddp_cfg``: the stage's ``ddp_config`` (the distributed optimizer is on where it says so).

    ``offload`` > 0: megatron-core's ``HybridDeviceOptimizer`` keeps that share of the trained parameters'
    fp32 master copy and Adam moments on the host and steps them there (torch's CPU AdamW; the rest on the
    GPU with torch's AdamW: neither needs Transformer Engine or Apex). megatron offloads through its
    precision-aware distributed optimizer, so the GPU keeps no fp32 master copy of the offloaded share
    (``pretrain.trainer.memory``).

    ``overlap_grad_reduce`` on CPU (gloo) too: the async all-reduce / reduce-scatter and megatron's
    bucket-readiness bookkeeping are device-independent, so CI runs the production code path;
    text-only micro-batches keep every bucket complete through ``VLM.embed``'s zero-valued dummy image."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    mcfg = model.config
    ddp = DistributedDataParallel(mcfg, ddp_cfg, model)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=lr, min_lr=stage.min_lr, weight_decay=stage.weight_decay, adam_beta1=0.9,
        adam_beta2=stage.adam_beta2, adam_eps=stage.adam_eps, clip_grad=1.0, bf16=bf16, params_dtype=dtype,
        use_distributed_optimizer=ddp_cfg.use_distributed_optimizer, overlap_param_gather=ddp_cfg.overlap_param_gather,
        optimizer_cpu_offload=offload > 0, optimizer_offload_fraction=offload,
        use_precision_aware_optimizer=offload > 0), [ddp])
    # megatron leaves norms and biases undecayed through each group's wd_mult, which its
    # OptimizerParamScheduler multiplies in; this trainer sets the lr itself (lr_at), so it applies
    # the (constant) decay here, once
    for g in opt.param_groups:
        g["weight_decay"] = stage.weight_decay * g.get("wd_mult", 1.0)
    mcfg.finalize_model_grads_func = finalize_model_grads
    mcfg.no_sync_func = ddp.no_sync
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
