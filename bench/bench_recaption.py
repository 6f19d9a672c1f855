"""Recaption / rollout generation benchmarks (the shared backend, ``inference.backends``).

    python -m bench.bench_recaption                   # 32 images × (en, zh) on the CPU, tiny random Qwen2-VL
    python -m bench.bench_recaption --quick           # 8 images
    python -m bench.bench_recaption --model DIR       # any HF VLM folder (the demo's RUN/pretrain/hf-stage-2)
    python -m bench.bench_recaption --device cuda --size 2b --max-new-tokens 64   # GPU: a random Qwen2-VL-2B-shaped model

Figures: captions/s and generated tokens/s of the ``transformers`` backend (one seeded ``generate`` per
request, what ``recaption`` runs), and the ``vllm`` backend's request building (chat template + image
decode + ``SamplingParams`` per request) against a stand-in ``vllm`` module — the CPU-side work vLLM's
engine waits on. Images are demo-sized (96–224 px) rendered shapes; random weights rarely stop early,
so every caption runs to ``max_new_tokens`` (the worst case of a real captioner's lengths).
"""
from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
import types
from pathlib import Path

PROMPTS = {"en": "Describe this image in detail.", "zh": "请详细描述这张图片。"}


def images(n: int, seed: int = 0) -> list[bytes]:
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        w, h = (int(x) for x in rng.integers(96, 225, 2))
        im = Image.new("RGB", (w, h), tuple(int(c) for c in rng.integers(180, 256, 3)))
        d = ImageDraw.Draw(im)
        for _ in range(3):
            x, y, r = int(rng.integers(0, w)), int(rng.integers(0, h)), int(rng.integers(6, 30))
            d.ellipse([x - r, y - r, x + r, y + r], fill=tuple(int(c) for c in rng.integers(0, 200, 3)))
        b = io.BytesIO()
        im.save(b, format="PNG")
        out.append(b.getvalue())
    return out


def requests(imgs: list[bytes]):
    from inference.backends import Request, seed_for

    return [Request([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": p}]}], [b], 1,
                    seed_for(0, f"{i}:{lang}")) for i, b in enumerate(imgs) for lang, p in sorted(PROMPTS.items())]


def build_2b(out: Path) -> Path:
    """A random Qwen2-VL with Qwen2-VL-2B's layer shapes (LM: 28 layers × 1536, ViT: 32 × 1280; 2.44 B
    parameters with untied embeddings). Built on the GPU in bf16; CPU-only machines should not ask for it."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from demo.tiny_vlm import build_tiny_vlm

    build_tiny_vlm(out)                                       # tokenizer + processor files
    tiny = Qwen2VLConfig.from_pretrained(out)
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, bos_token_id=None,
                         eos_token_id=tiny.text_config.eos_token_id, pad_token_id=tiny.text_config.pad_token_id),
        vision_config=dict(depth=32, embed_dim=1280, num_heads=16, hidden_size=1536, mlp_ratio=4, patch_size=14,
                           spatial_merge_size=2, in_chans=3, temporal_patch_size=2),
        image_token_id=tiny.image_token_id, video_token_id=tiny.video_token_id,
        vision_start_token_id=tiny.vision_start_token_id, vision_end_token_id=tiny.vision_end_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2VLForConditionalGeneration(cfg).to(torch.bfloat16)
    model.generation_config.eos_token_id = tiny.text_config.eos_token_id
    model.save_pretrained(out)
    return out


def bench_transformers(model: str, imgs: list[bytes], max_new_tokens: int, device: str, threads: int) -> dict:
    from inference.backends import Sampling, load_backend

    t0 = time.perf_counter()
    be = load_backend("transformers", model, device=device, cpu_threads=threads)
    load_s = time.perf_counter() - t0
    reqs = requests(imgs)
    be.generate(reqs[:2], Sampling(0.0, 1.0, max_new_tokens))          # warm-up
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
    t0 = time.perf_counter()
    gens = be.generate(reqs, Sampling(0.0, 1.0, max_new_tokens))
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(g[0].tokens for g in gens)
    return {"device": be.device, "load_s": load_s, "captions": len(gens), "seconds": dt,
            "captions_per_s": len(gens) / dt, "tokens_per_s": tokens / dt, "mean_tokens": tokens / len(gens)}


def bench_vllm_requests(model: str, imgs: list[bytes], rounds: int = 3) -> dict:
    """``VllmBackend.build`` with the real processor and a stand-in ``vllm`` (no engine)."""
    from inference.backends import Sampling, VllmBackend

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw

    class LLM:
        def __init__(self, model, **kw):
            pass

    saved = sys.modules.get("vllm")
    sys.modules["vllm"] = types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams)
    try:
        be = VllmBackend(model)
        reqs = requests(imgs)
        be.build(reqs[:2], Sampling(0.0, 1.0, 64))
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            inputs, params, errors = be.build(reqs, Sampling(0.0, 1.0, 64))
            best = min(best, time.perf_counter() - t0)
        assert len(inputs) == len(reqs) and not any(errors)
    finally:
        if saved is None:
            sys.modules.pop("vllm", None)
        else:
            sys.modules["vllm"] = saved
    return {"requests": len(reqs), "seconds": best, "requests_per_s": len(reqs) / best}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", help="an HF VLM folder (default: a tiny random Qwen2-VL built here)")
    ap.add_argument("--size", choices=["tiny", "2b"], default="tiny")
    ap.add_argument("--images", type=int)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (a recaption task's cpu_threads)")
    a = ap.parse_args(argv)
    n = a.images or (8 if a.quick else 32)
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if model is None:
            from demo.tiny_vlm import build_tiny_vlm

            model = str(build_2b(Path(tmp) / "vlm") if a.size == "2b" else build_tiny_vlm(Path(tmp) / "vlm"))
        imgs = images(n)
        t = bench_transformers(model, imgs, a.max_new_tokens, a.device, a.threads)
        v = bench_vllm_requests(model, imgs)
    name = a.model or f"random Qwen2-VL ({a.size})"
    print(f"\n### recaption generation: {n} images × {len(PROMPTS)} languages, max_new_tokens {a.max_new_tokens}, "
          f"greedy, {name}\n")
    print("| backend | device | captions | s | captions/s | tokens/s | mean tokens |\n"
          "| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    print(f"| transformers (one seeded generate per request) | {t['device']}"
          f"{f' ({a.threads} thread)' if t['device'] == 'cpu' else ''} | {t['captions']} | {t['seconds']:.2f} | "
          f"{t['captions_per_s']:.2f} | {t['tokens_per_s']:.1f} | {t['mean_tokens']:.1f} |")
    print(f"\nmodel load: {t['load_s']:.2f} s\n")
    print("| vLLM request building (stand-in engine) | requests | s | requests/s |\n| --- | ---: | ---: | ---: |")
    print(f"| chat template + image decode + SamplingParams | {v['requests']} | {v['seconds']:.3f} | "
          f"{v['requests_per_s']:,.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
