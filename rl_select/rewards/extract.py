"""Pulling the final answer out of an untrusted response, with hard size limits."""
from __future__ import annotations

import re

MAX_RESPONSE_CHARS = 200_000          # longer responses are cut before any parsing
MAX_ANSWER_CHARS = 4_000



class BadResponse(ValueError):
    """The response cannot be scored (malformed JSON, unsafe SVG, no <svg>): reward 0, status
    ``bad_response``. It counts as an incorrect rollout, unlike ``error`` (a broken ground truth or
    reward), which drops the prompt."""


def parse_response(fn, text: str):
    """``fn(text)``, with any parsing failure of the untrusted text turned into ``BadResponse``."""
    try:
        return fn(text)
    except BadResponse:
        raise
    except Exception as e:  # any failure on the untrusted side (the same parser accepted the ground truth)
        raise BadResponse(f"{type(e).__name__}: {e}"[:200]) from None


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{…}`` (balanced braces), or None."""
    i = text.rfind("\\boxed")
    if i < 0:
        return None
    j = text.find("{", i)
    if j < 0:
        return None
    depth = 0
    for k in range(j, min(len(text), j + MAX_ANSWER_CHARS)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return text[j + 1:k]
    return None


def extract_answer(response: str) -> str:
    """``<answer>…</answer>`` (last one), else the last ``\\boxed{}``, else the last non-empty line."""
    response = (response or "")[-MAX_RESPONSE_CHARS:]
    found = _ANSWER.findall(response)
    if found:
        ans = found[-1]
        boxed = last_boxed(ans)
        return (boxed if boxed is not None else ans).strip()[:MAX_ANSWER_CHARS]
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed.strip()[:MAX_ANSWER_CHARS]
    lines = [ln for ln in response.strip().splitlines() if ln.strip()]
    return (lines[-1].strip() if lines else "")[:MAX_ANSWER_CHARS]
