"""`ovpipe grpo` with `shuffle_r1`: sizes the paper's batch cannot hold fail before any work naming the field; the
trainer splits an ordered reshaper's rows in its order; a run trains on the kept half of a 16-rollout pool and logs
both symptoms for every step."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from demo.word_lm import word_lm, write_split

ROWS = [{"question": "say yes", "answer": "yes"}, {"question": "say no", "answer": "no"}]
# 2 prompts × 16 rollouts generated a step; PTS keeps 4 pairs a prompt (8 pairs, 16 rollouts), ABS: S = 4 × T = 2
TINY = ["--set", "steps=2", "--set", "batch_size=32", "--set", "num_generations=16", "--set", "micro_batch=8",
        "--set", "max_completion_length=1", "--set", "learning_rate=0.05", "--set", "save_every=100",
        "--set", "stages=[answer_only]", "--set", "reward_workers=1", "--quiet"]


def _grpo(run, model, *sets):
    from ovpipe.cli import main

    return main(["grpo", "--run-dir", str(run), "--set", f"model={model}", *TINY,
                 *[x for s in sets for x in ("--set", s)]])


@pytest.mark.parametrize("sets, names", [
    (["shuffle_r1={S: 3}"], "shuffle_r1.S=3 must divide the 8 kept pairs (2 prompts × 4 pairs)"),
    (["shuffle_r1={alphaa: 0.5}"], "shuffle_r1: unknown keys ['alphaa']"),
    (["shuffle_r1={variant: shuffle}"], "shuffle_r1.variant='shuffle'"),
    (["shuffle_r1={alpha: 0.1}"], "shuffle_r1.alpha=0.1 keeps 0 pairs"),
    (["shuffle_r1={alpha: 0.375, S: 2}"], "micro_batch=8: shuffle_r1 keeps 6 of num_generations=16"),
    (["shuffle_r1={S: 4}", "micro_batch=12"], "batch_size=32 is not a multiple of micro_batch=12 × 1 rank(s) × 2"),
])
def test_sizes_the_paper_cannot_hold_fail_before_any_work(tmp_path, capsys, sets, names):
    run = tmp_path / "run"
    write_split(run, "stage1-answer-only", ROWS)
    (tmp_path / "lm").mkdir()
    (tmp_path / "lm" / "config.json").write_text("{}")
    assert _grpo(run, tmp_path / "lm", *sets) == 2
    err = capsys.readouterr().err
    assert names in err, err
    assert not (run / "grpo").exists()


def test_an_ordered_reshaper_is_split_in_its_order():
    """ABS's sub-samplings are consecutive micro-batches: TRL's shuffle is skipped for a reshaper with `ordered`."""
    from grpo.trainer import OvpipeGRPOTrainer

    B, spg = 32, 4
    batch = {"prompt_ids": torch.arange(B)[:, None], "prompt_mask": torch.ones(B, 1, dtype=torch.int),
             "completion_ids": torch.arange(B)[:, None], "completion_mask": torch.ones(B, 1, dtype=torch.int),
             "advantages": torch.linspace(-1, 1, B), "num_items_in_batch": torch.tensor(B)}
    order = torch.randperm(B, generator=torch.Generator().manual_seed(0))[:16]

    def reshaper(b, trainer):
        return {k: (v[order] if v.ndim else v) for k, v in b.items()}

    for ordered in (True, False):
        reshaper.ordered = ordered
        tr = OvpipeGRPOTrainer.__new__(OvpipeGRPOTrainer)     # the hook's logic alone: no model, no generation
        tr.model = SimpleNamespace(training=True)
        tr.args = SimpleNamespace(steps_per_generation=spg)
        tr.num_iterations, tr._step, tr._buffered_inputs, tr.num_generations = 1, 0, None, 2
        tr.batch_reshaper, tr.reward_funcs, tr._last_rewards = reshaper, [], None
        tr.step_stats, tr.reshape_stats, tr.rollout_stats = {}, {}, {}
        tr._generate_and_score_completions = lambda _inputs: batch
        first = tr._prepare_inputs(None)
        seen = torch.cat([b["completion_ids"][:, 0] for b in tr._buffered_inputs])
        assert len(tr._buffered_inputs) == spg and len(first["completion_ids"]) == 4
        assert sorted(seen.tolist()) == sorted(order.tolist())
        assert torch.equal(seen, order) == ordered          # in order only when the reshaper asks for it


def test_a_shuffle_r1_run_trains_the_kept_half_and_logs_both_symptoms(tmp_path):
    import pyarrow.parquet as pq

    run = tmp_path / "run"
    write_split(run, "stage1-answer-only", ROWS * 2)
    assert _grpo(run, word_lm(tmp_path / "lm"), "shuffle_r1={S: 4}", "batch_size=64") == 0
    m = pq.read_table(next((run / "grpo" / "grpo_metrics").glob("part-*.parquet"))).to_pylist()
    assert [x["step"] for x in m] == [1, 2]
    for x in m:
        e = json.loads(x["extras"])
        # 4 prompts × 16 generated; PTS keeps 4 × 4 pairs = 16, drawn as S = 4 sub-samplings of T = 4
        assert (e["reshape_rows_in"], e["reshape_rows_out"], e["reshape_S"], e["reshape_T"]) == (64, 32, 4, 4)
        assert e["generated_rollouts"] == 64 and e["rollouts"] == 32
        assert x["token_utilization"] == e["reshape_token_utilization"]
        assert 0 <= x["small_advantage_share"] <= e["generated_small_advantage_share"] <= 1
        assert x["reward_mean"] is not None and x["loss"] is not None


def test_a_rank_count_that_would_split_a_group_is_refused_at_launch():
    """Each rank reshapes its own buffer, `batch_size / ranks` rows, so groups must be whole on every rank: at 8
    ranks 64 rows are 8 a rank, half a group of 16 — refused naming the fields; at 4 ranks one group a rank."""
    from grpo.step import GRPOStepConfig

    cfg = GRPOStepConfig(model="m", batch_size=64, num_generations=16, micro_batch=4, shuffle_r1={"S": 2})
    cfg.check_world(4)
    with pytest.raises(ValueError, match=r"batch_size=64 on 8 rank\(s\) splits a group of num_generations=16"):
        cfg.check_world(8)
    GRPOStepConfig(model="m", batch_size=64, num_generations=16, micro_batch=4).check_world(8)   # GRPO: TRL's rule
