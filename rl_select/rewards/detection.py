"""ROLL's detection verifier (``roll/pipeline/rlvr/rewards/detection_reward_worker.py``, after
One-RL-to-See-Them-All's ``reward_server/verify.py``), rule for rule.

Boxes are ``[{'bbox_2d': [x1, y1, x2, y2], 'label': str}, …]`` inside ``<answer>…</answer>``, written as
ROLL's data writes them: a Python literal with single quotes (JSON reads the same). They are read with a
literal parser (``ast.literal_eval`` on a size-limited slice), never ``eval``; items without four numeric,
ordered coordinates or a string label are dropped and repeated positions kept once, as ROLL does.

For an IoU threshold τ and each of ROLL's two greedy matchings (``iou_max_iou_first``: the globally
largest remaining IoU first, a wrong label scoring 0; ``iou_max_label_first``: per ground-truth box, the
best same-label prediction), with ``m`` matches, ``P`` predictions and ``G`` ground-truth boxes:

    mean_iou     = Σ matched IoU / G
    completeness = 1 − (FN/G + FP/P) / 2                     (FN = G − m, FP = P − m)
    score_τ      = (1 − c) · mean_iou + c · completeness     (c = det_reward_ratio.iou_completeness)

τ comes from ``DET_IOU_THRESHOLD`` (one of 0.5, 0.55, …, 0.95, 0.99, ``average`` — the default, the mean of
score_τ over all eleven — or ``dynamic``: 0.85 for the first 10 % of the steps, 0.95 up to 25 %, then 0.99);
a row's ``iou_threshold`` parameter overrides it. With ``size_penalty = 0.6 ** |P − G|``:

    accuracy = size_penalty · Σ_k r_k · s_k / Σ_k r_k
               k ∈ {iou_max_iou_first, iou_max_label_first, map, map50, map75}, r = det_reward_ratio

where the mAP terms are COCO's bbox AP of the one image (``coco_ap``: IoU 0.50:0.95, 101 recall points,
100 detections, every prediction at confidence 1). ``det_verifier_normalized`` rescales the predicted boxes
from the model's input frame (``input_size`` = [W, H], which ``rl-ingest`` records from the row's image) to a
1000-sided one, truncating to integers as ROLL does. The format term (``verify_format``) is 1 iff the
response holds one ``\\n<answer>\\n … \\n</answer>`` block whose boxes parse. ``rl_select.rewards.roll``
weights accuracy and format by the row's ``accuracy_ratio`` / ``format_ratio``.
"""
from __future__ import annotations

import ast
import json
import os
import re

import numpy as np

THRESHOLDS = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.99)
RATIO_KEYS = ("iou_max_label_first", "iou_max_iou_first", "iou_completeness", "map", "map50", "map75")
SIZE_PENALTY_BASE = 0.6
MAX_BOX_TEXT = 100_000
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


class BoxesUnreadable(ValueError):
    """The text holds no list of boxes."""


def answer_content(text: str) -> str:
    """ROLL's ``extract_answer_content``: the first ``<answer>…</answer>``, else the text itself (a bare list
    of boxes, as ovpipe's own rows give the ground truth)."""
    m = _ANSWER.search(text or "")
    return m.group(1).strip() if m else (text or "").strip()


def parse_boxes(text: str) -> list[dict]:
    """The valid boxes of a list literal (Python or JSON), labels lower-cased, repeated positions dropped."""
    text = (text or "")[:MAX_BOX_TEXT]
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end <= start:
        raise BoxesUnreadable("no list of boxes")
    body = text[start:end + 1]
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        try:
            data = ast.literal_eval(body)         # literals only: no names, calls or attribute access
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as e:
            raise BoxesUnreadable(f"not a list literal: {type(e).__name__}") from None
    if not isinstance(data, list):
        raise BoxesUnreadable("boxes must be a list")
    out, seen = [], set()
    for d in data:
        b = d.get("bbox_2d") if isinstance(d, dict) else None
        if not (isinstance(b, (list, tuple)) and len(b) == 4 and isinstance(d.get("label"), str)
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in b)
                and b[0] <= b[2] and b[1] <= b[3]):
            continue
        if tuple(b) in seen:
            continue
        seen.add(tuple(b))
        out.append({"bbox_2d": [float(x) for x in b], "label": d["label"].lower()})
    if not out:
        raise BoxesUnreadable("no valid box")
    return out


