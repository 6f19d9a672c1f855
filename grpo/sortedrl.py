"""SortedRL: length-aware online rollout scheduling, as a framework-neutral controller plus a
discrete-event simulation of a rollout engine to measure it.

The controller (``SortedRLController``) sits between a prompt source and an inference engine:

* **grouped prompt loading** — a *group* of prompts (enough for several policy updates) is loaded
  into the cache; no new prompt enters until every cached prompt of the group is consumed;
* **oversubscription** — free engine slots are always filled from the whole cached group, not
  only from the current batch, so the engine stays saturated;
* **early termination** — as soon as ``batch_size`` rollouts have completed, the batch is emitted
  for the update (it naturally holds the *shortest* completions: length-sorted batches), and the
  still-running rollouts are stopped;
* **on-policy mode** — stopped rollouts are discarded and regenerated from scratch under the
  new policy (every trained token is on-policy; the discarded tokens are wasted work);
* **partial mode** — stopped rollouts keep their partial trajectory and its log-probs in the
  buffer and resume after the update (no waste; tokens from several policy versions, recorded
  per entry for the decoupled loss's behaviour weights).

``RolloutBuffer`` entries carry the prompt, the partial trajectory (token count or ids), its
log-probs, the completion flag, the policy version(s) and a lifecycle state
(cached → running → paused/aborted → … → completed → consumed).

``simulate`` runs baseline / on-policy / partial on the same prompt lengths with an engine of
``Q`` slots that decodes one token per running sequence per step (Δt = 1), and reports

    bubble ratio = Σ_k (Q − r_k)·Δt_k / (T·Q)      (r_k sequences running during step k)
    output tokens/s = trained tokens / T
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Mode = Literal["on_policy", "partial"]


@dataclass
class Entry:
    prompt_id: int
    target_len: int                   # the engine's business; the controller never reads it
    tokens: int = 0
    logprobs: list = field(default_factory=list)
    versions: list = field(default_factory=list)   # policy version of each generated chunk
    done: bool = False
    state: str = "cached"
    restarts: int = 0


class RolloutBuffer:
    def __init__(self) -> None:
        self.entries: dict[int, Entry] = {}

    def add(self, e: Entry) -> None:
        self.entries[e.prompt_id] = e

    def by_state(self, state: str) -> list[Entry]:
        return [e for e in self.entries.values() if e.state == state]


class SortedRLController:
    def __init__(self, batch_size: int, mode: Mode = "on_policy"):
        self.batch_size = batch_size
        self.mode = mode
        self.buffer = RolloutBuffer()
        self.version = 0
        self.wasted_tokens = 0

    # prompt loading ----------------------------------------------------------------------
    def needs_group(self) -> bool:
        return not any(e.state != "consumed" for e in self.buffer.entries.values())

    def load_group(self, entries: list[Entry]) -> None:
        assert self.needs_group(), "grouped loading: the current group is not consumed yet"
        self.buffer = RolloutBuffer()
        for e in entries:
            self.buffer.add(e)

    # scheduling --------------------------------------------------------------------------
    def schedule(self, free_slots: int) -> list[Entry]:
        """Entries to start: paused partials first (oldest work), then cached prompts."""
        ready = self.buffer.by_state("paused") + self.buffer.by_state("cached")
        out = ready[:free_slots]
        for e in out:
            e.state = "running"
        return out

    def on_step(self, e: Entry, n_tokens: int, logprobs=None) -> None:
        e.tokens += n_tokens
        if logprobs is not None:
            e.logprobs.extend(logprobs)
        if not e.versions or e.versions[-1] != self.version:
            e.versions.append(self.version)

    def on_finish(self, e: Entry) -> None:
        e.done, e.state = True, "completed"

    def ready_batch(self, final: bool = False) -> list[Entry] | None:
        done = self.buffer.by_state("completed")
        if len(done) >= self.batch_size or (final and done):
            batch = done[: self.batch_size]
            for e in batch:
                e.state = "consumed"
            return batch
        return None

    def end_update(self) -> list[Entry]:
        """After a batch is emitted: stop the running rollouts (returned, for the engine to drop)."""
        self.version += 1
        stopped = self.buffer.by_state("running")
        for e in stopped:
            if self.mode == "on_policy":
                self.wasted_tokens += e.tokens
                e.tokens, e.logprobs, e.versions = 0, [], []
                e.state, e.restarts = "cached", e.restarts + 1
            else:
                e.state = "paused"
        return stopped


def sample_lengths(n: int, max_len: int = 8192, seed: int = 0, median: float = 600.0, sigma: float = 1.1) -> np.ndarray:
    """Long-tailed output lengths (lognormal, capped at ``max_len``)."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(median), sigma, n), 16, max_len).astype(np.int64)


