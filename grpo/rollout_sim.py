"""SortedRL measured on a rollout engine whose decode step takes the time a real one takes.

The paper's end-to-end test (SortedRL, arXiv 2603.23414, §4.4.1, Figure 5, equation 4): 512 samples in 4
batches, at most 8K generated tokens, each sample's generation length the same in every mode, and

    bubble ratio      = Σ_k (Q − r_k)·Δt_k / (T·Q)     (r_k sequences running in engine step k, Q slots)
    output tokens/s   = trained tokens / T             (T = Σ_k Δt_k, the rollout's wall time)

An engine step's time Δt_k is what decides both figures, so it is modelled, not set to 1 (``EngineTime``):
a decode step of a memory-bound engine reads every weight once and every running sequence's KV cache once,

    Δt = max(W / B + S · kv / B,  r · 2N / F) + overhead        (S: context tokens of the r running sequences)

with W the weights' bytes, kv the KV bytes per token, B the HBM bandwidth, N the parameters and F the bf16
peak. Prefill (a new prompt, a regenerated on-policy rollout, a resumed partial one whose KV cache was
dropped at the stop) costs 2N FLOPs a token at ``prefill_mfu`` of the peak. ``LLAMA31_8B_H100`` takes the
paper's 8B model (32 layers, 8 KV heads of 128, bf16: 128 KiB of KV a token, 16.1 GB of weights) on one H100
SXM (3.35 TB/s, 989 TFLOP/s). The bubble and the throughput *ratios* depend on W / kv (the context in flight
whose KV reads cost as much as the weights: 122K tokens here), not on the card; ``EngineTime.unit()`` is the
Δt = 1 engine, kept to show what the time model changes.

The simulation jumps from event to event (a completion, an admission, an update), integrating the step time
exactly over the jump as the contexts grow by one token a step; the compute bound is taken over the jump's
totals (it never binds below ~295 running sequences for the 8B, above any Q measured here).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from grpo.sortedrl import Entry, Mode, SortedRLController

# The paper's §4.4.1 figures: bubble ratio and output tokens/s per mode.
PAPER = {"baseline": (0.74, 3987.0), "on_policy": (0.0581, 4289.0), "partial": (0.0337, 5559.0)}


@dataclass(frozen=True)
class EngineTime:
    name: str
    fixed_s: float                  # one decode step's weight reads
    kv_s_per_token: float           # one context token's KV reads in a decode step
    flops_s_per_seq: float          # one sequence's decode FLOPs (the compute bound)
    prefill_s_per_token: float
    overhead_s: float = 0.0         # per decode step: scheduling, sampling, launches
    seq_s: float = 0.0              # per running sequence and step, added (a compute-bound CPU engine's matmuls)
    # A measured engine's step cost against the running count, where it is not linear: (r, seconds) knots,
    # interpolated linearly between them and held flat past the last; when set it replaces fixed + seq·r.
    by_running: tuple[tuple[int, float], ...] = ()

    @classmethod
    def unit(cls) -> "EngineTime":
        return cls("Δt = 1", 1.0, 0.0, 0.0, 0.0)

    @classmethod
    def roofline(cls, name: str, params: float, kv_bytes_per_token: float, hbm_bytes_s: float,
                 peak_flops: float, prefill_mfu: float = 0.5, overhead_s: float = 0.0) -> "EngineTime":
        return cls(name, 2 * params / hbm_bytes_s, kv_bytes_per_token / hbm_bytes_s, 2 * params / peak_flops,
                   2 * params / (peak_flops * prefill_mfu), overhead_s)

    def per_step(self, r: int) -> float:
        """One step's cost of ``r`` running sequences, context and prefill aside."""
        if self.by_running:
            ks, ts = zip(*self.by_running)
            return float(np.interp(r, ks, ts))
        return self.fixed_s + self.overhead_s + r * self.seq_s

    def decode(self, r: int, context: int, steps: int) -> float:
        """Seconds of ``steps`` decode steps of ``r`` sequences holding ``context`` tokens in all at the first."""
        if self.kv_s_per_token == 0 and self.flops_s_per_seq == 0:
            return steps * self.per_step(r)
        growth = r * steps * (steps - 1) / 2            # the contexts grow by one token a step
        if self.by_running:
            return steps * (self.per_step(r) + self.kv_s_per_token * context) + self.kv_s_per_token * growth
        memory = steps * (self.fixed_s + self.kv_s_per_token * context) + self.kv_s_per_token * growth
        return max(memory, steps * r * self.flops_s_per_seq) + steps * (self.overhead_s + r * self.seq_s)

    @classmethod
    def fit(cls, name: str, running, context, prefill, seconds, knots=None) -> "EngineTime":
        """Calibrated on an engine's measured steps (``running`` r_k, ``context`` KV tokens at the step's start,
        ``prefill`` prompt tokens computed in the step, ``seconds``), by non-negative least squares:

        * ``knots=None``: Δt = fixed + seq·r + kv·context + prefill·tokens;
        * ``knots`` (running counts, ascending, the first 1): Δt = f(r) + kv·context + prefill·tokens with f
          piecewise linear between the knots (hat functions; flat past the last). A CPU engine's step is not linear
          in r — flat while a step's cost is the weights' reads and the per-step work, then growing once the batch's
          matmuls and per-request work dominate — and a linear f spreads that error over every step; f is kept
          non-decreasing.

        The result plugs into the simulation unchanged."""
        from scipy.optimize import nnls

        r = np.asarray(running, dtype=np.float64)
        y = np.asarray(seconds, dtype=np.float64)
        rest = np.column_stack([context, prefill]).astype(np.float64)
        if knots is None:
            A = np.column_stack([np.ones(len(y)), r, rest])
            (fixed, seq, kv, pre), _ = nnls(A, y)
            return cls(name, float(fixed), float(kv), 0.0, float(pre), 0.0, float(seq))
        ks = [int(k) for k in knots]
        if ks != sorted(set(ks)) or ks[0] != 1:
            raise ValueError(f"knots must be ascending running counts starting at 1, got {ks}")
        # f(r) = f(1) + Σ_i Δ_i·ramp_i(r), each ramp rising 0 → 1 from knot i−1 to knot i: non-negative Δ_i make f
        # non-decreasing (a step computing more requests never costs less), which keeps the fit from trading f
        # against kv·context where the two move together in the sweep
        ramps = [np.clip((r - lo) / (hi - lo), 0.0, 1.0) for lo, hi in zip(ks, ks[1:])]
        coef, _ = nnls(np.column_stack([np.ones(len(y)), *ramps, rest]), y)
        f = np.cumsum(coef[:len(ks)])
        kv, pre = coef[len(ks):]
        return cls(name, 0.0, float(kv), 0.0, float(pre), by_running=tuple((k, float(t)) for k, t in zip(ks, f)))

    def prefill(self, tokens: int) -> float:
        return tokens * self.prefill_s_per_token


