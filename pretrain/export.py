"""Export a trained stage as one Hugging Face folder in the published LLaVA-OneVision-1.5 layout —
what lmms-eval's ``llava_onevision1_5`` model, the HF quick start and RL rollout engines load.

    ovpipe export-model --run-dir RUN --stage 2 --out DIR

An ordinary ovpipe step (``RUN/pretrain/export-<S>/``: config, log, completion, ``ovpipe status``) whose
declared input is the stage's checkpoint (``pretrain/stage-<S>``, trained or imported): a stage that is
training, failed or was killed is refused by the core's upstream check, naming it.

``DIR`` is written by ``llava_ov.export.write_folder`` (what it holds is said there). The dist checkpoint is read at TP=1/PP=1 whatever layout it was saved at (megatron's
``dist_checkpointing`` reshards on load). The folder is written as ``DIR.partial`` and renamed when
whole; an existing ``DIR`` that is not an earlier export is refused. The tokenizer and image settings
are found through the
run folder: the stage's ``stage.json`` names its pack step, whose config names its ``lengths`` step,
whose config holds the tokenizer and the image token settings (``--tokenizer`` overrides).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ovpipe.step import Step


LMMS_EVAL = ("accelerate launch --num_processes=1 -m lmms_eval --model llava_onevision1_5 "
             "--model_args pretrained={out} --tasks mmstar --batch_size 1 --output_path {out}/lmms-eval")


def lmms_eval_command(out: Path) -> str:
    return LMMS_EVAL.format(out=Path(out).resolve())


def _json(path: Path) -> dict:
    return json.loads(Path(path).read_text()) if Path(path).exists() else {}


def training_inputs(run_dir: Path, folder: str):
    """(recipe or None, tokenizer path or None, ImageTokenConfig) the stage in step folder ``folder`` was
    trained with, from the run folder (stage.json → pack step config → lengths step config)."""
    from packing.tokens import ImageTokenConfig

    st = _json(run_dir / folder / "stage.json")
    pack = _json(run_dir / st["data"] / "config.json") if st.get("data") else {}
    lengths = _json(run_dir / pack.get("lengths_step", "lengths") / "config.json") if st.get("data") else {}
    img = ImageTokenConfig(**{k: lengths[k] for k in ("patch_size", "merge_size", "min_pixels", "max_pixels")
                              if k in lengths})
    tok = lengths.get("tokenizer") or (str(run_dir / "tokenizer") if (run_dir / "tokenizer").exists() else None)
    return st.get("recipe"), tok, img


def export_inputs(run_dir: Path, stage: str, folder: str, recipe: str | None = None, tokenizer: str | None = None):
    """(recipe, tokenizer, ImageTokenConfig, checkpoint root) an export of the stage in ``folder`` reads — the
    recipe and tokenizer found through the run folder unless given —, or a ``ValueError`` naming what is
    missing. The step's pre-start check and the export itself both go through here."""
    from pretrain.recipes import RECIPES
    from pretrain.trainer.checkpoint import is_complete

    run_dir = Path(run_dir)
    rec_name, tok_path, img = training_inputs(run_dir, folder)
    recipe = recipe or rec_name
    if recipe is None:
        raise ValueError(f"stage {stage}: no stage.json names the recipe — give --recipe")
    if rec_name and recipe != rec_name:
        raise ValueError(f"recipe: stage {stage} was trained with {rec_name!r}, not {recipe!r}")
    if recipe not in RECIPES:
        raise ValueError(f"recipe: {recipe!r} is not one of {sorted(RECIPES)}")
    tokenizer = tokenizer or tok_path
    if tokenizer is None:
        raise ValueError(f"stage {stage}: no tokenizer found through the run folder — give --tokenizer")
    ckpt = run_dir / folder / "dist_ckpt"
    if not is_complete(ckpt):
        raise ValueError(f"stage {stage}: no complete dist checkpoint at {ckpt}; train or import the stage first")
    return recipe, tokenizer, img, ckpt


