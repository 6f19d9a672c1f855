"""Stage 1's starting weights from Hugging Face checkpoints, converted once into a megatron dist
checkpoint (``RUN/pretrain/stage-0/dist_ckpt``) — the conversion Megatron users run before training.

    python -m pretrain.hf_import --run-dir RUN --recipe llava-ov-1.5-8b --llm Qwen/Qwen3-8B-dir --vit rice-vit-dir

``--llm``: a saved ``Qwen3ForCausalLM`` (``pretrain.hf``), ``--vit``: a saved ``MLCDVisionModel`` (RICE-ViT
as transformers holds it, ``pretrain.vision.load_mlcd``); either may be left out (that part keeps
its seeded init, the projector always does). Their configs must match the recipe, field by field.
The conversion runs in one process at TP=1/PP=1; the dist checkpoint reshards when stage 1 loads
it at its own layout (stage 1 starts from ``stage-0`` as 1.5 starts from 1).
"""
from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

import torch


def _check(kind: str, path: str, got, want) -> None:
    diff = {k: (v, asdict(want)[k]) for k, v in asdict(got).items() if asdict(want)[k] != v}
    if diff:
        raise ValueError(f"{kind} checkpoint {path} does not match the recipe: " +
                         ", ".join(f"{k}={a} (recipe: {b})" for k, (a, b) in diff.items()))


def import_hf(run_dir: Path, recipe: str, llm: str | None = None, vit: str | None = None, seed: int = 0) -> Path:
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain import dist_ckpt
    from pretrain.hf import load_qwen3, size_from_hf_config
    from pretrain.recipes import RECIPES
    from pretrain.train import setup_distributed
    from pretrain.vision import load_mlcd
    from pretrain.vlm import VLM

    rec = RECIPES[recipe]
    if llm:                                   # check sizes before building anything large
        from transformers import AutoConfig

        _check("Qwen3", llm, size_from_hf_config(AutoConfig.from_pretrained(llm)), rec.llm)
    setup_distributed(1)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    model = VLM(rec, image_pad_id=0, tp=1, backend="sdpa" if not torch.cuda.is_available() else "auto")
    if llm:
        load_qwen3(llm, model.llm)
    if vit:
        tower = load_mlcd(vit)
        _check("MLCD vision", vit, tower.size, rec.vit)
        model.vision.load_state_dict(tower.state_dict())
    out = Path(run_dir) / "pretrain" / "stage-0" / "dist_ckpt"
    dist_ckpt.save(out, model, None, 0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--llm", help="saved Qwen3ForCausalLM folder")
    ap.add_argument("--vit", help="saved MLCDVisionModel folder")
    a = ap.parse_args(argv)
    if not (a.llm or a.vit):
        ap.error("give --llm and/or --vit")
    print(import_hf(Path(a.run_dir), a.recipe, a.llm, a.vit))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
