"""The published LLaVA-OneVision-1.5 Hugging Face folder, written from our weights — what lmms-eval's
``llava_onevision1_5`` model, the HF quick start and RL rollout engines load (``pretrain.export`` reads a
trained stage and calls ``write_folder``).

The folder holds:

* ``model-0000K-of-0000N.safetensors`` + ``model.safetensors.index.json`` — the weights under the
  published names (``visual.*`` RICE-ViT with its ``merger``, ``model.*`` Qwen3, ``lm_head``;
  ``llava_ov.convert``), sharded with ``huggingface_hub.split_torch_state_dict_into_shards``;
* ``config.json`` — ``model_type: llavaonevision1_5``, ``architectures:
  [LLaVAOneVision1_5_ForConditionalGeneration]``, the RICE vision config and the Qwen3 text config,
  the token ids of the training tokenizer; plus ``auto_map`` and the official
  ``configuration_/modeling_llavaonevision1_5.py`` copied from the installed lmms-engine wheel
  (``llava_ov.official``) so ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``
  works as on the released checkpoints (left out, with a warning, when lmms-engine is not installed);
* ``generation_config.json`` — ``eos_token_id`` = ``<|im_end|>``, greedy;
* the tokenizer (its chat template included) and a Qwen2-VL image processor with the patch / merge /
  pixel bounds packing counted tokens with (``preprocessor_config.json``, ``processor_config.json``,
  ``chat_template.jinja``), ``processor_class: Qwen2_5_VLProcessor`` as published.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

# What the trainer normalises pixels with (OpenAI CLIP's statistics, as RICE-ViT was trained), and so
# what the exported image processor must say.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


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


def save_processor(out: Path, tok, img) -> None:
    """The training tokenizer + a Qwen2-VL image processor with packing's image settings, saved as
    the published folders hold them. ``img``: the image token settings (patch, merge, min / max
    pixels) packing counted tokens with (``preprocessor_config.json`` for transformers 4.x readers too)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor


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


def write_folder(ours: dict, recipe, tok, img, out: Path, dtype: str = "float32", max_shard_size: str = "5GB",
                 record: dict | None = None, log=print) -> Path:
    """Our full (TP=1) state dict as one published LLaVA-OneVision-1.5 folder at ``out``: sharded
    safetensors under the published names (``llava_ov.convert``), ``config.json`` (+ ``auto_map`` and the
    official modeling files when lmms-engine is installed), ``generation_config.json``, the tokenizer
    ``tok`` and an image processor with packing's settings ``img``; ``record`` → ``ovpipe_export.json``.
    Written as ``out.partial`` and renamed when whole. ``recipe``: the model's shapes (``.vit``, ``.llm``)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from llava_ov import official
    from llava_ov.convert import config_dict, published_state_dict

    state = published_state_dict(ours, recipe)
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
    cfg = config_dict(recipe, tok, dtype)
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
    save_processor(out, tok, img)
    (out / "ovpipe_export.json").write_text(json.dumps(record or {}, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    out.rename(final)
    return final
