"""verl's custom reward function over ovpipe's rewards.

    reward.custom_reward_function.path=<this file> reward.custom_reward_function.name=compute_score

verl (0.9.1, both the reward-loop and the legacy ``naive`` manager) calls
``compute_score(data_source=, solution_str=, ground_truth=, extra_info=, **reward_kwargs)`` once per
response; ``extra_info`` is the exported row's: ``answer_type`` picks the reward and ``reward_params``
(the prompt's ``extra``, JSON) carries its parameters (tolerances, IoU threshold, the detection
verifier's ``det_reward_ratio``, ``correct_threshold``, ``require_answer_tag``). ``reward_kwargs``
(``+reward.custom_reward_function.reward_kwargs.timeout_s=5``) may set ``timeout_s``, ``workers`` and
``format_weight``. Returns ``{"score", "accuracy", "format", "correct", "failed"}``, all floats (verl
averages every key into its metrics). ``compute_score_batch`` is the same for verl's
``BatchRewardManager`` (``verl.workers.reward_manager.batch``; the 0.9.1 trainer itself uses the
reward loop, which calls ``compute_score``): one round over the worker processes for the whole batch.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("rl_select") is None:      # loaded by file path from a trainer's own environment
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rl_select.trainers import DEFAULT_TIMEOUT_S, DEFAULT_WORKERS, score_many  # noqa: E402


def _item(solution_str, ground_truth, extra_info) -> tuple:
    extra_info = extra_info or {}
    return (extra_info.get("answer_type"), solution_str, ground_truth, extra_info.get("reward_params"))


def compute_score(data_source=None, solution_str: str = "", ground_truth: str = "", extra_info: dict | None = None,
                  timeout_s: float = DEFAULT_TIMEOUT_S, workers: int = 1, format_weight: float = 0.0,
                  **_ignored) -> dict:
    """One response → its parts (``score`` is what verl puts on the last response token)."""
    return score_many([_item(solution_str, ground_truth, extra_info)], timeout_s, workers, format_weight)[0]


def compute_score_batch(data_sources=None, solution_strs=(), ground_truths=(), extra_infos=(),
                        timeout_s: float = DEFAULT_TIMEOUT_S, workers: int = DEFAULT_WORKERS,
                        format_weight: float = 0.0, **_ignored) -> list[dict]:
    """A batch of responses → one dict of parts each (verl's ``BatchRewardManager`` interface)."""
    items = [_item(s, g, e) for s, g, e in zip(solution_strs, ground_truths, extra_infos)]
    return score_many(items, timeout_s, workers, format_weight)
