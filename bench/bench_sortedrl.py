"""SortedRL on a real engine: the controller (grpo/sortedrl.py) driving transformers' continuous batching on the CPU,
beside ``rollout_sim``'s prediction for the same workload.

    python -m bench.bench_sortedrl --model demo     [--n 128 --batches 4 --slots 32 --max-len 256]
    python -m bench.bench_sortedrl --model qwen3-0.1b [--n 32 --batches 4 --slots 8 --max-len 64]

The workload is the paper's §4.4.1 shape (SortedRL, arXiv 2603.23414: 512 samples in 4 batches, Q = one batch,
at most 8K tokens) scaled to run in minutes: ``n`` samples in ``batches`` batches, ``slots`` running requests,
output lengths from the lognormal ``bench_grpo`` fitted to the paper's baseline (median 1,200, σ 1.2, capped at
8,192) scaled by ``max_len`` / 8,192. Each length is imposed as the request's ``max_new_tokens`` with EOS off, so
every mode generates the same samples to the same lengths; prompts are ``prompt_len`` random token ids.

Runs, each on a fresh engine over the same model, one after the other: baseline (synchronous: a batch fills the
slots, the update waits for its longest rollout), on-policy and partial (one group of all samples: grouped loading,
oversubscription, early termination at ``batch`` completions). Per run: the bubble ratio (eq. 4) over every step
and the part of it accrued in the final drain (the simulation's two figures), output tokens/s (trained tokens over
the engine's wall time), wasted tokens. The simulation's step-time model (``EngineTime.fit``: Δt = f(r) +
kv·context + prefill·tokens, f piecewise linear and non-decreasing between r = 1, 2, 4, …, Q) is calibrated three
ways, each printed with its prediction errors: on the three runs' own steps (the simulation then predicts the
schedule, its steps and running counts itself: only a step's cost is the engine's), on the baseline run's steps
alone (on-policy and partial out of sample: what a lab has before it runs SortedRL), and on a separate sweep of
fixed batches at every knot, each request generating half the workload's cap. The sweep's step time against the
batch is printed too, because it decides the throughput: on a CPU a step's matmuls grow with the batch, on a
memory-bound GPU they do not. Modes run interleaved over ``repeats`` rounds; every round of a mode runs the same
steps (the schedule, running counts and tokens are a function of the seed), so each step's time is its minimum over
the rounds: a pause of the interpreter or of the machine only ever adds time, and it hits one step of one round,
where a mode's least-disturbed *whole* round still carries every pause of that round.

Models: ``demo`` is the RL demo's tiny Qwen3 (``demo.rl.build_tiny_model``'s class and shape, 2 layers × 64);
``qwen3-0.1b`` is a Qwen3 of realistic shape with random weights (12 layers × 768, 12 heads, 4 KV heads,
vocab 32K: 100M parameters). One torch thread (``--threads``): on a shared 2-core machine two threads spin
against the other jobs and a step runs ~25× slower.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import numpy as np

MODELS = {
    "demo": dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    "qwen3-0.1b": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True),
}


def build_model(name: str, max_len: int, seed: int = 0):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(**MODELS[name], max_position_embeddings=max(1024, 2 * max_len), eos_token_id=1, pad_token_id=0)
    return Qwen3ForCausalLM(cfg).eval()


def workload_lengths(n: int, max_len: int, seed: int) -> np.ndarray:
    from grpo.rollout_sim import Workload, sample_lengths

    w = Workload()
    full = sample_lengths(n, w.max_len, seed, w.median, w.sigma)
    return np.maximum(1, np.ceil(full * max_len / w.max_len)).astype(np.int64)


def entries(lengths, prompt_len: int, vocab: int, seed: int):
    from grpo.sortedrl import Entry

    rng = np.random.default_rng(seed + 1)
    return [Entry(i, int(n), prompt_ids=[int(t) for t in rng.integers(2, vocab, prompt_len)])
            for i, n in enumerate(lengths)]


def run_mode(model, mode: str, lengths, a) -> "EngineRun":
    from grpo.engines.cb import ContinuousBatchingEngine
    from grpo.sortedrl import run_sorted, synchronous_rollout

    eng = ContinuousBatchingEngine(model, slots=a.slots, max_len=a.prompt_len + a.max_len, seed=a.seed,
                                   ignore_eos=True, max_batch_tokens=a.slots * (a.prompt_len + a.max_len))
    eng.admit("warmup", [2, 3, 4], 2)                  # the first forward pays one-off allocations
    while eng.has_work():
        eng.step()
    es = entries(lengths, a.prompt_len, model.config.vocab_size, a.seed)
    bs = a.n // a.batches
    run = synchronous_rollout(eng, es, a.slots, bs) if mode == "baseline" else run_sorted(eng, [es], a.slots, bs, mode)
    eng.close()
    return run


def knots(slots: int) -> list[int]:
    """The running counts the calibration sweep measures: 1, 2, 4, … up to the slot count, and the slot count."""
    out, k = [], 1
    while k < slots:
        out.append(k)
        k *= 2
    return out + [slots]


def calibration_sweep(model, a) -> list:
    """Engine steps apart from the three runs, what the simulation's step-time model is fitted on: at each knot r
    (``knots``) and two context sizes, half the r requests are admitted, two steps later the other half (so prefill
    chunks ride in decode steps, as in the runs), and the steps run until all finish; also the table of Δt against
    the batch."""
    from grpo.engines.cb import ContinuousBatchingEngine
    from grpo.sortedrl import StepLog

    eng = ContinuousBatchingEngine(model, slots=a.slots, max_len=a.prompt_len + a.max_len, seed=a.seed,
                                   ignore_eos=True, max_batch_tokens=a.slots * (a.prompt_len + a.max_len))
    rng = np.random.default_rng(a.seed + 2)
    steps, k = [], 0

    def admit(n: int, extra: int) -> None:
        nonlocal k
        for _ in range(n):
            eng.admit(f"cal{k}", [int(t) for t in rng.integers(2, model.config.vocab_size, a.prompt_len + extra)],
                      a.sweep_tokens)
            k += 1

    def step() -> None:
        rep = eng.step()
        steps.append(StepLog(rep.running, rep.seconds, False, rep.prefill_tokens, rep.context_tokens,
                             sum(len(p.token_ids) for p in rep.new.values())))

    for extra in (0, a.max_len // 2):
        for r in knots(a.slots):
            admit(-(-r // 2), extra)
            for _ in range(2):
                step()
            admit(r // 2, extra)
            while eng.has_work():
                step()
    eng.close()
    return steps[1:]                                   # the first forward pays one-off allocations


def per_step_min_steps(rounds: list[list]) -> list:
    """Steps of identical rounds (the same running count, prefill and context at every step, checked), each with its
    minimum time over the rounds."""
    def shape(steps):
        return [(s.running, s.prefill_tokens, s.context_tokens, s.new_tokens) for s in steps]

    first = shape(rounds[0])
    if any(shape(other) != first for other in rounds[1:]):
        raise RuntimeError("the rounds ran different schedules: a step's minimum over them is undefined")
    return [dataclasses.replace(s, seconds=min(r[i].seconds for r in rounds)) for i, s in enumerate(rounds[0])]


def per_step_min(runs: list) -> "EngineRun":
    """One round of a mode with each step's minimum time over its rounds (``per_step_min_steps``)."""
    out = dataclasses.replace(runs[0], steps=per_step_min_steps([r.steps for r in runs]))
    if any(r.schedule != out.schedule or r.wasted_tokens != out.wasted_tokens for r in runs[1:]):
        raise RuntimeError("the rounds emitted different batches")
    return out


