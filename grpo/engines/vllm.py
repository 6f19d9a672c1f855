"""SortedRL's engine operations over vLLM's ``LLMEngine`` (GPU; request building is tested on the CPU against a
stand-in ``vllm`` module, tests/grpo/test_engines.py).

* ``admit``  ``engine.add_request(rid, {"prompt_token_ids": ids}, SamplingParams(max_tokens=n, logprobs=0,
             output_kind=DELTA, detokenize=False, ...))``: ``logprobs=0`` returns the sampled token's log-prob
             alone, ``DELTA`` makes each ``step()`` return only the tokens appended in that step, and no text is
             decoded (token ids in, token ids out: an engine started with ``skip_tokenizer_init`` has no tokenizer);
* ``step``   ``engine.step()``; a ``RequestOutput`` per request that advanced, ``finished`` when it hit its budget;
* ``stop``   ``engine.abort_request([rid])``; the tokens are the ones the adapter collected from the deltas, so
             nothing is lost (vLLM frees the KV blocks; the paper patched SGLang for the same state);
* ``resume`` a new request with ``prompt + partial`` as its prompt token ids and the remaining budget (a
             re-prefill; with ``enable_prefix_caching`` vLLM finds the stopped request's full blocks still cached
             and skips most of it).

``running`` of a step is the number of live requests (admitted, not finished or stopped): vLLM's scheduler
computes all of them each step while they fit in ``max_num_seqs`` and the KV cache, which the controller keeps
by never admitting more than ``slots``. vLLM's default ``logprobs_mode`` (``raw_logprobs``) returns the model's
log-probs before any logits processing; at temperature 1 with no top-k/top-p they are the sampling distribution's,
the behaviour log-probs the decoupled loss wants.
"""
from __future__ import annotations

import time

from grpo.engines import RequestEngine, StepReport


class VllmEngine(RequestEngine):
    name = "vllm"

    def __init__(self, model: str, *, slots: int = 128, max_len: int = 8192, seed: int = 0,
                 temperature: float = 1.0, ignore_eos: bool = False, prefix_caching: bool = True,
                 engine_args: dict | None = None):
        from vllm import EngineArgs, LLMEngine

        self.slots, self.seed, self.temperature, self.ignore_eos = slots, seed, temperature, ignore_eos
        args = dict(model=model, seed=seed, max_num_seqs=slots, max_model_len=max_len,
                    enable_prefix_caching=prefix_caching)
        self.engine = LLMEngine.from_engine_args(EngineArgs(**{**args, **(engine_args or {})}))
        super().__init__()
        self._admitted = 0

    def sampling_params(self, max_new_tokens: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # a seed per admission: the same schedule samples the same tokens, whatever else runs beside it
        self._admitted += 1
        return SamplingParams(max_tokens=max_new_tokens, temperature=self.temperature, top_p=1.0, top_k=-1,
                              ignore_eos=self.ignore_eos, logprobs=0, seed=self.seed + self._admitted,
                              output_kind=RequestOutputKind.DELTA, detokenize=False)

    def _add(self, rid: str, prompt_ids: list[int], max_new_tokens: int) -> None:
        if rid in self._seen:
            raise ValueError(f"request id {rid!r} is live already")
        self.engine.add_request(rid, {"prompt_token_ids": prompt_ids}, self.sampling_params(max_new_tokens))

    def _cancel(self, rid: str) -> None:
        self.engine.abort_request([rid])

    def step(self) -> StepReport:
        t0 = time.perf_counter()
        running, context = len(self._context), sum(self._context.values())
        fresh = sum(n for rid, n in self._context.items() if not self._seen[rid].token_ids)
        new, finished = {}, []
        for out in self.engine.step():
            rid = out.request_id
            if rid not in self._seen:
                continue
            c = out.outputs[0]
            ids = list(c.token_ids)
            # logprobs=0: one {token id: Logprob} per generated token, holding the sampled token
            lps = [float(d[t].logprob) for t, d in zip(ids, c.logprobs or [])]
            if len(lps) != len(ids):
                raise RuntimeError(f"vLLM returned {len(lps)} log-probs for {len(ids)} tokens of {rid}")
            new[rid] = self._record(rid, ids, lps, out.finished)     # DELTA: the tokens of this step alone
            if out.finished:
                finished.append(rid)
        return StepReport(new, finished, running, fresh, context, time.perf_counter() - t0)

    def close(self) -> None:
        self.engine = None
