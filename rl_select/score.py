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
    rollouts_step: str = "rollout"
    timeout_s: float = 5.0
    workers: int = 2
    format_reward: bool = True

    def __post_init__(self):
        if self.timeout_s <= 0 or self.workers < 1:
            raise ValueError("timeout_s must be > 0 and workers >= 1")
        check_range(self, "timeout_s", 0, lo_open=True)
        check_step_folder("rollouts_step", self.rollouts_step)


def run(cfg: ScoreConfig, task: TaskContext) -> None:
    from rl_select.rewards import RewardRunner

    prompts = {r["prompt_id"]: r for r in task.read_input("rl_prompts", columns=[
        "prompt_id", "ground_truth", "answer_type", "extra", "status"]).to_pylist() if r["status"] == "ok"}
    rolls = task.read_input_slice("rollouts", step=cfg.rollouts_step,
                                  columns=["prompt_id", "rollout_idx", "prompt_type", "response"]).to_pylist()
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
    with task.stats.timer("score"), RewardRunner(cfg.workers, cfg.timeout_s) as runner:
        results = runner.score(jobs)
    rows = []
    for (pid, idx, rtype), (reward, correct, status, error) in zip(keys, results):
        rows.append({"prompt_id": pid, "rollout_idx": idx, "reward": reward, "correct": correct,
                     "reward_type": rtype, "status": status, "error": error})
        task.stats.inc(f"status/{status}")
        task.stats.inc(f"reward_type/{rtype}")
    task.stats.inc("rollouts", len(rolls))
    task.write_part("rewards", rows)


STEP = Step("score", ScoreConfig, run, inputs={"rollouts": "rollouts_step", "rl_prompts": None}, outputs=("rewards",),
            description="rule-based rewards in time-limited worker processes")
