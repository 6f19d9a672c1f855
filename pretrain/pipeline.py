"""Pipeline-parallel stage of the VLM and a PP/CP loss check (GPU only: megatron-core's schedules
allocate their p2p buffers on CUDA).

Stage 0 holds RICE-ViT, the projector, the embedding and its share of the LLM layers; the last
stage holds the output layer and the loss; the stages between hold layers only. The schedule passes
``[T, 1, hidden]`` activations between stages (one THD-packed sequence per micro-batch).

    torchrun --nproc-per-node=1 -m pretrain.pipeline --run-dir RUN --pp 1 --save CKPT --out pp1.json
    torchrun --nproc-per-node=2 -m pretrain.pipeline --run-dir RUN --pp 2 --load CKPT --out pp2.json
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from torch import nn

from pretrain.model import build_llm, packed_seq_params
from pretrain.recipes import Recipe
from pretrain.vision import Projector, RiceViT


class VLMStage(nn.Module):
    """One pipeline stage; parameter names match ``pretrain.vlm.VLM`` so dist checkpoints load across PP."""

    def __init__(self, recipe: Recipe, image_pad_id: int, tp: int = 1, backend: str = "auto"):
        super().__init__()
        from megatron.core import parallel_state as ps

        self.pre_process = ps.is_pipeline_first_stage()
        self.post_process = ps.is_pipeline_last_stage()
        if self.pre_process:
            self.vision = RiceViT(recipe.vit)
            self.projector = Projector(recipe.vit.hidden_size, recipe.llm.hidden_size)
        self.llm = build_llm(recipe.llm, tp=tp, backend=backend, pre_process=self.pre_process,
                             post_process=self.post_process)
        self.image_pad_id = image_pad_id
        self.config, self.model_type = self.llm.config, self.llm.model_type   # read by megatron's schedules

    def set_input_tensor(self, t) -> None:
        self.llm.set_input_tensor(t)

    def forward(self, batch):
        from pretrain.vlm import VLM

        emb = VLM.embed(self, batch.tokens, batch.position_ids, batch.images) if self.pre_process else None
        return self.llm(None if self.pre_process else batch.tokens, batch.position_ids, attention_mask=None,
                        decoder_input=emb, labels=batch.labels,
                        packed_seq_params=packed_seq_params(batch.cu_seqlens, batch.max_seqlen))


def pad_to(b, T: int):
    """Pad a packed batch to ``T`` tokens with one extra, loss-free sample (own ``cu_seqlens`` segment, so
    nothing attends across it): the schedule's p2p buffers need one sequence length for every micro-batch."""
    import dataclasses

    n = T - b.tokens.shape[1]
    if n == 0:
        return b
    z = torch.zeros(1, n, dtype=b.tokens.dtype)
    return dataclasses.replace(
        b, tokens=torch.cat([b.tokens, z], 1), labels=torch.cat([b.labels, z], 1),
        loss_mask=torch.cat([b.loss_mask, torch.zeros(1, n, dtype=b.loss_mask.dtype)], 1),
        position_ids=torch.cat([b.position_ids, torch.arange(n, dtype=b.position_ids.dtype)[None]], 1),
        cu_seqlens=torch.cat([b.cu_seqlens, torch.tensor([T], dtype=b.cu_seqlens.dtype)]),
        max_seqlen=max(b.max_seqlen, n))


def to_device(b, device):
    import dataclasses

    return dataclasses.replace(b, tokens=b.tokens.to(device), labels=b.labels.to(device),
                               loss_mask=b.loss_mask.to(device), position_ids=b.position_ids.to(device),
                               cu_seqlens=b.cu_seqlens.to(device), images=[x.to(device) for x in b.images or []])


def forward_losses(model, batches: list, forward_only: bool = True) -> list[float]:
    """Mean target-token loss per micro-batch through megatron's schedule (any PP size)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    it = iter(batches)

    def step(data_iterator, m):
        b = to_device(next(data_iterator), torch.cuda.current_device())
        out = m(b)

        def loss_func(per_tok):
            loss = (per_tok * b.loss_mask).sum() / b.loss_mask.sum().clamp(min=1)
            return loss, {"loss": loss.detach()}

        return out, loss_func

    T = batches[0].tokens.shape[1]
    assert all(b.tokens.shape[1] == T for b in batches), "the schedule's p2p shapes need equal-length micro-batches"
    res = get_forward_backward_func()(forward_step_func=step, data_iterator=it, model=[model],
                                      num_microbatches=len(batches), seq_length=T, micro_batch_size=1,
                                      forward_only=forward_only)
    return [float(r["loss"]) for r in res]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--load", help="a dist checkpoint to load (saved at any TP/PP layout)")
    ap.add_argument("--save", help="write this run's (seeded) weights as a dist checkpoint first")
    ap.add_argument("--micro-batches", type=int, default=2)
    a = ap.parse_args(argv)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from pretrain import dist_ckpt
    from pretrain.data import iter_batches
    from pretrain.recipes import RECIPES
    from pretrain.train import image_pad_id

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    ps.initialize_model_parallel(1, a.pp)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)
    model = VLMStage(RECIPES["tiny"], image_pad_id(Path(a.run_dir), None), backend="auto").cuda()
    if a.save:
        dist_ckpt.save(Path(a.save), model, torch.optim.SGD(model.parameters(), lr=0.0), 0)
    if a.load:
        dist_ckpt.load_model(Path(a.load), model)
    it = iter_batches(a.run_dir, "pack", 1)
    batches = [next(it) for _ in range(a.micro_batches)]
    T = max(b.tokens.shape[1] for b in batches)
    batches = [pad_to(b, T) for b in batches]
    losses = forward_losses(model.eval(), batches)
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        Path(a.out).write_text(json.dumps({"pp": a.pp, "losses": losses}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
