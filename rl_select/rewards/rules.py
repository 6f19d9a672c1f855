"""Rule-based rewards, one function per answer type: ``reward(response, ground_truth, extra) -> (score, correct)``.

Coverage follows the published recipe's reward module: math (math-verify, SymPy fallback),
multiple choice, number, bbox IoU, OCR text, HTML, SVG, bool, string, the format reward, and the
ROLL detection verifier (``rl_select.rewards.detection``). Every function treats the response as
untrusted text: size-limited, parsed, never executed.
"""
from __future__ import annotations

import json
import logging
import math
import re

from rl_select.rewards.extract import MAX_RESPONSE_CHARS, extract_answer, last_boxed

# math-verify logs every timed-out input in full (a 10 MB response would land in the task log)
logging.getLogger("math_verify").setLevel(logging.CRITICAL)
MATH_VERIFY_TIMEOUT_S = 2   # its own signal.alarm budget per parse/verify; the runner's timeout_s caps the whole job

_NUM = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")


def _norm(s: str) -> str:
    return re.sub(r"[\s\.\,\;\:\!\?\"'`]+", " ", (s or "").strip().lower()).strip()


# -- math -------------------------------------------------------------------------------
def math_reward(response: str, gt: str, extra: dict):
    ans = extract_answer(response)
    if not ans:
        return 0.0, False
    try:
        from math_verify import parse, verify

        # math-verify's own timeouts use signal.alarm: fine here, rewards run in a worker's main thread
        t = MATH_VERIFY_TIMEOUT_S
        gold = parse(f"${gt}$" if "$" not in gt and "\\boxed" not in gt else gt, parsing_timeout=t)
        pred = parse(f"${ans}$" if "$" not in ans else ans, parsing_timeout=t)
        if gold and pred and verify(gold, pred, timeout_seconds=t):
            return 1.0, True
    except Exception:
        pass
    try:
        from rl_select.rewards.safe_math import sympy_equal

        ok = sympy_equal(ans, gt)
    except Exception:
        ok = _norm(ans) == _norm(gt)
    return float(ok), bool(ok)


# -- multiple choice, number, bool, string ----------------------------------------------
_CHOICE = re.compile(r"(?:^|[^A-Za-z])\(?([A-J])\)?(?:[^A-Za-z]|$)")


def choice_letter(s: str) -> str | None:
    """The recipe's rule first (strip ``.()``, uppercase the first character: ``b.`` → B), taken
    only when that character stands alone (``B) 42``, ``(c)``, ``d.``), so ``Blue`` is not option B;
    then "answer is C", a standalone capital letter, the last one wins."""
    s = (s or "").strip()
    head = s.strip(".()")
    if head[:1].isalpha() and head[:1].upper() in "ABCDEFGHIJ" and (len(head) == 1 or head[1] in ".):,"):
        return head[0].upper()
    m = re.search(r"answer\s*(?:is|:)?\s*\(?([A-J])\)?\b", s, re.I)
    if m:
        return m.group(1).upper()
    found = _CHOICE.findall(s)
    return found[-1].upper() if found else None


def choice_reward(response: str, gt: str, extra: dict):
    pred = choice_letter(extract_answer(response))
    ok = pred is not None and pred == (choice_letter(gt) or gt.strip().upper())
    return float(ok), ok


def parse_number(s: str) -> float | None:
    s = (s or "").replace("$", "").replace("\\%", "%")
    frac = re.search(r"\\d?frac\{([-\d.]+)\}\{([-\d.]+)\}", s)
    if frac:
        try:
            return float(frac.group(1)) / float(frac.group(2))
        except (ValueError, ZeroDivisionError):
            return None
    m = re.search(r"([-+]?\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)", s)
    nums = _NUM.findall(s)
    if m and (not nums or m.group(0).startswith(nums[-1].split("/")[0])):
        try:
            return float(m.group(1)) / float(m.group(2))
        except ZeroDivisionError:
            return None
    if not nums:
        return None
    tok = nums[-1].replace(",", "")
    if len(tok) > 40:
        return None
    try:
        v = float(tok)
    except ValueError:
        return None
    return v


def number_reward(response: str, gt: str, extra: dict):
    p, g = parse_number(extract_answer(response)), parse_number(gt)
    if p is None or g is None or not math.isfinite(p):
        return 0.0, False
    ok = math.isclose(p, g, rel_tol=float(extra.get("rel_tol", 1e-4)), abs_tol=float(extra.get("abs_tol", 1e-6)))
    return float(ok), ok


_TRUE, _FALSE = {"yes", "true", "correct", "right", "1", "y", "t"}, {"no", "false", "incorrect", "wrong", "0", "n", "f"}


def bool_value(s: str) -> bool | None:
    w = _norm(s).split()
    if not w:
        return None
    return True if w[0] in _TRUE else False if w[0] in _FALSE else None


def bool_reward(response: str, gt: str, extra: dict):
    p, g = bool_value(extract_answer(response)), bool_value(gt)
    ok = p is not None and p == g
    return float(ok), ok


def string_reward(response: str, gt: str, extra: dict):
    ok = _norm(extract_answer(response)) == _norm(gt)
    return float(ok), ok


def exact_reward(response: str, gt: str, extra: dict):
    """The recipe's ``critic`` rule: the answer equals the ground truth after stripping whitespace."""
    ok = bool(gt and gt.strip()) and extract_answer(response).strip() == gt.strip()
    return float(ok), ok


