"""OpenRLHF's reward-function file over ovpipe's rewards.

    --remote_rm_url <this file> --label_key reward_label   (OpenRLHF 0.11: ``--reward.remote_url``)

OpenRLHF loads ``reward_func`` from a ``.py`` given as the remote RM URL and calls
``reward_func(queries, prompts, labels)`` with the decoded prompt + response (special tokens kept),
the chat-templated prompt and the ``--label_key`` field. The export's ``reward_label`` is a JSON
object ``{"ground_truth", "answer_type", "reward_params"}``: OpenRLHF passes nothing else per sample,
so the answer type travels in the label (the plain ``label`` field stays the bare ground truth).
Returns ``{"rewards", "scores", "extra_logs"}`` tensors, as OpenRLHF's examples do.

The response is the query after the prompt when the query starts with it, else after the last
``<|im_start|>assistant`` turn (a VLM prompt's image pads are expanded in the query), without
trailing end-of-turn tokens. ``OVPIPE_REWARD_TIMEOUT_S`` / ``OVPIPE_REWARD_WORKERS`` /
``OVPIPE_FORMAT_WEIGHT`` set the limits (OpenRLHF passes no keyword arguments).
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

ASSISTANT_TURN = "<|im_start|>assistant"
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>")


def response_of(query: str, prompt: str) -> str:
    if prompt and query.startswith(prompt):
        resp = query[len(prompt):]
    else:
        i = query.rfind(ASSISTANT_TURN)
        resp = query[i + len(ASSISTANT_TURN):].lstrip("\n") if i >= 0 else query
    resp = resp.rstrip()
    stripped = True
    while stripped:
        stripped = False
        for t in END_TOKENS:
            if resp.endswith(t):
                resp, stripped = resp[: -len(t)].rstrip(), True
    return resp


def parse_label(label) -> tuple[str, str, str]:
    """``(answer_type, ground_truth, reward_params)`` from an exported ``reward_label``."""
    try:
        d = json.loads(label) if isinstance(label, str) else label
    except ValueError:
        d = None
    if not isinstance(d, dict) or "answer_type" not in d:
        raise ValueError(f"label {str(label)[:80]!r} is not an ovpipe reward_label: train with --label_key reward_label "
                         "on the export's openrlhf/*.jsonl")
    return d["answer_type"], d.get("ground_truth", ""), d.get("reward_params") or "{}"


def reward_func(queries, prompts, labels, **_ignored) -> dict:
    import torch

    items = []
    for q, p, lab in zip(queries, prompts, labels):
        answer_type, gt, params = parse_label(lab)
        items.append((answer_type, response_of(q, p), gt, params))
    res = score_many(items, float(os.environ.get("OVPIPE_REWARD_TIMEOUT_S", DEFAULT_TIMEOUT_S)),
                     int(os.environ.get("OVPIPE_REWARD_WORKERS", DEFAULT_WORKERS)),
                     float(os.environ.get("OVPIPE_FORMAT_WEIGHT", 0.0)))
    col = lambda k: torch.tensor([r[k] for r in res], dtype=torch.float32)  # noqa: E731
    return {"rewards": col("score"), "scores": col("score"),
            "extra_logs": {"accuracy": col("accuracy"), "format": col("format"), "correct": col("correct"),
                           "failed": col("failed")}}
