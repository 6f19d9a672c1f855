"""Training loop on packed THD batches (work in progress: the LLM side of the recipe).

    python -m pretrain.train --run-dir RUN --recipe tiny --stage 1.5 --steps 30
    (or under torchrun; TP = WORLD_SIZE)

Per step: loss (token mean over target tokens), lr (linear warmup, cosine decay to ``min_lr``),
grad norm, tokens/s and an MFU estimate (6·N·tokens/s over ``peak_tflops``) go to
``RUN/pretrain/stage-<S>/metrics.jsonl``; a checkpoint (model, optimizer, step, data position) is
written at the end and resumed from if present.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

STAGE_LR = {"1": 1e-4, "1.5": 1e-5, "2": 1e-5}
STAGE_DATA = {"1": "pack", "1.5": "pack", "2": "pack-instruct"}
PREV = {"1.5": "1", "2": "1.5"}


def lr_at(step: int, total: int, peak: float, min_lr: float = 1e-6, warmup_frac: float = 0.002) -> float:
    warm = max(1, int(round(total * warmup_frac)))
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return min_lr + 0.5 * (peak - min_lr) * (1 + math.cos(math.pi * min(t, 1.0)))


def save_checkpoint(path: Path, model, opt, step: int) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def setup_distributed() -> int:
    import torch.distributed as dist

    if not torch.cuda.is_available():
        from pretrain.cpu_compat import apply

        apply()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                rank=int(os.environ.get("RANK", "0")), world_size=world)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    return world


def train(run_dir: Path, recipe: str, stage: str, steps: int, micro_batch: int = 2, lr: float | None = None,
          seed: int = 0, peak_tflops: float | None = None, log=print, save_every: int = 0,
          stop_after: int | None = None) -> dict:
    """``stop_after``: end (with a checkpoint) after that many steps of this run — a killed job, for drills."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain.data import iter_batches
    from pretrain.model import LLM_SIZES, build_llm, packed_seq_params

    if stage == "1":
        raise NotImplementedError("stage 1 trains the projector alone; the RICE-ViT tower and projector are "
                                  "not built yet — run stage 1.5 / 2 (the LLM side) for now")
    tp = setup_distributed()
    torch.manual_seed(seed)
    try:
        model_parallel_cuda_manual_seed(seed)
    except Exception:
        pass
    size = LLM_SIZES[recipe]
    model = build_llm(size, tp=tp, backend="auto" if torch.cuda.is_available() else "sdpa")
    out = run_dir / "pretrain" / f"stage-{stage}"
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint.pt"
    peak = lr if lr is not None else STAGE_LR[stage]
    opt = torch.optim.AdamW(model.parameters(), lr=peak, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.0)
    start = 0
    if ckpt.exists():                                   # resume mid-stage
        st = torch.load(ckpt, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        start = st["step"]
    elif stage in PREV and (run_dir / "pretrain" / f"stage-{PREV[stage]}" / "checkpoint.pt").exists():
        st = torch.load(run_dir / "pretrain" / f"stage-{PREV[stage]}" / "checkpoint.pt", weights_only=False)
        model.load_state_dict(st["model"])              # each stage starts from the previous one
    n_params = sum(p.numel() for p in model.parameters())
    peak_flops = (peak_tflops or (989.0 if torch.cuda.is_available() else 0.2)) * 1e12
    batches = iter_batches(run_dir, STAGE_DATA[stage], micro_batch)
    for _ in range(start):                              # same data order as an uninterrupted run
        next(batches)
    metrics = []
    with open(out / "metrics.jsonl", "a") as f:
        for step in range(start, steps):
            b = next(batches)
            t0 = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps, peak)
            psp = packed_seq_params(b.cu_seqlens, b.max_seqlen)
            per_tok = model(b.tokens, b.position_ids, attention_mask=None, labels=b.labels, packed_seq_params=psp)
            loss = (per_tok * b.loss_mask).sum() / b.loss_mask.sum().clamp(min=1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            dt = time.perf_counter() - t0
            ntok = b.tokens.numel()
            rec = {"step": step + 1, "loss": float(loss.detach()), "lr": opt.param_groups[0]["lr"], "grad_norm": float(gn),
                   "tokens_per_s": ntok / dt, "mfu": 6 * n_params * ntok / dt / peak_flops, "tokens": ntok}
            f.write(json.dumps(rec) + "\n")
            metrics.append(rec)
            log(f"stage {stage} step {step + 1}/{steps} loss {rec['loss']:.4f} lr {rec['lr']:.2e} "
                f"gn {rec['grad_norm']:.3f} {rec['tokens_per_s']:.0f} tok/s")
            if (save_every and (step + 1) % save_every == 0) or (stop_after and step + 1 - start >= stop_after):
                save_checkpoint(ckpt, model, opt, step + 1)
            if stop_after and step + 1 - start >= stop_after:
                return {"metrics": metrics, "checkpoint": str(ckpt), "params": n_params}
    save_checkpoint(ckpt, model, opt, steps)
    return {"metrics": metrics, "checkpoint": str(ckpt), "params": n_params}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--stage", choices=["1", "1.5", "2"], required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    train(Path(a.run_dir), a.recipe, a.stage, a.steps, a.micro_batch, a.lr, a.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
