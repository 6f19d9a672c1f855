"""SortedRL inside `ovpipe grpo`: ``sortedrl: {mode, …}`` makes the controller TRL's rollout source. A few GRPO steps
of a tiny word-level policy run through it; every call returns whole groups with their own prompts' reward columns;
in partial mode rollouts stopped at one update resume at the next, their tokens carrying the policy version that
sampled them and their steps logging the behaviour weights those tokens are trained with, and in on-policy mode every trained token is of the current version. Wrong settings fail before any
work, naming the field."""
from __future__ import annotations

import pytest

from demo.word_lm import word_lm, write_split

ROWS = [{"question": f"say {w}", "answer": w} for w in ("yes", "no", "red", "blue")]
# 16 rollouts a step = 2 prompts × 8; the controller caches 2 steps' prompts (32 rollouts) on 16 slots; up to 6
# tokens, EOS on (a random policy ends a completion at <|im_end|> about once in 16 tokens, so lengths vary)
TINY = ["--set", "steps=4", "--set", "batch_size=16", "--set", "num_generations=8", "--set", "micro_batch=8",
        "--set", "max_completion_length=6", "--set", "learning_rate=0.01", "--set", "save_every=10",
        "--set", "stages=[answer_only]", "--set", "reward_workers=1", "--set", "cpu_threads=1", "--quiet"]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return word_lm(tmp_path_factory.mktemp("lm") / "lm")


def _grpo(run, model, *extra):
    from ovpipe.cli import main

    return main(["grpo", "--run-dir", str(run), "--set", f"model={model}", *TINY, *extra])


@pytest.mark.parametrize("sets, names", [
    (["sortedrl={mode: sorted}"], "sortedrl.mode must be one of on_policy, partial, got 'sorted'"),
    (["sortedrl={mode: partial, group_batches: 0}"], "sortedrl.group_batches=0"),
    (["sortedrl={mode: partial, slot: 4}"], "sortedrl: unknown keys ['slot']"),
])
def test_a_wrong_sortedrl_config_fails_before_any_work(tmp_path, lm, capsys, sets, names):
    run = tmp_path / "run"
    write_split(run, "stage1-answer-only", ROWS)
    assert _grpo(run, lm, *[x for s in sets for x in ("--set", s)]) == 2
    assert names in capsys.readouterr().err
    assert not (run / "grpo").exists()


@pytest.mark.parametrize("mode", ["partial", "on_policy"])
def test_grpo_steps_run_through_sortedrl(tmp_path, lm, monkeypatch, mode):
    import pyarrow.parquet as pq

    import grpo.sortedrl as sortedrl

    calls = []
    make = sortedrl.make_rollout_func

    def recording(cfg, processor):
        inner = make(cfg, processor)

        def rollout_func(prompts, trainer):
            out = inner(prompts, trainer)
            calls.append((trainer.state.global_step, out, dict(trainer.rollout_stats)))
            return out
        return rollout_func

    monkeypatch.setattr(sortedrl, "make_rollout_func", recording)
    run = tmp_path / "run"
    write_split(run, "stage1-answer-only", ROWS)
    assert _grpo(run, lm, "--set", f"sortedrl={{mode: {mode}, group_batches: 2}}") == 0
    assert [c[0] for c in calls] == [0, 1, 2, 3]                      # one generation per optimizer step
    carried = 0
    for step, out, stats in calls:
        n = len(out["completion_ids"])
        assert n == 16 and len(out["prompt_ids"]) == n
        # whole groups, contiguous, each row with its own prompt's answer for the reward
        for g in range(0, n, 8):
            assert len({tuple(p) for p in out["prompt_ids"][g:g + 8]}) == 1
            assert len(set(out["ground_truth"][g:g + 8])) == 1
        for ids, lps, vs in zip(out["completion_ids"], out["logprobs"], out["token_versions"]):
            assert 1 <= len(ids) <= 6 and len(lps) == len(ids) == len(vs)
            assert all(lp <= 0 for lp in lps)
            # sampled by this step's policy or earlier ones (partial: a finished rollout waits for its group)
            assert vs == sorted(vs) and max(vs) <= step
            carried += min(vs) < step
        if mode == "on_policy":
            assert all(set(vs) == {step} for vs in out["token_versions"])
            assert stats["stale_token_share"] == 0
        else:
            assert stats["wasted_tokens"] == 0
        assert 0 <= stats["bubble_ratio"] < 1 and stats["engine_steps"] >= 1
    if mode == "partial":
        assert carried > 0                                                # resumed across an update
    else:
        assert calls[-1][2]["wasted_tokens"] > 0
    m = pq.read_table(next((run / "grpo" / "grpo_metrics").glob("part-*.parquet"))).to_pylist()
    assert [x["step"] for x in m] == [1, 2, 3, 4] and all(x["loss"] is not None for x in m)
    # the behaviour weights' figures (grpo.trainer): partial steps that train resumed tokens log them
    import json

    extras = [json.loads(x["extras"]) for x in m]
    if mode == "partial":
        weighted = [e for e in extras if e["behave_stale_token_share"] > 0]
        assert weighted and all(0 < e["behave_weight_min"] <= e["behave_weight_mean"] <= e["behave_weight_max"]
                                or e["behave_capped_share"] > 0 for e in weighted)
        assert all(0 <= e["behave_capped_share"] <= 1 for e in weighted)
    else:
        assert all(e["behave_stale_token_share"] == 0 and "behave_weight_mean" not in e for e in extras)
    assert (run / "grpo" / "model" / "config.json").exists()


