"""The GPU memory a training layout needs, and the recompute it should run (``recompute: auto``).

Recompute trades FLOPs for memory, and the fastest mode is the one that recomputes least while its
peak still leaves the allocator room. So the GPU default is chosen per recipe, layout, pack length
and card, not fixed per stage:

1. **The peak of each mode** (``estimate``), per rank, in bytes:

   - *states*, exact from the recipe's shapes: bf16 weights (2 B/param), megatron's fp32 gradient
     buffer (4 B/trained param, ``grad_reduce_in_fp32``), and Adam's fp32 master weights and two
     moments (12 B/trained param) sharded over DP·CP by the distributed optimizer (an fp32 run: 4 B
     weights, no master copy, activations twice the bytes). A frozen part holds its weights only.
     TP divides the LLM's matrices; PP keeps the largest stage (the first holds the tower, the
     projector and the embedding);
   - *activations*, the bf16 elements each layer keeps for its backward per token (``llm_elements``,
     ``vit_elements``: counted from the layer's tensors, e.g. ``selective`` keeps the two norms'
     inputs, the attention's q/k/v and output, the MLP's input), times the calibration factors below;
     the tower counts 4 patches per LLM token of the micro-batch (every token an image token: the
     worst pack a stage may meet later), and 1F1B keeps ``min(pp, grad_accum)`` micro-batches in flight
     on the first stage;
   - *the loss*: the [tokens, vocabulary] logits and their fp32 copies (megatron's or the plain loss;
     liger's fused linear cross-entropy never materialises them);
   - a fixed *overhead* (CUDA context, cuBLAS/flash workspaces, the layer being recomputed).

2. **The calibration** (``CALIBRATION``) is a least-squares fit of the overhead and of one factor per
   term to the peaks measured on one H200 (``CALIBRATION_POINTS``: ten (LLM, tower, loss) settings from
   ``bench/results/h200/``, listed in ``bench/results/h200.md``); ``tests/pretrain/test_memory.py`` refits it from those
   points and checks every point within ``ERROR_GIB`` (3.5 GiB; the worst residual is 3.3). The points
   span every LLM mode but ``full`` with a kept tower and every tower mode; a layout never measured
   (TP, PP, CP) is the same counts scaled by the same factors.

3. **The choice** (``choose``): among the (LLM, tower, loss kernel) settings whose estimate stays under
   ``HEADROOM`` of the card's memory, the one with the fewest recomputed FLOPs
   (``pretrain.trainer.flops``); at equal FLOPs megatron's loss before liger's, so liger's fused loss
   (4.7 GiB less) is chosen only where it lets less be recomputed, and only when no loss kernel is set;
   a setting within ``TIE`` of those FLOPs, with the same loss, and at least ``TIE_GIB`` smaller wins
   instead.
   ``HEADROOM`` 0.95: the 4B on one H200 ran fastest at 92% and 96% of the card (LLM kept whole, tower
   ``selective``, faster than with the tower fully recomputed at 81-85%; docs/pretrain.md); nothing ran
   slower for being near the limit. The margin is for the estimate's error,
   and the tower is already counted at its worst pack. ``TIE`` 1%: the 4B's ``mlp`` and ``selective``
   differ only by the core attention of short caption samples (0.2% of the FLOPs) and ran within 1% of
   each other; the smaller peak wins.
   When only the headroom is short, ``full`` runs (the least memory) with a warning naming the layouts
   that would fit; when even ``full``'s estimate is within ``ERROR_GIB`` of the card, the run fails
   before any work with that advice (an explicit ``recompute`` skips the estimate).

4. **Optimizer offload** (``optimizer_offload``, megatron-core's ``HybridDeviceOptimizer``): a fraction ``f``
   of the trained parameters has its fp32 master copy, both Adam moments and its update on the host, so the
   card keeps ``12·(1 − f)`` of Adam's 12 B per trained parameter (the bf16 weights and the fp32 gradient
   buffer stay); the host holds ``16·f`` B (those 12 B and a pinned copy of the gradient, ``host_bytes``).
   Left unset with ``recompute: auto``, offload stays off unless nothing fits without it; then the least
   fraction of ``OFFLOAD_STEPS`` at which a setting fits is taken, and the log says so (the 4B's stage 1.5 at
   DP = 1 on an 80 GB card: its weights, gradients and Adam state alone are 73 GiB). Its cost in step time
   is not in the estimate: the device script measures it (``bench/gpu/next_call.sh``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GIB = 1 << 30
HEADROOM = 0.95
ERROR_GIB = 3.5      # the fit's worst residual over CALIBRATION_POINTS (3.3 GiB), rounded up
TIE = 0.01
TIE_GIB = 1.0
OFFLOAD_STEPS = (0.25, 0.5, 0.75, 1.0)   # the optimizer shares on the host auto tries where nothing fits without
# Least-squares fit to CALIBRATION_POINTS (tests/pretrain/test_memory.py refits it)
CALIBRATION = {"overhead_gib": 2.270, "llm": 1.057, "vit": 1.505, "loss": 1.991}
# (LLM mode, tower mode, loss kernel, peak GiB) of the 4B, stage 1.5, one 8,192-token pack (the run's largest
# tower input: 27,479 tower tokens), DP = 1, bf16, distributed optimizer, on one H200 (fused kernels; the
# ``full`` run had eager kernels, so the 2.51 GiB eager kernels added to ``selective`` is taken off it).
CALIBRATION_POINTS = {
    "tokens": 8192, "vit_tokens": 27479,
    "peaks": [("full", "full", "megatron", 83.06 - 2.51),      # bench/results/h200/host_free_full.json
              ("selective", "selective", "megatron", 113.15),  # bench/results/h200/fused_megatron_selective.json
              ("selective", "selective", "liger", 108.40),     # fused_liger_selective.json
              ("mlp", "selective", "megatron", 117.4),         # the 3-step mlp run (bench/results/h200.md)
              ("mlp", "none", "megatron", 128.73),             # fused_megatron_mlp_vnone.json
              ("mlp", "none", "liger", 123.98),                # fused_liger_mlp_vnone.json
              ("none", "full", "liger", 113.55),               # none_vfull_liger.json
              ("none", "full", "megatron", 118.29),            # none_vfull_megatron.json
              ("none", "selective", "liger", 128.69),          # none_vsel_liger.json
              ("none", "selective", "megatron", 133.99)],      # none_vsel_megatron_ga4.json (grad-accum 4)
}
LLM_MODES = ("none", "mlp", "selective", "full")
VIT_MODES = ("none", "selective", "full")


def llm_elements(llm, mode: str, tp: int = 1, sequence_parallel: bool = False) -> float:
    """Elements kept per token by one LLM layer on one TP rank (SP splits the hidden-size ones too) for its
    backward: ``full`` keeps the layer's input; ``selective`` the input norm's input, the QKV
    matmul's input, the q/k norms' inputs, the core attention's q/k/v, the output projection's input,
    the pre-MLP norm's input and the MLP's input; ``mlp`` adds what flash attention keeps beside them
    (its own q/k/v and output); ``none`` adds the SwiGLU's two branches and its output."""
    h, q, kv = llm.hidden_size, llm.num_attention_heads * llm.kv_channels, llm.num_query_groups * llm.kv_channels
    f = llm.ffn_hidden_size
    hidden = {"full": h, "selective": 4 * h, "mlp": 4 * h, "none": 4 * h}[mode]
    wide = {"full": 0, "selective": (q + kv) + (q + 2 * kv) + q,
            "mlp": (q + kv) + (q + 2 * kv) + q + (2 * q + 2 * kv),
            "none": (q + kv) + (q + 2 * kv) + q + (2 * q + 2 * kv) + 3 * f}[mode]
    return hidden / (tp if sequence_parallel else 1) + wide / tp


