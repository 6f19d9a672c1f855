"""The trainer: one stage of RICE-ViT + projector + LLM through megatron-core's training stack, put
together from the parts of this package — ``config`` (the knobs), ``build`` (process groups, model,
DDP + optimizer, lr schedule), ``checkpoint`` (where the stage starts, what a save writes),
``loader`` (this rank's micro-batches), ``flops`` (MFU/HFU) and ``metrics`` (records, manifest) —
and the step itself.

The step: ``grad_accum`` micro-batches through ``get_forward_backward_func`` (no pipelining, or 1F1B
across pipeline stages), each returning its loss sum and target-token count
(``calculate_per_token_loss``: megatron divides the reduced gradients by the global count, so a global
batch gives the same update at any DP/PP/CP/TP layout), then the optimizer step, then one all-reduce
of the step's sums — its only host sync. After the step ``SavePolicy`` decides, the same on every rank,
whether to save and whether to stop (``save_every``, ``save_every_minutes``, SIGTERM / SIGUSR1, the
drills' ``stop_after``).
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict

import torch

from pretrain.trainer.config import TrainConfig


class Trainer:
    """``Trainer(cfg, log, on_step)`` builds everything (rank 0 logs the data plan, writes ``stage.json``);
    ``train()`` runs the steps left and returns the result; ``close()`` releases the signal handlers
    and files. ``on_step(record, ddp)``: called on every rank after each optimizer step with the step's
    record and the DDP-wrapped model (``.module`` is the VLM; grads in ``param.main_grad``) — probes,
    tests, the bench."""

    def __init__(self, cfg: TrainConfig, log=print, on_step=None):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        from pretrain.trainer import checkpoint
        from pretrain.data import plan_data
        from pretrain.recipes import RECIPES, STAGES, Parallelism, stage_folder, validate
        from pretrain.trainer.build import build_model, device, param_count, setup_distributed
        from pretrain.trainer.optimizer import build_optimizer, ddp_config, on_cuda
        from pretrain.trainer.checkpoint import StageCheckpoints
        from pretrain.trainer.loader import stage_batches
        from pretrain.trainer.memory import GIB
        from pretrain.trainer.metrics import MetricsLogger

        self.cuda = cuda = torch.cuda.is_available()
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank0 = int(os.environ.get("RANK", "0")) == 0
        validate(RECIPES[cfg.recipe], Parallelism(
            tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, sequence_parallel=cfg.sequence_parallel, world_size=world,
            distributed_optimizer=cfg.distributed_optimizer is not False))
        # ---- the config, resolved once and passed whole from here on
        memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB if cuda else None
        self.cfg = cfg = cfg.resolve(cuda, world, memory, log=log if rank0 else None)
        self.recipe, self.stage = RECIPES[cfg.recipe], STAGES[cfg.stage]
        self.log, self.on_step = log, on_step
        self.auto = cfg.recompute_auto
        if self.auto is not None and rank0:
            log(f"stage {cfg.stage}: {self.auto.describe()}")
        # ---- build: process groups, seeds, the data plan, the model
        self.sizes = setup_distributed(cfg.tp, cfg.pp, cfg.cp)
        self.rank0 = rank0 = not dist.is_initialized() or dist.get_rank() == 0
        from pretrain.trainer.build import CHOSEN
        from pretrain.trainer.host_collectives import describe

        self.collectives = describe()
        self.collectives_why = CHOSEN.get("why")
        self.dtype = torch.bfloat16 if cfg.bf16 else torch.float32
        torch.manual_seed(cfg.seed)
        model_parallel_cuda_manual_seed(cfg.seed)
        self.plan = plan_data(cfg.run_dir, cfg.data, cfg.micro_batch, cfg.grad_accum, self.sizes["dp"], cfg.steps,
                              cfg.epochs, count_samples=rank0)
        self.steps = self.plan.steps
        if rank0:
            log(f"stage {cfg.stage}: {self.plan.describe()}")
            log(f"stage {cfg.stage}: collectives: {self.collectives} ({self.collectives_why or 'set up before'})")
        self.model = build_model(cfg, self.sizes, self.dtype)
        if rank0 and cfg.precision.startswith("fp8"):
            from pretrain.model.float8 import converted

            log(f"stage {cfg.stage}: {cfg.precision}: {len(converted(self.model.llm))} LLM linear layers in float8 "
                "(torchao; the rest, the output layer, the tower and the projector in bf16)")
        self.out = cfg.run_dir / stage_folder(cfg.stage)
        self.out.mkdir(parents=True, exist_ok=True)
        self.ddp_cfg = ddp_config(cfg, self.sizes["dp"])
        if rank0:
            self._write_stage_json()
        # ---- checkpoint: the stage's own newest, else the previous stage's weights
        self.ckpt = StageCheckpoints(cfg.run_dir, cfg.stage, cfg.data, cfg.keep, cfg.start_from,
                                     log=log if rank0 else None)
        self.ckpt.load_model(self.model)
        self.model.set_trainable(self.stage.trainable)
        self.ddp, self.opt = build_optimizer(self.model, self.stage, cfg.lr, cfg.bf16, self.dtype,
                                             self.ddp_cfg, cfg.optimizer_offload)
        self.ckpt.load_optimizer(self.model, self.opt)
        if cuda:
            on_cuda(self.opt)
        self.n_params = param_count(self.model)
        self.peak_flops = cfg.peak_tflops * 1e12 * world
        # ---- data: the same order as an uninterrupted run, from the first pack not consumed
        self.start = self.ckpt.start
        self.start_pack = self.ckpt.start_pack(self.plan.gbs)
        self.batches = stage_batches(cfg, self.recipe, self.model.image_pad_id, self.dtype, self.sizes,
                                     self.start_pack)
        self.device = device()
        self.reports = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
        self.cp_rank = ps.get_context_parallel_rank()
        self.schedule = get_forward_backward_func()
        # ---- metrics and when to save
        self.metrics = MetricsLogger(self.out, cfg.stage, self.steps, self.start, rank0, log)
        self.policy = checkpoint.SavePolicy(cfg.save_every, cfg.save_every_minutes,
                                            log=log if rank0 else (lambda *_: None))

    def _write_stage_json(self) -> None:
        c = self.cfg
        (self.out / "stage.json").write_text(json.dumps(
            {**asdict(self.stage), "data": c.data, "lr": c.lr, "recipe": c.recipe, "steps": self.steps,
             "epochs": c.epochs, "data_packs": self.plan.packs, "data_samples": self.plan.samples,
             "micro_batch": c.micro_batch, "grad_accum": c.grad_accum, "global_batch": self.plan.gbs,
             **self.sizes,
             "sequence_parallel": c.sequence_parallel, "distributed_optimizer": c.distributed_optimizer,
             "bf16": c.bf16, "precision": c.precision, "optimizer_offload": c.optimizer_offload,
             "grad_reduce_dtype": c.grad_reduce_dtype, "overlap_param_gather": self.ddp_cfg.overlap_param_gather,
             "recompute": c.recompute, "vision_recompute": c.vision_recompute,
             "kernels": c.kernels, "loss_kernel": c.loss_kernel, "seed": c.seed, "collectives": self.collectives,
             "collectives_why": self.collectives_why,
             "recompute_auto": None if self.auto is None else {
                 "peak_estimate_gib": round(self.auto.peak_gib, 2), "memory_gib": round(self.auto.memory_gib, 2),
                 "candidates": [{"recompute": lm, "vision_recompute": vm, "loss_kernel": lk,
                                 "peak_estimate_gib": round(pk, 2), "recomputed_flops_share": round(x, 4)}
                                for lm, vm, lk, pk, x in self.auto.table]}},
            indent=2))

    # ------------------------------------------------------------------ the step

    def _forward_step(self, data_iterator, model):
        b = next(data_iterator)
        per_tok = model(b)

        def loss_func(per_tok):
            s = (per_tok.float() * b.loss_mask).sum()
            n = b.loss_mask.sum()
            return s, n.to(torch.int), {"lm": torch.stack([s.detach(), n.detach()])}

        return per_tok, loss_func

    def train_step(self, step: int) -> dict:
        """Optimizer step ``step`` (0-based) over the next ``grad_accum`` micro-batches; returns its record."""
        import torch.distributed as dist

        from pretrain.trainer.optimizer import lr_at
        from pretrain.trainer.flops import model_flops
        from pretrain.trainer.loader import to_device
        from pretrain.trainer.metrics import step_record

        cfg, cuda = self.cfg, self.cuda
        t0 = time.perf_counter()
        raw = [next(self.batches) for _ in range(cfg.grad_accum)]
        mbs = [to_device(b, self.device) for b in raw]
        t_data = time.perf_counter() - t0
        for g in self.opt.param_groups:
            g["lr"] = lr_at(step, self.steps, cfg.lr, self.stage.min_lr, self.stage.warmup_frac)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if cuda else None
        if cuda:
            ev[0].record()
        th0 = time.perf_counter()
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()
        res = self.schedule(forward_step_func=self._forward_step, data_iterator=iter(mbs), model=[self.ddp],
                            num_microbatches=cfg.grad_accum, seq_length=max(b.tokens.shape[1] for b in mbs),
                            micro_batch_size=1, forward_only=False)
        if cuda:
            ev[1].record()
        th1 = time.perf_counter()
        ok, gn, _ = self.opt.step()
        if cuda:
            ev[2].record()
        th2 = time.perf_counter()
        # loss sum / target tokens over DP×CP (from the last stage), tokens / images / packs /
        # samples / model and hardware FLOPs over DP
        agg = torch.zeros(8, dtype=torch.float64, device=self.device)
        if self.reports:
            agg[:2] = torch.stack([r["lm"] for r in res]).sum(0).double()
        if self.reports and self.cp_rank == 0:
            flops = [model_flops(self.recipe, self.stage.trainable, b.stats, cfg.recompute,
                                 cfg.vision_recompute) for b in raw]
            agg[2:] = torch.tensor([sum(b.stats["tokens"] for b in raw), sum(b.n_images for b in raw),
                                    sum(b.n_packs for b in raw), sum(b.n_samples for b in raw),
                                    sum(x[0] for x in flops), sum(x[1] for x in flops)], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(agg)
        agg = agg.cpu()                                 # the step's one host sync
        dt = time.perf_counter() - t0
        fwd_bwd, opt_s = (ev[0].elapsed_time(ev[1]) / 1e3, ev[1].elapsed_time(ev[2]) / 1e3) if cuda \
            else (th1 - th0, th2 - th1)
        return step_record(step + 1, agg, self.opt.param_groups[0]["lr"], gn, dt, t_data, fwd_bwd, opt_s,
                           self.peak_flops, [i for b in raw for i in b.pack_ids])

    # ------------------------------------------------------------------ the loop

    def packs_consumed(self, steps_done: int) -> int:
        """The loader state after optimizer step ``steps_done`` (1-based) of the stage."""
        return self.start_pack + (steps_done - self.start) * self.plan.gbs

    def train(self) -> dict:
        """The steps left (``start``..``steps``); saves per the policy; a signalled or ``stop_after`` run
        saves and returns early (``preempted``: the signal, or None for ``stop_after``). A stage that
        reaches its last step saves it (unless already saved) and writes the ``train_metrics`` manifest."""
        from pretrain.trainer.metrics import consumed, write_metrics_manifest

        cfg = self.cfg
        self.policy.install()
        for step in range(self.start, self.steps):
            rec = self.train_step(step)
            self.metrics.add(rec)
            if self.on_step is not None:
                self.on_step(rec, self.ddp)
            self.metrics.write(rec)
            due, preempted = self.policy.decide(step + 1, self.device)
            stopping = preempted or (bool(cfg.stop_after) and step + 1 - self.start >= cfg.stop_after)
            if (due or stopping) and step + 1 < self.steps:
                t0 = time.perf_counter()
                self._save(step + 1)
                self.policy.saved()
                if self.rank0:
                    self.log(f"checkpoint: step {step + 1} saved in {time.perf_counter() - t0:.1f} s")
            if stopping and step + 1 < self.steps:
                return self._result(self.policy.signalled or (signal.SIGTERM if preempted else None))
        self.close()
        if self.ckpt.newest_step() != self.steps:
            self._save(self.steps)
        rows = write_metrics_manifest(cfg.run_dir, cfg.stage, self.out / "metrics.jsonl")
        if rows:
            self.log(f"stage {cfg.stage}: {consumed(rows, self.plan)}")
        return self._result(None)

    def _save(self, step: int) -> None:
        """A checkpoint after optimizer step ``step``, with every parameter gathered first: under
        ``overlap_param_gather`` the step left the other ranks' shards to the next forward."""
        from pretrain.trainer.optimizer import params_gathered

        with params_gathered(self.ddp):
            self.ckpt.save(self.model, self.opt, step, self.packs_consumed(step))

    def _result(self, preempted) -> dict:
        return {"metrics": self.metrics.records, "checkpoint": str(self.ckpt.root), "params": self.n_params,
                "plan": asdict(self.plan), "preempted": preempted, **self.sizes}

    def close(self) -> None:
        """Signal handlers back, the metrics file closed (twice is harmless)."""
        self.policy.restore()
        self.metrics.close()
