"""Demo data for the RL stage (nothing downloaded).

    python -m demo.rl prompts    --out DIR        # geometry3k-style parquet of small visual questions
    python -m demo.rl tiny-model --out DIR        # a tiny random Qwen3 LM + tokenizer, saved
    python -m demo.rl simulate   --run-dir RUN --out FILE --n 8
        # a rollouts JSONL from a simulated policy with a known success rate per prompt, so
        # that selection on the demo has easy, hard and "latent capability" prompts to find

The tiny model really generates on the CPU (``rollout --backend transformers``); being random it
never answers correctly, which is exactly what selection should call ``too_hard``.
"""
from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import numpy as np


def _png(draw_fn, size=(96, 96)) -> bytes:
    from PIL import Image, ImageDraw

    im = Image.new("RGB", size, (240, 240, 235))
    draw_fn(ImageDraw.Draw(im))
    b = io.BytesIO()
    im.save(b, format="PNG")
    return b.getvalue()


def make_prompts(n: int = 24, seed: int = 0) -> list[dict]:
    from demo.corpus import COLORS, draw_shape

    rng = np.random.default_rng(seed)
    colors = list(COLORS)
    rows = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            k = int(rng.integers(1, 6))
            col = colors[int(rng.integers(len(colors)))]
            img = _png(lambda d: [draw_shape(d, "circle", COLORS[col], 12 + 18 * j, 48, 8) for j in range(k)])
            rows.append({"images": [{"bytes": img, "path": None}], "problem": f"<image>How many {col} circles are there?",
                         "answer": str(k), "category": "counting"})
        elif kind == 1:
            a, b = int(rng.integers(2, 50)), int(rng.integers(2, 50))
            img = _png(lambda d: d.text((10, 40), f"{a} + {b}", fill=(0, 0, 0)))
            rows.append({"images": [{"bytes": img, "path": None}], "problem": "<image>Compute the sum shown.",
                         "answer": str(a + b), "category": "arithmetic"})
        else:
            x = int(rng.integers(1, 9))
            img = _png(lambda d: d.text((10, 40), f"2x = {2 * x}", fill=(0, 0, 0)))
            rows.append({"images": [{"bytes": img, "path": None}], "problem": "Solve for x in the equation shown.",
                         "answer": f"{x}", "category": "algebra"})
    # one broken row: two placeholders, one image
    rows.append({"images": [{"bytes": rows[0]["images"][0]["bytes"], "path": None}],
                 "problem": "<image><image>Compare the two images.", "answer": "same",
                 "category": "comparison"})
    return rows


def write_prompts(out: Path, n: int = 24, seed: int = 0) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    path = out / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(make_prompts(n, seed)), path)
    return path


def build_tiny_model(out: Path, texts: list[str] | None = None) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from packing.tiny_tokenizer import build_tiny_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(texts or [r["problem"] for r in make_prompts()] + ["<answer>42</answer>"], out, 400)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=True)
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    return out


def simulate_rollouts(run_dir: Path, out: Path, n: int = 8, seed: int = 0) -> dict:
    """Per prompt a success probability from {0, 0.1, 0.3, 0.6, 1.0}; n answer-only + n thinking rollouts."""
    from manifests import read_manifest

    rng = np.random.default_rng(seed)
    prompts = [p for p in read_manifest(run_dir, "rl_prompts").to_pylist() if p["status"] == "ok"]
    levels = [0.0, 0.1, 0.3, 0.6, 1.0]
    truth = {}
    with open(out, "w") as f:
        for j, p in enumerate(prompts):
            rate = levels[j % len(levels)]
            truth[p["prompt_id"]] = rate
            idx = 0
            for ptype in ("answer_only", "thinking"):
                for _ in range(n):
                    ok = rng.random() < rate
                    ans = p["ground_truth"] if ok else str(int(rng.integers(100, 999)))
                    body = f"<answer>{ans}</answer>" if ptype == "answer_only" else \
                        f"<think>Let me look at the image carefully.</think><answer>{ans}</answer>"
                    f.write(json.dumps({"prompt_id": p["prompt_id"], "rollout_idx": idx, "prompt_type": ptype,
                                        "response": body, "model": "simulated-policy"}) + "\n")
                    idx += 1
    return truth


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["prompts", "tiny-model", "simulate"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--run-dir")
    ap.add_argument("--n", type=int, default=8)
    a = ap.parse_args(argv)
    if a.what == "prompts":
        print(write_prompts(Path(a.out)))
    elif a.what == "tiny-model":
        if not (Path(a.out) / "config.json").exists():
            build_tiny_model(Path(a.out))
        print(a.out)
    else:
        simulate_rollouts(Path(a.run_dir), Path(a.out), a.n)
        print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