def vit_elements(vit, mode: str) -> int:
    """Elements kept per tower token by one tower layer: ``full`` its input; ``selective`` the two
    LayerNorms' and the attention's inputs, q/k/v, the attention output and the MLP's input;
    ``none`` adds the MLP's hidden activation before and after the GELU."""
    D, inter = vit.hidden_size, vit.intermediate_size
    return {"full": D, "selective": 8 * D, "none": 8 * D + 2 * inter}[mode]


def param_counts(recipe) -> dict:
    from pretrain.trainer.flops import matmul_params

    n = matmul_params(recipe)
    llm = recipe.llm
    emb = llm.vocab_size * llm.hidden_size
    return {"llm_layer": n["llm_layers"] / llm.num_layers, "embedding": emb,
            "output": 0 if llm.tie_embeddings else emb, "vit": n["vit_layers"] + n["patch_embed"],
            "projector": n["projector"]}


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = True
    grad_accum: int = 1                # micro-batches 1F1B keeps in flight (with pp); a micro-batch's size is tokens
    bf16: bool = True
    offload: float = 0.0               # share of the optimizer's state on the host (optimizer_offload)


def state_bytes(recipe, trainable: str, lay: Layout) -> float:
    """Weights, gradients and optimizer state on the rank of the largest pipeline stage."""
    return max(stage_state_bytes(recipe, trainable, lay))


