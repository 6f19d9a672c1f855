"""VLM-Gym environments for GRPO: rendered observations, a rule prompt, actions from ``<answer>``.

    env = VecEnv("2048", n=16, seed=0)           # many environments stepped together
    obs = env.observations()                      # PNG bytes per env
    rewards = env.step(responses)                 # one response per env → ±1, envs advance
    group = score_actions(state, responses)       # N candidates from one state, nothing advances

Rewards: the game reward (+1/−1, ``rl_select.gym.games``), a perception reward (share of board
cells read correctly in ``<perception>…</perception>``, against ``perception_text``), and a format
reward (``<perception>…</perception><think>…</think><answer>…</answer>``, in that order).
``reward(answer_type, response, ground_truth, extra)`` is what the ``score`` step calls for
``gym-*`` answer types: it re-plays the action on the state stored in ``extra``.
"""
from __future__ import annotations

import json
import re

import numpy as np

from rl_select.gym import games
from rl_select.gym.render import render

GAMES = ("2048", "shisen-sho", "shisen-sho-pictures", "swap")

RULES = {
    "2048": ("You are playing 2048 on the board in the image. Slide all tiles up, down, left or right; equal "
             "tiles that collide merge. A move that changes nothing is illegal."),
    "shisen-sho": ("You are playing Shisen-Sho. Remove two identical tiles that can be connected by a path of at "
                   "most three straight lines through empty cells (the area around the board is empty). Rows and "
                   "columns are numbered from 0; answer with two cells as (row,col),(row,col)."),
    "swap": ("The grid holds the numbers 1..N in scrambled order; the goal is row-major order. Swap two adjacent "
             "cells so that at least one number reaches its home cell. Answer with (row,col),(row,col)."),
}
RULES["shisen-sho-pictures"] = RULES["shisen-sho"].replace("identical tiles", "tiles with identical pictures")
FORMAT = ("First transcribe the board inside <perception></perception> (one row per line), then reason inside "
          "<think></think>, then give the action inside <answer></answer>.")


def prompt(game: str) -> str:
    return f"<image>{RULES[game]} {FORMAT}"


def game_reward(state: dict, response: str) -> float:
    m = re.findall(r"<answer>(.*?)</answer>", response or "", re.S)
    action = games.parse_action(state["game"], m[-1] if m else "")
    return games.step(state, action)[1]


def perception_reward(state: dict, response: str) -> float:
    m = re.search(r"<perception>(.*?)</perception>", response or "", re.S)
    if not m:
        return 0.0
    got = [row.split() for row in m.group(1).strip().splitlines()]
    want = [row.split() for row in games.perception_text(state).splitlines()]
    total = sum(len(r) for r in want)
    hits = sum(1 for i, row in enumerate(want) for j, v in enumerate(row)
               if i < len(got) and j < len(got[i]) and got[i][j] == v)
    return hits / total if total else 0.0


def format_reward(response: str) -> float:
    ok = re.fullmatch(r"\s*<perception>.*?</perception>\s*<think>.*?</think>\s*<answer>.*?</answer>\s*",
                      response or "", re.S)
    return 1.0 if ok else 0.0


def score_actions(state: dict, responses: list[str]) -> np.ndarray:
    """Parallel actions: each candidate's game reward from the same state; the state does not advance."""
    return np.array([game_reward(state, r) for r in responses])


def reward(answer_type: str, response: str, ground_truth: str, extra: dict):
    """For the score step: (reward, correct). ``extra['state']`` is the board the prompt showed."""
    state = extra["state"] if isinstance(extra, dict) else json.loads(extra)["state"]
    r = game_reward(state, response)
    return r, r > 0


class VecEnv:
    def __init__(self, game: str, n: int, seed: int = 0, size: int = 4, kinds: int = 6):
        if game not in GAMES:
            raise ValueError(f"unknown game {game!r}; games: {GAMES}")
        self.game = game
        self.rngs = [np.random.default_rng([seed, i]) for i in range(n)]
        self.states = [games.reset(game, rng, size, kinds) for rng in self.rngs]

    def observations(self) -> list[bytes]:
        return [render(s) for s in self.states]

    def step(self, responses: list[str]) -> np.ndarray:
        rewards = []
        for i, resp in enumerate(responses):
            m = re.findall(r"<answer>(.*?)</answer>", resp or "", re.S)
            nxt, r = games.step(self.states[i], games.parse_action(self.game, m[-1] if m else ""))
            self.states[i] = nxt
            rewards.append(r)
        return np.array(rewards)
