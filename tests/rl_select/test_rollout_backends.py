"""Rollout backends. The shared VLM backend (``inference.backends``) with a tiny random Qwen2-VL the
test builds: the images really go through the processor (pixel values and grids reach ``generate``),
N seeded responses per prompt, the same for any batch. The vLLM backend's request building, against
a stand-in ``vllm`` module (no GPU here): one request per prompt and template, one
``SamplingParams(n=N, seed=…)`` per request, PIL images as multi_modal_data, rows back."""
import io
import json
import sys
import types

import pytest
from PIL import Image

from ovpipe.step import Stats
from rl_select.rollout import (TEMPLATES, RolloutConfig, file_rollouts, open_file, prompt_seed, requests_for,
                               rollouts_generate)


def png(color, size=(8, 8)):
    b = io.BytesIO()
    Image.new("RGB", size, color).save(b, format="PNG")
    return b.getvalue()


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from demo.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-vlm")


def test_vllm_requests(monkeypatch):
    seen = {}

    class SamplingParams:
        def __init__(self, **kw):
            seen.setdefault("sampling", []).append(kw)
            self.n = kw["n"]

    class LLM:
        def __init__(self, model, **kw):
            seen["llm"] = (model, kw)

        def generate(self, inputs, params):
            seen["inputs"] = inputs
            out = types.SimpleNamespace
            return [out(outputs=[out(text=f"<answer>{j}</answer>", token_ids=[1, 2, 3], finish_reason="stop")
                                 for j in range(sp.n)]) for sp in params]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams))

    class Processor:
        def apply_chat_template(self, messages, add_generation_prompt):
            content = messages[0]["content"]
            return "".join("<|image|>" if c["type"] == "image" else c["text"] for c in content)

    import transformers

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", staticmethod(lambda m, **kw: Processor()))
    prompts = [{"prompt_id": "a" * 16, "question": "<image>How many?", "images": [png("red")]},
               {"prompt_id": "b" * 16, "question": "Text only?", "images": []}]
    cfg = RolloutConfig(backend="vllm", model="some/vlm", n=4, prompt_types=["answer_only", "thinking"],
                        temperature=0.7, max_new_tokens=64, seed=3)
    rows = rollouts_generate(prompts, cfg, Stats())
    assert seen["llm"][0] == "some/vlm" and seen["llm"][1]["trust_remote_code"] is True
    assert len(seen["sampling"]) == 4                                      # one per request
    base = prompt_seed(3, "a" * 16)
    assert seen["sampling"][0] == {"n": 4, "temperature": 0.7, "top_p": 1.0, "max_tokens": 64, "seed": base}
    assert seen["sampling"][1]["seed"] == base + 4                         # the second template's offset
    assert len(seen["inputs"]) == 4                                        # 2 prompts × 2 templates
    first = seen["inputs"][0]
    assert "<|image|>How many?" in first["prompt"] and "<image>" not in first["prompt"]
    assert TEMPLATES["answer_only"].split("\n", 1)[0] + "\n<|image|>How many?" in first["prompt"]   # recipe order
    assert len(first["multi_modal_data"]["image"]) == 1 and first["multi_modal_data"]["image"][0].size == (8, 8)
    assert "multi_modal_data" not in seen["inputs"][2]                     # text-only prompt
    assert len(rows) == 16
    a = [r for r in rows if r["prompt_id"] == "a" * 16]
    assert [r["rollout_idx"] for r in a] == list(range(8))                 # unique across templates
    assert [r["prompt_type"] for r in a] == ["answer_only"] * 4 + ["thinking"] * 4
    assert all(r["tokens"] == 3 for r in rows)


def test_transformers_vlm_passes_images_through_the_processor(tiny_vlm):
    from inference.backends import load_backend

    backend = load_backend("transformers", str(tiny_vlm), cpu_threads=1)
    seen = []
    generate = backend.model.generate

    def spy(**kw):
        seen.append({k: tuple(v.shape) for k, v in kw.items() if hasattr(v, "shape")})
        return generate(**kw)

    backend.model.generate = spy
    prompts = [{"prompt_id": "a" * 16, "question": "<image>How many circles?", "images": [png("red", (64, 48))]},
               {"prompt_id": "b" * 16, "question": "Text only?", "images": []}]
    cfg = RolloutConfig(backend="transformers", model=str(tiny_vlm), n=3, max_new_tokens=6, seed=1)
    rows = rollouts_generate(prompts, cfg, Stats(), backend=backend)
    assert len(rows) == 6 and all(0 < r["tokens"] <= 6 for r in rows)
    assert "pixel_values" in seen[0] and seen[0]["image_grid_thw"] == (1, 3)   # the image, really encoded
    image_pad = backend.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    grid = 4 * 4 // 4           # 64×48 → smart_resize to 56×56 → 4×4 patches → 2×2 merged tokens
    assert "pixel_values" not in seen[1]
    # the prompt holds the processor's expansion of the image, not a "<image>" text placeholder
    req = requests_for(prompts[:1], cfg)[0][0]
    assert int((backend.inputs(req)["input_ids"] == image_pad).sum()) == grid
    assert "<image>" not in backend.prompt(req) and "<|vision_start|>" in backend.prompt(req)
    # seeded per request: the same rollouts when the prompt runs alone (another rank, another batch)
    again = rollouts_generate(prompts[:1], cfg, Stats(), backend=backend)
    assert again == rows[:3]