def stage_state_bytes(recipe, trainable: str, lay: Layout) -> list[float]:
    """Weights, gradients and optimizer state of a rank of each pipeline stage (first to last)."""
    stages = _stages(recipe, lay)
    trained = _trained(recipe, trainable, lay)
    shard = lay.dp * lay.cp if lay.distributed_optimizer else 1
    # bf16: bf16 weights, fp32 gradients, fp32 master weights + Adam's moments; fp32: no master copy
    weight, adam = (2, 12) if lay.bf16 else (4, 8)
    return [weight * s + (4 + adam * (1 - lay.offload) / shard) * t for s, t in zip(stages, trained)]


def _stages(recipe, lay: Layout) -> list[float]:
    from pretrain.recipes import pipeline_sizes

    p = param_counts(recipe)
    layers = pipeline_sizes(recipe.llm.num_layers, lay.pp)
    tower = p["vit"] + p["projector"]
    if lay.pp == 1:
        return [tower + (layers[0] * p["llm_layer"] + p["embedding"] + p["output"]) / lay.tp]
    # a tied output layer is a copy of the embedding on the last stage
    return [tower + (layers[0] * p["llm_layer"] + p["embedding"]) / lay.tp,
            (layers[-1] * p["llm_layer"] + (p["output"] or p["embedding"])) / lay.tp]


def _trained(recipe, trainable: str, lay: Layout) -> list[float]:
    p = param_counts(recipe)
    return [s if trainable == "all" else (p["projector"] if i == 0 else 0) for i, s in enumerate(_stages(recipe, lay))]


def host_bytes(recipe, trainable: str, lay: Layout) -> float:
    """Host memory the offloaded optimizer takes on the rank of the largest pipeline stage: per offloaded trained
    parameter its fp32 master copy and two moments (12 B) and the pinned copy of its fp32 gradient (4 B)."""
    shard = lay.dp * lay.cp if lay.distributed_optimizer else 1
    return max(16 * lay.offload * t / shard for t in _trained(recipe, trainable, lay))


def estimate(recipe, trainable: str, llm_mode: str, vit_mode: str, loss_kernel: str, tokens: int,
             lay: Layout, vit_tokens: int | None = None, calibration: dict | None = None) -> dict:
    """The peak of one rank in GiB, by term. ``tokens``: LLM tokens of a micro-batch (``micro_batch``
    packs of the step's ``seq_len``); ``vit_tokens``: the tower's, None: 4 per token (the worst pack).
    At PP > 1 it is the first stage's activations with the last stage's logits added, and CP does not
    split the tower: upper bounds, where the layouts were never measured."""
    from pretrain.recipes import pipeline_sizes

    c = calibration or CALIBRATION
    llm, vit = recipe.llm, recipe.vit
    vit_tokens = 4 * tokens if vit_tokens is None else vit_tokens
    t = tokens / lay.cp
    in_flight = min(lay.pp, lay.grad_accum)
    layers = pipeline_sizes(llm.num_layers, lay.pp)[0] if lay.pp > 1 else llm.num_layers
    width = 2 if lay.bf16 else 4                 # bytes per kept element
    act_llm = c["llm"] * width * llm_elements(llm, llm_mode, lay.tp, lay.sequence_parallel) * layers * t * in_flight
    # a frozen tower that nothing trained precedes runs forward only and keeps nothing
    act_vit = 0.0 if trainable != "all" else \
        c["vit"] * width * vit_elements(vit, vit_mode) * vit.num_layers * vit_tokens * in_flight
    loss = 0.0 if loss_kernel == "liger" else c["loss"] * width * t * llm.vocab_size / lay.tp
    parts = {"states": state_bytes(recipe, trainable, lay), "llm_activations": act_llm,
             "vit_activations": act_vit, "loss": loss}
    out = {k: v / GIB for k, v in parts.items()}
    out["overhead"] = c["overhead_gib"]
    out["total"] = sum(out.values())
    return out


