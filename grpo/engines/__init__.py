"""Rollout engines with request-level control: the operations SortedRL needs, over real inference engines.

SortedRL (``grpo.sortedrl``) schedules single requests, so it needs more than ``generate(batch)``:

* ``admit(rid, prompt_ids, max_new_tokens)``  put one request into the engine (it starts at the next step);
* ``step() -> StepReport``                     one engine iteration (prefill chunks and one decode token for
                                               every running request): the new tokens of each request, with
                                               their log-probs, which requests finished, and how many ran;
* ``stop(rid) -> Partial``                     take a running request out, keeping the tokens and log-probs it
                                               generated so far (SortedRL's early termination);
* ``resume(rid, prompt_ids, partial, max_new_tokens)``  restart a stopped request with ``prompt + partial``
                                               as its prompt and the remaining token budget (partial mode).
                                               Both engines drop a stopped request's KV cache, so a resume
                                               re-prefills it, as the paper's SGLang patch does.

Two implementations:

* ``ContinuousBatchingEngine`` (``grpo.engines.cb``): transformers' continuous batching (paged KV cache,
  FIFO scheduler, mixed prefill/decode batches), on the CPU or a GPU;
* ``VllmEngine`` (``grpo.engines.vllm``): vLLM's ``LLMEngine`` (``add_request`` / ``abort_request`` /
  ``step``), on a GPU.

A ``StepReport`` says what happened in one step; ``running`` is the ``r_k`` of the bubble ratio (the requests
the step computed), ``seconds`` its wall time. Log-probs are of the sampled token under the sampling
distribution (temperature 1 and no top-k/top-p: the policy's own log-probs), the behaviour log-probs of the
decoupled loss.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class Partial:
    """The tokens a request generated since it was admitted (or resumed), with their log-probs."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class StepReport:
    new: dict[str, Partial]             # per request: the tokens this step appended
    finished: list[str]                 # requests that reached their token budget (or EOS) in this step
    running: int                        # requests computed by this step (r_k)
    prefill_tokens: int                 # prompt tokens computed by this step
    context_tokens: int                 # KV tokens the step's requests held at its start
    seconds: float


class Engine(Protocol):
    def admit(self, rid: str, prompt_ids: list[int], max_new_tokens: int) -> None: ...

    def step(self) -> StepReport: ...

    def stop(self, rid: str) -> Partial: ...

    def resume(self, rid: str, prompt_ids: list[int], partial: list[int], max_new_tokens: int) -> None: ...

    def has_work(self) -> bool: ...

    def close(self) -> None: ...


ENGINES = ("transformers", "vllm")


def load_engine(name: str, model, **kw) -> Engine:
    """``transformers`` (continuous batching over a loaded model or a folder) or ``vllm`` (a folder or hub id)."""
    if name == "transformers":
        from grpo.engines.cb import ContinuousBatchingEngine

        return ContinuousBatchingEngine(model, **kw)
    if name == "vllm":
        from grpo.engines.vllm import VllmEngine

        return VllmEngine(model, **kw)
    raise ValueError(f"sortedrl.engine must be one of {', '.join(ENGINES)}, got {name!r}")
