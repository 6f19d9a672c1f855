"""Three-stage training of RICE-ViT + projector + LLM on packed THD batches: the trainer's entry point.

``ovpipe pretrain --stage S`` (``pretrain.stage``) runs a stage as an ovpipe step, whose ranks call
``train``. This module's command line is the bare trainer, outside the run folder's lifecycle (no lock,
markers or status), for probes and benches::

    python -m pretrain.train --run-dir RUN --recipe tiny --stage 1 --steps 30     (or under torchrun)

Stage 1 trains the projector alone (vision tower and LLM frozen), 1.5 and 2 train everything; each
stage starts from the previous stage's checkpoint (``RUN/pretrain/stage-<S>/dist_ckpt/iter_<step>/``,
megatron-core distributed checkpointing, see ``pretrain/trainer/checkpoint.py``; ``init: scratch``: from random
initialisation) and resumes from its own
newest complete one if any, skipping the batches already seen, so an interrupted stage continues
with the same losses as an uninterrupted one. Saves are atomic and rotate (``pretrain/trainer/checkpoint.py``):
``--save-every N`` steps, ``--save-every-minutes M``, at the end, and at the next step boundary after
SIGTERM / SIGUSR1 (then the run stops; rerunning the same command continues it).

Data: each stage reads the packed shards of one pack step (``recipes.STAGES``: ``pack-align`` for
stage 1, ``pack`` for 1.5, ``pack-instruct`` for 2; ``--data STEP`` overrides). ``--steps N`` or
``--epochs E`` (then ``steps = ⌈E · packs / GBS⌉``, GBS = micro_batch · grad_accum · dp packs, or
``--global-batch``, from the step's ``packs`` manifest). At start rank 0 prints the plan (samples → packs, GBS × steps, the share
of the packs seen: ``pretrain.data.plan_data``), at the end the totals consumed.

Per step, ``metrics.jsonl`` (and the ``train_metrics`` manifest) gets loss (token mean over target
tokens), lr (linear warmup, cosine to ``min_lr``), grad norm, tokens/s, MFU and HFU
(``pretrain.trainer.flops`` over ``peak_tflops``), the step time and its split (data wait,
forward+backward, optimizer), tokens, images, and the packs and source samples consumed over all DP
ranks; the resolved stage config is saved as ``stage.json``.

The trainer itself lives in ``pretrain.trainer`` (config, build, checkpoint, loader, flops,
metrics, loop); this module is its entry point: ``train(TrainConfig(...))`` and the CLI, whose flags
map one for one onto ``TrainConfig``'s fields.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from pretrain.recipes import RECIPES, STAGES
from pretrain.trainer.config import RECOMPUTE, TrainConfig, check_float8


def train(cfg: TrainConfig, log=print, on_step=None) -> dict:
    """One stage (``pretrain.trainer.loop.Trainer``): build, train, close. Returns ``metrics`` (this
    rank's records), ``checkpoint`` (the stage's checkpoint root), ``params``, ``plan`` (the data plan),
    ``preempted`` (the signal a stopped run got; None) and the layout sizes ``tp``/``pp``/``cp``/``dp``.
    ``log``: rank 0's lines (plan, per step, totals); ``on_step(record, ddp)``: see ``Trainer``."""
    from pretrain.trainer.loop import Trainer

    trainer = Trainer(cfg, log=log, on_step=on_step)
    try:
        return trainer.train()
    finally:
        trainer.close()


