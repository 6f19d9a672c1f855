"""``rollout``: N responses per prompt, with the recipe's two prompt templates.

Backends (``backend``) — ``transformers`` and ``vllm`` are the shared VLM generation backend
(``inference.backends``, also behind ``recaption``):

* ``vllm`` (GPU): ``LLM(model)`` once + one ``SamplingParams(n=N, seed=…)`` per request, the prompt
  rendered by the model's processor chat template with one image part per image and the PIL images
  passed as ``multi_modal_data`` — the path for real VLM rollouts at scale;
* ``transformers`` (CPU or GPU): any Hugging Face VLM folder (ovpipe's exported
  ``LLaVAOneVision1_5_ForConditionalGeneration`` folder included): ``AutoProcessor`` +
  ``AutoModelForImageTextToText`` (or ``AutoModelForCausalLM``), the images really passed through the
  processor, ``generate(num_return_sequences=N, do_sample=True)`` seeded per request. A text-only LM
  folder serves text-only prompts; a prompt with images needs a VLM (the task fails, naming it);
* ``file``: import rollouts produced elsewhere, JSONL rows ``{"prompt_id", "response",
  ["prompt_type"], ["rollout_idx"], ["model"]}`` (the selection-rule demo's simulated policy).

Every row records the backend, the model id and the sampling parameters (JSON). ``rollout_idx``
is unique per prompt across templates (answer-only first). Sampling is seeded per request
(``seed ⊕ prompt_id`` + template offset), so a prompt's rollouts do not depend on which rank drew it.

Resumable per rank, through the chunked-generation primitive ``recaption`` shares (``inference.chunked``):
the rank's ok prompts are cut into chunks of ``chunk_size``, and each chunk's rollouts are written,
atomically, to ``RUN/<step>/chunks/{rank:05d}/chunk-{k:06d}-{key}.parquet`` as soon as they are generated
(``key``: a hash of the chunk's prompt ids and of the config). A rank restarted after a kill or a Slurm
pre-emption keeps every chunk of its plan that is there and whole, and generates the rest: a pre-empted
task loses one chunk, not its slice. The chunks are streamed into the rank's ``rollouts`` part (a task holds
one chunk), and ``finalize`` removes them. What stays here: the templates, a prompt → its requests, the
``file`` backend's row → rollout, and the rows' backend, model and sampling.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from ovpipe.config import check_range
from inference.backends import check_backend_fields, check_backend_runtime
from ovpipe.step import Step, TaskContext

# the recipe's two prompts (LLaVA-OneVision-1.5-RL dataset/dataset.py: the instruction, a newline, the problem;
# `prompt_type: normal` gets the answer-only one)
THINKING_PROMPT = ("Think and solve the following question step by step. Please put your thinking and analysis "
                   "procedure within <think></think>. Put ONLY your final answer within <answer></answer>.")
ANSWER_ONLY_PROMPT = "Put ONLY your final answer within <answer></answer>."
TEMPLATES = {
    "answer_only": ANSWER_ONLY_PROMPT + "\n{question}",
    "thinking": THINKING_PROMPT + "\n{question}",
}


@dataclass
class RolloutConfig:
    # the engine: vllm (GPU), transformers, or responses from a file
    backend: Literal["vllm", "transformers", "file"] = "transformers"
    model: str = ""  # HF model folder or id (the demo: the exported stage-2 VLM)
    file: str = ""  # backend=file: the responses JSONL
    n: int = 8  # responses per prompt
    # answer_only and/or thinking (chain-of-thought) prompt templates
    prompt_types: list[str] = field(default_factory=lambda: ["answer_only"])
    temperature: float = 1.0  # sampling temperature
    top_p: float = 1.0  # nucleus sampling
    max_new_tokens: int = 512  # the longest response, in tokens
    seed: int = 0  # the sampling seed (per prompt and rollout index)
    device: str = "auto"          # transformers backend: "auto" (cuda when available), "cpu", "cuda", "cuda:1", ...
    dtype: str = "auto"           # transformers backend: "auto" (bf16 on cuda, fp32 on cpu), "float32", "bfloat16"
    cpu_threads: int = 0          # transformers on CPU: torch threads per task (0 = torch's default); 1 when
                                  # several tasks share few cores, else they oversubscribe them
    vllm_engine_args: dict[str, Any] = field(default_factory=dict)  # vllm backend: more LLM(...) arguments, e.g.
                                  # {tensor_parallel_size: 2, model_impl: transformers, max_model_len: 8192}
    chunk_size: int = 64          # prompts per written chunk: what a pre-empted task loses, and what it holds

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        bad = [t for t in self.prompt_types if t not in TEMPLATES]
        if bad or not self.prompt_types:
            raise ValueError(f"prompt_types: unknown {bad}; choose from {sorted(TEMPLATES)}")
        check_backend_fields(self, "rollouts")
        check_range(self, "temperature", 0)
        check_range(self, "top_p", 0, 1, lo_open=True)
        check_range(self, "max_new_tokens", 1)
        check_range(self, "seed", 0)
        check_range(self, "cpu_threads", 0)
        check_range(self, "chunk_size", 1)

    def sampling(self) -> str:
        return json.dumps({"n": self.n, "temperature": self.temperature, "top_p": self.top_p,
                           "max_new_tokens": self.max_new_tokens, "seed": self.seed, "dtype": self.dtype},
                          sort_keys=True)


def prompt_seed(seed: int, prompt_id: str) -> int:
    return (seed * 1_000_003 + int(prompt_id[:8], 16)) % (2 ** 31)


def prompt_messages(question: str) -> list[dict]:
    """The user turn as chat content parts: each ``<image>`` placeholder becomes an image part in
    place (the processor's template then renders the model's own image tokens)."""
    from manifests.conversation import to_messages

    return to_messages([("user", question)])


def requests_for(prompts: list[dict], cfg: RolloutConfig):
    """One ``Request`` per (prompt, template), seeded ``prompt_seed ⊕ template index``; keys alongside."""
    from inference.backends import Request

    reqs, keys = [], []
    for p in prompts:
        for j, ptype in enumerate(cfg.prompt_types):
            text = TEMPLATES[ptype].format(question=p["question"])
            reqs.append(Request(prompt_messages(text), list(p["images"] or []), cfg.n,
                                prompt_seed(cfg.seed, p["prompt_id"]) + j * cfg.n))
            keys.append((p["prompt_id"], ptype))
    return reqs, keys


def load(cfg: RolloutConfig, stats=None):
    from inference.backends import load_for

    return load_for(cfg, stats)


def rollouts_generate(prompts: list[dict], cfg: RolloutConfig, stats, backend=None) -> list[dict]:
    """``transformers`` / ``vllm`` through the shared VLM backend (``inference.backends``; loaded here if
    not given)."""
    from inference.backends import Sampling

    backend = backend or load(cfg)
    reqs, keys = requests_for(prompts, cfg)
    gens = backend.generate(reqs, Sampling(cfg.temperature, cfg.top_p, cfg.max_new_tokens))
    rows, next_idx = [], {}
    for (pid, ptype), outs in zip(keys, gens):
        for g in outs:
            if g.error is not None:    # the prompt could not be run (an image that does not decode)
                raise RuntimeError(f"prompt {pid}: {g.error}")
            i = next_idx.get(pid, 0)
            next_idx[pid] = i + 1
            rows.append({"prompt_id": pid, "rollout_idx": i, "prompt_type": ptype, "response": g.text,
                         "tokens": g.tokens})
        stats.inc("generated", len(outs))
    return rows


def open_file(cfg: RolloutConfig, want: set[str], stats):
    """backend=file: the rollouts JSONL indexed once for the prompts ``want`` (still to do) — byte offsets,
    not responses (``inference.backends.CannedResponses``); other prompts' lines count ``file/other_prompt``."""
    from inference.backends import CannedResponses

    return CannedResponses(cfg.file, lambda r: r.get("prompt_id") if r.get("prompt_id") in want else None,
                           stats, other_key="file/other_prompt")


