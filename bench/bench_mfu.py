"""Training throughput and MFU of a recipe at a few steps, on the GPU: ``python -m bench.bench_mfu
--run-dir RUN --recipe llava-ov-1.5-4b --steps 8``.

RUN holds packed data (``pack`` at the sequence length to measure, e.g. 8192) and its tokenizer;
the weights are a fresh initialisation (a timing needs no trained weights). The run goes through
``pretrain.train.train`` — megatron-core's DDP, optimizer and schedule, exactly as a stage runs —
and stops after ``--steps`` optimizer steps *without* the end-of-stage checkpoint (a 4B model's
dist checkpoint with Adam state is ~70 GB). MFU is ``6 · params · tokens / step time / peak``
(peak 989 TFLOP/s dense bf16 for H100/H200 SXM, ``--peak-tflops`` otherwise); with full activation
recompute the GPU does ~8·N FLOPs per token, so the 6·N MFU under-counts the work done by ~25 %.
The first ``--warmup`` steps are excluded from the summary. On a machine without CUDA it prints
that it skipped and returns 0 (``make bench`` runs on CPU-only machines).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path


class _Done(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir")
    ap.add_argument("--recipe", default="llava-ov-1.5-4b")
    ap.add_argument("--stage", default="1.5")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--recompute", choices=["full", "selective", "none"], help="default: the stage's")
    ap.add_argument("--distributed-optimizer", choices=["on", "off"], default="on")
    ap.add_argument("--peak-tflops", type=float)
    ap.add_argument("--profile", type=int, default=0, help="profile this many steps after the warm-up "
                    "(torch.profiler) and print the top operators by GPU and CPU self time")
    ap.add_argument("--out", help="write the per-step records and the summary here (JSON)")
    ap.add_argument("--quick", action="store_true", help="(make bench) same as the default on CPU: skip")
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available() or not a.run_dir:
        print("bench_mfu: needs a CUDA GPU and --run-dir with packed data; skipped")
        return 0
    import pretrain.train as T

    if a.recompute:
        T.STAGES[a.stage] = dataclasses.replace(T.STAGES[a.stage], recompute=a.recompute)
    recs: list[dict] = []
    stamps: list[float] = []

    prof = None

    def on_step(rec, ddp):
        nonlocal prof
        recs.append(rec)
        if a.profile and rec["step"] == a.warmup:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        elif prof is not None and rec["step"] == a.warmup + a.profile:
            prof.__exit__(None, None, None)
            for key in ("self_cuda_time_total", "self_cpu_time_total"):
                print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))
            prof = None
        stamps.append(time.perf_counter())
        mem = torch.cuda.max_memory_allocated() / 2**30
        print(f"step {rec['step']}: loss {rec['loss']:.4f} {rec['tokens_per_s']:,.0f} tok/s "
              f"MFU {rec['mfu']:.3f} peak mem {mem:.1f} GiB", flush=True)
        if rec["step"] >= a.steps:
            raise _Done

    t0 = time.perf_counter()
    try:
        T.train(Path(a.run_dir), a.recipe, a.stage, steps=a.steps, micro_batch=a.micro_batch,
                grad_accum=a.grad_accum, distributed_optimizer=a.distributed_optimizer == "on",
                peak_tflops=a.peak_tflops, on_step=on_step, log=lambda *_: None)
    except _Done:
        pass
    timed = recs[a.warmup:] or recs
    summary = {
        "recipe": a.recipe, "stage": a.stage, "device": torch.cuda.get_device_name(),
        "recompute": T.STAGES[a.stage].recompute, "distributed_optimizer": a.distributed_optimizer == "on",
        "micro_batch": a.micro_batch, "grad_accum": a.grad_accum, "steps": len(recs), "timed_steps": len(timed),
        "tokens_per_step": statistics.median(r["tokens"] for r in timed),
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in timed),
        "mfu_median": statistics.median(r["mfu"] for r in timed),
        "mfu_best": max(r["mfu"] for r in timed),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "wall_s": time.perf_counter() - t0,
        "command": "python -m bench.bench_mfu " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    print(json.dumps(summary, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "steps": recs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