# -- bbox, OCR, HTML ----------------------------------------------------------------------
def parse_box(s: str) -> list[float] | None:
    s = (s or "")[:10_000]
    try:
        v = json.loads(s)
        if isinstance(v, dict):
            v = v.get("bbox_2d") or v.get("bbox") or v.get("box")
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (list, dict)):
            v = v[0].get("bbox_2d") if isinstance(v[0], dict) else v[0]
        if isinstance(v, list) and len(v) == 4 and all(isinstance(x, (int, float)) for x in v):
            return [float(x) for x in v]
    except (ValueError, TypeError, AttributeError, RecursionError):
        pass
    nums = _NUM.findall(s)
    if len(nums) >= 4:
        try:
            return [float(x.replace(",", "")) for x in nums[-4:]]
        except ValueError:
            return None
    return None


def iou(a: list[float], b: list[float]) -> float:
    ax1, ay1, ax2, ay2 = a
    bx1, by1, bx2, by2 = b
    iw = max(0.0, min(ax2, bx2) - max(ax1, bx1))
    ih = max(0.0, min(ay2, by2) - max(ay1, by1))
    inter = iw * ih
    union = max(0.0, ax2 - ax1) * max(0.0, ay2 - ay1) + max(0.0, bx2 - bx1) * max(0.0, by2 - by1) - inter
    return inter / union if union > 0 else 0.0


def bbox_reward(response: str, gt: str, extra: dict):
    p, g = parse_box(extract_answer(response)), parse_box(gt)
    if p is None or g is None:
        return 0.0, False
    v = iou(p, g)
    return v, v >= float(extra.get("iou_threshold", 0.5))


def _ocr_golds(gt: str) -> list[str]:
    """A JSON list of acceptable transcriptions, or the ground truth itself."""
    g = (gt or "").strip()
    if g.startswith("["):
        try:
            v = json.loads(g)
            if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
                return v
        except ValueError:
            pass
    return [g]


def ocr_reward(response: str, gt: str, extra: dict):
    """The recipe's rule: lower-cased, whitespace collapsed, 1 − Levenshtein / max length against
    the best of the acceptable answers, zero below 0.5; an empty answer scores 0."""
    from rapidfuzz.distance import Levenshtein

    norm = lambda t: " ".join(t.strip().lower().split())  # noqa: E731
    p = norm(extract_answer(response))
    if not p:
        return 0.0, False
    score = max(1 - Levenshtein.distance(p, g) / max(len(p), len(g)) for g in map(norm, _ocr_golds(gt)))
    score = score if score >= 0.5 else 0.0
    return score, score >= 0.9


_TAG = re.compile(r"</?\s*([a-zA-Z][a-zA-Z0-9-]*)")
_WORD = re.compile(r"[A-Za-z0-9]+")


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if (a or b) else 1.0


def html_reward(response: str, gt: str, extra: dict):
    """0.6 · token Jaccard + 0.4 · tag Jaccard."""
    body = extract_answer(response) if "<answer>" in (response or "") else (response or "")[:MAX_RESPONSE_CHARS]
    text = lambda h: set(_WORD.findall(re.sub(r"<[^>]*>", " ", h)))  # noqa: E731
    tags = lambda h: set(t.lower() for t in _TAG.findall(h))  # noqa: E731
    score = 0.6 * jaccard(text(body), text(gt)) + 0.4 * jaccard(tags(body), tags(gt))
    return score, score >= 0.9


# -- format -------------------------------------------------------------------------------
_RECIPE_FORMAT = re.compile(r".*<think>.*</think>.*\\boxed\{.*\}.*", re.S)
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.S)


def format_reward(response: str, gt: str = "", extra: dict | None = None):
    """The recipe's ``reward/format.py``: the response is ``…<think>…</think>…\\boxed{…}…`` with exactly one
    ``<think>`` and one ``</think>``, and its ``<answer>`` blocks (each counted + 9 characters, as the recipe's
    ``extract_boxed_content`` — which reads ``<answer>``, not ``\\boxed`` — does) are at most 20% of its length."""
    r = (response or "")[:MAX_RESPONSE_CHARS]
    if not _RECIPE_FORMAT.fullmatch(r) or r.count("<think>") != 1 or r.count("</think>") != 1:
        return 0.0, False
    ok = sum(len(b) + 9 for b in _ANSWER_BLOCK.findall(r)) / len(r) <= 0.2
    return float(ok), ok


def answer_or_boxed_format_reward(response: str, gt: str = "", extra: dict | None = None):
    """Named variant ``format-answer-or-boxed`` (ovpipe's earlier rule, kept beside the recipe's): exactly one
    ``<think>…</think>``, an ``<answer>…</answer>`` *or* a ``\\boxed{}``, the last boxed content at most 20% of the
    response — it accepts what the recipe's own thinking prompt asks for (``<answer>``), which the recipe's
    format reward (``\\boxed`` required) scores 0."""
    r = (response or "")[:MAX_RESPONSE_CHARS]
    thinks = re.findall(r"<think>.*?</think>", r, re.S)
    has_answer = bool(re.search(r"<answer>.*?</answer>", r, re.S)) or last_boxed(r) is not None
    boxed = last_boxed(r)
    ok = len(thinks) == 1 and r.count("<think>") == 1 and has_answer and (boxed is None or len(boxed) <= 0.2 * len(r))
    return float(ok), ok


_SHUFFLE_R1_FORMAT = re.compile(r"\s*<think>.*?</think>.*\\boxed\{.*\}.*", re.S)


def shuffle_r1_format(response: str) -> float:
    """Shuffle-R1's format term: a ``<think>…</think>`` block, then the answer in ``\\boxed{}``."""
    r = (response or "")[:MAX_RESPONSE_CHARS]
    return 1.0 if _SHUFFLE_R1_FORMAT.fullmatch(r) and r.count("<think>") == 1 else 0.0
