"""Step-1 loss of the tiny recipe on the first demo batch, for the TP=1 vs TP=2 parity check.

    torchrun --nproc-per-node=2 tests/pretrain/tp_check.py --run-dir RUN --out loss.json [--save CKPT]
    torchrun --nproc-per-node=1 tests/pretrain/tp_check.py --run-dir RUN --out loss.json --seed 7 --load CKPT

``--save`` writes the initial weights as a megatron dist checkpoint; ``--load`` reads one (saved at any
TP size) over a differently seeded model: resharding TP=2 -> TP=1 must give the same loss.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stage", default="1.5")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save")
    ap.add_argument("--load")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain.data import iter_batches
    from pretrain.recipes import RECIPES
    from pretrain.trainer.build import image_pad_id, setup_distributed
    from pretrain.model.vlm import VLM

    tp = setup_distributed(tp=int(os.environ.get("WORLD_SIZE", "1")))["tp"]
    torch.manual_seed(a.seed)
    model_parallel_cuda_manual_seed(a.seed)       # as the trainer seeds: per-TP-rank init streams
    model = VLM(RECIPES["tiny"], image_pad_id(Path(a.run_dir), None), tp=tp, backend="sdpa")
    from pretrain.trainer import checkpoint

    b = next(iter_batches(a.run_dir, "pack", 2))
    if a.save:
        checkpoint.save(Path(a.save), model, None, 0)
    before = None
    if a.load:
        with torch.no_grad():                     # the seeded model's own loss: loading must change it
            before = float((model(b) * b.loss_mask).sum() / b.loss_mask.sum())
        checkpoint.load_model(Path(a.load), model)
    per_tok = model(b)
    loss = (per_tok * b.loss_mask).sum() / b.loss_mask.sum()
    loss.backward()
    gn = torch.sqrt(sum((p.grad.float() ** 2).sum() for n, p in model.named_parameters()
                        if p.grad is not None and n.startswith("projector.")))
    if int(os.environ.get("RANK", "0")) == 0:
        Path(a.out).write_text(json.dumps({"tp": tp, "loss": float(loss.detach()), "projector_grad_norm": float(gn),
                                             "loss_before_load": before}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