LLAMA31_8B_H100 = EngineTime.roofline("LLaMA-3.1-8B bf16, one H100 SXM", 8.03e9, 2 * 32 * 8 * 128 * 2, 3.35e12,
                                      989e12)


def sample_lengths(n: int, max_len: int = 8192, seed: int = 0, median: float = 600.0, sigma: float = 1.1,
                   capped_share: float = 0.0) -> np.ndarray:
    """Long-tailed output lengths: lognormal, capped at ``max_len``; ``capped_share`` of the samples run to the
    cap (truncated generations, as repetition loops give early in RL)."""
    rng = np.random.default_rng(seed)
    out = np.clip(rng.lognormal(np.log(median), sigma, n), 16, max_len).astype(np.int64)
    if capped_share:
        out[rng.random(n) < capped_share] = max_len
    return out


@dataclass
class SimResult:
    mode: str
    time_s: float
    bubble_ratio: float
    trained_tokens: int
    generated_tokens: int
    wasted_tokens: int
    batches: int
    steps: int                                          # decode steps
    drain_bubble: float = 0.0                           # the part of bubble_ratio with nothing left to admit
    schedule: list = field(default_factory=list)        # per batch: (prompt ids, policy versions of each entry)

    @property
    def tokens_per_s(self) -> float:
        return self.trained_tokens / self.time_s


