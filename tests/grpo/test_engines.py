"""SortedRL on a real engine. The continuous-batching adapter over a tiny random Qwen3 (the RL demo's class and
shape): its log-probs are the policy's (a full forward recomputes them), a stopped request keeps exactly the tokens
it generated, a resumed one continues from them. The controller driving it: partial mode trains every generated
token exactly once, on-policy mode counts every discarded token as waste and never mixes policy versions in a batch,
the schedule is the simulation's for the same lengths and the same seed gives the same tokens. The vLLM adapter's
request building, against a stand-in ``vllm`` module (no GPU here)."""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from grpo.sortedrl import Entry, SortedRLController, run_sorted, synchronous_rollout


@pytest.fixture(scope="module")
def model():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # a CPU engine step is ~1 ms of matmuls: threads only add spin-waits
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      eos_token_id=1, pad_token_id=0, tie_word_embeddings=True)
    yield Qwen3ForCausalLM(cfg).eval()
    torch.set_num_threads(threads)


def engine(model, slots=4, seed=0):
    from grpo.engines.cb import ContinuousBatchingEngine

    return ContinuousBatchingEngine(model, slots=slots, max_len=128, seed=seed, ignore_eos=True)


def full_forward_logprobs(model, prompt, tokens):
    import torch

    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


def drain(eng, got):
    while eng.has_work():
        rep = eng.step()
        for rid, p in rep.new.items():
            got.setdefault(rid, [[], []])
            got[rid][0] += p.token_ids
            got[rid][1] += p.logprobs
    return got


def test_cb_engine_budgets_logprobs_stop_and_resume(model):
    eng = engine(model)
    prompts = {"a": [5, 6, 7], "b": [8, 9, 10, 11], "c": [12, 13]}
    for rid, n in (("a", 6), ("b", 11), ("c", 20)):
        eng.admit(rid, prompts[rid], n)
    got = {}
    for k in range(8):                         # a finishes in step 6; b and c still run after 8 steps
        rep = eng.step()
        assert rep.running == (3 if k < 6 else 2) and rep.prefill_tokens == (9 if k == 0 else 0)
        assert ("a" in rep.finished) == (k == 5)
        for rid, p in rep.new.items():
            got.setdefault(rid, [[], []])
            got[rid][0] += p.token_ids
            got[rid][1] += p.logprobs
    partial = eng.stop("c")
    assert partial.token_ids == got["c"][0] and len(partial.token_ids) == 8      # exactly what it generated
    with pytest.raises(ValueError, match="was used before"):
        eng.admit("c", prompts["c"], 12)                                      # a cancelled id is never reused
    eng.resume("c.1", prompts["c"], partial.token_ids, 20 - 8)
    drain(eng, got)
    assert len(got["a"][0]) == 6 and len(got["b"][0]) == 11                  # each its own budget, EOS off
    assert len(got["c.1"][0]) == 12                                         # the rest of c's budget
    for rid, prompt in (("a", prompts["a"]), ("b", prompts["b"])):
        np.testing.assert_allclose(got[rid][1], full_forward_logprobs(model, prompt, got[rid][0]), atol=2e-4)
    # the resumed request's log-probs condition on the prompt and the partial, as one sequence
    c_tokens = partial.token_ids + got["c.1"][0]
    np.testing.assert_allclose(partial.logprobs + got["c.1"][1],
                               full_forward_logprobs(model, prompts["c"], c_tokens), atol=2e-4)
    eng.close()