def candidates(trainable: str = "all", vision: str | None = None) -> list[tuple[str, str]]:
    """Every (LLM, tower) pair: the tower's share of the memory and of the FLOPs differs by pack. With
    the tower's mode set (``vision``), only it; a frozen tower (stage 1: nothing trained before it) runs
    its forward only, keeps nothing for a backward and so recomputes nothing whatever its mode: ``none``."""
    towers = (vision,) if vision is not None else VIT_MODES if trainable == "all" else ("none",)
    return [(lm, vm) for lm in LLM_MODES for vm in towers]


def loss_kernels_for(tp: int, named: str | None = None) -> tuple[str, ...]:
    """The loss kernels ``recompute: auto`` weighs: the ``named`` one alone, or when none is named, the
    preferred first, megatron's (vocab-parallel; measured as fast or faster at equal recompute), and
    liger's fused linear cross-entropy (4.7 GiB less on the 4B's 8K packs) where it can run: TP = 1,
    liger installed."""
    from pretrain.model.fused import liger_available

    if named is not None:
        return (named,)
    return ("megatron", "liger") if tp == 1 and liger_available() else ("megatron",)


@dataclass(frozen=True)
class Choice:
    recompute: str
    vision_recompute: str
    loss_kernel: str
    peak_gib: float
    memory_gib: float
    fits: bool
    table: tuple = ()   # (llm, tower, loss kernel, peak GiB, recomputed FLOPs / model FLOPs) of every candidate

    def describe(self) -> str:
        rows = ", ".join(f"{lm}/{vm}/{lk} {pk:.1f} GiB +{x:.1%}" for lm, vm, lk, pk, x in self.table)
        return (f"recompute auto: {self.recompute} (tower {self.vision_recompute}, loss {self.loss_kernel}), "
                f"estimated peak {self.peak_gib:.1f} of {self.memory_gib:.1f} GiB [{rows}]")


def choose(recipe, trainable: str, loss_kernels, tokens: int, attn_sq: float, lay: Layout,
           memory_gib: float, vision: str | None = None) -> Choice:
    """The fastest (LLM, tower, loss kernel) setting whose estimated peak fits ``HEADROOM`` of ``memory_gib``.
    ``loss_kernels``: the run's loss kernel, or the kernels to choose from, the preferred first (a
    later one is taken only where its smaller peak lets fewer FLOPs be recomputed); ``vision``: the
    tower's mode when it is set, not chosen."""
    from pretrain.trainer.flops import model_flops

    kernels = (loss_kernels,) if isinstance(loss_kernels, str) else tuple(loss_kernels)
    stats = {"tokens": tokens, "attn_sq": attn_sq, "vit_tokens": 4 * tokens, "vit_sq": 4 * tokens * 1024,
             "merged": tokens}
    rows = []
    for lm, vm in candidates(trainable, vision):
        mf, hf = model_flops(recipe, trainable, stats, lm, vm)
        for lk in kernels:
            rows.append((lm, vm, lk, estimate(recipe, trainable, lm, vm, lk, tokens, lay)["total"], hf / mf - 1))
    fit = [r for r in rows if r[3] <= HEADROOM * memory_gib]
    if not fit:
        best = min(rows, key=lambda r: (r[3], kernels.index(r[2])))
        return Choice(*best[:4], memory_gib, False, tuple(rows))
    fastest = min(fit, key=lambda r: (r[4], kernels.index(r[2]), r[3]))
    near = [r for r in fit if r[2] == fastest[2] and r[4] <= fastest[4] + TIE and r[3] <= fastest[3] - TIE_GIB]
    best = min(near, key=lambda r: (r[3], r[4])) if near else fastest
    return Choice(*best[:4], memory_gib, True, tuple(rows))


