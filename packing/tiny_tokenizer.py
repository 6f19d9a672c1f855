"""A tiny Qwen-style tokenizer for the demo and the tests (nothing is downloaded).

A byte-level BPE trained on the demo captions with the Qwen2-VL special tokens and a
Qwen-style chat template, saved with ``save_pretrained`` and loaded back with
``AutoTokenizer.from_pretrained(path)`` — the same code path a real Qwen3 tokenizer takes.

    python -m packing.tiny_tokenizer --out RUN/tokenizer --run-dir RUN
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Iterable

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_tokenizer(texts: Iterable[str], out: Path, vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    base = ["Describe the image.", "What objects are in the image? Answer with a short sentence.",
            "user", "assistant", "system"]
    tok.train_from_iterator([*base, *texts], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL[1:])
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return fast


def build_qwen_style_tokenizer(texts: Iterable[str], out: Path, vocab_size: int, chat_template: str = CHAT_TEMPLATE):
    """A byte-level BPE with Qwen2's own pre-tokenizer (regex Split + ByteLevel) and NFC — the
    pipeline of the real Qwen2/2.5/3 tokenizers — saved to ``out`` (tests and benches)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from packing.word_counts import _QWEN2

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(texts), trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                                             show_progress=False,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL[1:])
    fast.chat_template = chat_template
    Path(out).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return fast


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--run-dir", help="train on the conversation texts of every samples manifest of this run")
    p.add_argument("--vocab-size", type=int, default=512)
    a = p.parse_args(argv)
    texts: list[str] = []
    if a.run_dir:
        from manifests import read_manifest

        t = read_manifest(a.run_dir, "samples", columns=["conversation", "status"])
        texts = [turn["text"].replace("<image>", "") for conv, s in
                 zip(t.column("conversation").to_pylist(), t.column("status").to_pylist())
                 if s == "ok" for turn in conv or [] if turn["text"]]
    if (Path(a.out) / "tokenizer.json").exists():
        print(f"tokenizer exists: {a.out}")
        return 0
    build_tiny_tokenizer(texts, Path(a.out), a.vocab_size)
    print(f"tiny tokenizer ({a.vocab_size} ids) trained on {len(texts)} conversation turns → {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
