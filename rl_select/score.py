"""``score``: a reward for every rollout, by its prompt's answer type, in sandboxed workers.

Each rank scores a contiguous slice of ``rollouts`` (joined with ``rl_prompts`` for the ground
truth, answer type and extra). Per row: ``reward``, ``correct`` (the reward's own notion: exact
match, IoU ≥ 0.5, …), ``reward_type``, ``status`` (``ok`` / ``timeout`` / ``error``) and ``error``.
With ``format_reward: true``, thinking-template rollouts also get a ``format`` row.
"""
from __future__ import annotations

from dataclasses import dataclass

from ovpipe.config import check_range, check_step_folder
from ovpipe.step import Step, TaskContext


@dataclass
class ScoreConfig:
    rollouts_step: str = "rollout"  # the rollout step folder scored
    timeout_s: float = 5.0  # a reward slower than this: a timeout row
    workers: int = 2  # sandboxed reward processes
    format_reward: bool = True  # also score the response's format (a reward_type format row)

    def __post_init__(self):
        if self.timeout_s <= 0 or self.workers < 1:
            raise ValueError("timeout_s must be > 0 and workers >= 1")
        check_range(self, "timeout_s", 0, lo_open=True)
        check_step_folder("rollouts_step", self.rollouts_step)


ROLLOUT_BATCH = 8_192       # rollouts read and scored at a time: a task holds one batch, whatever its slice


def run(cfg: ScoreConfig, task: TaskContext) -> None:
    """This rank's slice of ``rollouts``, streamed a batch at a time through the reward workers into the
    ``rewards`` part (sorted by its key as it goes). A rollout's reward rows for the last (prompt_id,
    rollout_idx) of a batch wait for the next batch, which may hold more of that rollout's prompt types.
    The prompts are read alongside, in the same prompt_id order: a task holds one batch's prompts."""
    from rl_select.rewards import RewardRunner

    cursor = PromptCursor(task.iter_input("rl_prompts", ["prompt_id", "ground_truth", "answer_type", "extra",
                                                         "status"]))
    columns = ["prompt_id", "rollout_idx", "prompt_type", "response"]
    held, n_rolls, prompts = [], 0, {}
    with task.stats.timer("score"), RewardRunner(cfg.workers, cfg.timeout_s) as runner, \
            task.part_writer("rewards") as out:
        for rb in task.iter_input_slice("rollouts", columns, cfg.rollouts_step, batch_rows=ROLLOUT_BATCH):
            rolls = rb.to_pylist()
            n_rolls += len(rolls)
            first, last = rolls[0]["prompt_id"], rolls[-1]["prompt_id"]
            prompts = {k: v for k, v in prompts.items() if k >= first} | cursor.upto(first, last)
            rows = held + _score(cfg, task, runner, prompts, rolls)
            rows.sort(key=lambda r: (r["prompt_id"], r["rollout_idx"], r["reward_type"]))
            tail = (rolls[-1]["prompt_id"], rolls[-1]["rollout_idx"])
            cut = next((i for i, r in enumerate(rows) if (r["prompt_id"], r["rollout_idx"]) == tail), len(rows))
            if cut:
                out.write(rows[:cut])
            held = rows[cut:]
        if held:
            out.write(held)
    task.stats.inc("rollouts", n_rolls)


class PromptCursor:
    """The ``ok`` rows of ``rl_prompts`` (record batches in prompt_id order), handed out by prompt_id range as
    a sorted slice of rollouts asks for them; rows before the range are passed over, not kept."""

    def __init__(self, batches):
        self._rows = (r for b in batches for r in b.to_pylist())
        self._next = next(self._rows, None)

    def upto(self, first: str, last: str) -> dict:
        out = {}
        while self._next is not None and self._next["prompt_id"] <= last:
            r = self._next
            if r["status"] == "ok" and r["prompt_id"] >= first:
                out[r["prompt_id"]] = r
            self._next = next(self._rows, None)
        return out


def _score(cfg: ScoreConfig, task: TaskContext, runner, prompts: dict, rolls: list[dict]) -> list[dict]:
    jobs, keys = [], []
    for r in rolls:
        p = prompts.get(r["prompt_id"])
        if p is None or p["status"] != "ok":
            continue
        jobs.append((p["answer_type"], r["response"], p["ground_truth"], p["extra"]))
        keys.append((r["prompt_id"], r["rollout_idx"], p["answer_type"]))
        if cfg.format_reward and r["prompt_type"] == "thinking":
            jobs.append(("format", r["response"], "", "{}"))
            keys.append((r["prompt_id"], r["rollout_idx"], "format"))
    rows = []
    for (pid, idx, rtype), (reward, correct, status, error) in zip(keys, runner.score(jobs)):
        rows.append({"prompt_id": pid, "rollout_idx": idx, "reward": reward, "correct": correct,
                     "reward_type": rtype, "status": status, "error": error})
        task.stats.inc(f"status/{status}")
        task.stats.inc(f"reward_type/{rtype}")
    return rows


STEP = Step("score", ScoreConfig, run, inputs={"rollouts": "rollouts_step", "rl_prompts": None}, outputs=("rewards",),
            description="rule-based rewards in time-limited worker processes")
