"""VLM-Gym environments for GRPO, with G1's rewards: rendered observations, G1's game prompts, actions from
``<answer>``.

    env = VecEnv("2048", n=16, seed=0)           # many environments stepped together
    obs = env.observations()                      # PNG bytes per env
    rewards = env.step(responses)                 # one response per env → ±1, envs advance
    group = score_actions(state, responses)       # N candidates from one state, nothing advances

The final reward (G1 §3.3) is

    R = GR + α · FR + β · PR          α = 1, β = 0 by default (``g1_alpha`` / ``g1_beta`` reward parameters)

* GR, the game reward: +1 / −1 from ``games.step`` (the action re-played on the state stored in ``extra``);
* FR, the format reward: 1 iff the response is ``<perception>…</perception><think>…</think><answer>…</answer>``
  in that order, else 0;
* PR, the perception reward: 1 iff FR holds and the perception block is the board's ground-truth transcript
  (``games.perception_text``; compared cell by cell, whitespace around cells ignored), else 0.

``reward(answer_type, response, ground_truth, extra)`` is what the registry resolves ``gym-<game>`` to, for
``score`` and ``grpo`` alike: ``(R, GR > 0)``. ``components`` gives GR, FR and PR apart (G1 reports game reward
and perception accuracy separately); ``play`` is the evaluation's multi-turn cumulative score.
"""
from __future__ import annotations

import json
import re

import numpy as np

from rl_select.gym import games
from rl_select.gym.games import GAMES
from rl_select.gym.render import render

# G1's game prompts (vlmgym/sandbox/games/*.py), the board size and tile sets filled in for ours
_FORMAT = ("First describe the board in <perception></perception>. Then output your thinking process in "
           "<think></think> and final action in <answer>{answer}</answer>.")
RULES = {
    "2048": ("You are now playing the 2048 game. 2048 is a sliding tile puzzle game where you combine numbered "
             "tiles to create a tile with the value 2048.\n\nRule:\nOnly Tiles with the SAME number merge when they "
             "collide. After each move, a new tile (2 or 4) appears randomly on the board. The game ends when there "
             "are no more valid moves.\n\nAvailable actions:\n- (0): Up (slide all tiles upward)\n- (1): Right (slide "
             "all tiles to the right)\n- (2): Down (slide all tiles downward)\n- (3): Left (slide all tiles to the "
             "left)\nWhat action should you take to achieve the highest score and reach the 2048 tile?\n\n"
             "First describe the board in <perception></perception>.Then output your thinking process in "
             "<think></think> and final action number in <answer></answer>."),      # G1's text, its missing space too
    "shisen-sho": ("You are playing a 'Shisen-sho' puzzle game.\nThe goal is to match pairs of identical tiles by "
                   "connecting them with a path that has at most 2 turns and doesn't cross any other tiles.\nThe tiles "
                   "are distinguished by their color and shape:\n- Red, Green, Blue, Yellow, Magenta, Cyan\n- Shapes "
                   "include: circle, square, triangle, diamond, cross, star\nPlease analyze the game board and "
                   "identify two matching tiles that can be connected according to these rules.\nReturn your answer "
                   "as follows:\n1. First coordinate: (row1, col1)\n2. Second coordinate: (row2, col2)\nWhere row and "
                   "col are 0-indexed numbers such as (0, 1), starting from the top-left of the board.\n"
                   + _FORMAT.format(answer="(row1, col1) (row2, col2)")),
    "shisen-sho-cifar10": ("You are playing a 'Shisen-sho' puzzle game.\nThe goal is to match pairs of tiles of the "
                           "same class by connecting them with a path that has at most 2 turns and doesn't cross any "
                           "other tiles.\nEach tile is a picture of one of the CIFAR-10 classes: airplane, automobile, "
                           "bird, cat, deer, dog, frog, horse, ship, truck. Two tiles match when they show the same "
                           "class.\nReturn your answer as follows:\n1. First coordinate: (row1, col1)\n2. Second "
                           "coordinate: (row2, col2)\nWhere row and col are 0-indexed numbers such as (0, 1), starting "
                           "from the top-left of the board.\n" + _FORMAT.format(answer="(row1, col1) (row2, col2)")),
    "swap": ("You are playing a Match-3 Game where you need to swap adjacent tiles to create matches of 3 or more "
             "identical tiles.\nRules:\n- Tiles are identified by color (Red, Green, Blue, Yellow) and shape (circle, "
             "square, triangle)\n- You can only swap adjacent tiles (not diagonal)\n- A valid move must create at "
             "least one match of 3 or more identical tiles\n- After matches are removed, tiles above will fall down "
             "and new tiles will appear at the top\n- If no valid moves are available, the board will automatically "
             "be shuffled\nPlease analyze the game board and identify two adjacent tiles to swap that will create a "
             "match.\nReturn your answer as follows:\n1. First coordinate: (row1, col1)\n2. Second coordinate: "
             "(row2, col2)\nWhere row and col are 0-indexed numbers starting from the top-left of the board.\n"
             + _FORMAT.format(answer="(row1, col1) (row2, col2)")),
}
ALPHA, BETA = 1.0, 0.0
_STRUCTURE = re.compile(r"\s*<perception>(.*?)</perception>\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.S)


def prompt(game: str) -> str:
    return f"<image>{RULES[game]}"


def game_reward(state: dict, response: str) -> float:
    return games.step(state, games.parse_action(state["game"], response or ""))[1]


def format_reward(response: str) -> float:
    return 1.0 if _STRUCTURE.fullmatch(response or "") else 0.0


def _cells(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("|")] for line in text.strip().splitlines() if line.strip()]


