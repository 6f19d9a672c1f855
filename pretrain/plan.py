"""``ovpipe plan``: what a cluster gets for one stage, before a GPU-hour is spent.

    ovpipe plan --recipe llava-ov-1.5-8b --stage 1.5 --samples 85000000 --tokens-per-sample 1000 --gpus 128xA800
    ovpipe plan --recipe llava-ov-1.5-4b --stage 1 --steps 23000 --global-batch 5888 --gpus 184xA800

Every layout of the GPU count (TP within a node, PP, CP, DP the rest) that passes the trainer's own checks
(``pretrain.recipes.validate``, the global batch split over DP) is weighed:

* **memory** per GPU and the recompute that fits it: ``pretrain.trainer.memory.choose``, the estimate
  ``recompute: auto`` runs on (calibrated on one H200; its error is ``ERROR_GIB``);
* **compute**: the stage's hardware FLOPs of a pack (``pretrain.trainer.flops.model_flops``) at the measured
  single-GPU efficiency ``MEASURED_MFU`` of the card's generation, split over TP × CP × PP;
* **communication**, from the card table ``GPUS`` (NVLink within a node of 8, the network across nodes,
  per GPU and direction), ring collectives: TP's four all-reduces per layer and micro-batch (not
  overlapped), CP's all-gather of keys and values forward and reduce-scatter backward (not overlapped), DP's
  gradient reduce-scatter and parameter all-gather of the distributed optimizer (overlapped with one
  micro-batch's compute, the rest exposed), and PP's 1F1B bubble, (pp − 1) / micro-batches of the step;
* **time**: steps × step time, as hours and GPU-hours, and tokens/s per GPU.

What it cannot know is said with the figure: the efficiency of a card generation never measured here (A100,
A800: Hopper's measured MFU is taken, a bound from above), the network a lab actually has, stragglers,
data-loading stalls and checkpoint time. ``docs/plan.md`` sets its predictions against published runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float          # what torch reports as total memory
    peak_tflops: float         # dense bf16
    nvlink_gbs: float          # per GPU and direction, within a node
    network_gbs: float         # per GPU and direction, across nodes (8 NICs a node)
    per_node: int = 8


GPUS = {
    "H100": Gpu("H100", 79.2, 989.0, 450.0, 50.0),     # NVLink 4 (900 GB/s both ways), 8 × 400 Gb/s NDR
    "H200": Gpu("H200", 139.8, 989.0, 450.0, 50.0),
    "A100": Gpu("A100", 79.2, 312.0, 300.0, 25.0),     # NVLink 3 (600 GB/s both ways), 8 × 200 Gb/s HDR
    "A800": Gpu("A800", 79.2, 312.0, 200.0, 25.0),     # the export A100: NVLink cut to 400 GB/s both ways
}
# Model FLOPs utilisation measured on one card by bench/bench_mfu.py (bench/results/h200.md: the 4B stage 1.5,
# four packs a step, commit cdf4d0d). The H200's figure stands for the cards whose stage 1.5 was never measured
# (an upper bound: the same kernels on a card with less memory bandwidth rarely keep a larger share of its peak).
MEASURED_MFU = {"H100": 0.410, "H200": 0.410, "A100": 0.410, "A800": 0.410}
MEASURED = {"H100": False, "H200": True, "A100": False, "A800": False}
PACK_FILL = 0.97           # tokens per pack / seq_len that ovpipe's packing reaches (docs/packing.md)
IMAGE_SHARE = 0.75         # share of a caption pack's tokens that are image tokens (--image-share)


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
    parts: dict                # seconds of the step: compute, bubble, tp, cp, dp (exposed)
    tokens_per_s_per_gpu: float
    mfu: float
    hours: float
    gpu_hours: float
    offload: float = 0.0       # share of the optimizer on the host (what recompute auto picks where nothing else fits)
    host_gib: float = 0.0      # host memory per GPU that offload takes
    comm_bytes: dict = dataclasses.field(default_factory=dict)   # ``comm_bytes`` of the first pipeline stage's rank


def parse_gpus(text: str) -> tuple[int, Gpu]:
    """``128xA800`` → (128, the A800)."""
    count, _, kind = text.lower().partition("x")
    gpu = GPUS.get(kind.upper())
    if not count.isdigit() or int(count) < 1 or gpu is None:
        raise ValueError(f"--gpus {text!r}: give COUNTxKIND with KIND one of {', '.join(GPUS)} (e.g. 128xA800)")
    return int(count), gpu


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


def trainer_ddp(recipe, stage: str, dp: int, distributed_optimizer: bool = True):
    """megatron-core's ``DistributedDataParallelConfig`` the trainer builds for this stage at DP size ``dp``
    (``pretrain.trainer.optimizer.ddp_config`` of a default ``TrainConfig``): the one source of the gradient
    reduce dtype, the overlap flags and the bucket size, for the trainer and the plan alike."""
    from pretrain.trainer.config import TrainConfig
    from pretrain.trainer.optimizer import ddp_config

    cfg = TrainConfig(run_dir="plan", recipe=getattr(recipe, "name", recipe), stage=stage, steps=1,
                      distributed_optimizer=distributed_optimizer)
    return ddp_config(cfg, dp)


def rank_params(recipe, trainable: str, tp: int, pp: int, pp_rank: int = 0) -> dict:
    """Parameters (elements) one rank of pipeline stage ``pp_rank`` holds, by part, as the trainer builds them:
    the tower and projector whole on the first stage (on every TP and CP rank), the word embedding and the
    output layer split over TP (a tied output layer on the last stage when pp > 1), each LLM layer's
    matrices split over TP and its four RMSNorm weights whole. ``trained``: those in the DDP buffer (stage 1:
    the projector); ``sp_norms``: the trained norm weights whose gradients are summed over TP under SP."""
    from pretrain.recipes import pipeline_sizes

    llm, vit = recipe.llm, recipe.vit
    h, d, f, v = llm.hidden_size, llm.kv_channels, llm.ffn_hidden_size, llm.vocab_size
    q, kv = llm.num_attention_heads * d, llm.num_query_groups * d
    D, inter = vit.hidden_size, vit.intermediate_size
    first, last = pp_rank == 0, pp_rank == pp - 1
    layers = pipeline_sizes(llm.num_layers, pp)[pp_rank]
    norms = layers * (2 * h + 2 * d) + (h if last else 0)
    parts = {
        "vit": (vit.num_layers * (4 * (D * D + D) + 2 * D * inter + inter + D + 4 * D) + D
                + 3 * vit.patch_size ** 2 * D + 2 * D + D // vit.num_heads // 2) if first else 0,
        "projector": (2 * D + 16 * D * D + 4 * D + 4 * D * h + h) if first else 0,
        "embedding": v * h // tp if first else 0,
        "layers": layers * (h * (q + 2 * kv) + q * h + 3 * h * f) // tp + norms,
        "output": v * h // tp if last and (pp > 1 or not llm.tie_embeddings) else 0,
    }
    trained = parts["projector"] if trainable != "all" else sum(parts.values())
    return {**parts, "trained": trained, "sp_norms": norms if trainable == "all" else 0}


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
      and received each way (first and last stage: one way each), each after a 24-byte shape message
      (variable sequence lengths); once a step a tied embedding's gradient is all-reduced between the first
      and last stage.
    - ``dp_grad`` / ``dp_param``: the DDP buffer of the rank's trained parameters in the dtype ``ddp``
      reduces in (fp32 with ``grad_reduce_in_fp32``), reduce-scattered once a step with the distributed
      optimizer (all-reduced without), and the parameters all-gathered back in their dtype (distributed
      optimizer only). megatron pads each bucket to a multiple of the DP size (not counted; under 0.1% of a
      4B's buffer). ``ddp``: the trainer's ``DistributedDataParallelConfig`` (``trainer_ddp``) by default."""
    from pretrain.recipes import STAGES, pipeline_sizes

    if ddp is None:
        ddp = trainer_ddp(recipe, stage, dp)
    trainable = STAGES[stage].trainable
    trains_llm = trainable == "all"
    sp = tp > 1 if sequence_parallel is None else sequence_parallel
    llm = recipe.llm
    e = 2 if bf16 else 4                                   # activation and parameter bytes
    h, first, last = llm.hidden_size, pp_rank == 0, pp_rank == pp - 1
    layers = pipeline_sizes(llm.num_layers, pp)[pp_rank]
    tokens = micro_batch * seq_len
    local = tokens / cp
    act = local * h * e
    out = {"tp": 0.0, "cp": 0.0, "pp": 0.0, "dp_grad": 0.0, "dp_param": 0.0}
    params = rank_params(recipe, trainable, tp, pp, pp_rank)
    grad_e = 4 if ddp.grad_reduce_in_fp32 else e
    if tp > 1:
        if sp:
            per_layer = (10 if trains_llm else 8) + {"full": 4, "selective": 2, "mlp": 2}.get(recompute, 0)
            output = 3 if trains_llm else 2
        else:
            per_layer = 4 + {"full": 2, "selective": 1, "mlp": 1}.get(recompute, 0)
            output = 1
        micro = layers * per_layer * act
        if first:
            micro += tokens * h * e + (act if sp else 0)
        if last:
            micro += output * act + 3 * local * 4
        out["tp"] = grad_accum * micro + (params["sp_norms"] * grad_e if sp else 0)
    if cp > 1:
        kv = tokens * llm.num_query_groups // tp * llm.kv_channels * e
        out["cp"] = float(grad_accum * layers * kv) * (4 + (2 if recompute in ("full", "selective") else 0))
    if pp > 1:
        ways = 1 if first or last else 2
        out["pp"] = grad_accum * ways * 2 * (local / (tp if sp else 1) * h * e + 24)
        if llm.tie_embeddings and trains_llm and (first or last):
            out["pp"] += llm.vocab_size * h // tp * grad_e
    out["dp_grad"] = float(params["trained"] * grad_e)
    if ddp.use_distributed_optimizer:
        out["dp_param"] = float(params["trained"] * e)
    return out


