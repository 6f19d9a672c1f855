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


class RequestEngine:
    """What both engines share: the per-request bookkeeping behind ``stop`` / ``resume`` / ``has_work``. Neither
    engine hands back a stopped request's tokens, so each keeps what every step delivered (``_record``) and ``stop``
    returns that; a resume is a new request over ``prompt + partial`` (both drop the KV cache of a stopped request).
    A subclass adds a request to its engine in ``_add`` and takes it out in ``_cancel``."""

    def __init__(self) -> None:
        self._seen: dict[str, Partial] = {}          # per live request: what it generated so far
        self._context: dict[str, int] = {}           # per live request: prompt + generated tokens

    def _add(self, rid: str, prompt_ids: list[int], max_new_tokens: int) -> None:
        raise NotImplementedError

    def _cancel(self, rid: str) -> None:
        raise NotImplementedError

    def admit(self, rid: str, prompt_ids: list[int], max_new_tokens: int) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"request {rid!r}: max_new_tokens={max_new_tokens} must be at least 1")
        self._add(rid, list(prompt_ids), max_new_tokens)
        self._seen[rid] = Partial()
        self._context[rid] = len(prompt_ids)

    def resume(self, rid: str, prompt_ids: list[int], partial: list[int], max_new_tokens: int) -> None:
        self.admit(rid, list(prompt_ids) + list(partial), max_new_tokens)

    def stop(self, rid: str) -> Partial:
        self._cancel(rid)
        self._context.pop(rid, None)
        return self._seen.pop(rid, Partial())

    def has_work(self) -> bool:
        return bool(self._context)

    def _record(self, rid: str, token_ids: list[int], logprobs: list[float], finished: bool) -> Partial:
        """A step's new tokens of ``rid``: appended to what it holds; a finished request is no longer live."""
        seen = self._seen[rid]
        seen.token_ids += token_ids
        seen.logprobs += logprobs
        self._context[rid] += len(token_ids)
        if finished:
            del self._seen[rid], self._context[rid]
        return Partial(list(token_ids), list(logprobs))


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