def file_rollouts(canned, prompts: list[dict]) -> list[dict]:
    """backend=file: a chunk's rollouts read back from the JSONL; a row without ``rollout_idx`` takes the one
    after the prompt's highest so far (file order)."""
    out = []
    for p in prompts:
        next_idx = 0
        for r in canned.get(p["prompt_id"]):
            i = r.get("rollout_idx", next_idx)
            next_idx = max(next_idx, i + 1)
            out.append({"prompt_id": r["prompt_id"], "rollout_idx": int(i),
                        "prompt_type": r.get("prompt_type", "answer_only"), "response": str(r.get("response", "")),
                        "tokens": int(r.get("tokens", 0)), "model": r.get("model")})
    return out


def ok_prompts(task: TaskContext, columns: list[str] | None, batch_rows: int):
    """The ``ok`` prompts of this rank's slice of ``rl_prompts``, streamed a batch of ``batch_rows`` at a time
    (the prompts carry their images)."""
    for b in task.iter_input_slice("rl_prompts", columns, batch_rows=batch_rows):
        for p in b.to_pylist():
            if p["status"] == "ok":
                yield p


def run(cfg: RolloutConfig, task: TaskContext) -> None:
    from inference.chunked import ChunkedGeneration, config_fingerprint

    # two passes over the slice: the ids first (two light columns: the chunks' names, and the rows the file
    # backend must find), then the prompts of the chunks still to do, images included
    ids = (p["prompt_id"] for p in ok_prompts(task, ["prompt_id", "status"], cfg.chunk_size))
    chunks = ChunkedGeneration(task, "rollouts", ids, cfg.chunk_size, config_fingerprint(cfg),
                               want_ids=cfg.backend == "file")
    canned, backend = None, None
    if chunks.todo:
        if cfg.backend == "file":
            canned = open_file(cfg, chunks.todo_ids, task.stats)
        else:
            backend = load(cfg, task.stats)
    sampling = cfg.sampling()

    def generate(prompts: list[dict]) -> list[dict]:
        rows = file_rollouts(canned, prompts) if canned is not None else \
            rollouts_generate(prompts, cfg, task.stats, backend)
        for r in rows:
            r["backend"] = cfg.backend
            r["model"] = r.get("model") or cfg.model or None
            r["sampling"] = sampling
        return rows

    try:
        with task.stats.timer("rollout"):
            chunks.generate(lambda: ok_prompts(task, None, cfg.chunk_size), generate, id_field="prompt_id",
                            unit="prompts")
    finally:
        if canned is not None:
            canned.close()
    n = chunks.write_part()      # chunks in prompt_id order, each sorted: the part's order
    task.stats.inc("prompts", chunks.n_items)
    task.stats.inc("rollouts", n)


def finalize(cfg: RolloutConfig, task: TaskContext) -> None:
    from inference.chunked import remove_chunks

    remove_chunks(task)          # every rank's part is written


def check(cfg: RolloutConfig, run_dir) -> None:
    """Before any task (and before a Slurm job is queued): a model or responses file given as a local path
    exists, and the installed transformers can load the model's remote code."""
    from ovpipe.config import check_local_path, looks_like_local_path

    if cfg.backend == "file":
        check_local_path("file", cfg.file)
    elif looks_like_local_path(cfg.model):
        check_local_path("model", cfg.model)
    check_backend_runtime(cfg)


STEP = Step("rollout", RolloutConfig, run, inputs={"rl_prompts": None}, outputs=("rollouts",), finalize=finalize,
            check=check,
            description="N rollouts per prompt (vLLM / transformers / file)")
