"""The vLLM backend's request building, against a stand-in ``vllm`` module (no GPU here): one
request per prompt and template, SamplingParams(n=N), PIL images as multi_modal_data, rows back."""
import io
import json
import sys
import types

from PIL import Image

from ovpipe.step import Stats
from rl_select.rollout import TEMPLATES, RolloutConfig, rollouts_file, rollouts_vllm


def png(color):
    b = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(b, format="PNG")
    return b.getvalue()


def test_vllm_requests(monkeypatch):
    seen = {}

    class SamplingParams:
        def __init__(self, **kw):
            seen["sampling"] = kw
            self.n = kw["n"]

    class LLM:
        def __init__(self, model, **kw):
            seen["llm"] = (model, kw)

        def generate(self, inputs, sp):
            seen["inputs"] = inputs
            out = types.SimpleNamespace
            return [out(outputs=[out(text=f"<answer>{j}</answer>", token_ids=[1, 2, 3]) for j in range(sp.n)])
                    for _ in inputs]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams))

    class Processor:
        def apply_chat_template(self, messages, add_generation_prompt):
            content = messages[0]["content"]
            return "".join("<|image|>" if c["type"] == "image" else c["text"] for c in content)

    import transformers

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", staticmethod(lambda m: Processor()))
    prompts = [{"prompt_id": "a" * 16, "question": "<image>How many?", "images": [png("red")]},
               {"prompt_id": "b" * 16, "question": "Text only?", "images": []}]
    cfg = RolloutConfig(backend="vllm", model="some/vlm", n=4, prompt_types=["answer_only", "thinking"],
                        temperature=0.7, max_new_tokens=64, seed=3)
    rows = rollouts_vllm(prompts, cfg, Stats())
    assert seen["sampling"] == {"n": 4, "temperature": 0.7, "top_p": 1.0, "max_tokens": 64, "seed": 3}
    assert len(seen["inputs"]) == 4                                        # 2 prompts × 2 templates
    first = seen["inputs"][0]
    assert first["prompt"].startswith("<|image|>How many?") and "<image>" not in first["prompt"]
    assert first["prompt"].endswith(TEMPLATES["answer_only"].split("\n", 1)[1])
    assert len(first["multi_modal_data"]["image"]) == 1 and first["multi_modal_data"]["image"][0].size == (8, 8)
    assert "multi_modal_data" not in seen["inputs"][2]                     # text-only prompt
    assert len(rows) == 16
    a = [r for r in rows if r["prompt_id"] == "a" * 16]
    assert [r["rollout_idx"] for r in a] == list(range(8))                 # unique across templates
    assert [r["prompt_type"] for r in a] == ["answer_only"] * 4 + ["thinking"] * 4
    assert all(r["tokens"] == 3 for r in rows)


def test_file_backend_counts_bad_lines(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text("\n".join([json.dumps({"prompt_id": "p1", "response": "x"}), "{not json",
                            json.dumps({"prompt_id": "p1", "response": "y", "prompt_type": "thinking"}),
                            json.dumps({"prompt_id": "other", "response": "z"})]) + "\n")
    stats = Stats()
    rows = rollouts_file([{"prompt_id": "p1"}], RolloutConfig(backend="file", file=str(f)), stats)
    assert [(r["rollout_idx"], r["prompt_type"], r["response"]) for r in rows] == [
        (0, "answer_only", "x"), (1, "thinking", "y")]
    assert stats.counters["file/bad_json"] == 1 and stats.counters["file/other_prompt"] == 1
