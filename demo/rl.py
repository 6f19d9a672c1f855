"""Demo data for the RL stage (nothing downloaded).

    python -m demo.rl prompts    --out DIR        # geometry3k-style parquet of the demo's answer-only questions
    python -m demo.rl tiny-model --out DIR        # a tiny random Qwen3 LM + tokenizer, saved

The prompts ask what stage 2 of the demo's pretraining teaches in the recipe's answer-only format
(``demo.conversations.ANSWER_SKILLS``: the colour of one shape, the number of shapes, 1–5), on fresh
draws of the same renderer, so the demo's own exported VLM answers some of them: ``rollout`` samples
it, ``score`` checks the answers, ``select`` keeps the prompts it solves only sometimes. Two sources:
``demo-visual-qa`` (what selection may keep, and GRPO trains on) and ``demo-visual-qa-heldout``
(the same skills, other draws: ``select``'s ``held_out_sources`` measures them and never keeps them, so
a trained model's pass@1 on them says whether what GRPO taught carries over).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

SOURCE, HELDOUT_SOURCE = "demo-visual-qa", "demo-visual-qa-heldout"
ANSWER_TYPES = {"color": "string", "count": "number"}


def _prompts(n: int, rng: np.random.Generator, source: str) -> list[dict]:
    from demo.conversations import ANSWER_SKILLS, answer_question

    skills = list(ANSWER_SKILLS)
    rows = []
    for i in range(n):
        skill = skills[i % len(skills)]
        question, answer, image = answer_question(skill, rng)
        rows.append({"images": [{"bytes": image, "path": None}], "problem": "<image>\n" + question, "answer": answer,
                     "answer_type": ANSWER_TYPES[skill], "category": skill, "source": source})
    return rows


def make_prompts(n: int = 48, n_heldout: int = 24, seed: int = 0) -> list[dict]:
    """``n`` prompts to select from and ``n_heldout`` held out, skills alternating, each set from its own
    RNG stream (``[seed, 62, 1]``, ``[seed, 62, 2]``: neither shares a draw with the instruction set's
    ``[seed, 62]``), plus one broken row (two placeholders, one image) that ingest marks."""
    rows = _prompts(n, np.random.default_rng([seed, 62, 1]), SOURCE)
    rows += _prompts(n_heldout, np.random.default_rng([seed, 62, 2]), HELDOUT_SOURCE)
    rows.append({"images": [{"bytes": rows[0]["images"][0]["bytes"], "path": None}],
                 "problem": "<image><image>Compare the two images.", "answer": "same", "answer_type": "string",
                 "category": "comparison", "source": SOURCE})
    return rows


def write_prompts(out: Path, n: int = 48, n_heldout: int = 24, seed: int = 0) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    path = out / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(make_prompts(n, n_heldout, seed)), path)
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


def grpo_stages(run_dir: Path, export_step: str = "export") -> list[str]:
    """The recipe's stages whose split the export wrote (a demo whose model kept no prompt of a split trains only
    the other; none kept: nothing to train)."""
    from grpo.step import STAGES

    verl = Path(run_dir) / export_step / "verl"
    return [s for s, d in STAGES.items() if (verl / f"{d['split']}.parquet").exists()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["prompts", "tiny-model", "grpo-stages"])
    ap.add_argument("--out")
    ap.add_argument("--run-dir", help="grpo-stages: the run whose export is read")
    ap.add_argument("--n", type=int, default=48, help="prompts: how many selection may keep")
    ap.add_argument("--n-heldout", type=int, default=24, help="prompts: how many are held out")
    a = ap.parse_args(argv)
    if a.what == "grpo-stages":          # `[answer_only, cot]` for --set stages=…, or nothing
        stages = grpo_stages(Path(a.run_dir))
        print(f"[{', '.join(stages)}]" if stages else "")
        return 0
    if not a.out:
        ap.error(f"{a.what} needs --out")
    if a.what == "prompts":
        print(write_prompts(Path(a.out), a.n, a.n_heldout))
    else:
        if not (Path(a.out) / "config.json").exists():
            build_tiny_model(Path(a.out))
        print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