def export(run_dir: Path, stage: str, out: Path, recipe: str | None = None, tokenizer: str | None = None,
           dtype: str = "float32", max_shard_size: str = "5GB", log=print, folder: str | None = None) -> Path:
    """The stage in step folder ``folder`` (default ``pretrain/stage-<stage>``) as one published folder at
    ``out`` (``llava_ov.export.write_folder``)."""
    from llava_ov.export import write_folder
    from packing.tokens import load_tokenizer
    from pretrain.recipes import RECIPES, stage_folder
    from pretrain.trainer.checkpoint import load_state_dict, step_of

    run_dir, out = Path(run_dir), Path(out)
    recipe, tokenizer, img, ckpt = export_inputs(run_dir, stage, folder or stage_folder(stage), recipe, tokenizer)
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype: float32, bfloat16 or float16, got {dtype!r}")
    if out.exists() and any(out.iterdir()) and not (out / "ovpipe_export.json").exists():
        raise ValueError(f"out: {out} exists and is not an earlier export — give a new or empty folder")
    record = {"run_dir": str(run_dir.resolve()), "stage": stage, "recipe": recipe, "tokenizer": str(tokenizer),
              "step": step_of(ckpt), "dtype": dtype}
    return write_folder(load_state_dict(ckpt, recipe), RECIPES[recipe], load_tokenizer(tokenizer), img, out, dtype,
                        max_shard_size, record, log=log)


@dataclass(frozen=True)
class ExportConfig:
    out: str                                  # the folder written (absolute)
    stage: str = "2"  # the trained stage exported: 1 | 1.5 | 2
    recipe: str | None = None                 # None: the one the stage's stage.json names
    tokenizer: str | None = None              # None: the lengths step's, found through the run folder
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # the safetensors' dtype
    max_shard_size: str = "5GB"  # the largest safetensors shard (transformers' save_pretrained)
    stage_folder: str = ""                    # the checkpoint's step folder; "": pretrain/stage-<stage>

    def __post_init__(self):
        from pretrain.recipes import stage_folder

        if not self.stage_folder:
            object.__setattr__(self, "stage_folder", stage_folder(self.stage))
        if not self.out:
            raise ValueError("out: give the folder to write")


def run(cfg: ExportConfig, task) -> None:
    from pretrain.trainer.build import setup_distributed

    setup_distributed(1)                      # the dist checkpoint is read into a TP=1 model
    out = export(task.run_dir, cfg.stage, Path(cfg.out), cfg.recipe, cfg.tokenizer, cfg.dtype, cfg.max_shard_size,
                 folder=cfg.stage_folder)
    task.stats.info["out"] = str(out)
    task.stats.inc("files", sum(1 for p in out.iterdir() if p.is_file()))


def check(cfg: ExportConfig, run_dir: Path) -> None:
    from llava_ov.official import check_transformers

    check_transformers("the exported folder's official modeling file")
    export_inputs(Path(run_dir), cfg.stage, cfg.stage_folder, cfg.recipe, cfg.tokenizer)


STEP = Step("export-model", ExportConfig, run, max_tasks=1, inputs={"dist_ckpt": "stage_folder"}, check=check,
            description="a trained stage as one Hugging Face LLaVA-OneVision-1.5 folder")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ovpipe export-model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--stage", default="2", help="stage whose dist checkpoint to export (0, 1, 1.5, 2)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--recipe", help="default: the one the stage's stage.json names")
    ap.add_argument("--tokenizer", help="default: the tokenizer of the lengths step behind the stage's pack step")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--overwrite", action="store_true", help="export again with another config")
    ap.add_argument("--wait-lock", action="store_true",
                    help="wait for a command holding the export's lock instead of refusing")
    a = ap.parse_args(argv)
    from ovpipe import console
    from ovpipe.cli import UsageError, execute
    from ovpipe.config import ConfigError, load_config
    from ovpipe.runfolder import RunFolderError

    run_dir, name = Path(a.run_dir).expanduser().resolve(), f"pretrain/export-{a.stage}"
    out = Path(a.out).expanduser().resolve()
    try:
        with console.warnings_to(run_dir / name / "logs" / "launch.log"):
            cfg = load_config(ExportConfig, {"out": str(out), "stage": a.stage, "recipe": a.recipe,
                                             "tokenizer": a.tokenizer, "dtype": a.dtype,
                                             "max_shard_size": a.max_shard_size})
            args = argparse.Namespace(run_dir=str(run_dir), name=name, executor="local", tasks=1, workers=1,
                                      overwrite=a.overwrite, quiet=False, wait_lock=a.wait_lock)
            return execute(STEP, cfg, args, summary=lambda seconds, where: (
                f"{name}: stage {a.stage} as a LLaVA-OneVision-1.5 folder — {seconds:.1f} s → {out}  "
                f"(evaluate it: {lmms_eval_command(out)})"))
    except (UsageError, ConfigError, RunFolderError, ValueError) as e:
        print(f"ovpipe export-model: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
