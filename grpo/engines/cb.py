"""SortedRL's engine operations over transformers' continuous batching (``ContinuousBatchingManager``, 5.23).

The manager's public surface is ``add_request`` / ``cancel_request`` / ``get_result`` around a background thread
that loops ``prepare_next_batch → forward → update_batch``. SortedRL has to react between two engine steps (the
batch is emitted the step its last rollout finishes), so this adapter runs that same loop body itself, one
iteration per ``step()``, on the manager's own ``ContinuousBatchProcessor`` (the thread is never started). Requests
still go in through ``add_request`` and out through ``cancel_request``; results come back through the manager's
output queue.

What the manager cannot do, and what stands in for it:

* **stop keeping the partial tokens.** ``cancel_request`` drops the request's state; nothing of it comes back
  (checked: a cancelled request never reaches ``get_result``). Every request is therefore added with
  ``streaming=True``: each step delivers every running request's ``GenerationOutput`` (its generated tokens and
  log-probs so far), and ``stop`` returns the last one seen. Driven step by step the cancellation lands before
  the next forward, so no token is generated after the one the adapter saw: the partial is exact.
* **resume.** There is no way to re-attach a cancelled request's KV cache; ``resume`` adds a new request whose
  prompt is ``prompt + partial`` with the remaining budget (a re-prefill). With ``prefix_sharing`` on, the
  paged cache's block sharing may find the stopped request's full blocks still cached and skip part of it.
* **per-request seeds.** Sampling draws from one torch generator seeded once (``seed``); the engine is
  deterministic for a given order of admissions, not per request.

Log-probs: ``return_logprobs=True`` makes the sampler return ``log softmax(processed logits)[token]``; with
temperature 1 and no top-k/top-p they are the policy's own log-probs (tests/grpo/test_engines.py recomputes them
with a full forward).
"""
from __future__ import annotations

import gc
import time

from grpo.engines import Partial, RequestEngine, StepReport


class ContinuousBatchingEngine(RequestEngine):
    name = "transformers"

    def __init__(self, model, *, slots: int = 64, max_len: int = 4096, max_batch_tokens: int | None = None,
                 page_size: int = 64, seed: int = 0, temperature: float = 1.0, ignore_eos: bool = False,
                 prefix_sharing: bool = False, dtype: str = "float32"):
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        if isinstance(model, str):
            model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
        self.model = model.eval()
        eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None else \
            model.config.eos_token_id
        self.eos = -1 if ignore_eos or eos is None else eos
        gen = GenerationConfig(do_sample=True, temperature=temperature, top_k=None, top_p=None,
                               eos_token_id=self.eos, pad_token_id=model.config.pad_token_id)
        # The paged cache holds every slot at full length, so a running request is never offloaded (that would
        # change which requests a step computes, and the bubble with it).
        blocks = slots * -(-max_len // page_size) + slots
        cb = ContinuousBatchingConfig(return_logprobs=True, seed=seed, page_size=page_size, num_blocks=blocks,
                                      max_batch_tokens=max_batch_tokens or max(1024, 4 * slots),
                                      max_requests_per_batch=slots, allow_block_sharing=prefix_sharing,
                                      use_async_batching=False, use_cuda_graph=False)
        self._mgr = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        self._bp = self._mgr._create_batch_processor()
        self._mgr.batch_processor = self._bp
        self.slots = slots
        super().__init__()
        self._used: set[str] = set()

    def _add(self, rid: str, prompt_ids: list[int], max_new_tokens: int) -> None:
        # A request id is never reused: a cancellation waits for the next step, and would drop the newcomer too.
        if rid in self._used:
            raise ValueError(f"request id {rid!r} was used before; give each admission its own id")
        self._used.add(rid)
        got = self._mgr.add_request(prompt_ids, request_id=rid, max_new_tokens=max_new_tokens,
                                    streaming=True, eos_token_id=self.eos)
        if got is None:
            raise RuntimeError(f"the continuous-batching manager refused request {rid!r}")

    def _cancel(self, rid: str) -> None:
        self._mgr.cancel_request(rid)

    def step(self) -> StepReport:
        from transformers.generation.continuous_batching.requests import RequestStatus

        t0 = time.perf_counter()
        bp = self._bp
        if not bp.prepare_next_batch():
            return StepReport({}, [], 0, 0, 0, time.perf_counter() - t0)
        batch = bp.inputs_and_outputs.requests_in_batch
        running = len(batch)
        # a request with no generated token yet is prefilling (a whole chunk of its prompt in this forward)
        prefill = sum(fs.query_length for fs in batch if fs.state.generated_len() == 0)
        context = sum(self._context.get(fs.state.request_id, 0) for fs in batch)
        bp._generation_step(self.model)
        bp.update_batch()
        new, finished = {}, []
        q = self._mgr.output_router.output_queue
        while not q.empty():
            out = q.get_nowait()
            rid = out.request_id
            if out.status == RequestStatus.FAILED:
                raise RuntimeError(f"continuous batching failed request {rid}: {out.error}")
            seen = self._seen.get(rid)
            if seen is None:                                     # stopped after this output was queued
                continue
            k = len(seen.token_ids)                              # streaming: the output holds every token so far
            done = out.status == RequestStatus.FINISHED
            new[rid] = self._record(rid, list(out.generated_tokens[k:]), list(out.logprobs[k:]), done)
            if done:
                finished.append(rid)
        return StepReport(new, finished, running, prefill, context, time.perf_counter() - t0)

    def close(self) -> None:
        self._bp = self._mgr.batch_processor = None
        gc.collect()