def test_each_rank_generates_its_own_shard_of_every_epoch():
    """At N ranks each process runs its own controller over the training set (TRL hands it its slice of the
    generation batch): rank r takes the epoch's seeded order at r, r + N, …, so the ranks' prompts are disjoint and
    together they are the epoch, each prompt with its num_generations rollouts in one group."""
    import numpy as np

    from grpo.sortedrl import SortedRLConfig, SortedRLRollouts

    ds = [{"prompt": f"p{i}"} for i in range(10)]

    def prompts(rank, world, n):
        r = SortedRLRollouts(SortedRLConfig(mode="partial", group_batches=2), processor=None)
        r.G, r.batch, r.ds, r.seed, r.max_new, r.rank, r.world = 2, 4, ds, 3, 4, rank, world
        r._encode = lambda p: [1, 2]
        out = []
        while len(out) < n * r.G:
            out += r._next_group()                   # 2 batches of 4 rollouts: 4 prompts × 2 a group
        assert [e.group for e in out[::2]] == [e.group for e in out[1::2]]      # a prompt's rollouts together
        return [r.rows[e.prompt_id]["prompt"] for e in out[: n * r.G: r.G]]

    epoch0 = [f"p{i}" for i in np.random.default_rng(3).permutation(10)]
    epoch1 = [f"p{i}" for i in np.random.default_rng(4).permutation(10)]
    a, b = prompts(0, 2, 10), prompts(1, 2, 10)
    assert a == epoch0[0::2] + epoch1[0::2] and b == epoch0[1::2] + epoch1[1::2]
    assert set(a[:5]).isdisjoint(b[:5]) and set(a[:5]) | set(b[:5]) == {r["prompt"] for r in ds}
    assert prompts(0, 1, 10) == epoch0                                          # one rank: the whole order


@pytest.mark.slow
def test_partial_mode_at_two_ranks_trains_every_step(tmp_path, lm):
    """`--nproc 2` (torchrun, gloo): each rank runs its own controller and continuous-batching engine over its own
    shard of the prompts (the test above), hands TRL one whole group a step, and every step trains; the behaviour
    weights and the staleness rule's token-count gather run on both ranks every step without a hang."""
    import json
    import os
    import subprocess
    import sys

    import pyarrow.parquet as pq

    run = tmp_path / "run"
    write_split(run, "stage1-answer-only", ROWS)
    r = subprocess.run([sys.executable, "-m", "ovpipe.cli", "grpo", "--run-dir", str(run), "--set", f"model={lm}",
                        *TINY, "--set", "sortedrl={mode: partial, group_batches: 2}", "--nproc", "2"],
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads((run / "grpo" / "stats.json").read_text())["info"]["world"] == 2
    m = pq.read_table(next((run / "grpo" / "grpo_metrics").glob("part-*.parquet"))).to_pylist()
    assert [x["step"] for x in m] == [1, 2, 3, 4] and all(x["loss"] is not None for x in m)
    extras = [json.loads(x["extras"]) for x in m]
    assert all("rollout_bubble_ratio" in e and "behave_stale_token_share" in e for e in extras)
    assert any(e["behave_stale_token_share"] > 0 for e in extras)           # rank 0 trained resumed tokens
    assert (run / "grpo" / "model" / "config.json").exists()
