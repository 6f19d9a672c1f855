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

``EngineDriver`` runs the controller on a real engine (``grpo.engines``: transformers' continuous batching on the
CPU, vLLM on a GPU): it admits what the controller schedules, steps the engine, feeds the new tokens and their
log-probs back, stops the running requests at each early termination and resumes the paused ones with their
tokens as the prompt. Every engine step is logged (requests computed ``r_k``, wall time), which is what the bubble
ratio (the paper's eq. 4) is computed from. ``synchronous_rollout`` is the baseline on the same engine.
``make_rollout_func`` puts the driver behind TRL's ``rollout_func``. ``grpo.rollout_sim`` is the same controller
on a modelled engine, the explanation of where the figures come from (bench/bench_sortedrl.py compares the two).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Mode = Literal["on_policy", "partial"]
MODES = ("on_policy", "partial")


@dataclass
class Entry:
    prompt_id: int
    target_len: int                   # the token budget (max new tokens); a real engine may stop earlier at EOS
    tokens: int = 0
    logprobs: list = field(default_factory=list)
    versions: list = field(default_factory=list)   # policy version of each generated chunk
    prompt_ids: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    token_versions: list = field(default_factory=list)   # the policy version that sampled each token
    done: bool = False
    state: str = "cached"
    restarts: int = 0
    finished_at: int = -1                          # completion order, so a batch takes the earliest finished
    group: int = -1                                # the GRPO group (rollouts of one prompt); -1: its own
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
    def __init__(self, batch_size: int, mode: Mode = "on_policy", terminate_at: int | None = None,
                 group_size: int = 1):
        """``group_size``: a batch takes whole GRPO groups (``Entry.group``), a group being finished when its last
        rollout is; 1 is the paper's per-rollout rule."""
        if mode not in MODES:
            raise ValueError(f"sortedrl.mode must be one of {', '.join(MODES)}, got {mode!r}")
        if batch_size < 1 or group_size < 1 or batch_size % group_size:
            raise ValueError(f"sortedrl: batch_size={batch_size} must be a positive multiple of the GRPO group "
                             f"size {group_size}")
        self.group_size = group_size
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

    def on_step(self, e: Entry, n_tokens: int, logprobs=None, token_ids=None) -> None:
        e.tokens += n_tokens
        if logprobs is not None:
            e.logprobs.extend(logprobs)
        if token_ids is not None:
            e.token_ids.extend(token_ids)
            e.token_versions.extend([self.version] * n_tokens)
        if not e.versions or e.versions[-1] != self.version:
            e.versions.append(self.version)

    def on_finish(self, e: Entry) -> None:
        e.done, e.finished_at = True, self._finished
        self._finished += 1
        e.move("completed")

    def ready_batch(self, final: bool = False) -> list[Entry] | None:
        done = sorted(self.buffer.by_state("completed"), key=lambda e: e.finished_at)
        if self.group_size > 1:
            groups: dict[int, list[Entry]] = {}
            for e in done:
                groups.setdefault(e.group, []).append(e)
            whole = sorted((g for g in groups.values() if len(g) == self.group_size), key=lambda g: g[-1].finished_at)
            done = [e for g in whole for e in g]
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
                self._discard(e)
        for e in stopped:
            if self.mode == "on_policy":
                self._discard(e)
            else:
                e.move("paused")
        return stopped

    def _discard(self, e: Entry) -> None:
        self.wasted_tokens += e.tokens
        e.tokens, e.logprobs, e.versions, e.token_ids, e.token_versions = 0, [], [], [], []
        e.done, e.finished_at = False, -1
        e.restarts += 1
        e.move("cached")


# ---------------------------------------------------------------------------------------------------------------
# The controller on a real engine


@dataclass
class StepLog:
    running: int              # r_k: requests the step computed
    seconds: float            # Δt_k
    draining: bool            # nothing left to admit, ever: the final drain
    prefill_tokens: int
    context_tokens: int
    new_tokens: int


@dataclass
class EngineRun:
    """What one rollout run did on an engine: its steps and its emitted batches (entries, in emission order)."""
    mode: str
    slots: int
    steps: list = field(default_factory=list)
    batches: list = field(default_factory=list)
    wasted_tokens: int = 0

    @property
    def time_s(self) -> float:
        return sum(s.seconds for s in self.steps)

    def _idle(self, drain_only: bool = False) -> float:
        return sum((self.slots - s.running) * s.seconds for s in self.steps if s.draining or not drain_only)

    @property
    def bubble_ratio(self) -> float:
        """The paper's eq. 4, Σ_k (Q − r_k)·Δt_k / (T·Q), over every step (the final drain included)."""
        return self._idle() / (self.time_s * self.slots)

    @property
    def drain_bubble(self) -> float:
        """The part of ``bubble_ratio`` accrued in the final drain (same denominator, as in ``rollout_sim``)."""
        return self._idle(True) / (self.time_s * self.slots)

    @property
    def generated_tokens(self) -> int:
        return sum(s.new_tokens for s in self.steps)

    @property
    def trained_tokens(self) -> int:
        return sum(e.tokens for b in self.batches for e in b)

    @property
    def tokens_per_s(self) -> float:
        return self.trained_tokens / self.time_s

    @property
    def schedule(self) -> list:
        return [([e.prompt_id for e in b], [list(e.versions) for e in b]) for b in self.batches]


class EngineDriver:
    """The controller driving an engine, batch by batch: ``feed`` groups of entries (each a prompt, its token ids
    and its budget), ``next_batch`` runs the engine until the controller emits a batch, and stops (on-policy:
    discards) what is still running. ``close_source()`` says no group will follow the fed ones, so the steps
    after the last admission count as the final drain. ``slots`` is Q, the requests the engine runs at once."""

    def __init__(self, ctl: SortedRLController, engine, slots: int):
        if slots < 1:
            raise ValueError(f"sortedrl.slots={slots} must be at least 1")
        self.ctl, self.engine, self.slots = ctl, engine, slots
        self.groups: deque = deque()
        self.running: dict[str, Entry] = {}
        self.run = EngineRun(ctl.mode, slots)
        self.source_closed = False
        self._attempts: dict[int, int] = {}

    def feed(self, group: list[Entry]) -> None:
        self.groups.append(group)

    def close_source(self) -> None:
        self.source_closed = True

    def _rid(self, e: Entry) -> str:
        n = self._attempts.get(e.prompt_id, 0)
        self._attempts[e.prompt_id] = n + 1
        return f"{e.prompt_id}.{n}"

    def _emit(self, batch: list[Entry]) -> list[Entry]:
        self.run.batches.append(batch)
        stopped = {id(e) for e in self.ctl.end_update()}
        for rid, e in list(self.running.items()):
            if id(e) in stopped:
                partial = self.engine.stop(rid)
                # partial mode: the engine's partial is the tail the buffer already holds (nothing unseen is lost)
                if e.state == "paused" and partial.token_ids != e.token_ids[len(e.token_ids) - len(partial.token_ids):]:
                    raise RuntimeError(f"request {rid}: the engine's partial tokens disagree with the buffer's")
                del self.running[rid]
        self.run.wasted_tokens = self.ctl.wasted_tokens
        return batch

    def next_batch(self) -> list[Entry] | None:
        ctl = self.ctl
        while True:
            if ctl.needs_group():
                if not self.groups:
                    return None
                ctl.load_group(self.groups.popleft())
            for e in ctl.schedule(self.slots - len(self.running)):
                rid = self._rid(e)
                if e.tokens:                                   # a paused partial: its tokens become the prompt
                    self.engine.resume(rid, e.prompt_ids, e.token_ids, e.target_len - e.tokens)
                else:
                    self.engine.admit(rid, e.prompt_ids, e.target_len)
                self.running[rid] = e
            if not self.running:
                batch = ctl.ready_batch(final=True)
                if batch:
                    return self._emit(batch)
                continue                                       # the group is consumed: load the next one
            waiting = any(e.state in ("cached", "paused") for e in ctl.buffer.entries.values())
            rep = self.engine.step()
            self.run.steps.append(StepLog(rep.running, rep.seconds, not waiting and not self.groups and
                                          self.source_closed, rep.prefill_tokens, rep.context_tokens,
                                          sum(len(p.token_ids) for p in rep.new.values())))
            for rid, p in rep.new.items():
                ctl.on_step(self.running[rid], len(p.token_ids), p.logprobs, p.token_ids)
            for rid in rep.finished:
                ctl.on_finish(self.running.pop(rid))
            remaining = sum(1 for e in ctl.buffer.entries.values() if e.state in ("cached", "paused", "running"))
            batch = ctl.ready_batch(final=remaining == 0)
            if batch:
                return self._emit(batch)


def run_sorted(engine, groups: list[list[Entry]], slots: int, batch_size: int, mode: Mode,
               terminate_at: int | None = None, measure_batches: int | None = None, group_size: int = 1) -> EngineRun:
    """The controller over ``groups`` on ``engine`` until every entry is trained (or ``measure_batches``)."""
    drv = EngineDriver(SortedRLController(batch_size, mode, terminate_at, group_size), engine, slots)
    for g in groups:
        drv.feed(g)
    drv.close_source()
    while measure_batches is None or len(drv.run.batches) < measure_batches:
        if drv.next_batch() is None:
            break
    for rid in list(drv.running):                             # measure_batches: the rest is left unfinished
        engine.stop(rid)
    return drv.run


def synchronous_rollout(engine, entries: list[Entry], slots: int, batch_size: int) -> EngineRun:
    """The baseline on the same engine: a batch's prompts fill the slots (refilled while the batch has prompts
    left), and the update waits for the batch's longest rollout."""
    run = EngineRun("baseline", slots)
    for b in range(0, len(entries), batch_size):
        batch = entries[b:b + batch_size]
        pending, running = deque(batch), {}
        while pending or running:
            while pending and len(running) < slots:
                e = pending.popleft()
                rid = f"{e.prompt_id}.0"
                engine.admit(rid, e.prompt_ids, e.target_len)
                running[rid] = e
            rep = engine.step()
            run.steps.append(StepLog(rep.running, rep.seconds, not pending, rep.prefill_tokens, rep.context_tokens,
                                     sum(len(p.token_ids) for p in rep.new.values())))
            for rid, p in rep.new.items():
                e = running[rid]
                e.tokens += len(p.token_ids)
                e.token_ids += p.token_ids
                e.logprobs += p.logprobs
                e.token_versions += [len(run.batches)] * len(p.token_ids)
            for rid in rep.finished:
                e = running.pop(rid)
                e.done, e.versions = True, [len(run.batches)]
                e.move("consumed")
        run.batches.append(batch)
    return run


# ---------------------------------------------------------------------------------------------------------------
# Inside `ovpipe grpo`: the controller as TRL's rollout_func


@dataclass(frozen=True)
class SortedRLConfig:
    """``grpo``'s ``sortedrl: {...}``. ``mode``: on_policy | partial. ``group_batches``: generation batches of
    prompts cached per group (grouped loading; 1 leaves early termination nothing to cut). ``slots``: requests the
    engine runs at once (0: one generation batch, the paper's Q). ``terminate_at``: early termination after this
    many batches' worth of finished rollouts (≥ 1). ``engine``: transformers (continuous batching over the policy
    being trained, weights shared) or vllm."""
    mode: str = ""
    group_batches: int = 2
    slots: int = 0
    terminate_at: float = 1.0
    engine: str = "transformers"

    def __post_init__(self):
        from grpo.engines import ENGINES

        if self.mode not in MODES:
            raise ValueError(f"sortedrl.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.group_batches < 1:
            raise ValueError(f"sortedrl.group_batches={self.group_batches}: a group holds at least one batch of "
                             f"prompts (a batch larger than the group could never be filled)")
        if self.slots < 0:
            raise ValueError(f"sortedrl.slots={self.slots} must be >= 0 (0: one generation batch)")
        if self.terminate_at < 1:
            raise ValueError(f"sortedrl.terminate_at={self.terminate_at} must be >= 1 (batches of completions)")
        if self.engine != "transformers":
            raise ValueError(f"sortedrl.engine={self.engine!r}: inside `ovpipe grpo` only the transformers engine "
                             f"shares the trained weights (known engines: {', '.join(ENGINES)})")

    @classmethod
    def from_dict(cls, d: dict) -> "SortedRLConfig":
        known = {f.name for f in cls.__dataclass_fields__.values()}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"sortedrl: unknown keys {unknown}; known: {', '.join(sorted(known))}")
        return cls(**d)


class SortedRLRollouts:
    """TRL's ``rollout_func(prompts, trainer)`` with SortedRL as the rollout source.

    TRL hands each call the generation batch's prompts (``num_generations`` copies of each, contiguous) and expects
    as many completions. SortedRL owns prompt loading (grouped loading is half the algorithm), so the controller
    caches ``group_batches`` batches of prompts of the training set — its own seeded order, epoch after epoch — and
    each call returns the first batch of *whole groups* to finish (a GRPO group's advantages need all of its
    rollouts), which need not be the prompts TRL passed. Each returned row therefore carries its own prompt's
    reward columns (``ground_truth``, ``answer_type``, …) as extra fields, which TRL writes over the dataset row's
    before the rewards run, plus ``token_versions`` (the policy version that sampled each completion token: the
    optimizer step, one generation per step), ``policy_version`` (the oldest) and ``trained_version`` (the step that
    trains the batch; ``OvpipeGRPOTrainer`` weighs the tokens of earlier versions by AReaL's behaviour importance
    weights). One call is one policy update:
    the rollouts still running are stopped, kept with their tokens and log-probs (partial) or discarded and counted
    as waste (on-policy). The engine is transformers' continuous batching over the trained model itself (the same
    parameters, so an update reaches the engine with no copy). Text prompts only: the engine runs a causal LM.
    Engine figures of the call go in ``trainer.rollout_stats``."""

    def __init__(self, cfg: SortedRLConfig, processor):
        self.cfg, self.processor = cfg, processor
        self.tok = getattr(processor, "tokenizer", processor)
        self.driver: EngineDriver | None = None
        self.rows: dict[int, dict] = {}
        self._order: list[int] = []
        self.rank, self.world = 0, 1
        self._epoch = self._next = self._uid = self._group = 0
        self.calls = 0

    def _setup(self, trainer, per_call: int) -> None:
        from grpo.engines.cb import ContinuousBatchingEngine

        ds = trainer.train_dataset
        if "images" in ds.column_names:
            raise ValueError("sortedrl: the continuous-batching engine generates text only; this split has images")
        G = trainer.num_generations
        if per_call % G:
            raise ValueError(f"sortedrl: {per_call} prompts a call is not whole groups of num_generations={G}")
        self.G, self.batch, self.ds, self.seed = G, per_call, ds, trainer.args.seed
        # at N ranks each runs its own controller and engine over its own shard of the epoch's prompt order (TRL
        # hands each process its slice of the generation batch, whole groups): one seeded order, rank r's prompts
        # those at r, r + N, …, so no prompt is generated on two ranks in one epoch
        self.rank, self.world = trainer.accelerator.process_index, trainer.accelerator.num_processes
        if len(ds) < self.world:
            raise ValueError(f"sortedrl: {len(ds)} prompt(s) cannot give each of {self.world} ranks a shard of its own")
        model = trainer.accelerator.unwrap_model(trainer.model)
        slots = self.cfg.slots or per_call
        self.engine = ContinuousBatchingEngine(model, slots=slots, max_len=self._max_prompt() +
                                               trainer.max_completion_length, seed=trainer.args.seed,
                                               temperature=trainer.temperature)
        ctl = SortedRLController(per_call, self.cfg.mode, max(per_call, round(self.cfg.terminate_at * per_call)), G)
        self.driver = EngineDriver(ctl, self.engine, slots)
        self.max_new = trainer.max_completion_length

    def _max_prompt(self) -> int:
        return max(len(self._encode(p)) for p in self.ds["prompt"])

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, list):                              # chat messages
            text = self.tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            return self.tok(text, add_special_tokens=False)["input_ids"]
        return self.tok(prompt)["input_ids"]

    def _next_group(self) -> list[Entry]:
        n = self.cfg.group_batches * self.batch // self.G
        out = []
        for _ in range(n):
            if self._next >= len(self._order):                   # a new epoch, its own seeded order, this rank's shard
                order = np.random.default_rng(self.seed + self._epoch).permutation(len(self.ds))
                self._order = list(order[self.rank::self.world])
                self._epoch, self._next = self._epoch + 1, 0
            row = self.ds[int(self._order[self._next])]
            self._next += 1
            ids = self._encode(row["prompt"])
            for _ in range(self.G):
                self.rows[self._uid] = row
                out.append(Entry(self._uid, self.max_new, prompt_ids=list(ids), group=self._group))
                self._uid += 1
            self._group += 1
        return out

    def __call__(self, prompts: list, trainer) -> dict:
        model = trainer.accelerator.unwrap_model(trainer.model)
        was_training = model.training                # the engine runs the policy in eval mode; training resumes
        if self.driver is None:
            self._setup(trainer, len(prompts))
        if len(prompts) != self.batch:
            raise ValueError(f"sortedrl: TRL passed {len(prompts)} prompts, the first call {self.batch}")
        drv = self.driver
        first_step = len(drv.run.steps)
        model.eval()
        try:
            while True:
                if drv.ctl.needs_group() and not drv.groups:
                    drv.feed(self._next_group())
                batch = drv.next_batch()
                if batch is not None:
                    break
        finally:
            model.train(was_training)
        self.calls += 1
        for e in batch:                                          # emitted: its row will not be needed again
            e.row = self.rows.pop(e.prompt_id)
        batch = sorted(batch, key=lambda e: (e.group, e.prompt_id))      # groups contiguous, as TRL's sampler
        steps = drv.run.steps[first_step:]
        t = sum(s.seconds for s in steps)
        idle = sum((drv.slots - s.running) * s.seconds for s in steps)
        stale = sum(sum(1 for v in e.token_versions if v < drv.ctl.version - 1) for e in batch)
        tokens = sum(e.tokens for e in batch)
        trainer.rollout_stats = {
            "engine_s": t, "engine_steps": float(len(steps)), "bubble_ratio": idle / (t * drv.slots) if t else 0.0,
            "tokens_per_s": tokens / t if t else 0.0, "wasted_tokens": float(drv.ctl.wasted_tokens),
            "stale_token_share": stale / tokens if tokens else 0.0,
            "resumed_rollout_share": sum(len(e.versions) > 1 for e in batch) / len(batch)}
        keys = [k for k in batch[0].row if k not in ("prompt", "images")]
        out = {"prompt_ids": [list(e.prompt_ids) for e in batch], "completion_ids": [list(e.token_ids) for e in batch],
               "logprobs": [list(e.logprobs) for e in batch],
               "token_versions": [list(e.token_versions) for e in batch],
               "policy_version": [min(e.token_versions) if e.token_versions else drv.ctl.version - 1 for e in batch],
               # the version this batch is trained at: its tokens of earlier ones get the behaviour weights
               "trained_version": [drv.ctl.version - 1] * len(batch)}
        out.update({k: [e.row[k] for e in batch] for k in keys})
        return out


def make_rollout_func(cfg: dict, processor) -> SortedRLRollouts:
    """``grpo``'s ``sortedrl: {mode, …}`` as TRL's ``rollout_func`` (see ``SortedRLRollouts``)."""
    return SortedRLRollouts(SortedRLConfig.from_dict(dict(cfg)), processor)
