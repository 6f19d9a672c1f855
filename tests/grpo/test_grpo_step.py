"""`ovpipe grpo` on TRL's GRPOTrainer: wrong configs fail before any work naming the field; a few steps move a tiny
policy toward the rewarded answer; the metrics manifest holds a row per step; the output folder loads again."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from demo.word_lm import word_lm, write_split  # noqa: E402

ROWS = [{"question": "say yes", "answer": "yes"}, {"question": "say no", "answer": "no"}]
TINY = ["--set", "steps=4", "--set", "batch_size=16", "--set", "num_generations=8", "--set", "micro_batch=8",
        "--set", "max_completion_length=1", "--set", "learning_rate=0.05", "--set", "save_every=2",
        "--set", "stages=[answer_only]", "--set", "reward_workers=1", "--quiet"]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return word_lm(tmp_path_factory.mktemp("lm") / "lm")


def _run(tmp_path, rows=ROWS * 2, split="stage1-answer-only"):
    run = tmp_path / "run"
    write_split(run, split, rows)
    return run


def _grpo(run, model, *extra):
    from ovpipe.cli import main

    return main(["grpo", "--run-dir", str(run), "--set", f"model={model}", *TINY, *extra])


# ------------------------------------------------------------------------------------------- fails before any work

@pytest.mark.parametrize("sets, names", [
    (["num_generations=12"], "num_generations=12 does not divide batch_size=16"),
    (["num_generations=1"], "num_generations must be >= 2"),
    (["micro_batch=3"], "micro_batch=3"),
    (["rewards={answer_only: [accuracy, formatt]}"], "rewards.answer_only: unknown reward ['formatt']"),
    (["stages=[answer_only, cot]"], "stage 'cot' reads split 'stage2-cot'"),
    (["stages=[answer_only, answer_only]"], "stages:"),
    (["model=/nonexistent"], "model: '/nonexistent' is not an HF folder"),
])
def test_a_wrong_config_fails_before_any_work_naming_the_field(tmp_path, lm, capsys, sets, names):
    run = _run(tmp_path)
    extra = [x for s in sets for x in ("--set", s)]
    assert _grpo(run, lm, *extra) == 2
    err = capsys.readouterr().err
    assert names in err, err
    assert not (run / "grpo").exists()          # nothing started: no step folder


def test_an_answer_type_the_registry_does_not_know_fails_before_any_work(tmp_path, lm, capsys):
    run = _run(tmp_path, [{"question": "say yes", "answer": "yes", "answer_type": "no-such-reward"}])
    assert _grpo(run, lm) == 2
    err = capsys.readouterr().err
    assert "answer type 'no-such-reward'" in err and not (run / "grpo").exists()


def test_the_batch_is_checked_against_the_ranks_it_launches_on(tmp_path, lm, capsys):
    run = _run(tmp_path)
    assert _grpo(run, lm, "--set", "batch_size=24", "--set", "micro_batch=4", "--nproc", "4") == 2
    assert "micro_batch=4 × 4 rank(s)" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- it learns

def completion_logp(model_dir, prompt: str, completion: str) -> float:
    """log p(completion | the chat-templated prompt) under the folder's model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    p = tok(text, add_special_tokens=False)["input_ids"]
    c = tok(completion, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p + c])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
    return float(sum(logp[len(p) - 1 + i, t] for i, t in enumerate(c)))


def test_a_few_steps_move_the_policy_toward_the_rewarded_answer(tmp_path, lm):
    """One-token completions from a 16-word vocabulary: a group of 8 finds the rewarded word about 40% of the time,
    so the groups disagree and GRPO has a gradient; 4 steps at lr 0.05 raise its log-probability."""
    import pyarrow.parquet as pq

    from rl_select.rollout import TEMPLATES

    run = _run(tmp_path)
    assert _grpo(run, lm) == 0
    out = run / "grpo" / "model"
    for r in ROWS:
        prompt = TEMPLATES["answer_only"].format(question=r["question"])
        before, after = completion_logp(lm, prompt, r["answer"]), completion_logp(out, prompt, r["answer"])
        assert after > before + 0.3, (r, before, after)       # the rewarded answer became more likely
    m = pq.read_table(next((run / "grpo" / "grpo_metrics").glob("part-*.parquet"))).to_pylist()
    assert [(x["stage"], x["step"]) for x in m] == [("answer_only", s) for s in (1, 2, 3, 4)]
    for x in m:
        assert x["reward_mean"] is not None and x["step_time_s"] > 0 and x["loss"] is not None
        assert 0 <= x["zero_std_group_share"] <= 1 and 0 <= x["token_utilization"] <= 1
        # rewards are (r − 0.5) · 10: a rollout scores −5 or +5
        assert -5 <= x["reward_mean"] <= 5
    # the output folder is an HF folder of the input's kind
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    stats = json.loads((run / "grpo" / "stats.json").read_text())
    assert stats["counters"]["steps"] == 4 and stats["counters"]["rollouts"] == 4 * 16


