"""Three-stage training of RICE-ViT + projector + LLM on packed THD batches.

    python -m pretrain.train --run-dir RUN --recipe tiny --stage 1 --steps 30     (or under torchrun)
    python -m pretrain.train --run-dir RUN --recipe tiny --stage 2 --epochs 1 --data pack-instruct

Stage 1 trains the projector alone (vision tower and LLM frozen), 1.5 and 2 train everything; each
stage starts from the previous stage's checkpoint (``RUN/pretrain/stage-<S>/dist_ckpt/iter_<step>/``,
megatron-core distributed checkpointing, see ``pretrain/dist_ckpt.py``) and resumes from its own
newest complete one if any, skipping the batches already seen, so an interrupted stage continues
with the same losses as an uninterrupted one. Saves are atomic and rotate (``pretrain/checkpoint.py``):
``--save-every N`` steps, ``--save-every-minutes M``, at the end, and at the next step boundary after
SIGTERM / SIGUSR1 (then the run stops; rerunning the same command continues it).

Data: each stage reads the packed shards of one pack step (``recipes.STAGES``: ``pack-align`` for
stage 1, ``pack`` for 1.5, ``pack-instruct`` for 2; ``--data STEP`` overrides). ``--steps N`` or
``--epochs E`` (then ``steps = ⌈E · packs / GBS⌉``, GBS = micro_batch · grad_accum · dp packs, from the
step's ``packs`` manifest). At start rank 0 prints the plan (samples → packs, GBS × steps, the share
of the packs seen: ``pretrain.data.plan_data``), at the end the totals consumed.

Per step, ``metrics.jsonl`` (and the ``train_metrics`` manifest) gets loss (token mean over target
tokens), lr (linear warmup, cosine to ``min_lr``), grad norm, tokens/s, MFU and HFU (``model_flops``
over ``peak_tflops``), the step time and its split (data wait, forward+backward, optimizer), tokens,
images, and the packs and source samples consumed over all DP ranks; the stage config is saved as
``stage.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from dataclasses import asdict
from pathlib import Path

import torch

from pretrain.recipes import PREVIOUS, RECIPES, STAGES, pipeline_overrides


def lr_at(step: int, total: int, peak: float, min_lr: float = 1e-6, warmup_frac: float = 0.002) -> float:
    warm = max(1, int(round(total * warmup_frac)))
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return min_lr + 0.5 * (peak - min_lr) * (1 + math.cos(math.pi * min(t, 1.0)))


def setup_distributed(tp: int = 1, pp: int = 1, cp: int = 1) -> dict:
    """Process group (nccl on GPU, gloo on CPU) and megatron's TP/PP/CP/DP groups; returns the sizes."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if not cuda:
        from pretrain.cpu_compat import apply

        apply()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if cuda else "gloo"
        if "RANK" in os.environ:                  # torchrun / srun: its rendezvous variables
            dist.init_process_group(backend, rank=int(os.environ["RANK"]), world_size=world)
        else:                                     # one process on its own: a private loopback store
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     context_parallel_size=cp)
    sizes = {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
             "cp": ps.get_context_parallel_world_size(), "dp": ps.get_data_parallel_world_size()}
    if (sizes["tp"], sizes["pp"], sizes["cp"]) != (tp, pp, cp):
        raise RuntimeError(f"megatron's parallel state is already set up as {sizes}, not tp={tp} pp={pp} cp={cp}")
    return sizes


def write_metrics_manifest(run_dir: Path, stage: str, jsonl: Path) -> list[dict] | None:
    """The stage's ``metrics.jsonl`` as the ``train_metrics`` manifest (``ovpipe sql`` / ``ovpipe report``);
    returns its rows (rank 0; None elsewhere)."""
    import torch.distributed as dist
    from manifests.io import write_part

    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    rows = {}
    for line in jsonl.read_text().splitlines():  # a resumed stage appends; the last record of a step wins
        m = json.loads(line)
        rows[m["step"]] = {"stage": stage, **{k: m[k] for k in ("step", "loss", "lr", "grad_norm", "tokens_per_s",
                                                                 "mfu", "tokens", "images")},
                           "packs": m.get("packs"), "samples": m.get("samples")}   # absent in older records
    idx = list(STAGES).index(stage)
    out = [rows[k] for k in sorted(rows)]
    write_part(out, run_dir / "pretrain" / "train_metrics" / f"part-{idx:05d}.parquet", "train_metrics")
    return out