def add_stage_args(ap: argparse.ArgumentParser) -> None:
    """The flags of one stage's training, ``TrainConfig``'s fields one for one: this bare trainer's command
    line and ``ovpipe pretrain``'s (``pretrain.stage``) share them."""
    length = ap.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="optimizer steps (default 30)")
    length.add_argument("--epochs", type=float, help="passes over the data step's packs: steps = "
                        "ceil(E × packs / (micro_batch × grad_accum × dp))")
    ap.add_argument("--data", help="pack step to read (default: the stage's, see pretrain.recipes.STAGES)")
    ap.add_argument("--init", choices=["previous", "scratch"], default="previous",
                    help="previous: start from the checkpoint of the stage before (`ovpipe pretrain` refuses to "
                         "start without one); scratch: from random initialisation")
    ap.add_argument("--micro-batch", type=int, default=2, help="packs per micro-batch (one THD sequence)")
    batch = ap.add_mutually_exclusive_group()
    batch.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step and DP rank")
    batch.add_argument("--global-batch", type=int, help="packs per optimizer step over all DP ranks (megatron's "
                       "--global-batch-size): grad_accum = global_batch / (micro_batch × dp)")
    ap.add_argument("--lr", type=float)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer")
    ap.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (0: only at "
                    "the end and on SIGTERM/SIGUSR1)")
    ap.add_argument("--save-every-minutes", type=float, help="also save when M minutes have passed since the "
                    "last save (default: off on this machine; on Slurm 30 — a node lost without a signal, a "
                    "hardware fault or a collective's timeout, then costs at most that much training)")
    ap.add_argument("--keep", type=int, default=2, help="checkpoints kept (the newest K)")
    ap.add_argument("--stop-after", type=int, help="checkpoint and stop after this many steps (drills)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--distributed-optimizer", choices=["auto", "on", "off"], default="auto",
                    help="megatron's distributed optimizer: Adam's state sharded over DP, the parameter "
                    "all-gather overlapped with the forward (auto: on)")
    ap.add_argument("--fp32", action="store_true", help="train in fp32 even on GPU")
    ap.add_argument("--precision", choices=["bf16", "fp32", "fp8", "fp8-tensorwise", "fp8-rowwise"],
                    help="fp8: torchao float8 on the LLM's linear layers (sm89+ GPU, tp 1; pretrain.model.float8), "
                    "bf16 elsewhere; fp8 = fp8-tensorwise (default: bf16 on GPU, fp32 on CPU)")
    ap.add_argument("--grad-reduce-dtype", choices=["fp32", "bf16"], help="the dtype data parallelism reduces "
                    "gradients in (default fp32; bf16 halves the bytes, needs bf16 parameters)")
    ap.add_argument("--optimizer-offload", type=float, help="share of the optimizer's state and update on the "
                    "host, 0..1 (megatron-core's HybridDeviceOptimizer; default 0, or with recompute auto what "
                    "lets the stage fit)")
    ap.add_argument("--recompute", choices=RECOMPUTE, help="activation recompute (default: auto on GPU, none on "
                    "CPU): full | selective (core attention + MLP) | mlp | none | auto (the least recompute whose "
                    "estimated peak fits the GPU, with the tower's: pretrain.trainer.memory)")
    ap.add_argument("--loader-workers", type=int, help="DataLoader worker processes (default 4 on GPU, 0 on CPU)")
    ap.add_argument("--vision-recompute", choices=["full", "selective", "none"], help="the tower's recompute "
                    "(default: follows --recompute, mlp → selective; with auto chosen with it)")
    ap.add_argument("--kernels", choices=["eager", "fused"], help="fused: compiled rotary/RMSNorm + megatron's "
                    "fused SwiGLU on CUDA (default on GPU; pretrain.model.fused)")
    ap.add_argument("--loss-kernel", choices=["megatron", "liger", "torch"], help="output layer + cross-entropy "
                    "(default megatron; liger: the fused linear cross-entropy, less memory, mostly slower)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--recipe", default="tiny", choices=sorted(RECIPES))
    ap.add_argument("--stage", choices=sorted(STAGES), required=True)
    add_stage_args(ap)
    ap.add_argument("--metrics-out", help="also write this run's per-step metrics here (JSON), from rank 0")
    a = ap.parse_args(argv)
    try:                                     # a wrong value fails here, naming the field, before any work
        cfg = config_from_args(a)
        check_float8(cfg.precision, torch.cuda.get_device_capability() if torch.cuda.is_available() else None)
    except ValueError as e:
        ap.error(str(e))
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    res = train(cfg)
    rc = 128 + int(res["preempted"]) if res.get("preempted") else 0   # saved and stopped: not done
    if a.metrics_out and int(os.environ.get("RANK", "0")) == 0:
        Path(a.metrics_out).write_text(json.dumps(res))
    return rc


def config_from_args(a) -> TrainConfig:
    """The CLI's flags as a ``TrainConfig`` (``--steps`` defaults to 30 when neither it nor ``--epochs`` is given)."""
    steps = 30 if a.steps is None and a.epochs is None else a.steps
    return TrainConfig(run_dir=Path(a.run_dir), recipe=a.recipe, stage=a.stage, steps=steps, epochs=a.epochs,
                       data=a.data, micro_batch=a.micro_batch, grad_accum=a.grad_accum,
                       global_batch=a.global_batch, lr=a.lr, seed=a.seed,
                       tokenizer=a.tokenizer, tp=a.tp, pp=a.pp, cp=a.cp, sequence_parallel=a.sequence_parallel,
                       distributed_optimizer={"auto": None, "on": True, "off": False}[a.distributed_optimizer],
                       bf16=False if a.fp32 else None, precision=a.precision,
                       optimizer_offload=a.optimizer_offload, grad_reduce_dtype=a.grad_reduce_dtype,
                       recompute=a.recompute, loader_workers=a.loader_workers,
                       kernels=a.kernels, loss_kernel=a.loss_kernel, vision_recompute=a.vision_recompute,
                       save_every=a.save_every, save_every_minutes=a.save_every_minutes or 0.0, keep=a.keep,
                       stop_after=a.stop_after, init=a.init)


if __name__ == "__main__":
    raise SystemExit(main())
