"""ROLL's RLVR-for-VLM rewards: the ``mathverify`` verifier and the per-row ratio weighting.

``mathverify`` is ``MathRuleRewardWorker``'s rule (``roll/pipeline/rlvr/rewards/math_rule_reward_worker.py``):

1. the answer part of the response (``_extract_after_last_end_think``): empty when it holds more than one
   ``</think>`` or a ``<think>`` anywhere but at its start; else the text after the last ``</think>``, else
   after the last blank line, else nothing;
2. its last ``\\boxed{…}`` (braces balanced, braces inside double quotes skipped) parsed by math-verify as
   ``$…$``, else the whole part parsed (``fallback_mode="no_fallback"``);
3. the ground truth parsed as ``$<ground_truth>$`` (ROLL's rows carry ``\\boxed{4}``); 1 iff math-verify
   says the first parse of each is equal, else 0.

Every ROLL row carries ``accuracy_ratio`` and ``format_ratio``; the row's score is ROLL's
``DetectionRewardWorker`` combination, applied to every verifier here:

    score = accuracy · a / (a + f) + format · f / (a + f)

with ``format`` the verifier's own (detection: ``detection.verify_format``; the rest: ROLL's math format,
``^<think>.*?</think>.*?<answer>.*?</answer>$``), ``a`` defaulting to 1 and ``f`` to 0.1 for detection (ROLL's
defaults) and 0 otherwise. ROLL's ``MathRuleRewardWorker`` itself reads neither ratio; on its example row
(a = 1, f = 0) both give the accuracy.
"""
from __future__ import annotations

import re

from rl_select.rewards.extract import MAX_RESPONSE_CHARS

_MATH_FORMAT = re.compile(r"^<think>.*?</think>.*?<answer>.*?</answer>$", re.S | re.M)


def after_last_end_think(response: str) -> str:
    if response.count("</think>") > 1 or ("<think>" in response and not response.startswith("<think>")):
        return ""
    _, sep, after = response.rpartition("</think>")
    if sep:
        return after.strip()
    _, sep, after = response.rpartition("\n\n")
    return after.strip() if sep else ""


def boxed_content(response: str) -> tuple[bool, str]:
    """ROLL's ``check_and_extract_within_boxed``: (closed, content of the last ``\\boxed{``)."""
    i = -1
    for start in ("\\boxed\\{", "\\boxed{"):
        i = response.rfind(start)
        if i >= 0:
            begin = i + len(start)
            break
    if i < 0:
        return False, ""
    depth, quoted = 0, False
    for k in range(begin, len(response)):
        ch = response[k]
        if ch == '"':
            quoted = not quoted
        elif not quoted and ch == "{":
            depth += 1
        elif not quoted and ch == "}":
            if depth == 0:
                return True, response[begin:k]
            depth -= 1
    return False, response[begin:]


def mathverify_reward(response: str, gt: str, extra: dict):
    from math_verify import parse, verify

    from rl_select.rewards.rules import MATH_VERIFY_TIMEOUT_S as t

    part = after_last_end_think((response or "")[-MAX_RESPONSE_CHARS:])
    closed, boxed = boxed_content(part)
    pred = parse(f"${boxed}$" if closed else part, fallback_mode="no_fallback", parsing_timeout=t)
    gold = parse(f"${gt}$", parsing_timeout=t)
    ok = bool(gold and pred and verify(gold[0], pred[0], timeout_seconds=t))
    return float(ok), ok


def is_roll_row(params: dict) -> bool:
    return "accuracy_ratio" in params or "format_ratio" in params


def format_score(answer_type: str, response: str) -> float:
    if answer_type == "detection":
        from rl_select.rewards.detection import verify_format

        return verify_format(response)
    return 1.0 if _MATH_FORMAT.match(response or "") else 0.0


def weighted(answer_type: str, accuracy: float, response: str, params: dict) -> float:
    a = params.get("accuracy_ratio")
    f = params.get("format_ratio")
    a = 1.0 if a is None else float(a)
    f = (0.1 if answer_type == "detection" else 0.0) if f is None else float(f)
    if a < 0 or f < 0 or a + f <= 0:
        raise ValueError(f"accuracy_ratio={a}, format_ratio={f}: both >= 0 and their sum > 0")
    fmt = format_score(answer_type, response) if f else 0.0
    return accuracy * a / (a + f) + fmt * f / (a + f)
