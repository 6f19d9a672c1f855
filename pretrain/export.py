"""Export a trained stage as one Hugging Face folder in the published LLaVA-OneVision-1.5 layout —
what lmms-eval's ``llava_onevision1_5`` model, the HF quick start and RL rollout engines load.

    ovpipe export-model --run-dir RUN --stage 2 --out DIR        (= python -m pretrain.export ...)

``DIR`` holds:

* ``model-0000K-of-0000N.safetensors`` + ``model.safetensors.index.json`` — the weights under the
  published names (``visual.*`` RICE-ViT with its ``merger``, ``model.*`` Qwen3, ``lm_head``;
  ``pretrain.hf_llava_ov``), sharded with ``huggingface_hub.split_torch_state_dict_into_shards``;
* ``config.json`` — ``model_type: llavaonevision1_5``, ``architectures:
  [LLaVAOneVision1_5_ForConditionalGeneration]``, the RICE vision config and the Qwen3 text config
  of the recipe, the token ids of the training tokenizer; plus ``auto_map`` and the official
  ``configuration_/modeling_llavaonevision1_5.py`` copied from the installed lmms-engine wheel
  (``pretrain.official``) so ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``
  works as on the released checkpoints (left out, with a warning, when lmms-engine is not installed);
* ``generation_config.json`` — ``eos_token_id`` = ``<|im_end|>``, greedy;
* the tokenizer the stage was trained with (its chat template included) and a Qwen2-VL image
  processor with the patch / merge / pixel bounds packing counted tokens with (``preprocessor_config.json``,
  ``processor_config.json``, ``chat_template.jinja``), ``processor_class: Qwen2_5_VLProcessor`` as published.

The dist checkpoint is read at TP=1/PP=1 whatever layout it was saved at (megatron's
``dist_checkpointing`` reshards on load). The folder is written as ``DIR.partial`` and renamed when
whole; an existing ``DIR`` that is not an earlier export is refused. The tokenizer and image settings
are found through the
run folder: the stage's ``stage.json`` names its pack step, whose config names its ``lengths`` step,
whose config holds the tokenizer and the image token settings (``--tokenizer`` overrides).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

LMMS_EVAL = ("accelerate launch --num_processes=1 -m lmms_eval --model llava_onevision1_5 "
             "--model_args pretrained={out} --tasks mmstar --batch_size 1 --output_path {out}/lmms-eval")


def lmms_eval_command(out: Path) -> str:
    return LMMS_EVAL.format(out=Path(out).resolve())


def _json(path: Path) -> dict:
    return json.loads(Path(path).read_text()) if Path(path).exists() else {}


def training_inputs(run_dir: Path, stage: str):
    """(recipe or None, tokenizer path or None, ImageTokenConfig) the stage was trained with, from
    the run folder (stage.json → pack step config → lengths step config)."""
    from packing.tokens import ImageTokenConfig

    st = _json(run_dir / "pretrain" / f"stage-{stage}" / "stage.json")
    pack = _json(run_dir / st["data"] / "config.json") if st.get("data") else {}
    lengths = _json(run_dir / pack.get("lengths_step", "lengths") / "config.json") if st.get("data") else {}
    img = ImageTokenConfig(**{k: lengths[k] for k in ("patch_size", "merge_size", "min_pixels", "max_pixels")
                              if k in lengths})
    tok = lengths.get("tokenizer") or (str(run_dir / "tokenizer") if (run_dir / "tokenizer").exists() else None)
    return st.get("recipe"), tok, img


def tokenizer_config_for_4x(path: Path) -> None:
    """Rewrite the ``tokenizer_config.json`` transformers 5 saves into the layout of the released
    Qwen2.5-VL / LLaVA-OV-1.5 folders, which transformers 4.x (lmms-eval's 4.57, vLLM, older rollout
    engines) and 5.x both read: 5.x writes ``extra_special_tokens`` as a list (4.x expects a dict there and
    fails with "'list' object has no attribute 'keys'") and ``tokenizer_class: TokenizersBackend`` (a
    5.x-only name). That one becomes ``PreTrainedTokenizerFast``, which both read as ``tokenizer.json``
    unchanged; not ``Qwen2Tokenizer``, which 5.x rebuilds with Qwen's own pre-tokenizer pattern (it splits
    combining marks differently from a tokenizer.json trained with another one). A tokenizer saved under
    its own class (a Qwen3 tokenizer: ``Qwen2Tokenizer``, as released) keeps it."""
    cfg = json.loads(path.read_text())
    specials = cfg.pop("extra_special_tokens", [])
    if isinstance(specials, list):
        cfg["additional_special_tokens"] = specials
    elif specials:
        cfg["extra_special_tokens"] = specials
    if cfg.get("tokenizer_class") == "TokenizersBackend":
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("backend", "is_local", "local_files_only"):    # 5.x load-time state, not tokenizer settings
        cfg.pop(key, None)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def save_processor(out: Path, tokenizer: str, img) -> None:
    """The training tokenizer + a Qwen2-VL image processor with packing's image settings, saved as
    the published folders hold them (``preprocessor_config.json`` for transformers 4.x readers too)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    from packing.tokens import load_tokenizer
    from pretrain.data import CLIP_MEAN, CLIP_STD       # what the trainer normalises pixels with

    tok = load_tokenizer(tokenizer)
    common = dict(patch_size=img.patch_size, temporal_patch_size=1, merge_size=img.merge_size,
                  image_mean=list(CLIP_MEAN), image_std=list(CLIP_STD))
    ip = Qwen2VLImageProcessor(min_pixels=img.min_pixels, max_pixels=img.max_pixels, **common)
    proc = Qwen2_5_VLProcessor(image_processor=ip, video_processor=Qwen2VLVideoProcessor(**common), tokenizer=tok,
                               chat_template=tok.chat_template)
    proc.save_pretrained(str(out))
    ip.save_pretrained(str(out))
    tokenizer_config_for_4x(out / "tokenizer_config.json")
    pre = json.loads((out / "preprocessor_config.json").read_text())
    pre.update(processor_class="Qwen2_5_VLProcessor", min_pixels=img.min_pixels, max_pixels=img.max_pixels)
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")


