"""The trainer's metrics part: one record per optimizer step — in ``metrics.jsonl`` (rank 0, appended,
so a resumed stage continues the file), tensorboard when installed, the progress bar and the log —
and, at the end of the stage, the same rows as the ``train_metrics`` manifest.

A record: ``loss`` (token mean over the step's target tokens), ``lr``, ``grad_norm``, ``tokens_per_s``,
``mfu`` / ``hfu`` (``pretrain.trainer.flops``, over the step time and the world's peak FLOP/s),
``tokens``, ``images``, ``packs`` and ``samples`` over all DP ranks, the step time ``step_s`` and its
split — ``data_wait_s`` (waiting for the loader and the host→device copies), ``fwd_bwd_s`` and
``optimizer_s`` (GPU time between CUDA events; host time on a CPU) — and ``pack_ids`` (this rank's
packs; kept out of the file).
"""
from __future__ import annotations

import json
from pathlib import Path

from pretrain.recipes import STAGES

TB_KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu")
# the record's fields in the train_metrics manifest: always present, and absent from older records (NULL)
REQUIRED = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "tokens", "images")
OPTIONAL = ("packs", "samples", "hfu", "step_s", "data_wait_s", "fwd_bwd_s", "optimizer_s")


def step_record(step: int, agg, lr: float, grad_norm, step_s: float, data_wait_s: float, fwd_bwd_s: float,
                optimizer_s: float, peak_flops: float, pack_ids: list[int]) -> dict:
    """The record of optimizer step ``step`` (1-based) from the step's reduced sums ``agg``: loss sum,
    target tokens, tokens, images, packs, samples, model FLOPs, hardware FLOPs."""
    ntok = int(agg[2])
    return {"step": step, "loss": float(agg[0] / agg[1].clamp(min=1)), "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "tokens_per_s": ntok / step_s,
            "mfu": float(agg[6]) / step_s / peak_flops, "hfu": float(agg[7]) / step_s / peak_flops,
            "tokens": ntok, "images": int(agg[3]), "packs": int(agg[4]), "samples": int(agg[5]),
            "step_s": step_s, "data_wait_s": data_wait_s, "fwd_bwd_s": fwd_bwd_s, "optimizer_s": optimizer_s,
            "pack_ids": pack_ids}


class MetricsLogger:
    """Where the records go. Rank 0 writes the file, tensorboard, the bar and the log lines; every
    rank keeps its records (``records``) for the caller."""

    def __init__(self, out: Path, stage: str, steps: int, start: int, rank0: bool, log=print):
        self.out, self.stage, self.steps, self.rank0, self.log = Path(out), stage, steps, rank0, log
        self.records: list[dict] = []
        self.tb = self.file = None
        if rank0:
            try:  # tensorboard beside the JSONL when it is installed
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.out / "tensorboard"))
            except Exception:
                self.tb = None
        from tqdm import tqdm

        from ovpipe.console import terminal

        self.bar = tqdm(desc=f"stage {stage}", unit="step", initial=start, total=steps, leave=False,
                        file=terminal(), disable=log is not print or not rank0)
        self.file = open(self.out / "metrics.jsonl", "a") if rank0 else None

    def add(self, rec: dict) -> None:
        self.records.append(rec)

    def write(self, rec: dict) -> None:
        self.bar.update(1)
        if not self.rank0:
            return
        self.file.write(json.dumps({k: v for k, v in rec.items() if k != "pack_ids"}) + "\n")
        self.file.flush()
        self.bar.set_postfix(loss=f"{rec['loss']:.3f}")
        if self.tb is not None:
            for k in TB_KEYS:
                self.tb.add_scalar(k, rec[k], rec["step"])
        self.log(f"stage {self.stage} step {rec['step']}/{self.steps} loss {rec['loss']:.4f} lr {rec['lr']:.2e} "
                 f"gn {rec['grad_norm']:.3f} {rec['tokens_per_s']:.0f} tok/s")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        self.bar.close()


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
        rows[m["step"]] = {"stage": stage, **{k: m[k] for k in REQUIRED}, **{k: m.get(k) for k in OPTIONAL}}
    idx = list(STAGES).index(stage)
    out = [rows[k] for k in sorted(rows)]
    write_part(out, Path(run_dir) / "pretrain" / "train_metrics" / f"part-{idx:05d}.parquet", "train_metrics")
    return out


def data_wait_share(rows: list[dict]) -> float | None:
    """The share of the step time spent waiting for data, over the records that hold both (None: none do)."""
    timed = [r for r in rows if r.get("data_wait_s") is not None and r.get("step_s")]
    total = sum(r["step_s"] for r in timed)
    return sum(r["data_wait_s"] for r in timed) / total if total > 0 else None


def consumed(rows: list[dict], plan) -> str:
    """Totals of a stage's ``train_metrics`` rows (all its runs, resumes included), as one line."""
    tot = {k: sum(r[k] or 0 for r in rows) for k in ("packs", "samples", "tokens", "images")}
    ep = f" ≈ {tot['packs'] / plan.packs:.2f} epochs of {plan.step}" if plan.packs else ""
    return (f"consumed {tot['packs']:,} packs ({tot['samples']:,} samples, {tot['tokens']:,} tokens, "
            f"{tot['images']:,} images) in {len(rows)} steps{ep}")