def test_transformers_text_only_model_refuses_images(tmp_path):
    from demo.rl import build_tiny_model

    lm = build_tiny_model(tmp_path / "lm")
    cfg = RolloutConfig(backend="transformers", model=str(lm), n=2, max_new_tokens=4)
    rows = rollouts_generate([{"prompt_id": "c" * 16, "question": "What is 2+2?", "images": []}], cfg, Stats())
    assert len(rows) == 2                                                  # text-only prompts still work
    with pytest.raises(RuntimeError, match="no image processor"):
        rollouts_generate([{"prompt_id": "d" * 16, "question": "<image>Count.", "images": [png("red")]}], cfg, Stats())


def test_file_backend_counts_bad_lines(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text("\n".join([json.dumps({"prompt_id": "p1", "response": "x"}), "{not json",
                            json.dumps({"prompt_id": "p1", "response": "y", "prompt_type": "thinking"}),
                            json.dumps({"prompt_id": "other", "response": "z"})]) + "\n")
    stats = Stats()
    cfg = RolloutConfig(backend="file", file=str(f))
    with open_file(cfg, {"p1"}, stats) as canned:
        rows = file_rollouts(canned, [{"prompt_id": "p1"}])
    assert [(r["rollout_idx"], r["prompt_type"], r["response"]) for r in rows] == [
        (0, "answer_only", "x"), (1, "thinking", "y")]
    assert stats.counters["file/bad_json"] == 1 and stats.counters["file/other_prompt"] == 1


def published_llava_ov_folder(out):
    """A tiny random LLaVAOneVision1_5_ForConditionalGeneration in the published on-disk layout, as
    `ovpipe export-model` writes it: official config + auto_map + modeling files, `visual.*` / `model.*`
    safetensors names, the training tokenizer and a Qwen2.5-VL processor."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from packing.image_tokens import ImageTokenConfig
    from packing.tiny_tokenizer import build_tiny_tokenizer
    from llava_ov import official
    from llava_ov.convert import config_dict
    from llava_ov.export import save_processor
    from pretrain.recipes import RECIPES

    out.mkdir(parents=True)
    tok = build_tiny_tokenizer(["How many circles?", "<answer>3</answer>"], out / "tok", 400)
    cfg = config_dict(RECIPES["tiny"], tok)
    mod = official.load()
    torch.manual_seed(0)
    model = mod.LLaVAOneVision1_5_ForConditionalGeneration(
        mod.configuration.Llavaonevision1_5Config(**{k: v for k, v in cfg.items() if k != "architectures"}))
    on_disk = {(k.replace("model.visual.", "visual.", 1) if k.startswith("model.visual.")
                else k.replace("model.language_model.", "model.", 1)): v.contiguous().clone()
               for k, v in model.state_dict().items()}
    folder = out / "hf"
    folder.mkdir()
    save_file(on_disk, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for f in official.files():
        shutil.copy2(f, folder / f.name)
    (folder / "config.json").write_text(json.dumps({**cfg, "auto_map": dict(official.AUTO_MAP)}))
    save_processor(folder, tok, ImageTokenConfig(min_pixels=56 * 56, max_pixels=224 * 224))
    return folder


def test_transformers_backend_loads_the_published_llava_onevision_layout(tmp_path):
    """Our own exported architecture (trust_remote_code, AutoModelForCausalLM via auto_map): the weights
    that load are the checkpoint's (the class's key mapping applied, not random), and rollouts run with
    the image through the processor."""
    import torch

    from llava_ov import official

    if official.files() is None:
        pytest.skip("lmms-engine (the official modeling files) is not installed")
    from inference.backends import load_backend

    folder = published_llava_ov_folder(tmp_path / "ov")
    backend = load_backend("transformers", str(folder), cpu_threads=1)
    assert type(backend.model).__name__ == "LLaVAOneVision1_5_ForConditionalGeneration" and backend.vision
    ref = official.from_pretrained(folder).state_dict()
    got = backend.model.state_dict()
    assert set(ref) <= set(got) and all(torch.equal(ref[k], got[k]) for k in ref)
    cfg = RolloutConfig(backend="transformers", model=str(folder), n=2, max_new_tokens=4, seed=0)
    rows = rollouts_generate([{"prompt_id": "e" * 16, "question": "<image>How many circles?",
                               "images": [png("red", (64, 64))]}], cfg, Stats(), backend=backend)
    assert len(rows) == 2 and all(0 < r["tokens"] <= 4 for r in rows)


def test_a_checkpoint_missing_weights_is_refused(tiny_vlm, tmp_path):
    """Never generate from randomly initialised weights: a folder whose safetensors lack a parameter fails."""
    import shutil

    from safetensors.torch import load_file, save_file

    from inference.backends import load_backend

    folder = tmp_path / "broken"
    shutil.copytree(tiny_vlm, folder)
    weights = load_file(str(folder / "model.safetensors"))
    dropped = sorted(k for k in weights if "layers.1." in k)[0]
    save_file({k: v for k, v in weights.items() if k != dropped}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="not in the checkpoint"):
        load_backend("transformers", str(folder))