def export(run_dir: Path, stage: str, out: Path, recipe: str | None = None, tokenizer: str | None = None,
           dtype: str = "float32", max_shard_size: str = "5GB", log=print) -> Path:
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from packing.tokens import load_tokenizer
    from pretrain import official
    from pretrain.dist_ckpt import is_complete, load_state_dict, step_of
    from pretrain.hf_llava_ov import config_dict, published_state_dict
    from pretrain.recipes import RECIPES

    run_dir, out = Path(run_dir), Path(out)
    rec_name, tok_path, img = training_inputs(run_dir, stage)
    recipe = recipe or rec_name
    if recipe is None:
        raise ValueError(f"stage {stage}: no stage.json names the recipe — give --recipe")
    if rec_name and recipe != rec_name:
        raise ValueError(f"recipe: stage {stage} was trained with {rec_name!r}, not {recipe!r}")
    tokenizer = tokenizer or tok_path
    if tokenizer is None:
        raise ValueError(f"stage {stage}: no tokenizer found through the run folder — give --tokenizer")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype: float32, bfloat16 or float16, got {dtype!r}")
    if recipe not in RECIPES:
        raise ValueError(f"recipe: {recipe!r} is not one of {sorted(RECIPES)}")
    if out.exists() and any(out.iterdir()) and not (out / "ovpipe_export.json").exists():
        raise ValueError(f"out: {out} exists and is not an earlier export — give a new or empty folder")
    ckpt = run_dir / "pretrain" / f"stage-{stage}" / "dist_ckpt"
    if not is_complete(ckpt):
        raise FileNotFoundError(f"stage {stage}: no complete dist checkpoint at {ckpt}")
    rec = RECIPES[recipe]
    state = published_state_dict(load_state_dict(ckpt, recipe), rec)
    state = {k: v.to(getattr(torch, dtype)) for k, v in state.items()}
    final, out = out, out.with_name(out.name + ".partial")   # written whole, then renamed into place
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    split = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    for fname, keys in split.filename_to_tensors.items():
        save_file({k: state[k] for k in keys}, str(out / fname), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
             "weight_map": dict(sorted(split.tensor_to_filename.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    tok = load_tokenizer(tokenizer)
    cfg = config_dict(rec, tok, dtype)
    found = official.files()
    if found:
        for f in found:
            shutil.copy2(f, out / f.name)
        cfg["auto_map"] = dict(official.AUTO_MAP)
    else:
        log("warning: lmms-engine is not installed, so the export has no modeling files / auto_map "
            "(trust_remote_code loading needs them): pip install --no-deps lmms-engine==0.1.4")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    eos = cfg["text_config"]["eos_token_id"]
    GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id, bos_token_id=None,
                     do_sample=False).save_pretrained(str(out))
    save_processor(out, tokenizer, img)
    (out / "ovpipe_export.json").write_text(json.dumps(
        {"run_dir": str(run_dir.resolve()), "stage": stage, "recipe": recipe, "tokenizer": str(tokenizer),
         "step": step_of(ckpt), "dtype": dtype}, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    out.rename(final)
    return final


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
    ap.add_argument("--wait-lock", action="store_true",
                    help="wait for a command holding the stage's lock (training it, importing into it)")
    a = ap.parse_args(argv)
    from pretrain.official import IncompatibleTransformers, check_transformers

    try:
        check_transformers("the exported folder's official modeling file")
    except IncompatibleTransformers as e:
        print(f"ovpipe export-model: {e}", file=sys.stderr)
        return 2
    from ovpipe import console
    from ovpipe.runfolder import RunFolderError, lock
    from pretrain.stage_run import check_exportable, stage_dir

    sdir = stage_dir(Path(a.run_dir), a.stage)
    try:
        with lock.step_lock(sdir, wait=a.wait_lock), console.task_output(sdir / "logs" / "export.log"):
            check_exportable(Path(a.run_dir), a.stage)
            from pretrain.trainer.build import setup_distributed   # megatron's import notices: into export.log

            setup_distributed(1)                 # the dist checkpoint is read into a TP=1 model
            out = export(Path(a.run_dir), a.stage, Path(a.out), a.recipe, a.tokenizer, a.dtype, a.max_shard_size)
    except (ValueError, FileNotFoundError, RunFolderError) as e:
        print(f"ovpipe export-model: {e}", file=sys.stderr)
        return 2
    print(f"export-model: stage {a.stage} as a LLaVA-OneVision-1.5 folder → {out}  "
          f"(evaluate it: {lmms_eval_command(out)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