def image_pad_id(run_dir: Path, tokenizer: str | None) -> int:
    from packing.tokens import IMAGE_PAD, load_tokenizer

    return load_tokenizer(tokenizer or str(run_dir / "tokenizer")).convert_tokens_to_ids(IMAGE_PAD)


def _param_count(model) -> int:
    """Parameters of the whole model (all TP/PP ranks), each counted once."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    n = sum(p.numel() for p in model.parameters()
            if getattr(p, "tensor_model_parallel", False) or tp_rank == 0)
    t = torch.tensor([float(n)], device=_device())
    if dist.is_initialized():
        dist.all_reduce(t, group=ps.get_model_parallel_group())
    return int(t.item())


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def to_device(b, device):
    import dataclasses

    mv = (lambda x: None if x is None else x.to(device, non_blocking=True))
    return dataclasses.replace(b, tokens=mv(b.tokens), labels=mv(b.labels), loss_mask=mv(b.loss_mask),
                               position_ids=mv(b.position_ids), cu_seqlens=mv(b.cu_seqlens),
                               cp_index=mv(b.cp_index), images=[mv(x) for x in b.images or []],
                               vision=None if b.vision is None else b.vision.to(device),
                               rotary=None if b.rotary is None else tuple(mv(x) for x in b.rotary))


RECOMPUTE = ("full", "selective", "none")


def recompute_overrides(recompute: str) -> dict:
    """``TransformerConfig`` fields of a recompute mode: ``full`` — every LLM layer's activations
    rebuilt in backward (and every tower layer's); ``selective`` — the core attention and the MLP
    (the widest activations: 2 × 9,728 per token in the 4B) of each layer, in the tower each MLP;
    ``none`` — everything kept."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]}
    return {}


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


def model_flops(recipe, trainable: str, stats: dict, recompute: str) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one micro-batch from its ``BatchPrep`` stats.

    Model FLOPs: per LLM token 2·N_llm forward (N_llm: the LLM's matmul weights, the output layer
    counted once, the input embedding — a lookup — not), per tower token 2·N_vit, per merged image
    token 2·N_proj; per sample of length s the causal attention 2·s²·(heads·head_dim)·layers
    forward (half of the square), per image of n tower tokens 4·n²·D·layers. Backward: 2× forward
    for a trained part; for a frozen one, its input gradient (1× forward) where a trained part lies
    before it (the LLM in stage 1), nothing where none does (the tower in stage 1). Hardware FLOPs
    add the recomputed forward: ``full`` the LLM layers and the tower; ``selective`` the MLPs and
    the core attention."""
    llm, vit = recipe.llm, recipe.vit
    h, f, layers = llm.hidden_size, llm.ffn_hidden_size, llm.num_layers
    attn_w = h * llm.kv_channels * (llm.num_attention_heads * 2 + llm.num_query_groups * 2)
    mlp_w = 3 * h * f
    n_llm_layers = layers * (attn_w + mlp_w)
    n_llm = n_llm_layers + h * llm.vocab_size
    D, L, I = vit.hidden_size, vit.num_layers, vit.intermediate_size
    n_vit_mlp = 2 * D * I
    n_vit_layers = L * (4 * D * D + n_vit_mlp)
    n_vit = n_vit_layers + 3 * vit.patch_size ** 2 * D
    n_proj = 16 * D * D + 4 * D * h
    llm_attn = 2 * stats["attn_sq"] * llm.num_attention_heads * llm.kv_channels * layers
    vit_attn = 4 * stats["vit_sq"] * D * L
    fwd_llm = 2 * n_llm * stats["tokens"] + llm_attn
    fwd_vit = 2 * n_vit * stats["vit_tokens"] + vit_attn
    fwd_proj = 2 * n_proj * stats["merged"]
    trains_all = trainable == "all"
    # backward multipliers: trained 2× (input + weight gradients); frozen 1× behind a trained part
    mult_vit, mult_proj, mult_llm = (3, 3, 3) if trains_all else (1, 3, 2)
    mf = mult_vit * fwd_vit + mult_proj * fwd_proj + mult_llm * fwd_llm
    extra = 0.0
    if recompute == "full":
        extra = fwd_llm - 2 * h * llm.vocab_size * stats["tokens"] + fwd_vit
    elif recompute == "selective":
        extra = 2 * layers * mlp_w * stats["tokens"] + llm_attn + 2 * L * n_vit_mlp * stats["vit_tokens"]
    return float(mf), float(mf + extra)


def build(recipe: str, run_dir: Path, tokenizer: str | None, sizes: dict, sequence_parallel: bool,
          dtype: torch.dtype, recompute: str):
    """The VLM for this rank (its PP stage, TP shard), on the device, in the training dtype."""
    from pretrain.vlm import VLM

    cuda = torch.cuda.is_available()
    overrides = {"pipeline_model_parallel_size": sizes["pp"], "context_parallel_size": sizes["cp"],
                 "calculate_per_token_loss": True, "variable_seq_lengths": sizes["pp"] > 1}
    if sizes["pp"] > 1:   # packed micro-batches differ in length; megatron's config check asks for this dispatcher
        overrides["moe_token_dispatcher_type"] = "alltoall"
    overrides.update(pipeline_overrides(RECIPES[recipe].llm.num_layers, sizes["pp"]))
    overrides.update(recompute_overrides(recompute))
    model = VLM(RECIPES[recipe], image_pad_id(run_dir, tokenizer), tp=sizes["tp"],
                backend="auto" if cuda else "sdpa", sequence_parallel=sequence_parallel, dtype=dtype, **overrides)
    if getattr(model, "vision", None) is not None:
        model.vision.recompute = recompute      # the tower's activations too, not only the LLM's
    if cuda:
        model.cuda()
    return model.to(dtype)


def train(run_dir: Path, recipe: str, stage: str, steps: int | None = None, micro_batch: int = 2,
          lr: float | None = None, seed: int = 0, peak_tflops: float | None = None, log=print, save_every: int = 0,
          stop_after: int | None = None, tokenizer: str | None = None, tp: int = 1, pp: int = 1, cp: int = 1,
          sequence_parallel: bool = False, distributed_optimizer: bool | None = None, grad_accum: int = 1,
          bf16: bool | None = None, epochs: float | None = None, data: str | None = None,
          on_step=None, save_every_minutes: float = 0.0, keep: int = 2,
          recompute: str | None = None, loader_workers: int | None = None) -> dict:
    """One stage through megatron-core's own training stack: the model in DDP
    (``DistributedDataParallel``, grads reduced over DP×CP), ``get_megatron_optimizer`` (Adam; the
    distributed optimizer on GPU), and the forward/backward schedule of ``get_forward_backward_func``
    (1F1B across pipeline stages, ``grad_accum`` micro-batches per step). The loss is the token mean
    over all target tokens of the step (``calculate_per_token_loss``: each micro-batch returns its
    loss sum and token count, megatron divides the reduced gradients by the global count), so the
    same global batch gives the same update at any DP/PP/CP/TP layout.

    Each step takes ``grad_accum × dp`` micro-batches of ``micro_batch`` packs from the packed
    shards, in a fixed order; DP rank ``d`` gets every ``dp``-th. Exactly one of ``steps`` /
    ``epochs`` (``pretrain.data.plan_data``); ``data``: the pack step to read instead of the stage's.
    ``stop_after``: end (with a checkpoint) after that many steps of this run — a killed job, for
    drills. ``save_every`` / ``save_every_minutes`` / SIGTERM / SIGUSR1 / ``keep``: see
    ``pretrain.checkpoint.SavePolicy``; a signalled run saves, stops and returns ``preempted``: the
    signal number. ``on_step(record, ddp)``: called on every rank after each optimizer step with the step's record and
    the DDP-wrapped model (``.module`` is the VLM; grads in ``param.main_grad``) — probes, tests.

    Gradients are reduced with ``overlap_grad_reduce`` (each DDP bucket's all-reduce / reduce-scatter
    starts during the backward pass, as soon as its last gradient is in): text-only micro-batches
    keep every bucket complete through ``VLM.embed``'s zero-valued dummy image.

    ``recompute``: ``full`` | ``selective`` | ``none`` (``recompute_overrides``; default the stage's
    on GPU, none on CPU). ``loader_workers``: DataLoader worker processes that decode and prepare
    the micro-batches (``pretrain.data.loader``; default 4 on GPU, 0 — in this process — on CPU).
    The loader's position (packs consumed) is saved with every checkpoint, and a resumed run
    continues at the next pack of the stream.

    Each record also holds: the time split of the step — ``data_wait_s`` (waiting for the loader and
    the host→device copies), ``fwd_bwd_s`` and ``optimizer_s`` (GPU time between CUDA events; host
    time on CPU) — ``mfu`` / ``hfu`` (``model_flops``), and ``pack_ids`` (this rank's packs)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain import checkpoint, dist_ckpt
    from pretrain.data import BatchPrep, loader, plan_data
    from pretrain.recipes import Parallelism, validate

    run_dir = Path(run_dir)
    st_cfg = STAGES[stage]
    data = data or st_cfg.data
    cuda = torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dist_opt = cuda if distributed_optimizer is None else distributed_optimizer
    validate(RECIPES[recipe], Parallelism(tp=tp, pp=pp, cp=cp, sequence_parallel=sequence_parallel,
                                          distributed_optimizer=dist_opt, world_size=world), cuda=cuda)
    sizes = setup_distributed(tp, pp, cp)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    bf16 = (cuda and st_cfg.bf16) if bf16 is None else bf16
    dtype = torch.bfloat16 if bf16 else torch.float32
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    if recompute is None:
        recompute = st_cfg.recompute if cuda else "none"    # activation recompute is a GPU-memory trade
    plan = plan_data(run_dir, data, micro_batch, grad_accum, sizes["dp"], steps, epochs, count_samples=rank0)
    steps = plan.steps
    if rank0:
        log(f"stage {stage}: {plan.describe()}")
    model = build(recipe, run_dir, tokenizer, sizes, sequence_parallel, dtype, recompute)
    out = run_dir / "pretrain" / f"stage-{stage}"
    out.mkdir(parents=True, exist_ok=True)
    peak = lr if lr is not None else st_cfg.lr
    if rank0:
        (out / "stage.json").write_text(json.dumps(
            {**asdict(st_cfg), "data": data, "lr": peak, "recipe": recipe, "steps": steps, "epochs": epochs,
             "data_packs": plan.packs, "data_samples": plan.samples, "micro_batch": micro_batch,
             "grad_accum": grad_accum, **sizes, "sequence_parallel": sequence_parallel,
             "distributed_optimizer": dist_opt, "bf16": bf16, "recompute": recompute, "seed": seed}, indent=2))
    ckpt = out / "dist_ckpt"                            # iter_<step>/ + latest (pretrain/checkpoint.py)
    prev = run_dir / "pretrain" / f"stage-{PREVIOUS[stage]}" / "dist_ckpt" if stage in PREVIOUS else None
    how, start, src = checkpoint.resume_point(ckpt, prev, dist_ckpt.readable, log=log if rank0 else None)
    if src is not None:                                 # each stage starts from the last, or resumes its own
        dist_ckpt.load_model(src, model)
        if rank0:
            log(f"stage {stage}: {'resuming at step ' + str(start) if how == 'resume' else 'starting'} from {src}")
    model.set_trainable(st_cfg.trainable)
    cfg = model.config
    # overlap_grad_reduce on CPU (gloo) too: the async all-reduce / reduce-scatter and megatron's
    # bucket-readiness bookkeeping are device-independent, so CI runs the production code path.
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt, overlap_grad_reduce=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=peak, min_lr=st_cfg.min_lr, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
        adam_eps=st_cfg.adam_eps, clip_grad=1.0, bf16=bf16, params_dtype=dtype,
        use_distributed_optimizer=dist_opt), [ddp])
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.no_sync_func = ddp.no_sync
    if how == "resume" and start:                       # step 0: imported weights, no optimizer state
        dist_ckpt.load_optimizer(src, model, opt)
    if cuda:
        fused_adam(opt)
    n_params = _param_count(model)
    peak_flops = (peak_tflops or (989.0 if cuda else 0.2)) * 1e12 * world
    dp, dp_rank = sizes["dp"], ps.get_data_parallel_rank()
    cp_rank = ps.get_context_parallel_rank()
    # same data order as an uninterrupted run: the loader continues at the first pack not consumed
    # (the checkpoint's loader state; older checkpoints: the steps done × the global batch)
    state = dist_ckpt.data_state(src) if how == "resume" and start else None
    if state is not None and state.get("step") not in (None, data):
        raise ValueError(f"the checkpoint {src} was reading pack step {state['step']!r}, this run reads {data!r}")
    start_pack = state["packs_consumed"] if state is not None else start * plan.gbs
    rec_ = RECIPES[recipe]
    prep = BatchPrep(rec_.vit, rec_.llm.kv_channels, rec_.llm.rope_theta, model.image_pad_id, dtype, sizes["tp"],
                     sizes["cp"], cp_rank, sequence_parallel)
    workers = (4 if cuda else 0) if loader_workers is None else loader_workers
    batches = iter(loader(run_dir, data, micro_batch, dp_rank, dp, start_pack, prep, workers, pin_memory=cuda))
    device = _device()
    reports = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0

    def forward_step(data_iterator, m):
        b = next(data_iterator)
        per_tok = m(b)

        def loss_func(per_tok):
            s = (per_tok.float() * b.loss_mask).sum()
            n = b.loss_mask.sum()
            return s, n.to(torch.int), {"lm": torch.stack([s.detach(), n.detach()])}

        return per_tok, loss_func

    metrics, tb = [], None
    if rank0:
        try:  # tensorboard beside the JSONL when it is installed
            from torch.utils.tensorboard import SummaryWriter

            tb = SummaryWriter(str(out / "tensorboard"))
        except Exception:
            tb = None
    from tqdm import tqdm

    from ovpipe.console import terminal

    bar = tqdm(range(start, steps), desc=f"stage {stage}", unit="step", initial=start, total=steps, leave=False,
               file=terminal(),
               disable=log is not print or not rank0)
    fb = get_forward_backward_func()
    f = open(out / "metrics.jsonl", "a") if rank0 else None
    policy = checkpoint.SavePolicy(save_every, save_every_minutes, log=log if rank0 else (lambda *_: None))
    policy.install()
    try:
        for step in bar:
            t0 = time.perf_counter()
            raw = [next(batches) for _ in range(grad_accum)]
            mbs = [to_device(b, device) for b in raw]
            t_data = time.perf_counter() - t0
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps, peak, st_cfg.min_lr, st_cfg.warmup_frac)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if cuda else None
            if cuda:
                ev[0].record()
            th0 = time.perf_counter()
            ddp.zero_grad_buffer()
            opt.zero_grad()
            res = fb(forward_step_func=forward_step, data_iterator=iter(mbs), model=[ddp],
                     num_microbatches=grad_accum, seq_length=max(b.tokens.shape[1] for b in mbs),
                     micro_batch_size=1, forward_only=False)
            if cuda:
                ev[1].record()
            th1 = time.perf_counter()
            ok, gn, _ = opt.step()
            if cuda:
                ev[2].record()
            th2 = time.perf_counter()
            # loss sum / target tokens over DP×CP (from the last stage), tokens / images / packs /
            # samples / model and hardware FLOPs over DP
            agg = torch.zeros(8, dtype=torch.float64, device=device)
            if reports:
                agg[:2] = torch.stack([r["lm"] for r in res]).sum(0).double()
            if reports and cp_rank == 0:
                flops = [model_flops(rec_, st_cfg.trainable, b.stats, recompute) for b in raw]
                agg[2:] = torch.tensor([sum(b.stats["tokens"] for b in raw), sum(b.n_images for b in raw),
                                        sum(b.n_packs for b in raw), sum(b.n_samples for b in raw),
                                        sum(x[0] for x in flops), sum(x[1] for x in flops)], dtype=torch.float64)
            if dist.is_initialized():
                dist.all_reduce(agg)
            agg = agg.cpu()                                 # the step's one host sync
            dt = time.perf_counter() - t0
            fwd_bwd, opt_s = (ev[0].elapsed_time(ev[1]) / 1e3, ev[1].elapsed_time(ev[2]) / 1e3) if cuda \
                else (th1 - th0, th2 - th1)
            ntok = int(agg[2])
            rec = {"step": step + 1, "loss": float(agg[0] / agg[1].clamp(min=1)), "lr": opt.param_groups[0]["lr"],
                   "grad_norm": float(gn) if gn is not None else float("nan"), "tokens_per_s": ntok / dt,
                   "mfu": float(agg[6]) / dt / peak_flops, "hfu": float(agg[7]) / dt / peak_flops,
                   "tokens": ntok, "images": int(agg[3]), "packs": int(agg[4]), "samples": int(agg[5]),
                   "step_s": dt, "data_wait_s": t_data, "fwd_bwd_s": fwd_bwd, "optimizer_s": opt_s,
                   "pack_ids": [i for b in raw for i in b.pack_ids]}
            packs_done = start_pack + (step + 1 - start) * plan.gbs
            metrics.append(rec)
            if on_step is not None:
                on_step(rec, ddp)
            if rank0:
                f.write(json.dumps({k: v for k, v in rec.items() if k != "pack_ids"}) + "\n")
                f.flush()
                bar.set_postfix(loss=f"{rec['loss']:.3f}")
                if tb is not None:
                    for k in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu"):
                        tb.add_scalar(k, rec[k], step + 1)
                log(f"stage {stage} step {step + 1}/{steps} loss {rec['loss']:.4f} lr {rec['lr']:.2e} "
                    f"gn {rec['grad_norm']:.3f} {rec['tokens_per_s']:.0f} tok/s")
            due, preempted = policy.decide(step + 1, device)
            stopping = preempted or (bool(stop_after) and step + 1 - start >= stop_after)
            if (due or stopping) and step + 1 < steps:
                dist_ckpt.save(ckpt, model, opt, step + 1, keep, {"step": data, "packs_consumed": packs_done})
                policy.saved()
            if stopping and step + 1 < steps:
                return {"metrics": metrics, "checkpoint": str(ckpt), "params": n_params,
                        "preempted": policy.signalled or (signal.SIGTERM if preempted else None), **sizes}
    finally:
        policy.restore()
        if f is not None:
            f.close()
    if checkpoint.newest(ckpt, log=None) is None or checkpoint.newest(ckpt, log=None)[0] != steps:
        dist_ckpt.save(ckpt, model, opt, steps, keep,
                       {"step": data, "packs_consumed": start_pack + (steps - start) * plan.gbs})
    rows = write_metrics_manifest(run_dir, stage, out / "metrics.jsonl")
    if rows:
        log(f"stage {stage}: {consumed(rows, plan)}")
    return {"metrics": metrics, "checkpoint": str(ckpt), "params": n_params, "plan": asdict(plan), **sizes}


