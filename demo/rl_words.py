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

from pathlib import Path

WORDS = ["yes", "no", "red", "blue", "maybe", "cat", "dog", "one", "two", "three"]
TRAIN_WORDS = ["yes", "no", "red", "blue", "cat", "dog"]
HELD_OUT_WORDS = ["maybe", "one", "two", "three"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def rows(words=TRAIN_WORDS) -> list[dict]:
    """``{question, answer, answer_type}`` rows, one per word."""
    return [{"question": f"say {w}", "answer": w, "answer_type": "string"} for w in words]


def word_lm(out: Path, seed: int = 0, hidden: int = 32) -> Path:
    """A random 1-layer Qwen3 over the word-level tokenizer, saved as an HF folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS + ["user", "assistant"])}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token="[UNK]", chat_template=CHAT)
    out = Path(out)
    tok.save_pretrained(out)
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                      eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"], bos_token_id=None,
                      tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg)
    model.generation_config.eos_token_id = vocab["<|im_end|>"]
    model.generation_config.pad_token_id = vocab["<|endoftext|>"]
    model.save_pretrained(out)
    return out


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
