"""ROLL's reward worker over ovpipe's rewards.

ROLL routes each sample by its ``tag`` to a reward worker (``rewards.<domain>.worker_cls`` with
``tag_included``); a worker's ``compute_rewards(data: DataProto)`` decodes ``data.batch["responses"]``,
reads ``data.non_tensor_batch["reward_model"]`` (``ground_truth``, ``accuracy_ratio``,
``format_ratio``, ``verifier``, ``verifier_parm``) and the step from ``data.meta_info`` (``global_step``,
``max_steps``), and returns a ``DataProto`` of ``token_level_rewards`` (zeros), ``response_level_rewards``
and ``scores``. The export writes exactly that ``reward_model`` (``verifier`` = the answer type,
``verifier_parm`` = ROLL's struct of ``det_verifier_normalized`` and ``det_reward_ratio``, and
``reward_params`` = every ovpipe reward parameter as JSON).

``score_roll`` is the framework-free core (tested here); ``OvpipeRewardWorker`` wraps it in ROLL's
``Worker`` where ROLL is installed (it is not on PyPI: the ``roll`` package there is an unrelated
project; install ROLL from its repository). ``rewards.ovpipe.worker_cls:
rl_select.trainers.roll_reward.OvpipeRewardWorker``.

The score is our registry's reward, which for every ROLL row is ROLL's
``(accuracy_ratio · accuracy + format_ratio · format) / (accuracy_ratio + format_ratio)``
(``rl_select/rewards/roll.py``), the combination ROLL's ``DetectionRewardWorker`` computes.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

if importlib.util.find_spec("rl_select") is None:      # loaded by file path from a trainer's own environment
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rl_select.trainers import DEFAULT_TIMEOUT_S, DEFAULT_WORKERS, score_many  # noqa: E402


def roll_params(reward_model: dict, step: int = 0, total_steps: int = 0) -> dict:
    """The registry's parameters from a ROLL ``reward_model``: ovpipe's ``reward_params`` (JSON) where the export
    wrote it, ``verifier_parm`` (ROLL's struct or its JSON text, nulls dropped) on top, the ratios, and the
    training step for the detection verifier's ``dynamic`` IoU threshold."""
    from rl_select.ingest import roll_extra

    params = roll_extra(reward_model)
    params.pop("verifier", None)
    if total_steps:
        params.update(step=int(step), total_steps=int(total_steps))
    return params


def score_roll(responses: list[str], reward_models: list[dict], step: int = 0, total_steps: int = 0,
               timeout_s: float = DEFAULT_TIMEOUT_S, workers: int = DEFAULT_WORKERS) -> list[dict]:
    items = []
    for resp, rm in zip(responses, reward_models):
        if not rm.get("verifier"):
            raise ValueError("reward_model.verifier (the answer type) is missing: train on the export's roll/*.parquet")
        items.append((rm["verifier"], resp, rm.get("ground_truth", ""), roll_params(rm, step, total_steps)))
    return score_many(items, timeout_s, workers)


try:  # ROLL's worker API, where ROLL is installed
    from roll.distributed.executor.worker import Worker
    from roll.distributed.scheduler.decorator import Dispatch, register
    from roll.distributed.scheduler.protocol import DataProto
    from roll.models.model_providers import default_processor_provider
except ImportError:  # pragma: no cover - ROLL is not installable from PyPI
    Worker = None

if Worker is not None:  # pragma: no cover - exercised only inside a ROLL install
    class OvpipeRewardWorker(Worker):
        def __init__(self, worker_config):
            super().__init__(worker_config=worker_config)
            self.tokenizer = default_processor_provider(model_args=worker_config.model_args).tokenizer

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def initialize(self, pipeline_config):
            pass

        @register(dispatch_mode=Dispatch.DP_MP_COMPUTE, clear_cache=False)
        def compute_rewards(self, data: DataProto):
            import torch

            texts = self.tokenizer.batch_decode(data.batch["responses"], skip_special_tokens=True)
            res = score_roll(texts, list(data.non_tensor_batch["reward_model"]),
                             data.meta_info.get("global_step", 0), data.meta_info.get("max_steps", 0),
                             float(os.environ.get("OVPIPE_REWARD_TIMEOUT_S", DEFAULT_TIMEOUT_S)))
            scores = torch.tensor([r["score"] for r in res], dtype=torch.float16)
            return DataProto.from_dict(tensors={
                "token_level_rewards": torch.zeros_like(data.batch["responses"], dtype=torch.float16),
                "response_level_rewards": scores, "scores": scores})
