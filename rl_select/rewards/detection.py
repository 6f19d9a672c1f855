"""The detection verifier of the ROLL VLM pipeline (our reading of it, stated as formulas).

Predictions and ground truth are lists of ``{"bbox_2d": [x1, y1, x2, y2], "label": str}``
(JSON, in ``<answer>`` or the response). For an IoU threshold τ, boxes are matched greedily:

* ``iou_first``: all (pred, gt) pairs by IoU descending; a pair is matched when both are free,
  IoU ≥ τ and the labels agree;
* ``label_first``: the same, but pairs with equal labels are considered before any other pair
  (so a better-overlapping wrong label cannot steal a box).

With ``m_τ`` matches, ``P`` predictions and ``G`` ground-truth boxes:

    precision_τ = m_τ / P,  recall_τ = m_τ / G,  AP_τ ≈ precision_τ · recall_τ   (the mAP term)
    completeness = 1 − (miss + false_alarm) / 2,  miss = 1 − m_0.5/G,  false_alarm = 1 − m_0.5/P
    size_penalty = min(1, (G + 1) / P)  when P > 2G + 2 (box spamming), else 1
    accuracy = size_penalty · ( ½ · mean_τ AP_τ + ½ · completeness )

τ runs over 0.50, 0.55, …, 0.95 and 0.99 (averaged), or — ``schedule: dynamic`` — a single τ
that rises with the training step: τ = 0.5 + 0.45 · min(1, step / total_steps).
The reward is ``accuracy_ratio · accuracy + format_ratio · format`` (ratios per sample from
``extra``, defaults 1 and 0).
"""
from __future__ import annotations

import json

from rl_select.rewards.extract import extract_answer, parse_response
from rl_select.rewards.rules import format_reward, iou

THRESHOLDS = [0.5 + 0.05 * i for i in range(10)] + [0.99]


def parse_boxes(text: str) -> list[dict]:
    text = (text or "")[:100_000]
    start = text.find("[")
    end = text.rfind("]")
    if start < 0 or end <= start:
        raise ValueError("no JSON list of boxes")
    data = json.loads(text[start:end + 1])
    out = []
    if not isinstance(data, list):
        raise ValueError("boxes must be a JSON list")
    for d in data:
        if not isinstance(d, dict):
            raise ValueError("each box must be a JSON object")
        b = d.get("bbox_2d") or d.get("bbox")
        if not (isinstance(b, list) and len(b) == 4):
            raise ValueError("box without 4 coordinates")
        out.append({"bbox": [float(x) for x in b], "label": str(d.get("label", "")).strip().lower()})
    return out


def match(pred: list[dict], gt: list[dict], tau: float, strategy: str = "iou_first") -> int:
    pairs = []
    for i, p in enumerate(pred):
        for j, g in enumerate(gt):
            v = iou(p["bbox"], g["bbox"])
            if v >= tau:
                same = p["label"] == g["label"]
                key = (same, v) if strategy == "label_first" else (v, same)
                pairs.append((key, i, j, same))
    pairs.sort(key=lambda x: x[0], reverse=True)
    used_p, used_g, m = set(), set(), 0
    for _, i, j, same in pairs:
        if i in used_p or j in used_g:
            continue
        used_p.add(i)
        used_g.add(j)
        m += same
    return m


def detection_accuracy(pred: list[dict], gt: list[dict], strategy: str = "iou_first",
                       schedule: str = "average", step: int = 0, total_steps: int = 1) -> float:
    G, P = len(gt), len(pred)
    if G == 0 and P == 0:
        return 1.0
    if G == 0 or P == 0:
        return 0.0
    taus = THRESHOLDS if schedule == "average" else [0.5 + 0.45 * min(1.0, step / max(total_steps, 1))]
    ap = [match(pred, gt, t, strategy) / P * match(pred, gt, t, strategy) / G for t in taus]
    m50 = match(pred, gt, 0.5, strategy)
    completeness = 1 - ((1 - m50 / G) + (1 - m50 / P)) / 2
    size_penalty = min(1.0, (G + 1) / P) if P > 2 * G + 2 else 1.0
    return size_penalty * (0.5 * sum(ap) / len(ap) + 0.5 * completeness)


def detection_reward(response: str, gt: str, extra: dict):
    gold = parse_boxes(gt)
    pred = parse_response(parse_boxes, extract_answer(response))
    acc = detection_accuracy(pred, gold, extra.get("match", "iou_first"), extra.get("schedule", "average"),
                             int(extra.get("step", 0)), int(extra.get("total_steps", 1)))
    fmt, _ = format_reward(response)
    a, f = float(extra.get("accuracy_ratio", 1.0)), float(extra.get("format_ratio", 0.0))
    score = a * acc + f * fmt
    return score, acc >= 0.5
