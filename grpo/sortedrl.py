"""SortedRL: length-aware online rollout scheduling, as a framework-neutral controller.

The controller (``SortedRLController``) sits between a prompt source and an inference engine:

* **grouped prompt loading** — a *group* of prompts (enough for several policy updates) is loaded
  into the cache; no new prompt enters until every cached prompt of the group is consumed;
* **oversubscription** — free engine slots are always filled from the whole cached group, not
  only from the current batch, so the engine stays saturated;
* **early termination** — as soon as ``batch_size`` rollouts have completed (``terminate_at``: the
  paper's rule; a larger value waits for more completions and carries the extra ones, already
  finished, into the next batch), the batch is emitted for the update (it naturally holds the
  *shortest* completions: length-sorted batches), and the still-running rollouts are stopped;
* **on-policy mode** — stopped rollouts are discarded and regenerated from scratch under the
  new policy (every trained token is on-policy; the discarded tokens are wasted work);
* **partial mode** — stopped rollouts keep their partial trajectory and its log-probs in the
  buffer and resume after the update (no waste; tokens from several policy versions, recorded
  per entry for the decoupled loss's behaviour weights).

``RolloutBuffer`` entries carry the prompt, the partial trajectory (token count or ids), its
log-probs, the completion flag, the policy version(s) and a lifecycle state
(cached → running → paused (partial) or cached again (on-policy) → … → completed → consumed), with
every transition kept in ``Entry.history`` so a test can check the lifecycle is complete.

``grpo.rollout_sim`` drives this controller with a rollout engine whose decode step takes the time a
memory-bound engine takes, and measures the bubble ratio and throughput of the paper's workload.
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
    finished_at: int = -1                          # completion order, so a batch takes the earliest finished
    history: list = field(default_factory=list)    # every state this entry entered, in order

    def move(self, state: str) -> None:
        self.state = state
        self.history.append(state)


class RolloutBuffer:
    def __init__(self) -> None:
        self.entries: dict[int, Entry] = {}

    def add(self, e: Entry) -> None:
        self.entries[e.prompt_id] = e
        if not e.history:
            e.history.append(e.state)

    def by_state(self, state: str) -> list[Entry]:
        return [e for e in self.entries.values() if e.state == state]


class SortedRLController:
    def __init__(self, batch_size: int, mode: Mode = "on_policy", terminate_at: int | None = None):
        if terminate_at is not None and terminate_at < batch_size:
            raise ValueError(f"terminate_at={terminate_at} must be at least batch_size={batch_size}")
        self.batch_size = batch_size
        self.terminate_at = terminate_at or batch_size
        self.mode = mode
        self.buffer = RolloutBuffer()
        self.version = 0
        self.wasted_tokens = 0
        self._finished = 0

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
            e.move("running")
        return out

    def on_step(self, e: Entry, n_tokens: int, logprobs=None) -> None:
        e.tokens += n_tokens
        if logprobs is not None:
            e.logprobs.extend(logprobs)
        if not e.versions or e.versions[-1] != self.version:
            e.versions.append(self.version)

    def on_finish(self, e: Entry) -> None:
        e.done, e.finished_at = True, self._finished
        self._finished += 1
        e.move("completed")

    def ready_batch(self, final: bool = False) -> list[Entry] | None:
        done = sorted(self.buffer.by_state("completed"), key=lambda e: e.finished_at)
        if len(done) >= self.terminate_at or (final and done):
            batch = done[: self.batch_size]
            for e in batch:
                e.move("consumed")
            return batch
        return None

    def end_update(self) -> list[Entry]:
        """After a batch is emitted: stop the running rollouts (returned, for the engine to drop)."""
        self.version += 1
        stopped = self.buffer.by_state("running")
        if self.mode == "on_policy":
            # finished under the old policy but not in the emitted batch: stale now, so regenerated too
            for e in self.buffer.by_state("completed"):
                self.wasted_tokens += e.tokens
                e.tokens, e.logprobs, e.versions, e.done, e.finished_at = 0, [], [], False, -1
                e.restarts += 1
                e.move("cached")
        for e in stopped:
            if self.mode == "on_policy":
                self.wasted_tokens += e.tokens
                e.tokens, e.logprobs, e.versions = 0, [], []
                e.restarts += 1
                e.move("cached")
            else:
                e.move("paused")
        return stopped
