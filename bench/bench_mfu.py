"""Training throughput, MFU and HFU of a recipe at a few steps, on the GPU: ``python -m bench.bench_mfu
--run-dir RUN --recipe llava-ov-1.5-4b --steps 8``.

RUN holds packed data (``pack`` at the sequence length to measure, e.g. 8192) and its tokenizer;
the weights are a fresh initialisation (a timing needs no trained weights). The run goes through
``pretrain.train.train`` — megatron-core's DDP, optimizer and schedule, exactly as a stage runs —
and stops after ``--steps`` optimizer steps *without* the end-of-stage checkpoint (a 4B model's
dist checkpoint with Adam state is ~70 GB). MFU counts the model's FLOPs (``pretrain.trainer.flops``:
6·N per LLM token, 6·N_vit per tower token, causal attention per sample, frozen parts without
their weight gradients) over the step time and ``--peak-tflops`` (989 dense bf16 for H100/H200
SXM); HFU adds the recomputed forward. The step time includes the wait for the loader; its share is
reported, with the forward+backward and optimizer times (CUDA events). The first ``--warmup``
steps and the profiled ones are excluded from the summary. ``--profile N`` profiles N steps after
the warm-up (torch.profiler) and reports the top 15 operators by GPU self time and the launch and
copy counts. On a machine without CUDA it prints that it skipped and returns 0 (``make bench`` runs
on CPU-only machines).
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
    ap.add_argument("--global-batch", type=int, help="packs per optimizer step (the trainer's --global-batch: "
                    "sets the grad-accum for this GPU; the recipe's quick-start is 32 packs of 8K tokens)")
    ap.add_argument("--recompute", choices=["full", "selective", "mlp", "none", "auto"],
                    help="default: the trainer's (auto: pretrain.trainer.memory)")
    ap.add_argument("--vision-recompute", choices=["full", "selective", "none"], help="default: follows --recompute")
    ap.add_argument("--kernels", choices=["eager", "fused"], help="default: the trainer's (fused on GPU)")
    ap.add_argument("--loss-kernel", choices=["megatron", "liger", "torch"], help="default: the trainer's")
    ap.add_argument("--loader-workers", type=int, help="DataLoader worker processes (default: the trainer's)")
    ap.add_argument("--distributed-optimizer", choices=["on", "off"], default="on")
    ap.add_argument("--peak-tflops", type=float)
    ap.add_argument("--precision", choices=["bf16", "fp8", "fp8-tensorwise", "fp8-rowwise"],
                    help="the trainer's (default bf16); MFU stays against --peak-tflops, the bf16 peak")
    ap.add_argument("--optimizer-offload", type=float, help="the trainer's --optimizer-offload (default: its own)")
    ap.add_argument("--memory-gib", type=float, help="cap the allocator at this many GiB (an 80 GB card's 79.2 on "
                    "a larger one: torch.cuda.set_per_process_memory_fraction)")
    ap.add_argument("--profile", type=int, default=0, help="profile this many steps after the warm-up "
                    "(torch.profiler): top 15 operators by GPU self time, launch and copy counts")
    ap.add_argument("--out", help="write the per-step records and the summary here (JSON)")
    ap.add_argument("--quick", action="store_true", help="(make bench) same as the default on CPU: skip")
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available() or not a.run_dir:
        print("bench_mfu: needs a CUDA GPU and --run-dir with packed data; skipped")
        return 0
    from pretrain.train import train
    from pretrain.trainer.config import TrainConfig

    recs: list[dict] = []
    prof, profiled, prof_out = None, set(), {}
    if a.memory_gib:
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.memory_gib / total))

    def on_step(rec, ddp):
        nonlocal prof
        recs.append({k: v for k, v in rec.items() if k != "pack_ids"})
        if a.profile and rec["step"] == a.warmup:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        elif prof is not None:
            profiled.add(rec["step"])
            if rec["step"] == a.warmup + a.profile:
                prof.__exit__(None, None, None)
                prof_out.update(_profile_summary(prof, a.profile))
                print(prof_out["table"])
                prof = None
        mem = torch.cuda.max_memory_allocated() / 2**30
        print(f"step {rec['step']}: loss {rec['loss']:.4f} {rec['tokens_per_s']:,.0f} tok/s MFU {rec['mfu']:.3f} "
              f"HFU {rec['hfu']:.3f} data {rec['data_wait_s']:.3f}s fwd+bwd {rec['fwd_bwd_s']:.3f}s "
              f"opt {rec['optimizer_s']:.3f}s peak mem {mem:.1f} GiB", flush=True)
        if rec["step"] >= a.steps:
            raise _Done

    t0 = time.perf_counter()
    try:
        train(TrainConfig(run_dir=Path(a.run_dir), recipe=a.recipe, stage=a.stage, steps=a.steps,
                          micro_batch=a.micro_batch, grad_accum=a.grad_accum, global_batch=a.global_batch,
                          distributed_optimizer=a.distributed_optimizer == "on", peak_tflops=a.peak_tflops,
                          recompute=a.recompute, loader_workers=a.loader_workers, kernels=a.kernels,
                          loss_kernel=a.loss_kernel, vision_recompute=a.vision_recompute, precision=a.precision,
                          optimizer_offload=a.optimizer_offload),
              on_step=on_step, log=lambda *_: None)
    except _Done:
        pass
    stage_json = Path(a.run_dir) / "pretrain" / f"stage-{a.stage}" / "stage.json"
    ran = json.loads(stage_json.read_text()) if stage_json.exists() else {}      # what the trainer resolved
    timed = [r for r in recs[a.warmup:] if r["step"] not in profiled] or recs
    med = (lambda k: statistics.median(r[k] for r in timed))
    summary = {
        "recipe": a.recipe, "stage": a.stage, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "recompute": ran.get("recompute"), "vision_recompute": ran.get("vision_recompute"),
        "kernels": ran.get("kernels"), "loss_kernel": ran.get("loss_kernel"),
        "distributed_optimizer": a.distributed_optimizer == "on",
        "precision": ran.get("precision"), "optimizer_offload": ran.get("optimizer_offload"),
        "mfu_basis": f"the bf16 peak, {ran.get('peak_tflops') or a.peak_tflops or 989.0} TFLOP/s",
        "peak_tflops": ran.get("peak_tflops") or a.peak_tflops or 989.0, "commit": _commit(),
        "tp": ran.get("tp", 1), "pp": ran.get("pp", 1), "cp": ran.get("cp", 1), "dp": ran.get("dp", 1),
        "memory_gib_cap": a.memory_gib, "losses": [r["loss"] for r in recs],
        "micro_batch": a.micro_batch, "grad_accum": ran.get("grad_accum", a.grad_accum),
        "global_batch": ran.get("global_batch", a.global_batch), "steps": len(recs), "timed_steps": len(timed),
        "tokens_per_step": med("tokens"), "tokens_per_s_median": med("tokens_per_s"),
        "mfu_median": med("mfu"), "mfu_best": max(r["mfu"] for r in timed), "hfu_median": med("hfu"),
        "step_s_median": med("step_s"), "fwd_bwd_s_median": med("fwd_bwd_s"), "optimizer_s_median": med("optimizer_s"),
        "optimizer_share": med("optimizer_s") / med("step_s"),
        "data_wait_share": sum(r["data_wait_s"] for r in timed) / sum(r["step_s"] for r in timed),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "host_peak_rss_gib": _host_peak_gib(),
        "peak_estimate_gib": _estimate(a, ran),
        "recompute_auto": ran.get("recompute_auto"),
        "wall_s": time.perf_counter() - t0,
        "command": "python -m bench.bench_mfu " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    summary.update({k: v for k, v in prof_out.items() if k != "table"})
    print(json.dumps(summary, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "steps": recs, "profile_table": prof_out.get("table")},
                                          indent=2))
    return 0


def _estimate(a, ran: dict) -> float | None:
    """``pretrain.trainer.memory``'s peak for the modes that ran (every token an image token: an upper
    bound where the packs hold text), beside the measured one, to check and refit its calibration."""
    from pretrain.data import pack_shape
    from pretrain.recipes import RECIPES, STAGES
    from pretrain.trainer.memory import Layout, estimate

    if not ran.get("recompute"):
        return None
    tokens, _ = pack_shape(a.run_dir, ran.get("data") or STAGES[a.stage].data)
    lay = Layout(tp=ran.get("tp", 1), pp=ran.get("pp", 1), cp=ran.get("cp", 1), dp=ran.get("dp", 1),
                 sequence_parallel=ran.get("sequence_parallel", False),
                 distributed_optimizer=ran.get("distributed_optimizer", True),
                 grad_accum=ran.get("grad_accum", a.grad_accum), bf16=ran.get("bf16", True),
                 offload=ran.get("optimizer_offload") or 0.0)
    return estimate(RECIPES[a.recipe], STAGES[a.stage].trainable, ran["recompute"], ran["vision_recompute"],
                    ran.get("loss_kernel") or "megatron", a.micro_batch * tokens, lay)["total"]


def _commit() -> str | None:
    """The tree that ran (``git rev-parse --short HEAD``, ``+dirty`` with local changes): what ``ovpipe plan
    --calibration`` names beside the figure. None outside a git checkout."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def _host_peak_gib() -> float:
    """This process's peak resident host memory (the offloaded optimizer's state and pinned copies live there)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _profile_summary(prof, steps: int) -> dict:
    """Top 15 operators by GPU self time, and per step: kernel launches, memcpys, GPU busy time."""
    ev = prof.key_averages()
    table = ev.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60)
    count = {e.key: e.count for e in ev}
    busy = sum(e.self_device_time_total for e in ev if e.device_type == torch_device_cuda()) / 1e6
    return {"table": table, "profiled_steps": steps,
            "launches_per_step": sum(v for k, v in count.items() if "LaunchKernel" in k) / steps,
            "memcpy_per_step": sum(v for k, v in count.items() if "Memcpy" in k and k.startswith("cuda")) / steps,
            "gpu_busy_s_per_step": busy / steps}


def torch_device_cuda():
    from torch.autograd import DeviceType

    return DeviceType.CUDA


if __name__ == "__main__":
    sys.exit(main())