# ------------------------------------------------------------------------------------------- killed, rerun

METRICS = ["stage", "step", "reward_mean", "reward_std", "loss", "grad_norm", "token_utilization",
           "zero_std_group_share", "completion_len_mean"]


def _metrics(run):
    import pyarrow.parquet as pq

    return pq.read_table(next((run / "grpo" / "grpo_metrics").glob("part-*.parquet")), columns=METRICS).to_pylist()


def test_sigkill_then_rerun_ends_with_the_uninterrupted_runs_metrics(tmp_path, lm):
    """SIGKILL once the first checkpoint is whole; the rerun resumes there (the checkpoint's optimizer, RNG and
    epoch-seeded prompt order) and every step's metrics equal the uninterrupted run's, bit for bit; the steps the
    killed run logged after its checkpoint are not kept twice."""
    import os
    import signal
    import subprocess
    import time

    ovpipe = str(Path(sys.executable).with_name("ovpipe"))
    args = ["--set", f"model={lm}", *TINY, "--set", "steps=6"]
    ref, drill = tmp_path / "ref", tmp_path / "drill"
    for run in (ref, drill):
        write_split(run, "stage1-answer-only", ROWS * 2)
    beside = subprocess.Popen([ovpipe, "grpo", "--run-dir", str(ref), *args])       # the uninterrupted run
    p = subprocess.Popen([ovpipe, "grpo", "--run-dir", str(drill), *args], start_new_session=True)
    ckpt = drill / "grpo" / "stage-answer_only" / "checkpoints" / "checkpoint-2" / "trainer_state.json"
    deadline = time.time() + 300
    while not ckpt.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert ckpt.exists() and p.poll() is None, "the drill run ended before its first checkpoint"
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert not (drill / "grpo" / "grpo_metrics").exists()
    assert subprocess.run([ovpipe, "grpo", "--run-dir", str(drill), *args]).returncode == 0
    assert beside.wait() == 0
    assert _metrics(drill) == _metrics(ref)
    assert [m["step"] for m in _metrics(drill)] == [1, 2, 3, 4, 5, 6]


def test_lora_trains_an_adapter_and_saves_it_merged(tmp_path, lm):
    """`lora: {r, alpha}` (the official path's lora_enable): peft wraps the policy, the base weights stay frozen
    during training, and the saved folder is a plain model with the adapter merged into its weights."""
    import torch
    from safetensors.torch import load_file

    run = _run(tmp_path)
    assert _grpo(run, lm, "--set", "steps=2", "--set", "lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj]}") == 0
    out = run / "grpo" / "model"
    assert not list(out.glob("adapter_*")), "the adapter is merged, not saved beside the model"
    before, after = load_file(str(lm / "model.safetensors")), load_file(str(out / "model.safetensors"))
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("q_proj" in k or "v_proj" in k for k in changed), changed


def test_batch_stats_at_two_processes_are_the_whole_batchs():
    """Each rank holds its slice of the generation batch: the shares, lengths and counts rank 0 writes are the
    whole batch's (counts reduced over the processes), not its own slice's."""
    import math

    import torch

    from grpo.trainer import batch_stats

    def part(adv, lens):
        mask = torch.zeros(len(lens), 6)
        for i, n in enumerate(lens):
            mask[i, :n] = 1
        return {"advantages": torch.tensor(adv, dtype=torch.float32), "completion_mask": mask}

    a = part([0.0, 0.05, 1.2, -0.7], [6, 1, 2, 3])
    b = part([0.0, 0.0, 0.0, 0.3], [0, 5, 4, 4])

    class Recorder:          # rank 1: what it hands to each gather
        num_processes, seen = 2, []

        def gather(self, x):
            self.seen.append(x)
            return torch.cat([x, x])

    class Rank0:             # rank 0: each gather brings rank 1's tensor beside its own
        num_processes = 2

        def __init__(self, other):
            self.other = list(other)

        def gather(self, x):
            return torch.cat([x, self.other.pop(0)])

    rec = Recorder()
    batch_stats(b, 2, None, rec)
    got = batch_stats(a, 2, None, Rank0(rec.seen))
    whole = batch_stats({k: torch.cat([a[k], b[k]]) for k in a}, 2, None)
    assert got.keys() == whole.keys() and all(math.isclose(got[k], whole[k]) for k in got), (got, whole)
    assert got["small_advantage_share"] == 5 / 8 and got["completion_len_max"] == 6 and got["completion_len_min"] == 0
    assert got["token_utilization"] == (1 + 2 + 3 + 4) / 25          # A ≠ 0 rows' tokens over all tokens
    assert batch_stats(a, 2, None)["small_advantage_share"] == 2 / 4      # one process alone: its own rows