@dataclass
class SimResult:
    mode: str
    steps: int
    bubble_ratio: float
    trained_tokens: int
    wasted_tokens: int
    tokens_per_step: float
    batches: int


def simulate_baseline(lengths: np.ndarray, Q: int, batch_size: int) -> SimResult:
    """Synchronous rollout: a batch's prompts fill the engine; the update waits for the longest."""
    steps = idle = 0
    for b in range(0, len(lengths), batch_size):
        pending = list(lengths[b:b + batch_size])
        running: list[int] = []
        while pending or running:
            while pending and len(running) < Q:
                running.append(int(pending.pop()))
            # advance to the next completion in one jump (same accounting as per-step)
            dt = min(running)
            steps += dt
            idle += (Q - len(running)) * dt
            running = [r - dt for r in running if r - dt > 0]
    return SimResult("baseline", steps, idle / (steps * Q), int(lengths.sum()), 0, lengths.sum() / steps,
                     -(-len(lengths) // batch_size))


def simulate_sorted(lengths: np.ndarray, Q: int, batch_size: int, mode: Mode, group_batches: int | None = None) -> SimResult:
    group = batch_size * (group_batches or -(-len(lengths) // batch_size))
    ctl = SortedRLController(batch_size, mode)
    steps = idle = batches = trained = 0
    next_prompt = 0
    running: list[Entry] = []
    while True:
        if ctl.needs_group():
            if next_prompt >= len(lengths):
                break
            ids = range(next_prompt, min(next_prompt + group, len(lengths)))
            ctl.load_group([Entry(i, int(lengths[i])) for i in ids])
            next_prompt += len(ids)
        running += ctl.schedule(Q - len(running))
        if not running:
            batch = ctl.ready_batch(final=True)
            if batch:
                batches += 1
                trained += sum(e.tokens for e in batch)
                ctl.end_update()
                continue
            break
        dt = min(e.target_len - e.tokens for e in running)
        steps += dt
        idle += (Q - len(running)) * dt
        still = []
        for e in running:
            ctl.on_step(e, dt)
            if e.tokens >= e.target_len:
                ctl.on_finish(e)
            else:
                still.append(e)
        running = still
        remaining = sum(1 for e in ctl.buffer.entries.values() if e.state in ("cached", "paused", "running"))
        batch = ctl.ready_batch(final=remaining == 0)
        if batch:
            batches += 1
            trained += sum(e.tokens for e in batch)
            if remaining:          # early termination; the last batch of a group has nothing to stop
                stopped = set(id(e) for e in ctl.end_update())
                running = [e for e in running if id(e) not in stopped]
            else:
                ctl.end_update()
    return SimResult(mode, steps, idle / (steps * Q), trained, ctl.wasted_tokens, trained / steps, batches)


def simulate(n: int = 512, n_batches: int = 4, Q: int = 128, max_len: int = 8192, seed: int = 0) -> list[SimResult]:
    lengths = sample_lengths(n, max_len, seed)
    bs = n // n_batches
    return [simulate_baseline(lengths, Q, bs), simulate_sorted(lengths, Q, bs, "on_policy"),
            simulate_sorted(lengths, Q, bs, "partial")]