def compute_iou(a, b) -> float:
    ix1, iy1, ix2, iy2 = max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])
    if ix2 <= ix1 or iy2 <= iy1:
        return 0.0
    inter = (ix2 - ix1) * (iy2 - iy1)
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def match_max_iou_first(pred, gt, tau) -> list[tuple[int, int, float]]:
    """Repeatedly the largest IoU among unmatched pairs (first in (pred, gt) order on ties), until it falls
    below τ; a pair with different labels is matched with IoU 0."""
    iou = [[compute_iou(p["bbox_2d"], g["bbox_2d"]) for g in gt] for p in pred]
    free_p, free_g, out = list(range(len(pred))), list(range(len(gt))), []
    while free_p and free_g:
        best, bi, bj = -1.0, -1, -1
        for i in free_p:
            for j in free_g:
                if iou[i][j] > best:
                    best, bi, bj = iou[i][j], i, j
        if best < tau:
            break
        out.append((bi, bj, best if pred[bi]["label"] == gt[bj]["label"] else 0.0))
        free_p.remove(bi)
        free_g.remove(bj)
    return out


def match_max_label_first(pred, gt, tau) -> list[tuple[int, int, float]]:
    """Per ground-truth box in order: its best-overlapping unmatched prediction of the same label, kept if
    that IoU reaches τ."""
    used, out = set(), []
    for j, g in enumerate(gt):
        cands = [(compute_iou(p["bbox_2d"], g["bbox_2d"]), i) for i, p in enumerate(pred)
                 if i not in used and p["label"] == g["label"]]
        if not cands:
            continue
        best = max(c[0] for c in cands)
        i = next(i for v, i in cands if v == best)       # np.argmax: the first maximum
        if best >= tau:
            out.append((i, j, best))
            used.add(i)
    return out


def match_max_iou_first_roll_code(pred, gt, tau) -> list[tuple[int, int, float]]:
    """ROLL's released ``greedy_match_by_iou_max_iou_first`` as it runs: its search loop reuses the names it
    stores the best pair in, so after the loop the pair is the *last* unmatched prediction and ground truth,
    scored with the best IoU (when labels agree). Reproduced bit for bit against ROLL's code (conformance.md);
    chosen with ``det_match_impl: roll_code``."""
    iou = [[compute_iou(p["bbox_2d"], g["bbox_2d"]) for g in gt] for p in pred]
    free_p, free_g, out = list(range(len(pred))), list(range(len(gt))), []
    while free_p and free_g:
        best = max(iou[i][j] for i in free_p for j in free_g)
        if best < tau:
            break
        i, j = free_p[-1], free_g[-1]
        out.append((i, j, best if pred[i]["label"] == gt[j]["label"] else 0.0))
        free_p.remove(i)
        free_g.remove(j)
    return out


MATCHERS = {"iou_max_iou_first": match_max_iou_first, "iou_max_label_first": match_max_label_first}


def iou_score(pred, gt, strategy: str, tau: float, completeness_weight: float, impl: str = "documented") -> float:
    fn = match_max_iou_first_roll_code if (impl == "roll_code" and strategy == "iou_max_iou_first") else MATCHERS[strategy]
    m = fn(pred, gt, tau)
    mean_iou = sum(v for _, _, v in m) / len(gt) if m else 0.0
    completeness = 1.0 - ((len(gt) - len(m)) / len(gt) + (len(pred) - len(m)) / len(pred)) / 2.0
    return mean_iou * (1.0 - completeness_weight) + completeness * completeness_weight


def coco_ap(pred, gt) -> dict[str, float]:
    """COCO's bbox AP for one image (pycocotools' ``evaluate``/``accumulate``/``summarize`` at area ``all``,
    100 detections): per category and IoU threshold, detections in order (all at confidence 1) take the
    best-overlapping free ground truth with IoU ≥ t; precision is made monotone and read at 101 recall points.
    ``map`` averages t = 0.50:0.05:0.95 over the categories that have ground truth; ``map50``/``map75`` one t.
    Predicted labels absent from the ground truth are left out, as ROLL leaves them out."""
    iou_thrs = np.linspace(0.5, 0.95, 10)
    rec_thrs = np.linspace(0.0, 1.0, 101)
    cats = list(dict.fromkeys(g["label"] for g in gt))
    if not any(p["label"] in cats for p in pred):
        return {"map": 0.0, "map50": 0.0, "map75": 0.0}
    prec = np.full((len(iou_thrs), len(cats)), -1.0)
    for k, c in enumerate(cats):
        gs = [g["bbox_2d"] for g in gt if g["label"] == c]
        ds = [p["bbox_2d"] for p in pred if p["label"] == c][:100]
        for t_i, t in enumerate(iou_thrs):
            taken, tp = set(), []
            for d in ds:
                best, m = min(t, 1 - 1e-10), -1
                for j, g in enumerate(gs):
                    v = compute_iou(d, g)
                    if j in taken or v < best:
                        continue
                    best, m = v, j
                if m >= 0:
                    taken.add(m)
                tp.append(m >= 0)
            tps = np.cumsum(tp, dtype=float)
            fps = np.cumsum(np.logical_not(tp), dtype=float)
            rc = tps / len(gs)
            pr = tps / np.maximum(tps + fps, np.spacing(1))
            pr = np.maximum.accumulate(pr[::-1])[::-1] if len(pr) else pr
            q = np.zeros(len(rec_thrs))
            idx = np.searchsorted(rc, rec_thrs, side="left")
            ok = idx < len(pr)
            q[ok] = pr[idx[ok]]
            prec[t_i, k] = q.mean()
    mean = lambda a: float(a[a > -1].mean()) if (a > -1).any() else -1.0  # noqa: E731
    return {"map": mean(prec), "map50": mean(prec[0]), "map75": mean(prec[5])}


