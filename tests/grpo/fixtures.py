"""Small things the GRPO tests build for themselves: a word-level causal LM whose vocabulary is a dozen words (so a
random policy samples the rewarded word often enough for a group to disagree), and an export step's verl split
written in the export's own schema."""
from __future__ import annotations

from pathlib import Path

WORDS = ["yes", "no", "red", "blue", "maybe", "cat", "dog", "one", "two", "three"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def word_lm(out: Path, seed: int = 0, hidden: int = 32) -> Path:
    """A random 1-layer Qwen3 over a word-level tokenizer (WORDS + the chat specials), saved as an HF folder."""
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


def write_split(run: Path, split: str, rows: list[dict], export_step: str = "export") -> Path:
    """``RUN/<export_step>/verl/<split>.parquet`` in the export's schema (``rl_select.export``): rows of
    ``{question, answer, answer_type}`` (+ ``images``: list of encoded bytes)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rl_select.export import ExportConfig, _verl_row, verl_schema

    out = Path(run) / export_step / "verl"
    out.mkdir(parents=True, exist_ok=True)
    table = []
    for i, r in enumerate(rows):
        p = {"prompt_id": f"{i:016x}", "source": "test", "question": r["question"], "images": r.get("images") or [],
             "category": "test", "ground_truth": r["answer"], "answer_type": r.get("answer_type", "string"),
             "extra": r.get("extra") or "{}", "split": split}
        table.append(_verl_row(i, p, False, ExportConfig()))
    path = out / f"{split}.parquet"
    pq.write_table(pa.Table.from_pylist(table, schema=verl_schema(False)), path)
    return path
