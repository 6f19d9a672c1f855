"""A tiny, randomly initialised Qwen2-VL saved as a Hugging Face VLM folder (nothing downloaded).

The stand-in for a real VLM wherever the demo or a test needs one before ovpipe's own exported
model exists: ``config.json`` + ``model.safetensors`` + a byte-level BPE tokenizer with the
Qwen2-VL special tokens (``packing.tiny_tokenizer``) + a ``Qwen2VLImageProcessor`` and the chat
template, so ``AutoProcessor`` / ``AutoModelForImageTextToText`` load it exactly as they load
``Qwen/Qwen2-VL-2B-Instruct``. ~0.2 M parameters: a CPU generates a 16-token caption for one
image in well under a second. Being random, it writes nonsense — what it proves is the path.

    python -m demo.tiny_vlm --out DIR [--run-dir RUN]   # RUN: train the tokenizer on its captions too
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Iterable

BASE_TEXTS = ["Describe this image in detail.", "请详细描述这张图片。",
              "a photo of a red circle on a white background",
              "图片中有一个红色的圆形。", "How many circles are there?", "<answer>42</answer>"]


def build_tiny_vlm(out: Path, texts: Iterable[str] = (), vocab_size: int = 512, seed: int = 0) -> Path:
    import torch
    from transformers import (Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor)

    from packing.tiny_tokenizer import build_tiny_tokenizer

    out = Path(out)
    tok = build_tiny_tokenizer([*BASE_TEXTS, *texts], out, vocab_size)
    # Small images stay small: 56²..224² pixels → 4..64 merged image tokens.
    proc = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=224 * 224),
                            video_processor=Qwen2VLVideoProcessor(), tokenizer=tok, chat_template=tok.chat_template)
    proc.save_pretrained(out)
    special = ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_end|>")
    ids = {t: tok.convert_tokens_to_ids(t) for t in special}
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, bos_token_id=None,
                         eos_token_id=ids["<|im_end|>"], pad_token_id=tok.pad_token_id),
        vision_config=dict(depth=1, embed_dim=32, num_heads=2, hidden_size=64, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, in_chans=3, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|image_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(cfg)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    return out


def run_texts(run_dir: str) -> list[str]:
    """Conversation texts of every ok ``samples`` row of a run (the demo's captions)."""
    from manifests import read_manifest

    try:
        t = read_manifest(run_dir, "samples", columns=["conversation", "status"])
    except FileNotFoundError:           # a run folder with no ingest yet (e.g. `make rl` alone)
        return []
    return [turn["text"].replace("<image>", "") for conv, s in
            zip(t.column("conversation").to_pylist(), t.column("status").to_pylist())
            if s == "ok" for turn in conv or [] if turn["text"]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--run-dir", help="also train the tokenizer on the conversation texts of this run")
    a = ap.parse_args(argv)
    if (Path(a.out) / "config.json").exists():
        print(f"tiny VLM exists: {a.out}")
        return 0
    build_tiny_vlm(Path(a.out), run_texts(a.run_dir) if a.run_dir else ())
    print(f"tiny random Qwen2-VL → {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