def _ring(bytes_: float, n: int, gbs: float) -> float:
    """Seconds of a ring all-gather or reduce-scatter of ``bytes_`` (the whole tensor) over ``n`` ranks."""
    return 0.0 if n <= 1 else bytes_ * (n - 1) / n / (gbs * 1e9)


def predict(recipe, stage: str, gpu: Gpu, n_gpus: int, tp: int, pp: int, cp: int, dp: int, grad_accum: int,
            micro_batch: int, seq_len: int, sample_len: float, steps: int,
            image_share: float = IMAGE_SHARE) -> Plan | None:
    """One layout's plan; None where nothing fits the card's memory. Memory is weighed at the worst pack
    (every token an image token, as ``recompute: auto`` does); compute at ``image_share`` of the tokens
    from images (each a merged 2×2 of tower patches, images of ~1,024 patches)."""
    from pretrain.recipes import STAGES
    from pretrain.trainer.flops import model_flops
    from pretrain.trainer.memory import GIB, OFFLOAD_STEPS, Layout, choose, host_bytes, loss_kernels_for, param_counts

    trainable = STAGES[stage].trainable
    tokens = micro_batch * seq_len
    lay = Layout(tp=tp, pp=pp, cp=cp, dp=dp, sequence_parallel=tp > 1, grad_accum=grad_accum)
    c = choose(recipe, trainable, loss_kernels_for(tp), tokens, tokens * sample_len, lay, gpu.memory_gib)
    for f in OFFLOAD_STEPS:         # as recompute auto: the least optimizer share on the host that fits
        if c.fits:
            break
        lay = dataclasses.replace(lay, offload=f)
        c = choose(recipe, trainable, loss_kernels_for(tp), tokens, tokens * sample_len, lay, gpu.memory_gib)
    if not c.fits:
        return None
    merged = image_share * tokens
    stats = {"tokens": tokens, "attn_sq": tokens * sample_len, "vit_tokens": 4 * merged,
             "vit_sq": 4 * merged * 1024, "merged": merged}
    mf, hf = model_flops(recipe, trainable, stats, c.recompute, c.vision_recompute)
    eff = MEASURED_MFU[gpu.name] * gpu.peak_tflops * 1e12
    micro = hf / (tp * cp * pp) / eff                      # one micro-batch's compute on one GPU (its stage)
    compute = grad_accum * micro
    bubble = (pp - 1) * micro                              # 1F1B: pp − 1 micro-batches of idle per step
    llm = recipe.llm
    layers = llm.num_layers / pp
    act = tokens / cp * llm.hidden_size * 2                # bf16 activations of a micro-batch
    link_tp = gpu.nvlink_gbs
    t_tp = grad_accum * layers * 4 * 2 * _ring(act, tp, link_tp)      # all-reduce = reduce-scatter + all-gather
    kv = tokens / cp * 2 * llm.num_query_groups * llm.kv_channels * 2
    link_cp = gpu.nvlink_gbs if tp * cp <= gpu.per_node else gpu.network_gbs
    t_cp = grad_accum * layers * 3 * _ring(kv * cp, cp, link_cp)      # gather forward, gather + scatter backward
    n_params = sum(param_counts(recipe).values()) if trainable == "all" else param_counts(recipe)["projector"]
    shard = n_params / (tp * pp) * 2                       # bf16 gradients out, bf16 parameters back
    link_dp = gpu.nvlink_gbs if tp * cp * pp * dp <= gpu.per_node else gpu.network_gbs
    t_dp = 2 * _ring(shard, dp * cp, link_dp)
    exposed_dp = max(0.0, t_dp - micro)                    # overlapped with one micro-batch's compute
    step = compute + bubble + t_tp + t_cp + exposed_dp
    step_tokens = grad_accum * micro_batch * dp * seq_len * PACK_FILL
    return Plan(tp, pp, cp, dp, micro_batch, grad_accum, c.recompute, c.vision_recompute, c.loss_kernel,
                c.peak_gib, step, {"compute": compute, "bubble": bubble, "tp": t_tp, "cp": t_cp, "dp": exposed_dp},
                step_tokens / step / n_gpus, mf * grad_accum * dp / step / (n_gpus * gpu.peak_tflops * 1e12),
                steps * step / 3600, steps * step / 3600 * n_gpus, lay.offload,
                host_bytes(recipe, trainable, lay) / GIB,
                comm_bytes(recipe, stage, tp, pp, cp, dp, grad_accum, micro_batch, seq_len, recompute=c.recompute))


