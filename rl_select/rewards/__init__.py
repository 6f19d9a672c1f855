"""Reward registry keyed by answer type, and a runner that scores untrusted responses in worker
processes under a time limit.

    REWARDS["math"](response, ground_truth, extra) -> (reward, correct)

Why processes: a pathological answer (a 10⁹-digit power, a deeply nested LaTeX fraction) can
spin SymPy forever, and math-verify's own timeout uses ``signal.alarm``, which only works in a
process's main thread. ``RewardRunner`` sends each job to a pool of worker processes; a job that
exceeds ``timeout_s`` becomes ``status = timeout`` (reward 0) and its worker is replaced; a response
that cannot be parsed (malformed JSON boxes, unsafe SVG) is ``status = bad_response`` (reward 0, an
incorrect rollout); any other exception is ``status = error`` with the message. Nothing in a response is executed.

The recipe's AnswerType names (``multiple-choice``, ``math-expressions``, ``ocrtext``, ``critic`` …)
resolve to the same rules; a prompt's ``require_answer_tag: true`` applies the recipe's extraction
(no ``<answer>…</answer>``, reward 0). Trainers call the same registry through ``rl_select.trainers``.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import time
from typing import Callable

from rl_select.rewards.detection import detection_reward
from rl_select.rewards.extract import MAX_RESPONSE_CHARS, BadResponse
from rl_select.rewards.rules import (answer_or_boxed_format_reward, bbox_reward, bool_reward, choice_reward, exact_reward,
                                     format_reward, html_reward, math_reward, number_reward, ocr_reward,
                                     shuffle_r1_format, string_reward)
from rl_select.rewards.roll import is_roll_row, mathverify_reward, weighted
from rl_select.rewards.svg import svg_reward

REWARDS: dict[str, Callable] = {
    "math": math_reward,
    "choice": choice_reward,
    "multiple_choice": choice_reward,
    "number": number_reward,
    "numeric": number_reward,
    "bbox": bbox_reward,
    "ocr": ocr_reward,
    "html": html_reward,
    "svg": svg_reward,
    "bool": bool_reward,
    "string": string_reward,
    "format": format_reward,                              # the recipe's (rules.format_reward)
    "format-answer-or-boxed": answer_or_boxed_format_reward,   # named variant beside it
    "detection": detection_reward,
    "exact": exact_reward,
    "mathverify": mathverify_reward,     # ROLL's `verifier: "mathverify"` (rl_select.rewards.roll)
}
# the published recipe's AnswerType names (its data ships with them), on the same rules
REWARDS.update({"multiple-choice": choice_reward, "math-expressions": math_reward, "html-code": html_reward,
                "svg-code": svg_reward, "boolean": bool_reward, "ocrtext": ocr_reward, "any": string_reward,
                "critic": exact_reward})


def register(name: str, fn: Callable) -> None:
    REWARDS[name] = fn


def resolve(answer_type: str) -> Callable:
    if answer_type in REWARDS:
        return REWARDS[answer_type]
    if answer_type.startswith("gym-"):
        from rl_select.gym import reward as gym_reward  # the game environments check their own answers

        return lambda r, g, e: gym_reward(answer_type, r, g, e)
    raise KeyError(f"no reward for answer_type {answer_type!r}; known: {sorted(REWARDS)}")


def reward_params(extra) -> dict:
    """A prompt's ``extra`` (JSON) as reward parameters; a ROLL ``verifier_parm`` (a JSON object or
    its text) is merged on top, so e.g. ``{"det_reward_ratio": {…}, "det_verifier_normalized": true}``
    reaches the detection verifier."""
    params = json.loads(extra) if isinstance(extra, str) and extra else dict(extra or {})
    vp = params.get("verifier_parm")
    if isinstance(vp, str) and vp.strip().startswith("{"):
        vp = json.loads(vp)
    if isinstance(vp, dict):
        params.update(vp)
    return params


def has_answer_tag(response: str) -> bool:
    """An ``<answer>…</answer>`` pair (case-insensitive) in the part of the response that is scored."""
    low = (response or "")[-MAX_RESPONSE_CHARS:].lower()
    i = low.find("<answer>")
    return i >= 0 and low.find("</answer>", i) >= 0


def score_one(job: tuple) -> tuple[float, bool, str, str | None]:
    answer_type, response, gt, extra = job
    try:
        fn = resolve(answer_type)
        params = reward_params(extra)
        if params.get("require_answer_tag") and answer_type != "format" and not has_answer_tag(response):
            return 0.0, False, "ok", None      # the recipe's extraction: no <answer>…</answer>, no reward
        r, c = fn(response, gt, params)
        if is_roll_row(params):                # ROLL's accuracy_ratio / format_ratio weighting, every verifier
            r = weighted(answer_type, float(r), response or "", params)
        mix = params.get("reward_mix")
        if mix == "shuffle-r1":                # Shuffle-R1 §5.1: 0.9 · accuracy + 0.1 · format
            r = 0.9 * float(r) + 0.1 * shuffle_r1_format(response or "")
        elif mix is not None:
            raise ValueError(f"reward_mix={mix!r}: the one named combination is 'shuffle-r1'")
        if "correct_threshold" in params:      # per-prompt override of a graded reward's notion of correct
            c = float(r) >= float(params["correct_threshold"])
        return float(r), bool(c), "ok", None
    except BadResponse as e:
        return 0.0, False, "bad_response", str(e)[:300]
    except Exception as e:
        return 0.0, False, "error", f"{type(e).__name__}: {e}"[:300]


def _worker(conn) -> None:
    """Score a batch of ``(index, job)``, answering after each job, so the parent knows which job
    of the batch is running and since when."""
    while True:
        batch = conn.recv()
        if batch is None:
            return
        for i, job in batch:
            conn.send((i, score_one(job)))


_warm = False


def warm_up() -> None:
    """Import and exercise the slow-to-start rewards once in the parent, before the workers fork:
    a worker that had to import SymPy and build math-verify's parsers on its first job spent seconds
    of that job's time limit on it (the demo's first math jobs timed out on a loaded machine)."""
    global _warm
    if _warm:
        return
    _warm = True
    for job in (("math", "<answer>\\frac{1}{2}</answer>", "0.5", "{}"), ("ocr", "<answer>a</answer>", "a", "{}")):
        try:
            score_one(job)
        except Exception:   # best effort (e.g. math-verify's signal timeouts outside the main thread)
            pass


class RewardRunner:
    """Score jobs ``(answer_type, response, ground_truth, extra_json)`` in ``workers`` processes.

    Jobs go out in small batches (one pipe round trip per job made the sandbox ~6× slower than
    in-process scoring for cheap rewards); a worker answers after every job, so the running job
    started at the worker's last answer. A job past ``timeout_s`` is answered ``timeout``, only its
    worker is killed and replaced, and the rest of its batch goes back to the queue.
    """

    def __init__(self, workers: int = 2, timeout_s: float = 5.0, batch: int = 32):
        self.workers = max(1, workers)
        self.timeout_s = timeout_s
        self.batch = max(1, batch)
        self._ctx = mp.get_context("fork")  # workers inherit the imported reward modules
        self._procs: list = []

    def _spawn(self):
        parent, child = self._ctx.Pipe()
        p = self._ctx.Process(target=_worker, args=(child,), daemon=True)
        p.start()
        child.close()
        return p, parent

    def __enter__(self):
        warm_up()
        self._procs = [self._spawn() for _ in range(self.workers)]
        return self

    def __exit__(self, *exc):
        for p, conn in self._procs:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            p.join(timeout=1)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []

    def score(self, jobs: list[tuple]) -> list[tuple[float, bool, str, str | None]]:
        from collections import deque
        from multiprocessing.connection import wait

        out: list = [None] * len(jobs)
        queue = list(range(len(jobs)))[::-1]            # pop() from the end = job order
        busy: dict[int, tuple[deque, float]] = {}      # worker slot -> (pending job indices, last event time)
        while queue or busy:
            for w in range(len(self._procs)):
                if w not in busy and queue:
                    # small batches near the end, so the last jobs spread over all workers
                    size = max(1, min(self.batch, len(queue) // (2 * len(self._procs))))
                    idx = [queue.pop() for _ in range(min(size, len(queue)))]
                    self._procs[w][1].send([(i, jobs[i]) for i in idx])
                    busy[w] = (deque(idx), time.monotonic())
            now = time.monotonic()
            wait_s = max(0.0, min(last + self.timeout_s - now for _, last in busy.values()))
            ready = wait([self._procs[w][1] for w in busy], timeout=wait_s)
            for w in list(busy):
                pending, last = busy[w]
                conn = self._procs[w][1]
                if conn in ready:
                    try:
                        while pending and conn.poll():
                            i, res = conn.recv()
                            out[i] = res
                            pending.popleft()
                            last = time.monotonic()
                    except (EOFError, OSError):   # the worker died (e.g. out of memory) on pending[0]
                        out[pending.popleft()] = (0.0, False, "error", "reward worker died")
                        queue.extend(reversed(pending))
                        pending.clear()
                        self._replace(w)
                    if pending:
                        busy[w] = (pending, last)
                    else:
                        del busy[w]
                elif time.monotonic() - last > self.timeout_s:
                    out[pending.popleft()] = (0.0, False, "timeout", f"reward exceeded {self.timeout_s}s")
                    queue.extend(reversed(pending))
                    self._replace(w)
                    del busy[w]
        return out

    def _replace(self, w: int) -> None:
        p, conn = self._procs[w]
        p.kill()
        p.join()
        conn.close()
        self._procs[w] = self._spawn()
