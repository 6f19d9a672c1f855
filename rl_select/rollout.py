"""``rollout``: N responses per prompt, with the recipe's two prompt templates.

Backends (``backend``):

* ``vllm`` (GPU): ``LLM(model)`` + ``SamplingParams(n=N, …)``, the prompt rendered by the model's
  processor chat template with one image part per image and the PIL images passed as
  ``multi_modal_data`` — the path for real VLM rollouts at scale;
* ``transformers`` (CPU or GPU): ``generate(num_return_sequences=N, do_sample=True)``. Text-only:
  ``<image>`` placeholders stay in the prompt as text (the demo's tiny model has no vision tower);
* ``file``: import rollouts produced elsewhere, JSONL rows ``{"prompt_id", "response",
  ["prompt_type"], ["rollout_idx"], ["model"]}``.

Every row records the backend, the model id and the sampling parameters (JSON). ``rollout_idx``
is unique per prompt across templates (answer-only first). Sampling is seeded per prompt
(``seed ⊕ prompt_id``), so a prompt's rollouts do not depend on which rank drew it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from ovpipe.config import check_range
from ovpipe.step import Step, TaskContext

TEMPLATES = {
    "answer_only": "{question}\nPut ONLY your final answer within <answer></answer>.",
    "thinking": ("{question}\nYou FIRST think about the reasoning process as an internal monologue and then "
                 "provide the final answer. The reasoning process MUST BE enclosed within <think> </think> tags. "
                 "The final answer MUST BE put in <answer></answer>."),
}


@dataclass
class RolloutConfig:
    backend: Literal["vllm", "transformers", "file"] = "transformers"
    model: str = ""
    file: str = ""
    n: int = 8
    prompt_types: list[str] = field(default_factory=lambda: ["answer_only"])
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    seed: int = 0
    device: str = "auto"          # transformers backend: "auto" (cuda when available), "cpu", "cuda", "cuda:1", ...
    dtype: str = "auto"           # transformers backend: "auto" (bf16 on cuda, fp32 on cpu), "float32", "bfloat16"
    cpu_threads: int = 0          # transformers on CPU: torch threads per task (0 = torch's default); 1 when
                                  # several tasks share few cores, else they oversubscribe them

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        bad = [t for t in self.prompt_types if t not in TEMPLATES]
        if bad or not self.prompt_types:
            raise ValueError(f"prompt_types: unknown {bad}; choose from {sorted(TEMPLATES)}")
        if self.backend == "file" and not self.file:
            raise ValueError("file: the JSONL of rollouts (backend=file)")
        if self.backend != "file" and not self.model:
            raise ValueError(f"model: a model path or id (backend={self.backend})")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: one of auto, float32, bfloat16, float16, got {self.dtype!r}")
        check_range(self, "temperature", 0)
        check_range(self, "top_p", 0, 1, lo_open=True)
        check_range(self, "max_new_tokens", 1)
        check_range(self, "seed", 0)
        check_range(self, "cpu_threads", 0)

    def sampling(self) -> str:
        return json.dumps({"n": self.n, "temperature": self.temperature, "top_p": self.top_p,
                           "max_new_tokens": self.max_new_tokens, "seed": self.seed, "dtype": self.dtype},
                          sort_keys=True)


def prompt_seed(seed: int, prompt_id: str) -> int:
    return (seed * 1_000_003 + int(prompt_id[:8], 16)) % (2 ** 31)


def rollouts_transformers(prompts: list[dict], cfg: RolloutConfig, stats) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    if device == "cpu" and cfg.cpu_threads > 0:
        torch.set_num_threads(cfg.cpu_threads)
    dtype = (torch.bfloat16 if device.startswith("cuda") else torch.float32) if cfg.dtype == "auto" \
        else getattr(torch, cfg.dtype)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()      # the task's own progress/log is enough
    tok = AutoTokenizer.from_pretrained(cfg.model)
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype).to(device)
    model.eval()
    stats.info["device"] = device
    rows = []
    for p in prompts:
        idx = 0
        for ptype in cfg.prompt_types:
            text = TEMPLATES[ptype].format(question=p["question"])
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True).to(device)
            torch.manual_seed(prompt_seed(cfg.seed, p["prompt_id"]) + idx)
            with torch.inference_mode():
                out = model.generate(**ids, do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p,
                                     max_new_tokens=cfg.max_new_tokens, num_return_sequences=cfg.n,
                                     pad_token_id=tok.pad_token_id or tok.eos_token_id)
            gen = out[:, ids["input_ids"].shape[1]:]
            for seq in gen:
                ntok = int((seq != (tok.pad_token_id if tok.pad_token_id is not None else -1)).sum())
                rows.append({"prompt_id": p["prompt_id"], "rollout_idx": idx, "prompt_type": ptype,
                             "response": tok.decode(seq, skip_special_tokens=True), "tokens": ntok})
                idx += 1
            stats.inc("generated", cfg.n)
    return rows


def rollouts_vllm(prompts: list[dict], cfg: RolloutConfig, stats) -> list[dict]:  # pragma: no cover - GPU
    import io

    from PIL import Image, ImageOps
    from transformers import AutoProcessor
    from vllm import LLM, SamplingParams

    processor = AutoProcessor.from_pretrained(cfg.model)
    llm = LLM(model=cfg.model, seed=cfg.seed, limit_mm_per_prompt={"image": 16})
    inputs, keys = [], []
    for p in prompts:
        for ptype in cfg.prompt_types:
            text = TEMPLATES[ptype].format(question=p["question"]).replace("<image>", "")
            content = [{"type": "image"} for _ in p["images"]] + [{"type": "text", "text": text}]
            prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
            mm = {"image": [ImageOps.exif_transpose(Image.open(io.BytesIO(b))).convert("RGB")
                                 for b in p["images"]]} if p["images"] else None
            inputs.append({"prompt": prompt, **({"multi_modal_data": mm} if mm else {})})
            keys.append((p["prompt_id"], ptype))
    sp = SamplingParams(n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_new_tokens,
                        seed=cfg.seed)
    rows, next_idx = [], {}
    for (pid, ptype), out in zip(keys, llm.generate(inputs, sp)):
        for o in out.outputs:
            i = next_idx.get(pid, 0)
            next_idx[pid] = i + 1
            rows.append({"prompt_id": pid, "rollout_idx": i, "prompt_type": ptype, "response": o.text,
                         "tokens": len(o.token_ids)})
        stats.inc("generated", len(out.outputs))
    return rows


def rollouts_file(prompts: list[dict], cfg: RolloutConfig, stats) -> list[dict]:
    want = {p["prompt_id"] for p in prompts}
    rows, next_idx = [], {}
    with open(cfg.file, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                stats.inc("file/bad_json")
                continue
            pid = r.get("prompt_id")
            if pid not in want:
                stats.inc("file/other_prompt")
                continue
            i = r.get("rollout_idx", next_idx.get(pid, 0))
            next_idx[pid] = max(next_idx.get(pid, 0), i + 1)
            rows.append({"prompt_id": pid, "rollout_idx": int(i), "prompt_type": r.get("prompt_type", "answer_only"),
                         "response": str(r.get("response", "")), "tokens": int(r.get("tokens", 0)),
                         "model": r.get("model")})
    return rows


def run(cfg: RolloutConfig, task: TaskContext) -> None:
    prompts = [p for p in task.read_input_slice("rl_prompts").to_pylist() if p["status"] == "ok"]
    fn = {"transformers": rollouts_transformers, "vllm": rollouts_vllm, "file": rollouts_file}[cfg.backend]
    with task.stats.timer("rollout"):
        rows = fn(prompts, cfg, task.stats)
    sampling = cfg.sampling()
    for r in rows:
        r["backend"] = cfg.backend
        r["model"] = r.get("model") or cfg.model or None
        r["sampling"] = sampling
    task.stats.inc("prompts", len(prompts))
    task.stats.inc("rollouts", len(rows))
    task.write_part("rollouts", rows)


STEP = Step("rollout", RolloutConfig, run, inputs=("rl_prompts",), outputs=("rollouts",),
            description="N rollouts per prompt (vLLM / transformers / file)")