def consumed(rows: list[dict], plan) -> str:
    """Totals of a stage's ``train_metrics`` rows (all its runs, resumes included), as one line."""
    tot = {k: sum(r[k] or 0 for r in rows) for k in ("packs", "samples", "tokens", "images")}
    ep = f" ≈ {tot['packs'] / plan.packs:.2f} epochs of {plan.step}" if plan.packs else ""
    return (f"consumed {tot['packs']:,} packs ({tot['samples']:,} samples, {tot['tokens']:,} tokens, "
            f"{tot['images']:,} images) in {len(rows)} steps{ep}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--recipe", default="tiny", choices=sorted(RECIPES))
    ap.add_argument("--stage", choices=sorted(STAGES), required=True)
    length = ap.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="optimizer steps (default 30)")
    length.add_argument("--epochs", type=float, help="passes over the data step's packs: steps = "
                        "ceil(E × packs / (micro_batch × grad_accum × dp))")
    ap.add_argument("--data", help="pack step to read (default: the stage's, see pretrain.recipes.STAGES)")
    ap.add_argument("--micro-batch", type=int, default=2, help="packs per micro-batch (one THD sequence)")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step and DP rank")
    ap.add_argument("--lr", type=float)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer")
    ap.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (0: only at "
                    "the end and on SIGTERM/SIGUSR1)")
    ap.add_argument("--save-every-minutes", type=float, default=0.0, help="also save when M minutes have "
                    "passed since the last save")
    ap.add_argument("--keep", type=int, default=2, help="checkpoints kept (the newest K)")
    ap.add_argument("--stop-after", type=int, help="checkpoint and stop after this many steps (drills)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--distributed-optimizer", choices=["auto", "on", "off"], default="auto",
                    help="auto: on with CUDA (megatron's distributed optimizer checks for CUDA tensors)")
    ap.add_argument("--fp32", action="store_true", help="train in fp32 even on GPU")
    ap.add_argument("--recompute", choices=RECOMPUTE, help="activation recompute (default: the stage's on GPU, "
                    "none on CPU): full | selective (core attention + MLP) | none")
    ap.add_argument("--loader-workers", type=int, help="DataLoader worker processes (default 4 on GPU, 0 on CPU)")
    ap.add_argument("--metrics-out", help="also write this run's per-step metrics here (JSON), from rank 0")
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    steps = 30 if a.steps is None and a.epochs is None else a.steps
    from pretrain.stage_run import tracking

    with tracking(Path(a.run_dir), a.stage, rank0=int(os.environ.get("RANK", "0")) == 0) as finished:
        res = _train_cli(a, steps)
        rc = 128 + int(res["preempted"]) if res.get("preempted") else 0   # saved and stopped: not done
        finished(rc)
    if a.metrics_out and int(os.environ.get("RANK", "0")) == 0:
        Path(a.metrics_out).write_text(json.dumps(res))
    return rc


def _train_cli(a, steps: int | None) -> dict:
    return train(Path(a.run_dir), a.recipe, a.stage, steps, a.micro_batch, a.lr, a.seed, tokenizer=a.tokenizer,
                 save_every=a.save_every, stop_after=a.stop_after, save_every_minutes=a.save_every_minutes,
                 keep=a.keep, tp=a.tp, pp=a.pp, cp=a.cp, sequence_parallel=a.sequence_parallel,
                 distributed_optimizer={"auto": None, "on": True, "off": False}[a.distributed_optimizer],
                 grad_accum=a.grad_accum, bf16=False if a.fp32 else None, epochs=a.epochs, data=a.data,
                 recompute=a.recompute, loader_workers=a.loader_workers)

if __name__ == "__main__":
    raise SystemExit(main())
