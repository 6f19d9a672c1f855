"""Reward entry points for GRPO trainers: thin adapters over ``rl_select.rewards``, so training scores
a rollout exactly as ``ovpipe score`` scored the rollouts that selection counted.

One module per trainer, each loadable by import or by file path:

* ``verl_reward.py``     — ``compute_score(data_source, solution_str, ground_truth, extra_info)``
  (``reward.custom_reward_function.path=<this file>``) and ``compute_score_batch`` (``batch`` manager);
* ``openrlhf_reward.py`` — ``reward_func(queries, prompts, labels)`` (``--remote_rm_url <this file>``);
* ``areal_reward.py``    — ``reward_fn(prompt, completions, prompt_ids, completion_ids, **data)``, what
  AReaL's (and the published recipe's) ``VisionRLVRWorkflow`` calls;
* ``roll_reward.py``     — ``score_roll`` over a ROLL batch, and ``OvpipeRewardWorker`` where ROLL is installed.

All of them go through :func:`score_many`: the same registry (``resolve(answer_type)``), the same
per-job time limit in sandboxed worker processes (``RewardRunner``, ``timeout_s`` = the score
step's default 5 s), the same statuses. A status maps to a score the way ``select`` counts it:
``ok`` → the reward; ``bad_response`` → 0 (an ordinary wrong answer); ``timeout`` / ``error`` → 0,
flagged ``failed = 1`` in the parts so a trainer's logs show them. The reward *scale and bias* of
GRPO (the recipe's ``(r − 0.5) × 10``) stay the trainer's settings (docs/rl_handoff.md says where).

The workers are forked once per process, on first use, and shut down at exit; calls from several
threads (verl's reward loop runs ``compute_score`` in a thread pool) take turns on one lock.
"""
from __future__ import annotations

import atexit
import json
import os
import threading
from typing import Any

DEFAULT_TIMEOUT_S = 5.0      # = ScoreConfig.timeout_s: the limit the selection was scored under
DEFAULT_WORKERS = 2

_lock = threading.Lock()
_state: dict[str, Any] = {"runner": None, "key": None}


def _close() -> None:
    runner = _state["runner"]
    if runner is not None and _state["key"][0] == os.getpid():
        runner.__exit__(None, None, None)
    _state.update(runner=None, key=None)


atexit.register(_close)


def _runner(timeout_s: float, workers: int):
    """The process-wide RewardRunner (a new one after a fork, or when the limits change)."""
    from rl_select.rewards import RewardRunner

    key = (os.getpid(), float(timeout_s), int(workers))
    if _state["key"] != key:
        if _state["key"] is not None and _state["key"][0] == os.getpid():
            _close()
        _state.update(runner=RewardRunner(int(workers), float(timeout_s)).__enter__(), key=key)
    return _state["runner"]


def params_json(params) -> str:
    """Reward parameters as the registry takes them: a JSON object's text (``None`` → ``{}``)."""
    if params is None or params == "":
        return "{}"
    if isinstance(params, str):
        return params
    return json.dumps(dict(params), sort_keys=True, default=str)


def parts(result: tuple, fmt: tuple | None, format_weight: float = 0.0) -> dict:
    """A registry result ``(reward, correct, status, error)`` (+ the format job's) as trainer-facing
    numbers: ``score`` (what the trainer optimises), ``accuracy``, ``format``, ``correct``, ``failed``."""
    reward, correct, status, _ = result
    f = float(fmt[0]) if fmt is not None and fmt[2] == "ok" else 0.0
    return {"score": float(reward) + format_weight * f, "accuracy": float(reward), "format": f,
            "correct": float(bool(correct)), "failed": float(status in ("timeout", "error"))}


def score_many(items: list[tuple[str, str, str, Any]], timeout_s: float = DEFAULT_TIMEOUT_S,
               workers: int = DEFAULT_WORKERS, format_weight: float = 0.0) -> list[dict]:
    """Score ``(answer_type, response, ground_truth, params)`` items; one dict of parts per item.

    Each item is one job for its answer type and one ``format`` job (the same format reward
    ``ovpipe score`` writes for thinking rollouts); ``format_weight`` (default 0: the recipe trains on
    accuracy alone) adds the format part to ``score``.
    """
    jobs = []
    for answer_type, response, gt, params in items:
        if not answer_type:
            raise ValueError("answer_type is missing: the export writes it (extra_info.answer_type, the OpenRLHF "
                             "reward_label, the AReaL answer_type field); pass exported data")
        jobs.append((str(answer_type), response if isinstance(response, str) else str(response), str(gt),
                     params_json(params)))
        jobs.append(("format", jobs[-1][1], "", "{}"))
    with _lock:
        results = _runner(timeout_s, workers).score(jobs)
    return [parts(results[i], results[i + 1], format_weight) for i in range(0, len(results), 2)]
