"""``rl-gym``: G1's initial game states, several games in one step, as an ``rl_prompts`` manifest, so rollout /
score / select / export / grpo run on games exactly as on benchmark data.

    ovpipe rl-gym --set "games=[2048,shisen-sho,shisen-sho-cifar10,swap]" --set states=64 --run-dir RUN

State i of game g: a fresh board, then G1's random walk (``walk_steps``, default 100 for 2048 and 250 for the
others; ``rl_select.gym.games.WALK_STEPS``), seeded by (seed, g, i), so a state does not depend on the task
count. Each prompt: the rendered board (PNG), G1's game prompt, ``answer_type = gym-<game>`` (the registry's
final reward GR + α·FR + β·PR), ``ground_truth`` = JSON list of the +1 actions (for reference; the reward
re-plays the answer on the stored state), ``extra = {"state", "perception", "g1_alpha", "g1_beta"}``.
A state with no +1 action is a row with ``status = no_legal_move``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from ovpipe.step import Step, TaskContext, slice_bounds

ALL_GAMES = ["2048", "shisen-sho", "shisen-sho-cifar10", "swap"]


@dataclass
class GymConfig:
    games: list[str] = field(default_factory=lambda: list(ALL_GAMES))   # the VLM-Gym games, all in one step
    states: int = 64  # game states (prompts) per game
    sizes: dict[str, int] = field(default_factory=dict)  # board side per game; default G1's (4, 8, 6, 8)
    walk_steps: dict[str, int] = field(default_factory=dict)  # random-walk length per game; default G1's (100/250)
    alpha: float = 1.0  # final reward GR + alpha·FR + beta·PR (G1: alpha 1)
    beta: float = 0.0  # (G1: beta 0)
    seed: int = 0  # the seeded states

    def __post_init__(self):
        from rl_select.gym.games import GAMES

        self.games = [str(g) for g in self.games]          # `--set games=[2048,swap]` reads 2048 as an int
        bad = [g for g in self.games if g not in GAMES]
        if bad or not self.games or len(set(self.games)) != len(self.games):
            raise ValueError(f"games: {self.games!r}; each once, from {list(GAMES)}")
        for name in ("sizes", "walk_steps"):
            d = getattr(self, name)
            if any(g not in GAMES for g in d):
                raise ValueError(f"{name}: unknown game in {sorted(d)}; games: {list(GAMES)}")
        if any(v < 4 or v % 2 for g, v in self.sizes.items() if g.startswith("shisen")):
            raise ValueError(f"sizes: Shisen-Sho boards are even and >= 4, got {self.sizes}")
        if any(v < 3 for v in self.sizes.values()) or any(v < 0 for v in self.walk_steps.values()):
            raise ValueError(f"sizes >= 3 and walk_steps >= 0, got sizes={self.sizes} walk_steps={self.walk_steps}")
        if self.states < 1:
            raise ValueError(f"states must be >= 1, got {self.states}")


def run(cfg: GymConfig, task: TaskContext) -> None:
    import xxhash

    from rl_select.gym import games, prompt, render

    total = cfg.states * len(cfg.games)
    lo, hi = slice_bounds(total, task.rank, task.world_size)
    rows = []
    for k in range(lo, hi):
        game, i = cfg.games[k // cfg.states], k % cfg.states
        rng = np.random.default_rng([cfg.seed, games.GAMES.index(game), i])
        state = games.reset(game, rng, cfg.sizes.get(game), cfg.walk_steps.get(game))
        legal = games.legal_actions(state)
        rows.append({"prompt_id": xxhash.xxh3_64(f"{game}|{json.dumps(state)}|{i}".encode()).hexdigest(),
                     "source": f"vlm-gym-{game}", "category": game, "question": prompt(game),
                     "images": [render(state)], "ground_truth": json.dumps(legal), "answer_type": f"gym-{game}",
                     "extra": json.dumps({"state": state, "perception": games.perception_text(state),
                                          "g1_alpha": cfg.alpha, "g1_beta": cfg.beta}),
                     "status": "ok" if legal else "no_legal_move", "error": None if legal else "no +1 action"})
        task.stats.inc(f"states/{game}")
        task.stats.inc("legal_actions", len(legal))
    task.write_part("rl_prompts", rows)


STEP = Step("rl-gym", GymConfig, run, outputs=("rl_prompts",),
            description="VLM-Gym game states (G1's random walks) → rl_prompts")
