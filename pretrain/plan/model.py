"""The time of one optimizer step at one layout, as the trainer runs it (``pretrain.plan``'s contract).

Per pipeline stage ``r`` and micro-batch, on one GPU:

- **compute**: hardware FLOPs (``pretrain.trainer.flops.flops_by_part``, with the recompute ``memory.choose``
  picks) at the calibration's FLOP/s of the forward+backward (``Calibration.flops_per_s``, scaled by the
  card's bf16 peak where the card differs). The tower and the projector run whole on the first stage, on
  every TP and CP rank (``pretrain.model.vision``, ``vlm``: the tower is data-parallel and CP embeds the whole
  micro-batch); the decoder layers' matmuls divide by TP × CP and follow the stage's share of the layers
  (``recipes.pipeline_sizes``); the output layer and loss divide by TP × CP on the last stage. Without
  Transformer Engine, CP attention is SDPA of the rank's queries against all gathered keys under a dense
  mask (``pretrain.model.attention``): 4·(T/cp)·T·heads/tp·head_dim FLOPs a layer forward, three passes
  (four where recompute reruns it), whatever the samples' lengths.
- **TP, CP, PP communication**: the calls of ``collectives`` as ring collectives over NVLink (TP and CP stay
  within a node), point-to-point over NVLink or the network (stage neighbours are ``tp·cp·dp`` ranks apart,
  megatron's tp-cp-dp-pp order); none overlapped (megatron without TE runs them in line).
- **the pipeline**: 1F1B, ``Σ_r t_r + (grad_accum − 1)·max_r t_r``: the slowest stage (the first, with the
  tower) sets the pace, the others wait; at pp = 1 that is ``grad_accum · t_0``.
- **DP**: the gradient reduce-scatter (all-reduce without the distributed optimizer) and the parameter
  all-gather over the DP×CP ranks, in the dtypes and with the overlap of the trainer's
  ``DistributedDataParallelConfig`` (``trainer_ddp``): an overlapped reduce hides behind the last micro-batch's
  backward, an overlapped gather behind the first micro-batch's forward, and one bucket of each stays exposed
  (megatron's buckets of ``bucket_size`` parameters); a collective not overlapped is exposed whole.
- **the optimizer step**: the GPU's share at the calibration's seconds per parameter scaled by HBM bandwidth
  (Adam is memory-bound); the offloaded share (megatron-core's ``HybridDeviceOptimizer``, without
  ``overlap_cpu_optimizer_d2h_h2d``, as the trainer builds it) copies its fp32 gradients to the host over
  PCIe, steps torch's CPU AdamW there, and copies the fp32 parameters back, in sequence after the GPU's part
  starts. The host and PCIe rates are the card table's assumptions, not measurements.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from pretrain.plan.shapes import (GPUS, HOST_ADAM_BYTES, IMAGE_SHARE, OFFLOAD_COPY_BYTES, PACK_FILL,  # noqa: F401
                                  PATCHES_PER_IMAGE, Gpu, parse_gpus, rank_params)


@functools.cache
def trainer_ddp(recipe, stage: str, dp: int, distributed_optimizer: bool = True):
    """megatron-core's ``DistributedDataParallelConfig`` the trainer builds for this stage at DP size ``dp``
    (``pretrain.trainer.optimizer.ddp_config`` of a default ``TrainConfig``): the one source of the gradient
    reduce dtype, the overlap flags and the bucket size, for the trainer and the plan alike."""
    from pretrain.trainer.config import TrainConfig
    from pretrain.trainer.optimizer import ddp_config

    cfg = TrainConfig(run_dir="plan", recipe=getattr(recipe, "name", recipe), stage=stage, steps=1,
                      distributed_optimizer=distributed_optimizer)
    return ddp_config(cfg, dp)


def grad_bytes(ddp, bf16: bool = True) -> int:
    """Bytes per gradient element in the DP reduce: fp32 with ``grad_reduce_in_fp32``, else the parameters' own
    dtype (bf16: 2)."""
    return 4 if ddp.grad_reduce_in_fp32 else (2 if bf16 else 4)


def grad_buckets(calls, ddp, bf16: bool = True) -> int:
    """How many buckets megatron cuts the largest gradient reduce of ``calls`` into: its parameters (its bytes over
    ``grad_bytes``, bf16 or fp32 as the reduce is) over ``bucket_size``. The last bucket is the exposed one."""
    grads = [x.nbytes for x in calls if x.kind == "dp_grad"]
    return max(1, math.ceil(max(grads) / grad_bytes(ddp, bf16) / ddp.bucket_size)) if grads else 1


@dataclass(frozen=True)
class Call:
    kind: str          # tp | cp | pp | dp_grad | dp_param
    op: str            # all_gather | reduce_scatter | all_reduce | send | recv
    nbytes: float      # the whole tensor given to one call
    count: float       # calls per micro-batch (per="micro") or per step (per="step")
    per: str = "micro"


def collectives(recipe, stage: str, tp: int, pp: int, cp: int, dp: int, micro_batch: int, seq_len: int, ddp,
                *, pp_rank: int = 0, bf16: bool = True, sequence_parallel: bool | None = None,
                recompute: str = "none") -> list[Call]:
    """The collectives one rank of pipeline stage ``pp_rank`` calls, per micro-batch and per step (``comm_bytes``
    says what each is)."""
    from pretrain.recipes import STAGES, pipeline_sizes

    trains_llm = STAGES[stage].trainable == "all"
    sp = tp > 1 if sequence_parallel is None else sequence_parallel
    llm = recipe.llm
    e = 2 if bf16 else 4
    h, first, last = llm.hidden_size, pp_rank == 0, pp_rank == pp - 1
    layers = pipeline_sizes(llm.num_layers, pp)[pp_rank]
    tokens = micro_batch * seq_len
    local = tokens / cp
    act = local * h * e
    params = rank_params(recipe, STAGES[stage].trainable, tp, pp, pp_rank)
    grad_e = grad_bytes(ddp, bf16)
    calls = []
    if tp > 1:
        if sp:
            rerun = {"full": 2, "selective": 1, "mlp": 1}.get(recompute, 0)     # gathers (and scatters) rerun
            gathers = layers * (2 + (2 if trains_llm else 0) + 2 + rerun)      # col fwd, col bwd, row bwd
            scatters = layers * (2 + 2 + rerun)                                 # row fwd, col bwd
            calls += [Call("tp", "all_gather", act, gathers), Call("tp", "reduce_scatter", act, scatters)]
            if first:
                calls += [Call("tp", "all_reduce", tokens * h * e, 1), Call("tp", "all_gather", act, 1)]
            if last:
                calls += [Call("tp", "all_gather", act, 2 if trains_llm else 1),
                          Call("tp", "reduce_scatter", act, 1)]
            if params["sp_norms"]:
                calls.append(Call("tp", "all_reduce", params["sp_norms"] * grad_e, 1, "step"))
        else:
            rerun = {"full": 2, "selective": 1, "mlp": 1}.get(recompute, 0)
            calls.append(Call("tp", "all_reduce", act, layers * 4 + rerun * layers))
            if first:
                calls.append(Call("tp", "all_reduce", tokens * h * e, 1))
            if last:
                calls.append(Call("tp", "all_reduce", act, 1))
        if last:
            calls.append(Call("tp", "all_reduce", local * 4, 3))            # vocab-parallel cross-entropy, fp32
    if cp > 1:
        kv = tokens * llm.num_query_groups // tp * llm.kv_channels * e
        again = 2 if recompute in ("full", "selective") else 0
        calls += [Call("cp", "all_gather", kv, layers * (2 + again)), Call("cp", "reduce_scatter", kv, layers * 2)]
    if pp > 1:
        ways = 1 if first or last else 2
        p2p = local / (tp if sp else 1) * h * e
        calls += [Call("pp", "send", p2p, ways), Call("pp", "recv", p2p, ways)]
        if llm.tie_embeddings and trains_llm and (first or last):
            calls.append(Call("pp", "all_reduce", llm.vocab_size * h // tp * grad_e, 1, "step"))
    if params["trained"] and dp * cp > 1:          # megatron calls them on a group of one too; nothing moves
        if ddp.use_distributed_optimizer:
            calls += [Call("dp_grad", "reduce_scatter", params["trained"] * grad_e, 1, "step"),
                      Call("dp_param", "all_gather", params["trained"] * e, 1, "step")]
        else:
            calls.append(Call("dp_grad", "all_reduce", params["trained"] * grad_e, 1, "step"))
    return calls


def comm_bytes(recipe, stage: str, tp: int, pp: int, cp: int, dp: int, grad_accum: int, micro_batch: int,
               seq_len: int, ddp=None, *, pp_rank: int = 0, bf16: bool = True, sequence_parallel: bool | None = None,
               recompute: str = "none") -> dict[str, float]:
    """Bytes one rank (of pipeline stage ``pp_rank``) hands to collectives in one optimizer step, by kind:
    the sum over calls of the whole tensor given to the call (an all-gather's or reduce-scatter's unsharded
    buffer, an all-reduce's tensor, a send's or receive's tensor), not the ring's wire traffic. Scalars under
    1 KiB a step (the loss and token counts, the gradient norm, the step's metrics) are not counted.

    - ``tp`` (tp > 1; SP on unless told): per LLM layer and micro-batch, with SP each column-parallel linear
      (QKV, the MLP's first) all-gathers its input forward and again backward for its weight gradient and
      reduce-scatters the input gradient, each row-parallel one reduce-scatters forward and all-gathers
      backward: 10 tensors of [tokens / cp, hidden] (a frozen LLM has no weight gradient: 8); a recompute
      reruns the forward's collectives it covers (``full`` 4, ``selective``/``mlp`` the MLP's 2). The first
      stage all-reduces the word embedding of the whole micro-batch and all-gathers the scattered
      embedding's gradient; the last gathers the output layer's input (forward, and backward for a trained
      layer), reduce-scatters its gradient, and all-reduces three fp32 [tokens / cp] of the vocabulary-
      parallel cross-entropy; once a step the norms' gradients are all-reduced. Without SP: all-reduces.
    - ``cp`` (cp > 1): each layer all-gathers the keys and the values of the whole micro-batch forward and
      reduce-scatters their gradients backward; ``full`` and ``selective`` recompute gather them again.
    - ``pp`` (pp > 1): per micro-batch the stage's activation [tokens / cp / tp under SP, hidden] is sent
      and received each way (first and last stage: one way each; the 24-byte shape message before each,
      variable sequence lengths, is a scalar); once a step a tied embedding's gradient is all-reduced between
      the first and last stage.
    - ``dp_grad`` / ``dp_param``: the DDP buffer of the rank's trained parameters in the dtype ``ddp``
      reduces in (fp32 with ``grad_reduce_in_fp32``), reduce-scattered once a step with the distributed
      optimizer (all-reduced without), and the parameters all-gathered back in their dtype (distributed
      optimizer only); nothing over a DP × CP group of one. With the distributed optimizer megatron pads each
      parameter's start to 64 elements and each bucket's end to the DP size; the padding is not counted (0.6%
      of the tiny recipe's buffer, a few parts per million of the 4B's). ``ddp``: the trainer's
      ``DistributedDataParallelConfig`` (``trainer_ddp``) by default."""
    if ddp is None:
        ddp = trainer_ddp(recipe, stage, dp)
    out = {"tp": 0.0, "cp": 0.0, "pp": 0.0, "dp_grad": 0.0, "dp_param": 0.0}
    for c in collectives(recipe, stage, tp, pp, cp, dp, micro_batch, seq_len, ddp, pp_rank=pp_rank, bf16=bf16,
                         sequence_parallel=sequence_parallel, recompute=recompute):
        out[c.kind] += float(c.nbytes * c.count * (grad_accum if c.per == "micro" else 1))
    return out


def call_seconds(c: Call, n: int, gbs: float) -> float:
    """Seconds of one call over ``n`` ranks at ``gbs`` GB/s per GPU and direction: a ring all-gather or
    reduce-scatter moves (n − 1)/n of the whole tensor through each GPU, an all-reduce twice that, a
    send or receive the tensor once."""
    if c.op in ("send", "recv"):
        return c.nbytes / (gbs * 1e9)
    if n <= 1:
        return 0.0
    return (2 if c.op == "all_reduce" else 1) * c.nbytes * (n - 1) / n / (gbs * 1e9)


@dataclass(frozen=True)
class Plan:
    tp: int
    pp: int
    cp: int
    dp: int
    micro_batch: int
    grad_accum: int
    recompute: str
    vision_recompute: str
    loss_kernel: str
    peak_gib: float
    step_s: float
    parts: dict                # seconds of the step: compute, bubble, tp, cp, pp, dp (exposed), optimizer
    tokens_per_s_per_gpu: float
    mfu: float
    hours: float
    gpu_hours: float
    offload: float = 0.0       # share of the optimizer on the host (what recompute auto picks where nothing else fits)
    host_gib: float = 0.0      # host memory per GPU that offload takes
    comm_bytes: dict = dataclasses.field(default_factory=dict)   # ``comm_bytes`` of the first pipeline stage's rank
    stage_s: tuple = ()        # one micro-batch's seconds on each pipeline stage (compute and TP/CP/PP calls)


def layouts(recipe, n_gpus: int, gpu: Gpu, seq_len: int, global_batch: int, micro_batch: int = 1):
    """(tp, pp, cp, dp, grad_accum) of every layout the trainer accepts: TP and CP within a node, PP a divisor of
    the layers' split, DP the rest, the global batch split evenly over DP."""
    from pretrain.recipes import Parallelism, validate
    from pretrain.trainer.config import accumulation

    for tp in (1, 2, 4, 8):
        for cp in (1, 2, 4):
            if tp * cp > gpu.per_node:
                continue
            for pp in (1, 2, 4, 8):
                if n_gpus % (tp * cp * pp):
                    continue
                dp = n_gpus // (tp * cp * pp)
                try:
                    validate(recipe, Parallelism(tp=tp, pp=pp, cp=cp, sequence_parallel=tp > 1,
                                                 distributed_optimizer=True, seq_len=seq_len, world_size=n_gpus))
                    accum = accumulation(global_batch, micro_batch, dp)
                except ValueError:
                    continue
                yield tp, pp, cp, dp, accum


def packed_stats(tokens: float, sample_len: float, image_share: float, fill: float = 1.0) -> dict:
    """``BatchPrep.stats`` of ``tokens`` LLM positions of which ``fill`` are samples of ``sample_len`` tokens,
    ``image_share`` of them image tokens (4 tower patches each, images of ``PATCHES_PER_IMAGE``)."""
    merged = image_share * tokens * fill
    return {"tokens": tokens, "attn_sq": tokens * fill * sample_len, "vit_tokens": 4 * merged,
            "vit_sq": 4 * merged * PATCHES_PER_IMAGE, "merged": merged}


def stage_seconds(recipe, stage: str, gpu: Gpu, cal, tp: int, pp: int, cp: int, dp: int, micro_batch: int,
                  seq_len: int, stats: dict, recompute: str, vision_recompute: str, ddp) -> list[dict]:
    """Per pipeline stage, one micro-batch's seconds on one of its GPUs: compute, and the TP, CP and PP calls."""
    from pretrain.recipes import STAGES, pipeline_sizes
    from pretrain.trainer.flops import flops_by_part

    trainable = STAGES[stage].trainable
    llm = recipe.llm
    parts = flops_by_part(recipe, trainable, stats, recompute, vision_recompute)
    rate = cal.flops_per_s_on(gpu)
    sizes = pipeline_sizes(llm.num_layers, pp)
    attn = parts["llm_attn"][1]
    if cp > 1:        # SDPA over the gathered keys under a dense mask: every (local query, key) pair, per layer
        tokens = stats["tokens"]
        fwd = 4 * (tokens / cp) * tokens * llm.num_attention_heads * llm.kv_channels * llm.num_layers
        attn = fwd * (3 + (1 if recompute in ("full", "selective") else 0)) * cp   # per rank below: ÷ (tp·cp)
    stride = tp * cp * dp
    link_pp = gpu.nvlink_gbs if stride < gpu.per_node else gpu.network_gbs
    out = []
    for r, n_layers in enumerate(sizes):
        share = n_layers / llm.num_layers
        flops = (parts["llm_layers"][1] + attn) * share / (tp * cp)
        if r == 0:
            flops += parts["vision"][1]
        if r == pp - 1:
            flops += parts["llm_output"][1] / (tp * cp)
        comm = {"tp": 0.0, "cp": 0.0, "pp": 0.0}
        for c in collectives(recipe, stage, tp, pp, cp, dp, micro_batch, seq_len, ddp, pp_rank=r,
                             recompute=recompute):
            if c.per == "micro" and c.kind in comm:
                n, link = {"tp": (tp, gpu.nvlink_gbs), "cp": (cp, gpu.nvlink_gbs), "pp": (2, link_pp)}[c.kind]
                comm[c.kind] += c.count * call_seconds(c, n, link)
        out.append({"compute": flops / rate, **comm})
    return out


def optimizer_seconds(recipe, trainable: str, gpu: Gpu, cal, tp: int, pp: int, cp: int, dp: int,
                      offload: float, distributed_optimizer: bool = True) -> float:
    """The optimizer step of the largest stage's rank: the GPU's share at the calibration's seconds per
    parameter (scaled by HBM bandwidth), the host's share as D2H copy, CPU AdamW and H2D copy in sequence."""
    trained = max(rank_params(recipe, trainable, tp, pp, r)["trained"] for r in range(pp))
    shard = trained / (dp * cp) if distributed_optimizer else trained
    gpu_s = (1 - offload) * shard * cal.optimizer_s_per_param_on(gpu)
    if not offload:
        return gpu_s
    host = offload * shard
    d2h = host * OFFLOAD_COPY_BYTES / (gpu.pcie_gbs * 1e9)
    return max(gpu_s, d2h) + host * HOST_ADAM_BYTES / (gpu.host_gbs * 1e9) + d2h


def predict(recipe, stage: str, gpu: Gpu, n_gpus: int, tp: int, pp: int, cp: int, dp: int, grad_accum: int,
            micro_batch: int, seq_len: int, sample_len: float = 1000.0, steps: int = 1,
            image_share: float = IMAGE_SHARE, *, stats: dict | None = None, useful_tokens: float | None = None,
            calibration=None, ddp=None, recompute: str | None = None) -> Plan | None:
    """One layout's plan; None where nothing fits the card's memory. Memory is weighed at the worst pack
    (every token an image token, as ``recompute: auto`` does). ``stats``: one micro-batch's
    ``BatchPrep.stats`` (default: ``micro_batch`` packs of ``seq_len``, ``PACK_FILL`` of them samples of
    ``sample_len`` tokens, ``image_share`` image tokens); ``useful_tokens``: its tokens that are samples, not
    padding (tokens/s counts these); ``recompute``: the LLM's mode as a run was configured (the tower's follows
    it, megatron's loss), instead of ``recompute: auto``'s choice."""
    from pretrain.plan.calibration import default_calibration
    from pretrain.recipes import STAGES
    from pretrain.trainer.flops import model_flops
    from pretrain.trainer.flops import vision_recompute_of
    from pretrain.trainer.memory import (GIB, HEADROOM, OFFLOAD_STEPS, Choice, Layout, choose, estimate, host_bytes,
                                         loss_kernels_for)

    cal = calibration or default_calibration()
    trainable = STAGES[stage].trainable
    tokens = micro_batch * seq_len
    if stats is None:
        stats = packed_stats(tokens, sample_len, image_share, PACK_FILL)
        useful_tokens = tokens * PACK_FILL
    useful = stats["tokens"] if useful_tokens is None else useful_tokens
    lay = Layout(tp=tp, pp=pp, cp=cp, dp=dp, sequence_parallel=tp > 1, grad_accum=grad_accum)

    def pick(lay):
        if recompute is None:           # recompute auto's choice
            return choose(recipe, trainable, loss_kernels_for(tp), tokens, tokens * sample_len, lay, gpu.memory_gib)
        vision = vision_recompute_of(recompute)
        peak = estimate(recipe, trainable, recompute, vision, "megatron", tokens, lay)["total"]
        return Choice(recompute, vision, "megatron", peak, gpu.memory_gib, peak <= HEADROOM * gpu.memory_gib, ())

    c = pick(lay)
    for f in OFFLOAD_STEPS:         # as recompute auto: the least optimizer share on the host that fits
        if c.fits:
            break
        lay = dataclasses.replace(lay, offload=f)
        c = pick(lay)
    if not c.fits:
        return None
    ddp = ddp or trainer_ddp(recipe, stage, dp)
    per_stage = stage_seconds(recipe, stage, gpu, cal, tp, pp, cp, dp, micro_batch, seq_len, stats, c.recompute,
                              c.vision_recompute, ddp)
    t = [sum(s.values()) for s in per_stage]
    slow = max(range(pp), key=lambda r: t[r])
    pipeline = sum(t) + (grad_accum - 1) * t[slow]
    # DP over the DP×CP ranks; they span nodes when tp·cp·dp exceeds a node
    link_dp = gpu.nvlink_gbs if tp * cp * dp <= gpu.per_node else gpu.network_gbs
    exposed = {"dp": 0.0}
    step_calls = [x for r in range(pp) for x in collectives(recipe, stage, tp, pp, cp, dp, micro_batch, seq_len,
                                                             ddp, pp_rank=r, recompute=c.recompute)
                  if x.per == "step" and (r == slow or x.kind not in ("dp_grad", "dp_param"))]
    buckets = grad_buckets(step_calls, ddp)
    for x in step_calls:
        if x.kind == "dp_grad":
            s = call_seconds(x, dp * cp, link_dp)
            hide = t[slow] * 2 / 3 if ddp.overlap_grad_reduce else 0.0       # the last micro-batch's backward
            exposed["dp"] += max(s - hide, s / buckets) if hide else s
        elif x.kind == "dp_param":
            s = call_seconds(x, dp * cp, link_dp)
            hide = t[0] / 3 if ddp.overlap_param_gather else 0.0              # the first micro-batch's forward
            exposed["dp"] += max(s - hide, s / buckets) if hide else s
        else:                          # the norms' and a tied embedding's once-a-step all-reduces
            n, link = (tp, gpu.nvlink_gbs) if x.kind == "tp" else (2, gpu.network_gbs)
            exposed["dp"] += call_seconds(x, n, link)
    opt = optimizer_seconds(recipe, trainable, gpu, cal, tp, pp, cp, dp, lay.offload)
    step = pipeline + exposed["dp"] + opt
    per_micro = per_stage[slow]
    parts = {"compute": grad_accum * per_micro["compute"], "bubble": pipeline - grad_accum * t[slow],
             "tp": grad_accum * per_micro["tp"], "cp": grad_accum * per_micro["cp"],
             "pp": grad_accum * per_micro["pp"], "dp": exposed["dp"], "optimizer": opt}
    mf, _ = model_flops(recipe, trainable, stats, c.recompute, c.vision_recompute)
    step_tokens = grad_accum * dp * useful
    return Plan(tp, pp, cp, dp, micro_batch, grad_accum, c.recompute, c.vision_recompute, c.loss_kernel,
                c.peak_gib, step, parts, step_tokens / step / n_gpus,
                mf * grad_accum * dp / step / (n_gpus * gpu.peak_tflops * 1e12),
                steps * step / 3600, steps * step / 3600 * n_gpus, lay.offload,
                host_bytes(recipe, trainable, lay) / GIB,
                comm_bytes(recipe, stage, tp, pp, cp, dp, grad_accum, micro_batch, seq_len, ddp,
                           recompute=c.recompute), tuple(t))


def plan(recipe_name: str, stage: str, gpus: str | tuple, steps: int, global_batch: int, seq_len: int = 8192,
         sample_len: float = 1000.0, micro_batch: int = 1, image_share: float = IMAGE_SHARE, *,
         stats: dict | None = None, useful_tokens: float | None = None, calibration=None,
         recompute: str | None = None) -> list[Plan]:
    """Every layout that fits, fastest first. ``gpus``: ``COUNTxKIND`` or a (count, ``Gpu``) pair."""
    from pretrain.recipes import RECIPES

    n, gpu = parse_gpus(gpus) if isinstance(gpus, str) else gpus
    recipe = RECIPES[recipe_name]
    out = [p for tp, pp, cp, dp, ga in layouts(recipe, n, gpu, seq_len, global_batch, micro_batch)
           if (p := predict(recipe, stage, gpu, n, tp, pp, cp, dp, ga, micro_batch, seq_len, sample_len, steps,
                            image_share, stats=stats, useful_tokens=useful_tokens, calibration=calibration,
                            recompute=recompute))]
    return sorted(out, key=lambda p: (p.hours, p.tp * p.pp * p.cp))
