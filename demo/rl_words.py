"""A word-copy task for the RL stage that a CPU trains in seconds, and that a random policy already solves often
enough for GRPO to have a gradient (the demo's tiny VLM, being random, never answers its visual questions).

The policy is a random one-layer Qwen3 over a word-level vocabulary of 16 tokens (10 words, 4 chat specials,
``user``, ``assistant``). A prompt is "say W"; the rewarded one-token answer is W (answer type ``string``). A random
policy says W with probability ≈ 1/16, so a group of 8 rollouts holds a correct one 40% of the time and a group of
16, 64% — the wider rollout pool Shuffle-R1 draws its pairs from. ``TRAIN_WORDS`` are the prompts trained on,
``HELD_OUT_WORDS`` prompts never seen in training (copying W from the prompt generalises to them; memorising
"say yes → yes" does not).

``pass_at_1`` is exact: a one-token completion at temperature 1 is correct with probability p(W | prompt), read
from the model's logits — no sampling noise in the figure.
"""
from __future__ import annotations

from demo.word_lm import WORDS, word_lm  # noqa: F401  (the policy this task trains)

TRAIN_WORDS = ["yes", "no", "red", "blue", "cat", "dog"]
HELD_OUT_WORDS = ["maybe", "one", "two", "three"]
assert set(TRAIN_WORDS) | set(HELD_OUT_WORDS) == set(WORDS)


def rows(words=TRAIN_WORDS) -> list[dict]:
    """``{question, answer, answer_type}`` rows, one per word."""
    return [{"question": f"say {w}", "answer": w, "answer_type": "string"} for w in words]


def pass_at_1(model_dir, prompts: list[str], answers: list[str]) -> float:
    """Mean over prompts of p(answer | chat-templated prompt): a one-token completion's exact pass@1."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total = 0.0
    for prompt, answer in zip(prompts, answers):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        (a,) = tok(answer, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        total += float(torch.softmax(logits, -1)[a])
    return total / len(prompts)