def plan(recipe_name: str, stage: str, gpus: str, steps: int, global_batch: int, seq_len: int = 8192,
         sample_len: float = 1000.0, micro_batch: int = 1, image_share: float = IMAGE_SHARE) -> list[Plan]:
    """Every layout that fits, fastest first."""
    from pretrain.recipes import RECIPES

    n, gpu = parse_gpus(gpus)
    recipe = RECIPES[recipe_name]
    out = [p for tp, pp, cp, dp, ga in layouts(recipe, n, gpu, seq_len, global_batch, micro_batch)
           if (p := predict(recipe, stage, gpu, n, tp, pp, cp, dp, ga, micro_batch, seq_len, sample_len, steps,
                            image_share))]
    return sorted(out, key=lambda p: (p.hours, p.tp * p.pp * p.cp))


def run_data(run_dir, step: str) -> tuple[int, float, float, int]:
    """(packs, mean sample length, image-token share, seq_len) of a run's pack step: what the plan needs from
    real data, read from its ``packs`` manifest (the columns only) and its config."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from manifests.io import manifest_files
    from pretrain.data import pack_shape

    packs = samples = tokens = 0
    for f in manifest_files(run_dir, "packs", step):
        t = pq.read_table(f, columns=["lengths", "total_tokens"])
        packs += t.num_rows
        samples += len(pc.list_flatten(t.column("lengths")))
        tokens += pc.sum(t.column("total_tokens")).as_py() or 0
    seq_len, _ = pack_shape(run_dir, step)
    return packs, tokens / max(samples, 1), IMAGE_SHARE, seq_len


def main(argv=None) -> int:
    from pretrain.recipes import RECIPES, STAGES

    ap = argparse.ArgumentParser(prog="ovpipe plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="llava-ov-1.5-8b", choices=sorted(RECIPES))
    ap.add_argument("--stage", default="1.5", choices=sorted(STAGES))
    ap.add_argument("--gpus", required=True, help=f"COUNTxKIND, KIND one of {', '.join(GPUS)} (e.g. 128xA800)")
    data = ap.add_mutually_exclusive_group(required=True)
    data.add_argument("--samples", type=int, help="samples in the stage (with --tokens-per-sample)")
    data.add_argument("--steps", type=int, help="optimizer steps of the stage (with --global-batch)")
    data.add_argument("--run-dir", help="a run whose pack step (--data) holds the stage's packs: their count, "
                                        "sample length and seq_len are read from it")
    ap.add_argument("--data", default="pack", help="with --run-dir: the pack step (default pack)")
    ap.add_argument("--epochs", type=float, default=1.0, help="with --run-dir: passes over the packs (default 1)")
    ap.add_argument("--tokens-per-sample", type=float, default=1000.0,
                    help="mean tokens of a sample, text and image (default 1000); also the attention's sample length")
    ap.add_argument("--global-batch", type=int, help="packs per optimizer step (default: 8 per GPU)")
    ap.add_argument("--seq-len", type=int, default=8192, help="tokens per pack")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--image-share", type=float, default=IMAGE_SHARE,
                    help=f"share of a pack's tokens that are image tokens (default {IMAGE_SHARE})")
    ap.add_argument("--top", type=int, default=8, help="layouts printed, fastest first")
    a = ap.parse_args(argv)
    try:
        n, gpu = parse_gpus(a.gpus)
    except ValueError as e:
        ap.error(str(e))
    gbs = a.global_batch or 8 * n
    if a.run_dir:
        try:
            packs, a.tokens_per_sample, _, a.seq_len = run_data(a.run_dir, a.data)
        except (FileNotFoundError, ValueError) as e:
            ap.error(str(e))
        steps = math.ceil(a.epochs * packs / gbs)
    elif a.steps is not None:
        steps = a.steps
    else:
        packs = a.samples * a.tokens_per_sample / (a.seq_len * PACK_FILL)
        steps = math.ceil(packs / gbs)
    if not 0 <= a.image_share <= 1:
        ap.error(f"--image-share must be within [0, 1], got {a.image_share}")
    plans = plan(a.recipe, a.stage, a.gpus, steps, gbs, a.seq_len, a.tokens_per_sample, a.micro_batch, a.image_share)
    tokens = steps * gbs * a.seq_len * PACK_FILL
    print(f"{a.recipe} stage {a.stage} on {n} × {gpu.name} ({gpu.memory_gib:.0f} GiB, {gpu.peak_tflops:.0f} TFLOP/s "
          f"bf16): {steps:,} steps × {gbs:,} packs of {a.seq_len:,} tokens ≈ {tokens / 1e9:,.1f}B tokens; "
          f"compute at {MEASURED_MFU[gpu.name]:.0%} MFU ("
          + ("measured on this card" if MEASURED[gpu.name] else "the H200's measured figure, not this card's: an "
             "upper bound") + ")")
    if not plans:
        print("no layout fits: more GPUs, a shorter --seq-len, or a smaller --micro-batch")
        return 1
    print(f"{'tp':>3} {'pp':>3} {'cp':>3} {'dp':>5} {'accum':>6} {'recompute':>10} {'tower':>10} {'loss':>8} "
          f"{'GiB':>6} {'step s':>8} {'tok/s/GPU':>10} {'MFU':>6} {'hours':>8} {'GPU-hours':>10}  exposed comm")
    for p in plans[:a.top]:
        comm = ", ".join(f"{k} {v / p.step_s:.0%}" for k, v in p.parts.items() if k != "compute" and v / p.step_s >= 0.005)
        if p.offload:
            comm += (", " if comm else "") + f"optimizer {p.offload:.0%} offloaded to the host ({p.host_gib:.0f} GiB)"
        print(f"{p.tp:>3} {p.pp:>3} {p.cp:>3} {p.dp:>5} {p.grad_accum:>6} {p.recompute:>10} {p.vision_recompute:>10} "
              f"{p.loss_kernel:>8} {p.peak_gib:>6.1f} {p.step_s:>8.2f} {p.tokens_per_s_per_gpu:>10,.0f} {p.mfu:>6.1%} "
              f"{p.hours:>8.1f} {p.gpu_hours:>10,.0f}  {comm or '-'}")
    if any(p.offload for p in plans[:a.top]):
        print("offloaded: megatron-core's HybridDeviceOptimizer steps that share of Adam on the host; its time is not "
              "in the step time above (not measured yet: bench/gpu/next_call.sh)")
    best = plans[0]
    print(f"best: tp={best.tp} pp={best.pp} cp={best.cp} dp={best.dp}, {best.hours:.1f} h ({best.hours / 24:.1f} days), "
          f"{best.gpu_hours:,.0f} GPU-hours: ovpipe pretrain --recipe {a.recipe} --stage {a.stage} --tp {best.tp} "
          f"--pp {best.pp} --cp {best.cp}{' --sequence-parallel' if best.tp > 1 else ''}"
          f"{f' --optimizer-offload {best.offload}' if best.offload else ''} --micro-batch "
          f"{best.micro_batch} --global-batch {gbs} --steps {steps} --executor slurm --nodes "
          f"{math.ceil(n / gpu.per_node)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