def step_growth(steps) -> list[tuple[int, float, int]]:
    """Median step time per running count (steps without prefill), for the table of Δt against the batch."""
    by = {}
    for s in steps:
        if s.prefill_tokens == 0:
            by.setdefault(s.running, []).append(s.seconds)
    return [(r, float(np.median(v)), len(v)) for r, v in sorted(by.items())]


def main(argv=None) -> int:
    import torch

    from grpo.rollout_sim import EngineTime, simulate_baseline, simulate_sorted

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=list(MODELS), default="demo")
    ap.add_argument("--n", type=int, default=None)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--slots", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sweep-tokens", type=int, default=None,
                    help="tokens per request in the calibration sweep (default: half of --max-len)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 3 demo, 1 qwen3-0.1b)")
    ap.add_argument("--json", default=None, help="write the figures here too")
    a = ap.parse_args(argv)
    small = a.model != "demo"
    a.n = a.n or (32 if small else 128)
    a.slots = a.slots or a.n // a.batches
    a.max_len = a.max_len or (64 if small else 256)
    a.repeats = a.repeats or (1 if small else 3)
    # the sweep's requests generate as far as the workload's do: on the demo model a step's cost grows with the
    # tokens its requests have generated (the engine's per-request Python: streamed outputs copy them every step),
    # which a sweep of short requests never reaches (16 tokens: its fit was 45% off, half the cap: 11%)
    a.sweep_tokens = a.sweep_tokens or a.max_len // 2
    if a.n % a.batches:
        raise SystemExit(f"--n={a.n} must be a multiple of --batches={a.batches}")
    torch.set_num_threads(a.threads)
    model = build_model(a.model, a.prompt_len + a.max_len, a.seed)
    lengths = workload_lengths(a.n, a.max_len, a.seed)
    bs = a.n // a.batches
    params = sum(p.numel() for p in model.parameters())
    print(f"### SortedRL on transformers' continuous batching (CPU, {a.threads} thread{'s' * (a.threads > 1)})\n"
          f"Model {a.model} ({params / 1e6:.1f}M parameters, random weights, fp32). Workload: {a.n} samples in "
          f"{a.batches} batches of {bs}, Q = {a.slots} slots, prompts of {a.prompt_len} tokens, output lengths the "
          f"fitted lognormal scaled to ≤ {a.max_len} (mean {lengths.mean():.1f}, max {lengths.max()}, "
          f"{lengths.sum():,} tokens), imposed as max_new_tokens with EOS off.")
    t0 = time.perf_counter()
    # the modes interleaved, `repeats` rounds (the schedule, steps and tokens are the same in every round: only the
    # machine's load moves the times)
    rounds = {m: [] for m in ("baseline", "on_policy", "partial")}
    sweeps = []
    for _ in range(a.repeats):
        sweeps.append(calibration_sweep(model, a))
        for m in rounds:
            rounds[m].append(run_mode(model, m, lengths, a))
    # every round runs the same steps; each step's least-disturbed time (its minimum over the rounds): a pause of the
    # interpreter or the machine only ever adds time, and it lands on one step of one round, not on a whole mode
    runs = {m: per_step_min(rs) for m, rs in rounds.items()}
    spread = {m: (min(r.time_s for r in rs), max(r.time_s for r in rs)) for m, rs in rounds.items()}
    sweep = per_step_min_steps(sweeps)
    wall = time.perf_counter() - t0
    b = runs["baseline"]
    ks = knots(a.slots)

    def fit(name, steps):
        st = np.array([(x.running, x.context_tokens, x.prefill_tokens, x.seconds) for x in steps])
        return EngineTime.fit(name, *st.T, knots=ks)

    # three calibrations of the step-time model, from the most data to the least: the three runs' own steps (the
    # issue's check: the schedule is the simulation's, only the cost of a step is the engine's), the baseline run's
    # steps alone (what a lab has before it runs SortedRL: on-policy and partial are then out of sample), and a
    # separate sweep of fixed batches (nothing of the workload)
    fits = {"runs": fit("the three runs' steps", [x for r in runs.values() for x in r.steps]),
            "baseline run": fit("the baseline run's steps", b.steps),
            "sweep": fit(f"a calibration sweep of {len(sweep)} steps", sweep)}
    prompts = np.full(a.n, a.prompt_len, dtype=np.int64)
    sims_by = {}
    for name, cal in fits.items():
        sims_by[name] = {"baseline": simulate_baseline(lengths, prompts, a.slots, bs, cal)}
        for m in ("on_policy", "partial"):
            sims_by[name][m] = simulate_sorted(lengths, prompts, a.slots, bs, m, engine=cal, terminate_at=bs,
                                               reprefill=True)
    sims = sims_by["runs"]
    print("\nStep-time model (rollout_sim.EngineTime.fit): Δt = f(r) + kv·context + prefill·tokens, f piecewise "
          f"linear and non-decreasing between r = {', '.join(map(str, ks))}, fitted by non-negative least squares on:")
    print("| fitted on | " + " | ".join(f"f({k})" for k in ks) + " | a context token | a prefill token |\n"
          "| --- | " + " | ".join("---:" for _ in ks) + " | ---: | ---: |")
    for name, cal in fits.items():
        print(f"| {cal.name} | " + " | ".join(f"{t * 1e3:.2f} ms" for _, t in cal.by_running) +
              f" | {cal.kv_s_per_token * 1e6:.3f} µs | {cal.prefill_s_per_token * 1e3:.3f} ms |")
    print("\nThe engine's figures, beside the simulation's for the same lengths (its step model fitted on the runs' "
          "steps; the schedule, its steps and their running counts are the simulation's own):")
    print("\n| mode | steps | bubble (eq. 4, all steps) | sim | of it in the final drain | sim | bubble before the "
          "drain | sim | output tokens/s | × baseline | sim × baseline | wasted tokens | sim |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    out = {"args": vars(a), "params": params, "wall_s": wall, "knots": ks,
           "fit": {k: dataclasses.asdict(v) for k, v in fits.items()}, "rows": {}}
    for m, r in runs.items():
        s = sims[m]
        gain, sgain = r.tokens_per_s / b.tokens_per_s, s.tokens_per_s / sims["baseline"].tokens_per_s
        print(f"| {m} | {len(r.steps):,} | {r.bubble_ratio:.1%} | {s.bubble_ratio:.1%} | {r.drain_bubble:.1%} | "
              f"{s.drain_bubble:.1%} | {r.bubble_ratio - r.drain_bubble:.1%} | {s.bubble_ratio - s.drain_bubble:.1%} | "
              f"{r.tokens_per_s:,.0f} | {gain:.2f} | {sgain:.2f} | {r.wasted_tokens:,} | {s.wasted_tokens:,} |")
        out["rows"][m] = dict(steps=len(r.steps), bubble=r.bubble_ratio, drain_bubble=r.drain_bubble,
                              tokens_per_s=r.tokens_per_s, gain=gain, wasted=r.wasted_tokens, time_s=r.time_s,
                              trained=r.trained_tokens, generated=r.generated_tokens,
                              sim={name: dict(bubble=x[m].bubble_ratio, drain_bubble=x[m].drain_bubble,
                                              tokens_per_s=x[m].tokens_per_s,
                                              gain=x[m].tokens_per_s / x["baseline"].tokens_per_s,
                                              wasted=x[m].wasted_tokens, time_s=x[m].time_s, steps=x[m].steps)
                                   for name, x in sims_by.items()})
    print("\nPrediction error of the simulation (sim / engine − 1) for each calibration of its step model — the "
          "runs' steps / the baseline run's alone / the separate sweep:")
    print("| mode | steps | engine time | bubble | output tokens/s | × baseline | wasted tokens |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    rel = lambda x, y: f"{x / y - 1:+.1%}" if y else ("0" if x == 0 else "—")  # noqa: E731
    figures = (lambda x, _: x.time_s, lambda x, _: x.bubble_ratio, lambda x, _: x.tokens_per_s,
               lambda x, base: x.tokens_per_s / base.tokens_per_s)             # the last: × baseline
    worst = dict.fromkeys(sims_by, 0.0)
    for m, r in runs.items():
        cells = []
        for f in figures:
            cells.append(" / ".join(rel(f(x[m], x["baseline"]), f(r, b)) for x in sims_by.values()))
            for name, x in sims_by.items():
                worst[name] = max(worst[name], abs(f(x[m], x["baseline"]) / f(r, b) - 1))
        print(f"| {m} | {rel(sims[m].steps, len(r.steps))} | {' | '.join(cells)} | "
              f"{rel(sims[m].wasted_tokens, r.wasted_tokens)} |")
    print("Largest error over every figure and mode: " + ", ".join(f"{n} {e:.1%}" for n, e in worst.items()))
    out["worst_error"] = worst
    growth = step_growth(sweep)
    print("\nThe CPU engine's decode step against the batch (calibration sweep, steps without prefill; median):")
    print("| running requests r | step time | × r = 1 | steps |\n| ---: | ---: | ---: | ---: |")
    ref = growth[0][1]
    for r, t, k in growth:
        print(f"| {r} | {t * 1e3:.1f} ms | {t / ref:.2f} | {k} |")
    out["growth"] = growth
    print(f"\nEvery round of a mode ran the same steps (checked); each step's time is its minimum over the {a.repeats} "
          f"rounds (modes interleaved). A whole round's engine time, min–max: " +
          ", ".join(f"{m} {lo:.1f}–{hi:.1f} s" for m, (lo, hi) in spread.items()))
    out["spread"] = spread
    print(f"\n(wall {wall:.0f} s for the runs; `python -m bench.bench_sortedrl {' '.join(argv or sys.argv[1:])}`)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
