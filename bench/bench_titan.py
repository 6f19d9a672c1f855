"""torchtitan's Qwen3 beside ovpipe's LLM, on one card, on the same packed 8K-token text sequences:
``python -m bench.bench_titan --side titan|ovpipe --precision bf16|fp8-rowwise|fp8-tensorwise --run-dir RUN``.

Both sides train the Qwen3-4B decoder (the 4B recipe's LLM, no tower) from a fresh initialisation on the
same sequences: the first ``--steps`` packs of RUN's pack step (``pretrain.data.iter_batches``), one pack per
step, every sample of a pack its own causal document (torchtitan's document-masked flex attention from
per-document positions, its default; ovpipe's packed THD attention from ``cu_seqlens``), so the FLOPs are the
same.

- ``titan``: torchtitan's own model (``torchtitan.models.qwen3.model_registry("4B")``, flex attention),
  its float8 converter (``Float8LinearConverter``, filter ``auto_filter_small_kn`` and the output layer
  kept in bf16) and its per-``TransformerBlock`` ``torch.compile`` (as ``apply_compile`` does), fp32 weights
  and torch's fused AdamW, the matmuls in bf16 autocast (what its FSDP mixed precision computes in; at one
  rank no FSDP wrapper). torchtitan's trainer itself is not run: it builds its own tokenizer and dataset
  loaders from the Hub.
- ``ovpipe``: ``pretrain.model.llm.build_llm`` with the trainer's kernels (``fused``), its float8
  (``pretrain.model.float8``), megatron-core's DDP and distributed optimizer (``build_optimizer``) and
  megatron's schedule, as ``pretrain.trainer`` runs the LLM of a stage.

MFU: 6·N per token plus causal attention per sample (``pretrain.trainer.flops``), over ``--peak-tflops``
(989, the dense bf16 peak, also for fp8: MFU against the bf16 peak). ``--cpu``: a dry run of the code
path at a tiny shape (torchtitan's ``debugmodel``, ovpipe's ``tiny`` LLM, random tokens), for the device
script's checks, not a figure; torchtitan's side runs its forward only there (torch's flex attention has no CPU
backward).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace


def sequences(run_dir: str | None, step: str, n: int, seq_len: int, vocab: int, seed: int = 0) -> list[dict]:
    """``n`` sequences: token ids, next-token labels, per-document positions and ``cu_seqlens`` (from RUN's
    packs; without RUN, random tokens in documents of 256 for a dry run)."""
    import numpy as np
    import torch

    out = []
    if run_dir:
        from pretrain.data import iter_batches

        for b in iter_batches(run_dir, step, 1, epochs=None):
            out.append({"tokens": b.tokens[0] % vocab, "labels": b.labels[0] % vocab, "positions": b.position_ids[0],
                        "cu": b.cu_seqlens.to(torch.int32), "max": b.max_seqlen})
            if len(out) == n:
                return out
    rng = np.random.default_rng(seed)
    for _ in range(n):
        lens = np.full(seq_len // 256, 256)
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)])).to(torch.int32)
        tok = torch.from_numpy(rng.integers(0, vocab, seq_len))
        out.append({"tokens": tok, "labels": torch.roll(tok, -1), "cu": cu, "max": 256,
                    "positions": torch.cat([torch.arange(int(x)) for x in lens])})
    return out


def flops_per_seq(size, seq) -> float:
    """Model FLOPs of one sequence's forward and backward: 6·N per token (the decoder's matrices and the
    output layer) and causal attention per document (4·d·Σ s²/2 forward, twice that backward)."""
    h, q, kv, f = size.hidden_size, size.num_attention_heads * size.kv_channels, \
        size.num_query_groups * size.kv_channels, size.ffn_hidden_size
    n = size.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * f) + size.vocab_size * h
    lens = (seq["cu"][1:] - seq["cu"][:-1]).double()
    tokens = float(lens.sum())
    attn = size.num_layers * 3 * 4 * q * float((lens ** 2).sum()) / 2
    return 6 * n * tokens + attn


def titan(a, seqs, dev, log):
    import torch
    import torch.nn.functional as F
    from torchtitan.models.qwen3 import model_registry

    conv = None
    if a.precision.startswith("fp8"):
        from torchtitan.components.quantization.float8 import Float8LinearConverter

        recipe = a.precision.split("-", 1)[1]
        conv = [Float8LinearConverter.Config(recipe_name=recipe, filter_fqns=["auto_filter_small_kn", "lm_head"],
                                             emulate=a.cpu)]
    spec = model_registry("debugmodel" if a.cpu else "4B", attn_backend=a.titan_attention, converters=conv)
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device=dev)
    with torch.no_grad():
        model.init_weights(buffer_device=dev)
    model.train()
    if a.compile:
        for _, block in model.layers.named_children():
            block.compile(fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, fused=dev.type == "cuda")
    amp = torch.autocast(dev.type, dtype=torch.bfloat16)

    def step(seq):
        tok, lab, pos = (seq[k][None].to(dev) for k in ("tokens", "labels", "positions"))
        with amp, torch.set_grad_enabled(not a.cpu):
            masks = model.get_attention_masks(pos)
            logits = model(tok, pos, masks)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), lab.flatten(0, 1))
        if a.cpu:           # torch's flex attention has no CPU backward, and varlen no CPU kernel: forward only
            return loss.detach()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    n = sum(p.numel() for p in model.parameters())
    log(f"titan: {n / 1e9:.2f}B parameters, {a.precision}, compile {a.compile}")
    return step


def ovpipe(a, seqs, dev, log):
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain.model import float8, fused
    from pretrain.model.attention import rotary_tables
    from pretrain.model.llm import LLM_SIZES, build_llm, packed_seq_params
    from pretrain.recipes import STAGES
    from pretrain.trainer.build import setup_distributed
    from pretrain.trainer.optimizer import build_optimizer, ddp_config, on_cuda

    cuda = dev.type == "cuda"
    setup_distributed(1)
    model_parallel_cuda_manual_seed(a.seed)
    size = LLM_SIZES["tiny" if a.cpu else "qwen3-4b"]
    fused.set_kernels("fused" if cuda else "eager")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_llm(size, backend="auto" if cuda else "sdpa", dtype=dtype, calculate_per_token_loss=True,
                      bias_activation_fusion=cuda).to(dev).to(dtype)
    if a.precision.startswith("fp8"):
        log(f"ovpipe: float8 on {len(float8.convert(model, a.precision))} linear layers")
    ddp, opt = build_optimizer(model, STAGES["1.5"], a.lr, cuda, dtype,
                               ddp_config(SimpleNamespace(distributed_optimizer=cuda)))
    if cuda:
        on_cuda(opt)
    for g in opt.param_groups:
        g["lr"] = a.lr
    schedule = get_forward_backward_func()
    for s in seqs:      # the rotary tables, as the trainer's loader workers make them ahead of the step
        s["rotary"] = rotary_tables(s["positions"], size.kv_channels, size.rope_theta)

    def forward_step(it, m):
        s = next(it)
        per_tok = m(s["tokens"][None].to(dev), s["positions"][None].to(dev), attention_mask=None,
                    labels=s["labels"][None].to(dev),
                    packed_seq_params=packed_seq_params(s["cu"].to(dev), s["max"],
                                                        tuple(t.to(dev) for t in s["rotary"])))

        def loss_func(out):
            total = out.float().sum()
            count = torch.tensor(out.numel(), device=dev, dtype=torch.int)
            return total, count, {"lm": torch.stack([total.detach(), count.detach().float()])}

        return per_tok, loss_func

    def step(seq):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        res = schedule(forward_step_func=forward_step, data_iterator=iter([seq]), model=[ddp], num_microbatches=1,
                       seq_length=int(seq["tokens"].numel()), micro_batch_size=1, forward_only=False)
        opt.step()
        s, c = res[0]["lm"]
        return s / c

    log(f"ovpipe: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, {a.precision}")
    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", choices=["titan", "ovpipe"], help="required on a GPU or with --cpu")
    ap.add_argument("--precision", choices=["bf16", "fp8-tensorwise", "fp8-rowwise"], default="bf16")
    ap.add_argument("--run-dir", help="a run whose pack step holds 8K-token packs (default: random tokens)")
    ap.add_argument("--data", default="pack", help="the pack step (default pack)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4, help="steps left out of the figures (compile, autotune)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="titan: eager blocks")
    ap.add_argument("--titan-attention", choices=["flex", "varlen"], default="flex",
                    help="torchtitan's attention backend (default flex, its own default: its varlen path passes "
                         "enable_gqa to torch's varlen_attn, which torch 2.11 lacks, and has no CPU kernel)")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU at a tiny shape (no figure)")
    ap.add_argument("--out", help="write the per-step records and the summary here (JSON)")
    ap.add_argument("--quick", action="store_true", help="(make bench) same as the default on CPU: skip")
    a = ap.parse_args(argv)
    import torch

    from pretrain.model.sizes import LLM_SIZES

    if not a.cpu and not torch.cuda.is_available():
        print("bench_titan: needs a CUDA GPU (or --cpu for a dry run); skipped")
        return 0
    if a.side is None:
        ap.error("--side titan or --side ovpipe")
    if a.cpu:
        a.compile = False
        torch.set_num_threads(2)
    if a.side == "titan" and a.precision == "fp8-tensorwise":
        ap.error("torchtitan 0.3's float8 converter has rowwise recipes only: --precision fp8-rowwise")
    torch.manual_seed(a.seed)
    dev = torch.device("cpu" if a.cpu else "cuda")
    size = LLM_SIZES["tiny" if a.cpu else "qwen3-4b"]
    seqs = sequences(a.run_dir, a.data, a.steps, 1024 if a.cpu else 8192, 512 if a.cpu else size.vocab_size, a.seed)
    step = (titan if a.side == "titan" else ovpipe)(a, seqs, dev, print)
    recs = []
    for i, seq in enumerate(seqs):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = float(step(seq))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        tokens = int(seq["cu"][-1])
        recs.append({"step": i + 1, "loss": loss, "step_s": dt, "tokens": tokens, "tokens_per_s": tokens / dt,
                     "mfu": flops_per_seq(size, seq) / dt / (a.peak_tflops * 1e12)})
        print(f"step {i + 1}: loss {loss:.4f} {tokens / dt:,.0f} tok/s MFU {recs[-1]['mfu']:.3f}", flush=True)
    timed = recs[a.warmup:] or recs
    summary = {
        "side": a.side, "precision": a.precision, "compile": a.compile, "cpu_dry_run": a.cpu,
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
        "steps": len(recs), "timed_steps": len(timed),
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in timed),
        "mfu_median": statistics.median(r["mfu"] for r in timed), "mfu_basis": f"bf16 peak {a.peak_tflops} TFLOP/s",
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
        "command": "python -m bench.bench_titan " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    if a.side == "titan":
        import torchtitan

        summary["torchtitan"] = torchtitan.__version__
    print(json.dumps(summary, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "steps": recs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
