"""``rl-gym``: game states as an ``rl_prompts`` manifest, so rollout / score / select / export run
on games exactly as on benchmark data.

    ovpipe rl-gym --set game=2048 --set states=64 --run-dir RUN

Each prompt: the rendered board (PNG), the rule prompt, ``answer_type = gym-<game>``,
``ground_truth`` = JSON list of the legal, progress-making actions (for reference; the reward
re-plays the answer on the stored state), ``extra = {"state", "perception"}``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ovpipe.step import Step, TaskContext, slice_bounds


@dataclass
class GymConfig:
    game: Literal["2048", "shisen-sho", "shisen-sho-pictures", "swap"] = "2048"  # the VLM-Gym game
    states: int = 64  # game states (prompts) generated
    size: int = 4  # the board side
    kinds: int = 6  # tile kinds (shisen-sho, swap)
    seed: int = 0  # the seeded states

    def __post_init__(self):
        if self.states < 1 or self.size < 2 or self.kinds < 1:
            raise ValueError("states >= 1, size >= 2, kinds >= 1")


def run(cfg: GymConfig, task: TaskContext) -> None:
    import xxhash

    from rl_select.gym import games, prompt, render

    lo, hi = slice_bounds(cfg.states, task.rank, task.world_size)
    rows = []
    for i in range(lo, hi):
        state = games.reset(cfg.game, np.random.default_rng([cfg.seed, i]), cfg.size, cfg.kinds)
        legal = games.legal_actions(state)
        img = render(state)
        q = prompt(cfg.game)
        rows.append({"prompt_id": xxhash.xxh3_64(f"{cfg.game}|{json.dumps(state)}|{i}".encode()).hexdigest(),
                     "source": f"vlm-gym-{cfg.game}", "category": cfg.game, "question": q, "images": [img],
                     "ground_truth": json.dumps(legal), "answer_type": f"gym-{cfg.game}",
                     "extra": json.dumps({"state": state, "perception": games.perception_text(state)}),
                     "status": "ok" if legal else "no_legal_move", "error": None if legal else "no legal action"})
        task.stats.inc("states")
        task.stats.inc("legal_actions", len(legal))
    task.write_part("rl_prompts", rows)


STEP = Step("rl-gym", GymConfig, run, outputs=("rl_prompts",), description="VLM-Gym game states → rl_prompts")
