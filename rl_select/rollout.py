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

Resumable per rank, like ``recaption``: the rank's prompts are cut into chunks of ``chunk_size``, and each
chunk's rollouts are written, atomically, to ``RUN/<step>/chunks/{rank:05d}/chunk-{k:06d}-{key}.parquet``
as soon as they are generated (``key``: a hash of the chunk's prompt ids and the sampling). A rank
restarted after a kill or a Slurm pre-emption keeps every chunk whose file is there and whole, and
generates the rest: a pre-empted task loses one chunk, not its slice. The chunks are streamed into the
rank's ``rollouts`` part (a task holds one chunk), and ``finalize`` removes them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

from ovpipe.config import check_range
from inference.backends import check_backend_fields, check_backend_runtime
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


def load(cfg: RolloutConfig):
    from inference.backends import load_backend

    return load_backend(cfg.backend, cfg.model, device=cfg.device, dtype=cfg.dtype, cpu_threads=cfg.cpu_threads,
                        seed=cfg.seed, engine_args=cfg.vllm_engine_args)


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


class FileRollouts:
    """backend=file: the rollouts JSONL indexed once for the prompts still to do — each wanted line's byte
    offset and its rollout index, not its response — and read back a chunk at a time, so a task holds one
    chunk's responses whatever the size of its slice or of the file."""

    def __init__(self, cfg: RolloutConfig, want: set[str], stats):
        from inference.backends import iter_jsonl_offsets

        self.path, self.at, next_idx = cfg.file, {}, {}
        for at, r in iter_jsonl_offsets(cfg.file, stats):
            pid = r.get("prompt_id")
            if pid not in want:
                stats.inc("file/other_prompt")
                continue
            i = r.get("rollout_idx", next_idx.get(pid, 0))
            next_idx[pid] = max(next_idx.get(pid, 0), i + 1)
            self.at.setdefault(pid, []).append((at, int(i)))

    def __call__(self, prompts: list[dict], cfg: RolloutConfig, stats) -> list[dict]:
        from inference.backends import read_jsonl_at

        out = []
        with open(self.path, "rb") as f:
            for p in prompts:
                for at, i in self.at.get(p["prompt_id"], []):
                    r = read_jsonl_at(f, at)
                    out.append({"prompt_id": r["prompt_id"], "rollout_idx": i,
                                "prompt_type": r.get("prompt_type", "answer_only"),
                                "response": str(r.get("response", "")),
                                "tokens": int(r.get("tokens", 0)), "model": r.get("model")})
        return out


def chunk_path(task: TaskContext, k: int, ids: list[str], cfg: RolloutConfig) -> Path:
    """Chunk ``k``'s file; its name carries a hash of the chunk's prompt ids and of what generates them, so
    an earlier try's chunk is reused only for the same prompts, backend, model and sampling."""
    import xxhash

    h = xxhash.xxh64()
    for pid in ids:
        h.update(pid.encode() + b"\0")
    h.update(json.dumps([cfg.backend, cfg.model, cfg.file, cfg.prompt_types, cfg.sampling()]).encode())
    return task.chunk_dir() / f"chunk-{k:06d}-{h.hexdigest()}.parquet"


def done_chunk(path: Path) -> bool:
    """An earlier try's chunk is kept iff its footer reads and holds the rollouts schema: chunks are renamed
    into place whole, and its name already says which prompts and sampling it holds (read in full once,
    when it is streamed into the part)."""
    import pyarrow.parquet as pq

    from manifests.io import check_part_schema

    if not path.exists():
        return False
    try:
        check_part_schema(path, pq.read_schema(path), "rollouts")
    except Exception:
        return False
    return True


def write_chunk(path: Path, rows: list[dict]) -> None:
    from manifests.io import write_part

    write_part(rows, path, "rollouts", sort=True)


def prompt_chunks(task: TaskContext, size: int, columns: list[str] | None = None):
    """The ``ok`` prompts of this rank's slice of ``rl_prompts``, streamed, in chunks of ``size`` (the last
    shorter): a task holds one chunk and one row group, not its slice (the prompts carry their images)."""
    chunk = []
    for b in task.iter_input_slice("rl_prompts", columns, batch_rows=size):
        for p in b.to_pylist():
            if p["status"] == "ok":
                chunk.append(p)
                if len(chunk) == size:
                    yield chunk
                    chunk = []
    if chunk:
        yield chunk


def run(cfg: RolloutConfig, task: TaskContext) -> None:
    from manifests.io import read_part

    # two passes over the slice: the ids first (two light columns: the chunks' names, and the rows the file
    # backend must find), then the prompts of the chunks still to do, images included
    ids = [[p["prompt_id"] for p in c] for c in prompt_chunks(task, cfg.chunk_size, ["prompt_id", "status"])]
    paths = [chunk_path(task, k, c, cfg) for k, c in enumerate(ids)]
    n_prompts = sum(map(len, ids))
    todo = {k for k in range(len(ids)) if not done_chunk(paths[k])}
    task.stats.inc("chunks/resumed", len(ids) - len(todo))
    generate = None
    if todo:
        if cfg.backend == "file":
            generate = FileRollouts(cfg, {pid for k in todo for pid in ids[k]}, task.stats)
        else:
            with task.stats.timer("load_model"):
                backend = load(cfg)
            task.stats.info["device"] = getattr(backend, "device", "cuda")
            generate = partial(rollouts_generate, backend=backend)
    sampling = cfg.sampling()
    with task.stats.timer("rollout"), task.progress(n_prompts, unit="prompts") as bar:
        bar.update(sum(len(ids[k]) for k in range(len(ids)) if k not in todo))
        for k, prompts in enumerate(prompt_chunks(task, cfg.chunk_size) if todo else ()):
            if k not in todo:
                continue
            rows = generate(prompts, cfg, task.stats)
            for r in rows:
                r["backend"] = cfg.backend
                r["model"] = r.get("model") or cfg.model or None
                r["sampling"] = sampling
            write_chunk(paths[k], rows)
            task.stats.inc("chunks/written")
            bar.update(len(prompts))
    n = 0
    with task.part_writer("rollouts") as out:   # chunks in prompt_id order, each sorted: the part's order
        for path in paths:
            t = read_part(path, "rollouts")
            n += t.num_rows
            out.write(t)
    task.stats.inc("prompts", n_prompts)
    task.stats.inc("rollouts", n)


def finalize(cfg: RolloutConfig, task: TaskContext) -> None:
    import shutil

    shutil.rmtree(task.step_dir / "chunks", ignore_errors=True)   # every rank's part is written


STEP = Step("rollout", RolloutConfig, run, inputs={"rl_prompts": None}, outputs=("rollouts",), finalize=finalize,
            check=lambda cfg, run_dir: check_backend_runtime(cfg),
            description="N rollouts per prompt (vLLM / transformers / file)")