def resolve_auto(cfg, recipe, trainable: str, sizes: dict, tokens: int, attn_sq: float, memory_gib: float,
                 log=print):
    """``(cfg, Choice)``: ``cfg`` with ``recompute: auto`` (and the tower's, unless set) replaced by
    ``choose``'s pick, and ``optimizer_offload`` left unset resolved: 0, or where nothing fits without it (and
    the distributed optimizer runs), the least of ``OFFLOAD_STEPS`` at which something fits, said in the log.
    Fails, naming the layouts that would fit, when the weights and optimizer state alone, or the least-memory
    mode, exceed the card."""
    lay = Layout(tp=sizes["tp"], pp=sizes["pp"], cp=sizes["cp"], dp=sizes["dp"],
                 sequence_parallel=cfg.sequence_parallel, distributed_optimizer=bool(cfg.distributed_optimizer),
                 grad_accum=cfg.grad_accum, bf16=bool(cfg.bf16), offload=cfg.optimizer_offload or 0.0)
    kernels = loss_kernels_for(lay.tp, cfg.loss_kernel)

    def fit(lay):
        if state_bytes(recipe, trainable, lay) / GIB + CALIBRATION["overhead_gib"] > memory_gib:
            return None
        c = choose(recipe, trainable, kernels, tokens, attn_sq, lay, memory_gib, cfg.vision_recompute)
        return c if c.fits else None

    if cfg.optimizer_offload is None and lay.distributed_optimizer and fit(lay) is None:
        for f in OFFLOAD_STEPS:
            off = dataclasses.replace(lay, offload=f)
            if (c := fit(off)) is not None:
                log(f"optimizer offload {f:.0%}: recipe {cfg.recipe!r} stage {cfg.stage} fits this GPU's "
                    f"{memory_gib:.1f} GiB at tp={lay.tp} pp={lay.pp} dp={lay.dp} only with the Adam state of "
                    f"{f:.0%} of its trained parameters on the host (megatron-core's HybridDeviceOptimizer: "
                    f"{state_bytes(recipe, trainable, off) / GIB:.1f} GiB of states on the GPU, "
                    f"{host_bytes(recipe, trainable, off) / GIB:.1f} GiB on the host; steps run slower)")
                return dataclasses.replace(cfg, recompute=c.recompute, vision_recompute=c.vision_recompute,
                                           loss_kernel=c.loss_kernel, optimizer_offload=f), c
    states = state_bytes(recipe, trainable, lay) / GIB
    if states + CALIBRATION["overhead_gib"] > memory_gib:
        raise ValueError(
            f"recipe {cfg.recipe!r} stage {cfg.stage}: weights, gradients and optimizer state need "
            f"{states:.1f} GiB per rank at tp={lay.tp} pp={lay.pp} dp={lay.dp} (distributed_optimizer="
            f"{lay.distributed_optimizer}, optimizer_offload={lay.offload}), more than this GPU's "
            f"{memory_gib:.1f} GiB: "
            f"{suggest(recipe, trainable, cfg.loss_kernel or 'megatron', tokens, lay, memory_gib)}")
    c = choose(recipe, trainable, kernels, tokens, attn_sq, lay, memory_gib, cfg.vision_recompute)
    if not c.fits:
        where = (f"even recompute {c.recompute} (tower {c.vision_recompute}, loss {c.loss_kernel}) is estimated at "
                 f"{c.peak_gib:.1f} GiB per rank at tp={lay.tp} pp={lay.pp} dp={lay.dp}")
        advice = suggest(recipe, trainable, c.loss_kernel, tokens, lay, memory_gib)
        if c.peak_gib > memory_gib - ERROR_GIB:
            raise ValueError(f"recipe {cfg.recipe!r} stage {cfg.stage}: {where}, more than this GPU's "
                             f"{memory_gib:.1f} GiB less the estimate's error ({ERROR_GIB} GiB): {advice} (or name "
                             f"--recompute to run anyway)")
        log(f"warning: {where}, over {HEADROOM:.0%} of {memory_gib:.1f} GiB; {advice}")
    return dataclasses.replace(cfg, recompute=c.recompute, vision_recompute=c.vision_recompute,
                               loss_kernel=c.loss_kernel, optimizer_offload=lay.offload), c


