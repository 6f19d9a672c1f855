"""Hugging Face checkpoints → a megatron dist checkpoint of the run, converted once — the conversion
Megatron users run before training. Two sources:

* a whole LLaVA-OneVision-1.5 folder in the published layout (a released stage-0 / instruct
  checkpoint, or ``ovpipe export-model``'s output) into ``RUN/pretrain/stage-<S>/dist_ckpt``, so a lab
  starts the stage after ``S`` (or RL, or an export) from it: ``--stage 1`` → stage 1.5 starts from
  it, ``--stage 1.5`` → stage 2, ``--stage 2`` → RL / export::

    ovpipe import-model --run-dir RUN --recipe llava-ov-1.5-8b --stage 2 --llava-ov LLaVA-OneVision-1.5-8B-Instruct

* stage 1's starting weights assembled from parts (``stage-0``)::

    ovpipe import-model --run-dir RUN --recipe llava-ov-1.5-8b --llm Qwen/Qwen3-8B-dir --vit rice-vit-dir

``--llm``: a saved ``Qwen3ForCausalLM`` (``llava_ov.qwen3``), ``--vit``: a saved ``MLCDVisionModel`` (RICE-ViT
as transformers holds it, ``pretrain.model.vision.load_mlcd``); either may be left out (that part keeps
its seeded init, the projector always does). Their configs must match the recipe, field by field.
The conversion runs in one process at TP=1/PP=1; the dist checkpoint reshards when a stage loads
it at its own layout (stage 1 starts from ``stage-0`` as 1.5 starts from 1). A published folder's
``config.json`` is checked against the recipe field by field first (``llava_ov.convert``).
The imported checkpoint is saved at step 0 with no optimizer state, and ``imported.json`` beside
it records where it came from. The import is an ordinary ovpipe step (``import-model``) whose folder is
the stage's, ``RUN/pretrain/stage-<S>/`` — the folder the next stage declares as the checkpoint it
starts from — so the lock, the refusal to replace a trained stage without ``--overwrite``, ``ovpipe
status`` and the next stage's upstream check are every step's.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ovpipe.step import Step


def _check(kind: str, path: str, got, want) -> None:
    diff = {k: (v, asdict(want)[k]) for k, v in asdict(got).items() if asdict(want)[k] != v}
    if diff:
        raise ValueError(f"{kind} checkpoint {path} does not match the recipe: " +
                         ", ".join(f"{k}={a} (recipe: {b})" for k, (a, b) in diff.items()))


def size_from_hf_config(cfg):
    from pretrain.model.llm import LLMSize

    return LLMSize(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                   cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size, float(getattr(cfg, "rope_theta", None)
                   or cfg.rope_parameters["rope_theta"]), bool(cfg.tie_word_embeddings))


def load_qwen3(path: str, model):
    """Load a saved ``Qwen3ForCausalLM`` into our megatron ``GPTModel`` (strict: every weight mapped)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llava_ov.qwen3 import qwen3_to_megatron

    cfg = AutoConfig.from_pretrained(path)
    size = size_from_hf_config(cfg)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).state_dict()
    state = qwen3_to_megatron(hf, size)
    own = model.state_dict()
    missing = [k for k in own if k not in state and not k.endswith("_extra_state")]
    if missing:
        raise KeyError(f"weights not provided by the HF checkpoint: {missing[:5]}")
    model.load_state_dict({**{k: v for k, v in own.items() if k.endswith('_extra_state')}, **state}, strict=True)
    return size


def import_hf(run_dir: Path, recipe: str, llm: str | None = None, vit: str | None = None, seed: int = 0) -> Path:
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain.trainer import checkpoint
    from pretrain.recipes import RECIPES
    from pretrain.trainer.build import setup_distributed
    from pretrain.model.vision import load_mlcd
    from pretrain.model.vlm import VLM

    rec = RECIPES[recipe]
    if llm:                                   # check sizes before building anything large
        from transformers import AutoConfig

        _check("Qwen3", llm, size_from_hf_config(AutoConfig.from_pretrained(llm)), rec.llm)
    setup_distributed(1)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    model = VLM(rec, image_pad_id=0, tp=1, backend="sdpa")   # local spec: the names llava_ov.qwen3 maps
    if llm:
        load_qwen3(llm, model.llm)
    if vit:
        tower = load_mlcd(vit)
        _check("MLCD vision", vit, tower.size, rec.vit)
        model.vision.load_state_dict(tower.state_dict())
    out = Path(run_dir) / "pretrain" / "stage-0" / "dist_ckpt"
    checkpoint.save(out, model, None, 0)
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

    from pretrain.trainer import checkpoint
    from llava_ov.convert import check_config, to_ours
    from pretrain.recipes import RECIPES, STAGES, stage_folder
    from pretrain.trainer.build import setup_distributed
    from pretrain.model.vlm import VLM

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
    model = VLM(rec, image_pad_id=0, tp=1, backend="sdpa")   # local spec: the names llava_ov.qwen3 maps
    state = to_ours(read_safetensors(Path(folder)), rec)
    own = model.state_dict()
    missing = [k for k in own if k not in state and not k.endswith("_extra_state")]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise KeyError(f"{folder} does not map onto the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.load_state_dict({**{k: v for k, v in own.items() if k.endswith("_extra_state")},
                           **{k: v.to(own[k].dtype) for k, v in state.items()}}, strict=True)
    out = Path(run_dir) / stage_folder(stage) / "dist_ckpt"
    checkpoint.save(out, model, None, 0)
    (out.parent / "imported.json").write_text(json.dumps(
        {"source": str(Path(folder).resolve()), "format": "llava-onevision-1.5", "recipe": recipe}, indent=2) + "\n")
    return out