def _entries(lengths, seed=0, group_size=1):
    rng = np.random.default_rng(seed)
    return [Entry(i, int(n), prompt_ids=[int(t) for t in rng.integers(2, 400, 6)],
                  group=i // group_size if group_size > 1 else -1) for i, n in enumerate(lengths)]


LENGTHS = np.array([3, 40, 5, 9, 2, 30, 7, 4, 12, 6, 3, 25, 8, 2, 5, 17])


@pytest.mark.parametrize("mode", ["partial", "on_policy"])
def test_the_controller_on_the_engine_trains_every_token_once_or_counts_it_wasted(model, mode):
    from grpo.rollout_sim import EngineTime, simulate_sorted

    es = _entries(LENGTHS)
    run = run_sorted(engine(model), [es], slots=4, batch_size=4, mode=mode)
    trained = [e for b in run.batches for e in b]
    assert sorted(e.prompt_id for e in trained) == list(range(len(LENGTHS)))    # every sample, once
    assert all(e.tokens == e.target_len == len(e.token_ids) == len(e.logprobs) == len(e.token_versions)
               for e in trained)
    assert run.trained_tokens == LENGTHS.sum()
    if mode == "partial":
        assert run.wasted_tokens == 0 and run.generated_tokens == run.trained_tokens
        assert any(len(set(e.token_versions)) > 1 for e in trained)              # resumed across updates
        for e in trained:                                                        # versions only grow
            assert e.token_versions == sorted(e.token_versions)
    else:
        assert run.wasted_tokens > 0 and run.generated_tokens == run.trained_tokens + run.wasted_tokens
        for k, b in enumerate(run.batches):                                      # no batch mixes versions
            assert {v for e in b for v in e.token_versions} == {k}, k
    # the same schedule as the simulation's controller on the same lengths
    sim = simulate_sorted(LENGTHS, np.full(len(LENGTHS), 6), 4, 4, mode, engine=EngineTime.unit(), terminate_at=4)
    assert run.schedule == sim.schedule and run.wasted_tokens == sim.wasted_tokens
    assert 0 <= run.bubble_ratio < 1 and run.drain_bubble <= run.bubble_ratio


def test_the_same_seed_gives_the_same_schedule_and_tokens(model):
    a = run_sorted(engine(model, seed=3), [_entries(LENGTHS)], 4, 4, "partial")
    b = run_sorted(engine(model, seed=3), [_entries(LENGTHS)], 4, 4, "partial")
    c = run_sorted(engine(model, seed=4), [_entries(LENGTHS)], 4, 4, "partial")
    tokens = lambda r: [e.token_ids for bt in r.batches for e in bt]  # noqa: E731
    assert a.schedule == b.schedule and tokens(a) == tokens(b)
    assert a.schedule == c.schedule and tokens(a) != tokens(c)          # lengths fix the schedule, seeds the tokens


def test_whole_groups_per_batch_and_the_baseline(model):
    es = _entries(LENGTHS, group_size=4)
    run = run_sorted(engine(model), [es], slots=8, batch_size=8, mode="partial", group_size=4)
    ctl_groups = [sorted({e.group for e in b}) for b in run.batches]
    for b in run.batches:
        assert all(sum(e.group == g for e in b) == 4 for g in {e.group for e in b})   # whole groups only
    assert sorted(g for gs in ctl_groups for g in gs) == [0, 1, 2, 3]
    base = synchronous_rollout(engine(model), _entries(LENGTHS), slots=4, batch_size=4)
    assert [sorted(e.prompt_id for e in b) for b in base.batches] == [list(range(k, k + 4)) for k in (0, 4, 8, 12)]
    assert base.trained_tokens == LENGTHS.sum() and base.drain_bubble == pytest.approx(base.bubble_ratio)


def test_a_batch_that_splits_a_group_is_refused():
    with pytest.raises(ValueError, match="batch_size=6 must be a positive multiple of the GRPO group size 4"):
        SortedRLController(6, "partial", group_size=4)
    with pytest.raises(ValueError, match="sortedrl.mode must be one of on_policy, partial, got 'sorted'"):
        SortedRLController(4, "sorted")


def test_vllm_engine_requests(monkeypatch):
    """add_request with the prompt's token ids and DELTA outputs carrying the sampled token's log-prob, abort on
    stop, a resume as prompt + partial with the rest of the budget — against a stand-in engine that appends one
    token per live request and step."""
    calls = []
    ns = types.SimpleNamespace

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw

    class LLMEngine:
        @classmethod
        def from_engine_args(cls, args):
            e = cls()
            e.args, e.live = args.kw, {}
            return e

        def add_request(self, rid, prompt, params):
            calls.append(("add", rid, prompt, params.kw))
            self.live[rid] = [params.kw["max_tokens"], 0]

        def abort_request(self, rids):
            calls.append(("abort", rids))
            for r in rids:
                self.live.pop(r)

        def step(self):
            outs = []
            for rid, st in list(self.live.items()):
                st[1] += 1
                tok = 100 + st[1]
                outs.append(ns(request_id=rid, finished=st[1] == st[0],
                               outputs=[ns(token_ids=[tok], logprobs=[{tok: ns(logprob=-0.25 * st[1])}])]))
                if st[1] == st[0]:
                    self.live.pop(rid)
            return outs

    vllm = types.ModuleType("vllm")
    vllm.SamplingParams, vllm.LLMEngine = SamplingParams, LLMEngine
    vllm.EngineArgs = lambda **kw: ns(kw=kw)
    sp = types.ModuleType("vllm.sampling_params")
    sp.RequestOutputKind = ns(DELTA="delta")
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sp)
    from grpo.engines import load_engine

    eng = load_engine("vllm", "some/model", slots=4, max_len=64, seed=7, ignore_eos=True)
    assert eng.engine.args == {"model": "some/model", "seed": 7, "max_num_seqs": 4, "max_model_len": 64,
                               "enable_prefix_caching": True}
    eng.admit("x.0", [1, 2, 3], 5)
    _, rid, prompt, kw = calls[0]
    assert prompt == {"prompt_token_ids": [1, 2, 3]}
    assert kw == {"max_tokens": 5, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True,
                  "logprobs": 0, "seed": 8, "output_kind": "delta", "detokenize": False}
    for _ in range(2):
        rep = eng.step()
    assert rep.running == 1 and rep.new["x.0"].logprobs == [-0.5]
    part = eng.stop("x.0")
    assert calls[-1] == ("abort", ["x.0"]) and part.token_ids == [101, 102] and part.logprobs == [-0.25, -0.5]
    eng.resume("x.1", [1, 2, 3], part.token_ids, 3)
    assert calls[-1][2] == {"prompt_token_ids": [1, 2, 3, 101, 102]} and calls[-1][3]["max_tokens"] == 3
    # the controller drives it like the CPU engine
    run = run_sorted(load_engine("vllm", "m", slots=2), [_entries([2, 6, 3, 1])], slots=2, batch_size=2,
                     mode="partial")
    assert run.trained_tokens == 12 and run.wasted_tokens == 0
    assert all(len(e.logprobs) == e.tokens for b in run.batches for e in b)
    with pytest.raises(ValueError, match="sortedrl.engine must be one of transformers, vllm"):
        load_engine("sglang", "m")