def suggest(recipe, trainable: str, loss_kernel: str, tokens: int, lay: Layout, memory_gib: float) -> str:
    """The smallest change of layout (2×, 4× or 8× the DP ranks with the distributed optimizer, the
    TP or the PP size) at which recompute ``full`` fits, as advice."""
    from pretrain.recipes import Parallelism, validate

    fixes = []
    for name in ("dp", "tp", "pp"):
        for k in (2, 4, 8):
            new = dataclasses.replace(lay, **{name: getattr(lay, name) * k},
                                      **({"distributed_optimizer": True} if name == "dp" else {}))
            try:
                validate(recipe, Parallelism(tp=new.tp, pp=new.pp, cp=new.cp, world_size=new.tp * new.pp * new.cp))
            except ValueError:
                break
            if estimate(recipe, trainable, "full", "full", loss_kernel, tokens, new)["total"] <= HEADROOM * memory_gib:
                fixes.append(f"{name}={getattr(new, name)}")
                break
    return ("it fits at " + " or ".join(fixes)) if fixes else "no layout up to 8× fits; use a GPU with more memory"


CARDS = {"h100": 79.2, "h200": 139.8}     # torch.cuda.get_device_properties(0).total_memory / 2**30


def main(argv=None) -> int:
    """Plan a layout without a GPU: every recompute pair's estimated peak per rank and the pick, e.g.
    ``python -m pretrain.trainer.memory --recipe llava-ov-1.5-4b --stage 1.5 --gpu h100 --dp 8``."""
    import argparse

    from pretrain.recipes import RECIPES, STAGES, Parallelism, validate

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--recipe", default="llava-ov-1.5-4b", choices=sorted(RECIPES))
    ap.add_argument("--stage", default="1.5", choices=sorted(STAGES))
    ap.add_argument("--gpu", default="h100", help=f"a card ({', '.join(CARDS)}) or its memory in GiB")
    ap.add_argument("--seq-len", type=int, default=8192, help="tokens per pack")
    ap.add_argument("--sample-len", type=int, default=190, help="mean sample length in a pack (attention FLOPs)")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=1)
    for name in ("tp", "pp", "cp", "dp"):
        ap.add_argument(f"--{name}", type=int, default=1)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--loss-kernel", choices=["megatron", "liger", "torch"],
                    help="default: chosen with the recompute (megatron, or liger where it lets less be recomputed)")
    ap.add_argument("--fp32", action="store_true")
    ap.add_argument("--offload", type=float, default=0.0, help="share of the optimizer's state on the host "
                    "(optimizer_offload, 0..1)")
    a = ap.parse_args(argv)
    memory = CARDS.get(a.gpu.lower()) or float(a.gpu)
    recipe, trainable = RECIPES[a.recipe], STAGES[a.stage].trainable
    validate(recipe, Parallelism(tp=a.tp, pp=a.pp, cp=a.cp, sequence_parallel=a.sequence_parallel,
                                 seq_len=a.seq_len, world_size=a.tp * a.pp * a.cp * a.dp))
    lay = Layout(tp=a.tp, pp=a.pp, cp=a.cp, dp=a.dp, sequence_parallel=a.sequence_parallel,
                 grad_accum=a.grad_accum, bf16=not a.fp32, offload=a.offload)
    tokens = a.micro_batch * a.seq_len
    kernels = loss_kernels_for(a.tp, a.loss_kernel)
    c = choose(recipe, trainable, kernels, tokens, tokens * a.sample_len, lay, memory)
    print(f"{a.recipe} stage {a.stage}, {tokens:,} tokens per micro-batch, tp={a.tp} pp={a.pp} cp={a.cp} "
          f"dp={a.dp}, {memory:.1f} GiB per GPU (headroom {HEADROOM:.0%}: {HEADROOM * memory:.1f} GiB); "
          f"weights, gradients and optimizer state {state_bytes(recipe, trainable, lay) / GIB:.1f} GiB"
          + (f" (and {host_bytes(recipe, trainable, lay) / GIB:.1f} GiB on the host)" if a.offload else ""))
    print(f"{'LLM':<10} {'tower':<10} {'loss':<9} {'peak GiB':>9} {'recomputed':>11}  fits")
    for lm, vm, lk, pk, x in sorted(c.table, key=lambda r: (r[4], kernels.index(r[2]))):
        mark = "<- auto" if (lm, vm, lk) == (c.recompute, c.vision_recompute, c.loss_kernel) and c.fits else ""
        print(f"{lm:<10} {vm:<10} {lk:<9} {pk:>9.1f} {x:>10.1%}  {'yes' if pk <= HEADROOM * memory else 'no ':<4}"
              f"{mark}")
    if not c.fits:
        print(f"nothing fits: {suggest(recipe, trainable, c.loss_kernel, tokens, lay, memory)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