class _Clock:
    """T, the bubble's numerator and the generated tokens, advanced per decode jump and per prefill."""

    def __init__(self, engine: EngineTime, Q: int):
        self.engine, self.Q = engine, Q
        self.t = self.idle = self.drain_idle = 0.0
        self.steps = self.generated = 0

    def decode(self, r: int, context: int, k: int, draining: bool = False) -> None:
        dt = self.engine.decode(r, context, k)
        self.t += dt
        self.idle += (self.Q - r) * dt
        if draining:
            self.drain_idle += (self.Q - r) * dt
        self.steps += k
        self.generated += r * k

    def prefill(self, tokens: int, r: int) -> None:
        dt = self.engine.prefill(tokens)
        self.t += dt
        self.idle += (self.Q - r) * dt


def simulate_baseline(lengths: np.ndarray, prompts: np.ndarray, Q: int, batch_size: int,
                      engine: EngineTime = LLAMA31_8B_H100) -> SimResult:
    """Synchronous rollout: a batch's prompts fill the engine; the update waits for the longest."""
    clock = _Clock(engine, Q)
    schedule = []
    for b in range(0, len(lengths), batch_size):
        pending = list(range(b, min(b + batch_size, len(lengths))))[::-1]
        running: dict[int, int] = {}                    # prompt id → tokens generated
        while pending or running:
            admitted = 0
            while pending and len(running) < Q:
                i = pending.pop()
                running[i] = 0
                admitted += int(prompts[i])
            clock.prefill(admitted, len(running))
            k = min(int(lengths[i]) - g for i, g in running.items())
            clock.decode(len(running), sum(int(prompts[i]) + g for i, g in running.items()), k, not pending)
            running = {i: g + k for i, g in running.items() if g + k < lengths[i]}
        ids = list(range(b, min(b + batch_size, len(lengths))))
        schedule.append((ids, [[0]] * len(ids)))
    trained = int(lengths.sum())
    return SimResult("baseline", clock.t, clock.idle / (clock.t * Q), trained, clock.generated, 0,
                     len(schedule), clock.steps, clock.drain_idle / (clock.t * Q), schedule)


