"""Hugging Face checkpoints → a megatron dist checkpoint of the run, converted once — the conversion
Megatron users run before training. Two sources:

* a whole LLaVA-OneVision-1.5 folder in the published layout (a released stage-0 / instruct
  checkpoint, or ``ovpipe export-model``'s output) into ``RUN/pretrain/stage-<S>/dist_ckpt``, so a lab
  starts the stage after ``S`` (or RL, or an export) from it: ``--stage 1`` → stage 1.5 starts from
  it, ``--stage 1.5`` → stage 2, ``--stage 2`` → RL / export::

    python -m pretrain.hf_import --run-dir RUN --recipe llava-ov-1.5-8b --stage 2 \\
        --llava-ov LLaVA-OneVision-1.5-8B-Instruct

* stage 1's starting weights assembled from parts (``stage-0``)::

    python -m pretrain.hf_import --run-dir RUN --recipe llava-ov-1.5-8b --llm Qwen/Qwen3-8B-dir --vit rice-vit-dir

``--llm``: a saved ``Qwen3ForCausalLM`` (``pretrain.hf``), ``--vit``: a saved ``MLCDVisionModel`` (RICE-ViT
as transformers holds it, ``pretrain.vision.load_mlcd``); either may be left out (that part keeps
its seeded init, the projector always does). Their configs must match the recipe, field by field.
The conversion runs in one process at TP=1/PP=1; the dist checkpoint reshards when a stage loads
it at its own layout (stage 1 starts from ``stage-0`` as 1.5 starts from 1). A published folder's
``config.json`` is checked against the recipe field by field first (``pretrain.hf_llava_ov``).
The imported checkpoint is saved at step 0 with no optimizer state, and ``imported.json`` beside
it records where it came from.
"""
from __future__ import annotations

import argparse
import json
import sys
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
    from pretrain.trainer.build import setup_distributed
    from pretrain.vision import load_mlcd
    from pretrain.vlm import VLM

    rec = RECIPES[recipe]
    if llm:                                   # check sizes before building anything large
        from transformers import AutoConfig

        _check("Qwen3", llm, size_from_hf_config(AutoConfig.from_pretrained(llm)), rec.llm)
    setup_distributed(1)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    model = VLM(rec, image_pad_id=0, tp=1, backend="sdpa")   # local spec: the names pretrain.hf maps
    if llm:
        load_qwen3(llm, model.llm)
    if vit:
        tower = load_mlcd(vit)
        _check("MLCD vision", vit, tower.size, rec.vit)
        model.vision.load_state_dict(tower.state_dict())
    out = Path(run_dir) / "pretrain" / "stage-0" / "dist_ckpt"
    dist_ckpt.save(out, model, None, 0)
    return out


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder: the shards its ``model.safetensors.index.json`` lists,
    or its single ``model.safetensors``."""
    from safetensors.torch import load_file

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{folder}: no model.safetensors(.index.json)")
    out = {}
    for f in files:
        out.update(load_file(str(folder / f)))
    return out


def import_llava_ov(run_dir: Path, recipe: str, folder: str, stage: str = "0", seed: int = 0) -> Path:
    """A published LLaVA-OneVision-1.5 folder → ``RUN/pretrain/stage-<stage>/dist_ckpt`` (every
    tensor mapped, strict); returns the checkpoint path."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain import dist_ckpt
    from pretrain.hf_llava_ov import check_config, to_ours
    from pretrain.recipes import RECIPES, STAGES
    from pretrain.trainer.build import setup_distributed
    from pretrain.vlm import VLM

    if stage != "0" and stage not in STAGES:
        raise ValueError(f"stage: one of 0, {', '.join(STAGES)}; got {stage!r}")
    rec = RECIPES[recipe]
    cfg_path = Path(folder) / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{folder}: no config.json")
    check_config(json.loads(cfg_path.read_text()), rec, folder)      # before reading any weight
    setup_distributed(1)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    model = VLM(rec, image_pad_id=0, tp=1, backend="sdpa")   # local spec: the names pretrain.hf maps
    state = to_ours(read_safetensors(Path(folder)), rec)
    own = model.state_dict()
    missing = [k for k in own if k not in state and not k.endswith("_extra_state")]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise KeyError(f"{folder} does not map onto the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.load_state_dict({**{k: v for k, v in own.items() if k.endswith("_extra_state")},
                           **{k: v.to(own[k].dtype) for k, v in state.items()}}, strict=True)
    out = Path(run_dir) / "pretrain" / f"stage-{stage}" / "dist_ckpt"
    dist_ckpt.save(out, model, None, 0)
    (out.parent / "imported.json").write_text(json.dumps(
        {"source": str(Path(folder).resolve()), "format": "llava-onevision-1.5", "recipe": recipe}, indent=2) + "\n")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--llava-ov", help="a LLaVA-OneVision-1.5 folder in the published layout (whole model)")
    ap.add_argument("--stage", default="0", help="with --llava-ov: the stage folder to write (0, 1, 1.5, 2)")
    ap.add_argument("--llm", help="saved Qwen3ForCausalLM folder (stage 0 from parts)")
    ap.add_argument("--vit", help="saved MLCDVisionModel folder (stage 0 from parts)")
    ap.add_argument("--overwrite", action="store_true", help="replace the stage's existing checkpoints")
    ap.add_argument("--wait-lock", action="store_true", help="wait for a command holding the stage's lock")
    a = ap.parse_args(argv)
    if a.llava_ov and (a.llm or a.vit):
        ap.error("--llava-ov imports a whole model; --llm / --vit assemble stage 0 from parts — not both")
    if not (a.llava_ov or a.llm or a.vit):
        ap.error("give --llava-ov, or --llm and/or --vit")
    from ovpipe.runfolder import RunFolderError, lock
    from pretrain.stage_run import ImportConfig, finish_import, prepare_import, stage_dir

    stage = a.stage if a.llava_ov else "0"
    run_dir = Path(a.run_dir)
    source = str(Path(a.llava_ov).resolve()) if a.llava_ov else " + ".join(
        str(Path(x).resolve()) for x in (a.llm, a.vit) if x)
    cfg = ImportConfig(source=source, format="llava-onevision-1.5" if a.llava_ov else "qwen3+mlcd", recipe=a.recipe)
    try:
        if a.llava_ov:              # before the stage folder is touched
            from pretrain.official import check_transformers

            check_transformers("importing a LLaVA-OneVision-1.5 folder")
            from pretrain.hf_llava_ov import check_config          # the config against the recipe, too
            from pretrain.recipes import RECIPES

            if a.recipe not in RECIPES:
                raise ValueError(f"recipe: {a.recipe!r} is not one of {sorted(RECIPES)}")
            cfg_path = Path(a.llava_ov) / "config.json"
            if not cfg_path.exists():
                raise FileNotFoundError(f"{a.llava_ov}: no config.json")
            check_config(json.loads(cfg_path.read_text()), RECIPES[a.recipe], a.llava_ov)
        with lock.step_lock(stage_dir(run_dir, stage), wait=a.wait_lock):
            if prepare_import(run_dir, stage, cfg, overwrite=a.overwrite) == "done":
                print(f"{stage_dir(run_dir, stage) / 'dist_ckpt'}: already imported from {source}")
                return 0
            if a.llava_ov:
                print(import_llava_ov(run_dir, a.recipe, a.llava_ov, stage))
            else:
                print(import_hf(run_dir, a.recipe, a.llm, a.vit))
            finish_import(run_dir, stage)
    except (ValueError, FileNotFoundError, RunFolderError) as e:
        print(f"hf_import: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
