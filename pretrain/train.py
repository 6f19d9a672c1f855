"""Three-stage training of RICE-ViT + projector + LLM on packed THD batches.

    python -m pretrain.train --run-dir RUN --recipe tiny --stage 1 --steps 30     (or under torchrun)

Stage 1 trains the projector alone (vision tower and LLM frozen), 1.5 and 2 train everything; each
stage starts from the previous stage's checkpoint (``RUN/pretrain/stage-<S>/dist_ckpt/``, megatron-core
distributed checkpointing, see ``pretrain/dist_ckpt.py``) and
resumes its own if present, skipping the batches already seen, so an interrupted stage continues
with the same losses as an uninterrupted one. Per step, ``metrics.jsonl`` gets loss (token mean
over target tokens), lr (linear warmup, cosine to ``min_lr``), grad norm, tokens/s and an MFU
estimate (6·N_trainable-forward-and-backward·tokens/s / ``peak_tflops``), and the stage config is
saved as ``stage.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch

from pretrain.recipes import PREVIOUS, RECIPES, STAGES


def lr_at(step: int, total: int, peak: float, min_lr: float = 1e-6, warmup_frac: float = 0.002) -> float:
    warm = max(1, int(round(total * warmup_frac)))
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return min_lr + 0.5 * (peak - min_lr) * (1 + math.cos(math.pi * min(t, 1.0)))


def setup_distributed(tp: int | None = None) -> int:
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
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp or world)
    return tp or world


def write_metrics_manifest(run_dir: Path, stage: str, jsonl: Path) -> None:
    """The stage's ``metrics.jsonl`` as the ``train_metrics`` manifest (``ovpipe sql`` / ``ovpipe report``)."""
    import torch.distributed as dist
    from manifests.io import write_part

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    rows = {}
    for line in jsonl.read_text().splitlines():  # a resumed stage appends; the last record of a step wins
        m = json.loads(line)
        rows[m["step"]] = {"stage": stage, **{k: m[k] for k in ("step", "loss", "lr", "grad_norm", "tokens_per_s",
                                                                 "mfu", "tokens", "images")}}
    idx = list(STAGES).index(stage)
    write_part([rows[k] for k in sorted(rows)], run_dir / "pretrain" / "train_metrics" / f"part-{idx:05d}.parquet",
               "train_metrics")


def image_pad_id(run_dir: Path, tokenizer: str | None) -> int:
    from packing.tokens import IMAGE_PAD, load_tokenizer

    return load_tokenizer(tokenizer or str(run_dir / "tokenizer")).convert_tokens_to_ids(IMAGE_PAD)


def train(run_dir: Path, recipe: str, stage: str, steps: int, micro_batch: int = 2, lr: float | None = None,
          seed: int = 0, peak_tflops: float | None = None, log=print, save_every: int = 0,
          stop_after: int | None = None, tokenizer: str | None = None, tp: int | None = None) -> dict:
    """``stop_after``: end (with a checkpoint) after that many steps of this run — a killed job, for drills."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain import dist_ckpt
    from pretrain.data import iter_batches
    from pretrain.vlm import VLM

    run_dir = Path(run_dir)
    st_cfg = STAGES[stage]
    tp = setup_distributed(tp)
    torch.manual_seed(seed)
    try:
        model_parallel_cuda_manual_seed(seed)
    except Exception:
        pass
    model = VLM(RECIPES[recipe], image_pad_id(run_dir, tokenizer), tp=tp,
                backend="auto" if torch.cuda.is_available() else "sdpa")
    out = run_dir / "pretrain" / f"stage-{stage}"
    out.mkdir(parents=True, exist_ok=True)
    peak = lr if lr is not None else st_cfg.lr
    (out / "stage.json").write_text(json.dumps({**asdict(st_cfg), "lr": peak, "recipe": recipe, "steps": steps,
                                                "micro_batch": micro_batch, "tp": tp, "seed": seed}, indent=2))
    ckpt = out / "dist_ckpt"                            # megatron dist_checkpointing (pretrain/dist_ckpt.py)
    start = 0
    prev = run_dir / "pretrain" / f"stage-{PREVIOUS.get(stage, '')}" / "dist_ckpt"
    if dist_ckpt.is_complete(ckpt):
        start = dist_ckpt.load_model(ckpt, model)
    elif stage in PREVIOUS and dist_ckpt.is_complete(prev):
        dist_ckpt.load_model(prev, model)               # each stage starts from the last
    model.set_trainable(st_cfg.trainable)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=peak, betas=(0.9, 0.95), eps=st_cfg.adam_eps, weight_decay=0.0)
    if start:
        dist_ckpt.load_optimizer(ckpt, opt)
    n_params = sum(p.numel() for p in model.parameters())
    peak_flops = (peak_tflops or (989.0 if torch.cuda.is_available() else 0.2)) * 1e12
    batches = iter_batches(run_dir, st_cfg.data, micro_batch)
    for _ in range(start):                              # same data order as an uninterrupted run
        next(batches)
    metrics = []
    try:  # tensorboard beside the JSONL when it is installed
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(str(out / "tensorboard"))
    except Exception:
        tb = None
    from tqdm import tqdm

    bar = tqdm(range(start, steps), desc=f"stage {stage}", unit="step", initial=start, total=steps, leave=False,
               disable=log is not print)
    with open(out / "metrics.jsonl", "a") as f:
        for step in bar:
            b = next(batches)
            t0 = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps, peak, st_cfg.min_lr, st_cfg.warmup_frac)
            per_tok = model(b)
            loss = (per_tok * b.loss_mask).sum() / b.loss_mask.sum().clamp(min=1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            dt = time.perf_counter() - t0
            ntok = b.tokens.numel()
            rec = {"step": step + 1, "loss": float(loss.detach()), "lr": opt.param_groups[0]["lr"],
                   "grad_norm": float(gn), "tokens_per_s": ntok / dt, "mfu": 6 * n_params * ntok / dt / peak_flops,
                   "tokens": ntok, "images": b.n_images}
            f.write(json.dumps(rec) + "\n")
            metrics.append(rec)
            bar.set_postfix(loss=f"{rec['loss']:.3f}")
            if tb is not None:
                for k in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu"):
                    tb.add_scalar(k, rec[k], step + 1)
            log(f"stage {stage} step {step + 1}/{steps} loss {rec['loss']:.4f} lr {rec['lr']:.2e} "
                f"gn {rec['grad_norm']:.3f} {rec['tokens_per_s']:.0f} tok/s")
            if (save_every and (step + 1) % save_every == 0) or (stop_after and step + 1 - start >= stop_after):
                dist_ckpt.save(ckpt, model, opt, step + 1)
            if stop_after and step + 1 - start >= stop_after:
                return {"metrics": metrics, "checkpoint": str(ckpt), "params": n_params}
    dist_ckpt.save(ckpt, model, opt, steps)
    write_metrics_manifest(run_dir, stage, out / "metrics.jsonl")
    return {"metrics": metrics, "checkpoint": str(ckpt), "params": n_params}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--recipe", default="tiny", choices=sorted(RECIPES))
    ap.add_argument("--stage", choices=sorted(STAGES), required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer")
    ap.add_argument("--save-every", type=int, default=0)
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    train(Path(a.run_dir), a.recipe, a.stage, a.steps, a.micro_batch, a.lr, a.seed, tokenizer=a.tokenizer,
          save_every=a.save_every)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