@dataclass(frozen=True)
class ImportConfig:
    stage: str = "0"                         # the stage folder written: pretrain/stage-<stage>
    recipe: str = "tiny"  # the model recipe the checkpoint is laid out for (pretrain.recipes)
    llava_ov: str | None = None              # a published LLaVA-OneVision-1.5 folder (the whole model), absolute
    llm: str | None = None                   # stage 0 from parts: a saved Qwen3ForCausalLM folder
    vit: str | None = None                   # ... and a saved MLCDVisionModel folder

    def __post_init__(self):
        if self.llava_ov and (self.llm or self.vit):
            raise ValueError("llava_ov imports a whole model; llm / vit assemble stage 0 from parts — not both")
        if not (self.llava_ov or self.llm or self.vit):
            raise ValueError("give llava_ov, or llm and/or vit")
        if (self.llm or self.vit) and self.stage != "0":
            raise ValueError(f"stage: parts (llm / vit) make stage 0's starting weights, got stage={self.stage!r}")


def check(cfg: ImportConfig, run_dir: Path) -> None:
    """Before the stage folder is touched: the transformers range (first: nothing heavy is imported before
    it), the recipe, and the folder's config against the recipe."""
    from llava_ov.official import check_transformers

    if cfg.llava_ov:
        check_transformers("importing a LLaVA-OneVision-1.5 folder")
    from pretrain.recipes import RECIPES

    if cfg.recipe not in RECIPES:
        raise ValueError(f"recipe: {cfg.recipe!r} is not one of {sorted(RECIPES)}")
    if not cfg.llava_ov:
        return
    from llava_ov.convert import check_config

    cfg_path = Path(cfg.llava_ov) / "config.json"
    if not cfg_path.exists():
        raise ValueError(f"{cfg.llava_ov}: no config.json")
    check_config(json.loads(cfg_path.read_text()), RECIPES[cfg.recipe], cfg.llava_ov)


def run(cfg: ImportConfig, task) -> None:
    if cfg.llava_ov:
        out = import_llava_ov(task.run_dir, cfg.recipe, cfg.llava_ov, cfg.stage)
    else:
        out = import_hf(task.run_dir, cfg.recipe, cfg.llm, cfg.vit)
    task.stats.info["dist_ckpt"] = str(out)


STEP = Step("import-model", ImportConfig, run, max_tasks=1, outputs=("dist_ckpt",), check=check,
            description="a released LLaVA-OneVision-1.5 folder (or Qwen3 + RICE-ViT parts) as a stage's checkpoint")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ovpipe import-model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--llava-ov", help="a LLaVA-OneVision-1.5 folder in the published layout (whole model)")
    ap.add_argument("--stage", default="0", help="with --llava-ov: the stage folder to write (0, 1, 1.5, 2)")
    ap.add_argument("--llm", help="saved Qwen3ForCausalLM folder (stage 0 from parts)")
    ap.add_argument("--vit", help="saved MLCDVisionModel folder (stage 0 from parts)")
    ap.add_argument("--overwrite", action="store_true", help="replace the stage's existing checkpoints")
    ap.add_argument("--wait-lock", action="store_true", help="wait for a command holding the stage's lock")
    a = ap.parse_args(argv)
    from ovpipe.cli import UsageError, execute
    from ovpipe.config import ConfigError, load_config
    from ovpipe.runfolder import RunFolderError

    from pretrain.recipes import stage_folder

    absolute = (lambda x: str(Path(x).expanduser().resolve()) if x else None)
    stage = a.stage if a.llava_ov else "0"
    run_dir, name = Path(a.run_dir).expanduser().resolve(), stage_folder(stage)
    try:
        cfg = load_config(ImportConfig, {"stage": stage, "recipe": a.recipe, "llava_ov": absolute(a.llava_ov),
                                         "llm": absolute(a.llm), "vit": absolute(a.vit)})
        args = argparse.Namespace(run_dir=str(run_dir), name=name, executor="local", tasks=1, workers=1,
                                  overwrite=a.overwrite, quiet=False, wait_lock=a.wait_lock)
        source = cfg.llava_ov or " + ".join(x for x in (cfg.llm, cfg.vit) if x)
        return execute(STEP, cfg, args, summary=lambda seconds, where: (
            f"{name}: imported {source} — {seconds:.1f} s → {run_dir / name / 'dist_ckpt'}"))
    except (UsageError, ConfigError, RunFolderError, ValueError) as e:
        print(f"ovpipe import-model: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