def iou_threshold(params: dict):
    """``params['iou_threshold']``, else ``DET_IOU_THRESHOLD``; anything outside ROLL's list is ``average``, as
    ROLL falls back (it logs an error)."""
    raw = params.get("iou_threshold", os.environ.get("DET_IOU_THRESHOLD"))
    if raw in (None, "average", "dynamic"):
        return raw or "average"
    try:
        v = float(raw)
    except (TypeError, ValueError):
        return "average"
    return v if v in THRESHOLDS else "average"


def dynamic_threshold(step: int, total_steps: int) -> float:
    """ROLL's ``dynamic`` schedule: τ = 0.85 while step/total ≤ 0.1, 0.95 while ≤ 0.25, then 0.99."""
    ratio = float(step) / float(total_steps) if total_steps else 0.0
    return 0.85 if ratio <= 0.1 else 0.95 if ratio <= 0.25 else 0.99


def reward_ratios(params: dict) -> dict[str, float]:
    """``verifier_parm.det_reward_ratio``; a missing, null or out-of-[0, 1] entry is 0, as ROLL sets it."""
    r = params.get("det_reward_ratio") or {}
    if isinstance(r, str):
        r = json.loads(r)
    out = {}
    for k in RATIO_KEYS:
        v = r.get(k)
        out[k] = float(v) if v is not None and 0.0 <= float(v) <= 1.0 else 0.0
    return out


def normalize_boxes(boxes: list[dict], width: float, height: float, size: float = 1000.0) -> list[dict]:
    return [{**b, "bbox_2d": [int(b["bbox_2d"][0] / width * size), int(b["bbox_2d"][1] / height * size),
                              int(b["bbox_2d"][2] / width * size), int(b["bbox_2d"][3] / height * size)]}
            for b in boxes]


def detection_accuracy(pred: list[dict], gt: list[dict], params: dict | None = None) -> float:
    """ROLL's ``verify_accuracy`` final score for parsed boxes (see the module docstring)."""
    params = params or {}
    ratios = reward_ratios(params)
    if params.get("det_verifier_normalized") and params.get("input_size"):
        w, h = params["input_size"]
        pred = normalize_boxes(pred, float(w), float(h))
    if not pred or not gt:
        return 0.0
    size_penalty = SIZE_PENALTY_BASE ** abs(len(pred) - len(gt))
    tau = iou_threshold(params)
    if tau == "dynamic":
        tau = dynamic_threshold(int(params.get("step", 0)), int(params.get("total_steps", 0)))
    taus = THRESHOLDS if tau == "average" else (tau,)
    c = ratios["iou_completeness"]
    impl = params.get("det_match_impl", "documented")
    if impl not in ("documented", "roll_code"):
        raise ValueError(f"det_match_impl={impl!r}: documented | roll_code")
    scores = {s: sum(iou_score(pred, gt, s, t, c, impl) for t in taus) / len(taus) for s in MATCHERS}
    norm = sum(ratios[k] for k in ("iou_max_iou_first", "iou_max_label_first", "map", "map50", "map75"))
    if norm <= 0:
        return 0.0
    if any(ratios[k] for k in ("map", "map50", "map75")):
        scores.update(coco_ap(pred, gt))
    total = sum(ratios[k] * scores[k] for k in ("iou_max_iou_first", "iou_max_label_first", "map", "map50", "map75")
                if ratios[k])
    return size_penalty * total / norm


def verify_format(response: str) -> float:
    """ROLL's ``verify_format``: one ``\\n<answer>\\n`` … ``\\n</answer>`` block whose content parses as boxes."""
    r = response or ""
    if not (r.count("\n<answer>\n") and r.count("\n</answer>") == 1):
        return 0.0
    try:
        parse_boxes(answer_content(r.strip()))
    except BoxesUnreadable:
        return 0.0
    return 1.0


def detection_reward(response: str, gt: str, extra: dict):
    """(accuracy, accuracy ≥ 0.5); the ratio weighting with the format term is ``rl_select.rewards.roll``'s.
    A response with no readable boxes scores 0 (ROLL's verifier returns 0 there); a ground truth with none
    raises, so the row is an ``error`` (ROLL logs "Check GT!")."""
    gold = parse_boxes(answer_content(gt))
    try:
        pred = parse_boxes(answer_content(response or "")[:MAX_BOX_TEXT]) if _ANSWER.search(response or "") else None
    except BoxesUnreadable:
        pred = None
    acc = detection_accuracy(pred, gold, extra) if pred else 0.0
    return acc, acc >= 0.5
