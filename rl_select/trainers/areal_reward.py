"""AReaL's reward function over ovpipe's rewards.

AReaL's ``RLVRWorkflow`` / ``VisionRLVRWorkflow`` (1.0) call, through ``AsyncRewardWrapper``
(a process pool, so the function is picked by import path)::

    reward_fn(prompt=, completions=, prompt_ids=, completion_ids=, **data)   # data = the dataset row

and expect a float; the published recipe's own ``VisionRLVRWorkflow`` also accepts a dict with
``reward`` / ``acc_reward``. ``reward_fn`` returns the float; ``reward_parts`` the recipe's dict
(``reward``, ``acc_reward``, ``format_reward``). The exported AReaL rows carry ``answer``,
``answer_type`` and ``reward_params``: pass ``workflow = VisionRLVRWorkflow(reward_fn=
"rl_select.trainers.areal_reward.reward_fn", ...)`` (a string is imported inside each worker).
``OVPIPE_REWARD_TIMEOUT_S`` / ``OVPIPE_REWARD_WORKERS`` / ``OVPIPE_FORMAT_WEIGHT`` set the limits;
keep AReaL's own wrapper timeout (15 s) above ``timeout_s`` so ours answers first.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

if importlib.util.find_spec("rl_select") is None:      # loaded by file path from a trainer's own environment
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rl_select.trainers import DEFAULT_TIMEOUT_S, score_many  # noqa: E402


def _score(completions, answer, answer_type, reward_params) -> dict:
    return score_many([(answer_type, completions, answer, reward_params)],
                      float(os.environ.get("OVPIPE_REWARD_TIMEOUT_S", DEFAULT_TIMEOUT_S)),
                      int(os.environ.get("OVPIPE_REWARD_WORKERS", 1)),
                      float(os.environ.get("OVPIPE_FORMAT_WEIGHT", 0.0)))[0]


def reward_fn(prompt=None, completions: str = "", prompt_ids=None, completion_ids=None, answer: str = "",
              answer_type: str | None = None, reward_params: str | None = None, **_data) -> float:
    return _score(completions, answer, answer_type, reward_params)["score"]


def reward_parts(prompt=None, completions: str = "", prompt_ids=None, completion_ids=None, answer: str = "",
                 answer_type: str | None = None, reward_params: str | None = None, **_data) -> dict:
    """The recipe's ``RewardSystem.reward`` shape: ``{"reward", "acc_reward", "format_reward"}``."""
    p = _score(completions, answer, answer_type, reward_params)
    return {"reward": p["score"], "acc_reward": p["accuracy"], "format_reward": p["format"]}