def perception_reward(state: dict, response: str) -> float:
    m = _STRUCTURE.fullmatch(response or "")
    return 1.0 if m and _cells(m.group(1)) == _cells(games.perception_text(state)) else 0.0


def components(state: dict, response: str) -> dict[str, float]:
    return {"game": game_reward(state, response), "format": format_reward(response),
            "perception": perception_reward(state, response)}


def final_reward(state: dict, response: str, alpha: float = ALPHA, beta: float = BETA) -> float:
    c = components(state, response)
    return c["game"] + alpha * c["format"] + beta * c["perception"]


def score_actions(state: dict, responses: list[str]) -> np.ndarray:
    """Parallel actions: each candidate's game reward from the same state; the state does not advance."""
    return np.array([game_reward(state, r) for r in responses])


def reward(answer_type: str, response: str, ground_truth: str, extra: dict):
    """For the registry: (GR + α·FR + β·PR, GR > 0). ``extra['state']`` is the board the prompt showed."""
    extra = extra if isinstance(extra, dict) else json.loads(extra)
    state = extra["state"]
    c = components(state, response)
    r = c["game"] + float(extra.get("g1_alpha", ALPHA)) * c["format"] + float(extra.get("g1_beta", BETA)) * c["perception"]
    return r, c["game"] > 0


def metrics(states: list[dict], responses: list[str]) -> dict[str, float]:
    """Per-batch figures as G1 plots them: mean game reward, perception accuracy (share of PR = 1), format share."""
    cs = [components(s, r) for s, r in zip(states, responses)]
    n = max(1, len(cs))
    return {k: sum(c[key] for c in cs) / n for k, key in
            (("game_reward", "game"), ("perception_accuracy", "perception"), ("format_rate", "format"))}


def play(policy, state: dict, turns: int) -> dict:
    """G1's evaluation: ``turns`` moves from ``state``, each the ``policy(state) -> response``'s answer; returns the
    cumulative game score (2048: the merged tiles' values), the summed ±1 rewards and the final state."""
    total, start = 0.0, state.get("score", 0)
    for _ in range(turns):
        state, r = games.step(state, games.parse_action(state["game"], policy(state)))
        total += r
    return {"score": state.get("score", 0) - start, "reward": total, "state": state}


class VecEnv:
    def __init__(self, game: str, n: int, seed: int = 0, size: int | None = None, walk_steps: int | None = None):
        if game not in GAMES:
            raise ValueError(f"unknown game {game!r}; games: {GAMES}")
        self.game = game
        self.rngs = [np.random.default_rng([seed, i]) for i in range(n)]
        self.states = [games.reset(game, rng, size, walk_steps) for rng in self.rngs]

    def observations(self) -> list[bytes]:
        return [render(s) for s in self.states]

    def step(self, responses: list[str]) -> np.ndarray:
        rewards = []
        for i, resp in enumerate(responses):
            self.states[i], r = games.step(self.states[i], games.parse_action(self.game, resp or ""))
            rewards.append(r)
        return np.array(rewards)