def simulate_sorted(lengths: np.ndarray, prompts: np.ndarray, Q: int, batch_size: int, mode: Mode,
                    engine: EngineTime = LLAMA31_8B_H100, group_batches: int | None = None,
                    measure_batches: int | None = None, terminate_at: int | None = None,
                    reprefill: bool = True) -> SimResult:
    """The controller on the engine. ``group_batches``: prompts cached per group, in batches (default: all of
    them, one group). ``measure_batches``: stop the clock when that many batches are emitted, the rest of the
    group still running (default: every prompt trained, the group drained). ``reprefill``: a resumed partial
    rollout recomputes its prompt and its generated tokens (the engine dropped its KV cache at the stop)."""
    group = batch_size * (group_batches or -(-len(lengths) // batch_size))
    ctl = SortedRLController(batch_size, mode, terminate_at)
    clock = _Clock(engine, Q)
    trained = batches = next_prompt = 0
    running: list[Entry] = []
    schedule = []

    def emit(batch):
        nonlocal trained, batches
        batches += 1
        trained += sum(e.tokens for e in batch)
        schedule.append(([e.prompt_id for e in batch], [list(e.versions) for e in batch]))

    while measure_batches is None or batches < measure_batches:
        if ctl.needs_group():
            if next_prompt >= len(lengths):
                break
            ids = range(next_prompt, min(next_prompt + group, len(lengths)))
            ctl.load_group([Entry(i, int(lengths[i])) for i in ids])
            next_prompt += len(ids)
        started = ctl.schedule(Q - len(running))
        running += started
        clock.prefill(sum(int(prompts[e.prompt_id]) + (e.tokens if reprefill else 0) for e in started), len(running))
        if not running:
            batch = ctl.ready_batch(final=True)
            if not batch:
                break
            emit(batch)
            ctl.end_update()
            continue
        k = min(e.target_len - e.tokens for e in running)
        waiting = any(e.state in ("cached", "paused") for e in ctl.buffer.entries.values())
        clock.decode(len(running), sum(int(prompts[e.prompt_id]) + e.tokens for e in running), k,
                     not waiting and next_prompt >= len(lengths))
        still = []
        for e in running:
            ctl.on_step(e, k)
            if e.tokens >= e.target_len:
                ctl.on_finish(e)
            else:
                still.append(e)
        running = still
        remaining = sum(1 for e in ctl.buffer.entries.values() if e.state in ("cached", "paused", "running"))
        batch = ctl.ready_batch(final=remaining == 0)
        if batch:
            emit(batch)
            stopped = {id(e) for e in ctl.end_update()}
            running = [e for e in running if id(e) not in stopped]
    return SimResult(mode, clock.t, clock.idle / (clock.t * Q), trained, clock.generated, ctl.wasted_tokens,
                     batches, clock.steps, clock.drain_idle / (clock.t * Q), schedule)


@dataclass(frozen=True)
class Workload:
    """The paper's §4.4.1 workload and the modelling choices it leaves open, each a field."""
    n: int = 512
    batches: int = 4
    max_len: int = 8192
    Q: int = 128                    # the engine's running slots: one batch, the update batch size
    median: float = 1200.0          # output lengths: lognormal, capped at max_len; fitted to the paper's
    sigma: float = 1.2              # baseline figures alone by fit_lengths (the bench re-runs the fit)
    capped_share: float = 0.0
    prompt_len: int = 256
    engine: EngineTime = LLAMA31_8B_H100
    window: str = "drain"           # drain: every sample trained; stream: the next group is already cached
    terminate_at: float = 1.0       # early termination after this many batches' worth of completions
    reprefill: bool = True
    seed: int = 0


def run_workload(w: Workload) -> dict[str, SimResult]:
    """Baseline, on-policy and partial on the same samples. Under ``window="stream"`` the controller caches a
    second group's prompts as well (oversubscription across groups) and the clock stops at the 4th batch."""
    bs = w.n // w.batches
    extra = w.n if w.window == "stream" else 0
    lengths = sample_lengths(w.n + extra, w.max_len, w.seed, w.median, w.sigma, w.capped_share)
    prompts = np.full(len(lengths), w.prompt_len, dtype=np.int64)
    kw = dict(engine=w.engine, terminate_at=max(bs, round(w.terminate_at * bs)), reprefill=w.reprefill)
    if w.window == "stream":
        kw.update(group_batches=2 * w.batches, measure_batches=w.batches)
    return {"baseline": simulate_baseline(lengths[:w.n], prompts[:w.n], w.Q, bs, w.engine),
            "on_policy": simulate_sorted(lengths, prompts, w.Q, bs, "on_policy", **kw),
            "partial": simulate_sorted(lengths, prompts, w.Q, bs, "partial", **kw)}


def fit_lengths(bubble: float = PAPER["baseline"][0], tokens_per_s: float = PAPER["baseline"][1],
                w: Workload = Workload()) -> list[tuple[float, float, float, float]]:
    """The output-length distribution is the one input of the paper's workload its text does not give (its
    Figure 1c shows a long tail, not parameters). Fit (median, σ) to the *baseline's* two figures only, so the
    on-policy and partial rows stay predictions: (error, median, σ, …) on a grid, best first."""
    out = []
    for median in (600, 800, 1000, 1200, 1500, 1800, 2200):
        for sigma in (0.6, 0.8, 1.0, 1.2, 1.4):
            lengths = sample_lengths(w.n, w.max_len, w.seed, median, sigma)
            b = simulate_baseline(lengths, np.full(w.n, w.prompt_len), w.Q, w.n // w.batches, w.engine)
            err = ((b.bubble_ratio - bubble) ** 2 + ((b.tokens_per_s - tokens_per_s) / tokens_per_s) ** 2) ** 0.5
            out.append((err, median, sigma, b.bubble_ratio, b.tokens_per_s))
    return sorted(out)
