"""RL benchmarks: rewards/s per core for each reward type, and ``select`` over 10M rollouts.

    python -m bench.bench_rl            # 10M rollouts (625K prompts × 16)
    python -m bench.bench_rl --quick    # 1M rollouts

Rewards are timed in-process on one core (``score_one``: parse, extract, verify), i.e. what one
``RewardRunner`` worker sustains; select is timed from the Arrow ``rewards`` table to the
per-prompt decisions (polars aggregation + vectorised pass@k).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

SVG = "<svg xmlns='http://www.w3.org/2000/svg' width='64' height='64'><rect x='8' y='8' width='30' height='30' fill='red'/></svg>"
CASES = {
    "math": ("<think>2+2</think><answer>\\frac{8}{2}</answer>", "4"),
    "choice": ("The answer is (C).", "C"),
    "number": ("<answer>1,234.5</answer>", "1234.5"),
    "bbox": ("<answer>[10, 10, 50, 50]</answer>", "[12, 10, 50, 52]"),
    "ocr": ("<answer>the quick brown fox</answer>", "the quick brown fax"),
    "html": ("<answer><div><p>hello <b>world</b></p></div></answer>", "<div><p>hello world</p></div>"),
    "svg": (SVG, SVG.replace("30", "28")),
    "bool": ("<answer>yes</answer>", "true"),
    "string": ("<answer>Red Circle</answer>", "red circle"),
    "format": ("<think>reasoning</think><answer>4</answer>", ""),
    "detection": ("<answer>" + json.dumps([{"bbox_2d": [0, 0, 10, 10], "label": "cat"},
                                           {"bbox_2d": [20, 20, 30, 31], "label": "dog"}]) + "</answer>",
                  json.dumps([{"bbox_2d": [0, 0, 10, 10], "label": "cat"}, {"bbox_2d": [20, 20, 30, 30], "label": "dog"}])),
}


def bench_rewards(seconds: float) -> None:
    from rl_select.rewards import score_one

    print("\n### rewards per second, one core (in-process score_one)\n| reward | rewards/s | result |\n| --- | ---: | --- |")
    for name, (resp, gt) in CASES.items():
        score_one((name, resp, gt, "{}"))  # warm-up (imports, caches)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            r = score_one((name, resp, gt, "{}"))
            n += 1
        dt = time.perf_counter() - t0
        print(f"| {name} | {n / dt:,.0f} | {r[0]:.3f} ({r[2]}) |", flush=True)


def bench_select(n_rollouts: int, per_prompt: int = 16) -> None:
    import pyarrow as pa

    from rl_select.select import SelectConfig, aggregate, decide

    rng = np.random.default_rng(0)
    n_prompts = n_rollouts // per_prompt
    pids = np.char.mod("%016x", np.arange(n_prompts, dtype=np.uint64)).astype(str)
    rate = rng.beta(0.6, 0.6, n_prompts)
    correct = rng.random((n_prompts, per_prompt)) < rate[:, None]
    table = pa.table({
        "prompt_id": pa.array(np.repeat(pids, per_prompt)),
        "rollout_idx": pa.array(np.tile(np.arange(per_prompt, dtype=np.int32), n_prompts)),
        "reward": pa.array(correct.ravel().astype(np.float64)),
        "correct": pa.array(correct.ravel()),
        "reward_type": pa.array(np.full(n_rollouts, "math")),
        "status": pa.array(np.full(n_rollouts, "ok")),
        "error": pa.nulls(n_rollouts, pa.string()),
    })
    t0 = time.perf_counter()
    agg = aggregate(table)
    d = decide(agg["n"].to_numpy(), agg["c"].to_numpy(), agg["errors"].to_numpy(), agg["mean_reward"].to_numpy(),
               agg["n_ao"].to_numpy(), agg["c_ao"].to_numpy(), [None] * agg.height, SelectConfig(ks=[1, 2, 4, 8, 16]))
    dt = time.perf_counter() - t0
    print(f"\n### select: {n_rollouts:,} rollouts ({n_prompts:,} prompts × {per_prompt})\n"
          f"| seconds | rollouts/s | kept |\n| ---: | ---: | ---: |\n| {dt:.2f} | {n_rollouts / dt:,.0f} | {int(d['kept'].sum()):,} |")


def bench_passk(n_prompts: int) -> None:
    """Peer: the exact ``math.comb`` loop (Python ints), on a sample, vs our vectorised product."""
    import math

    from rl_select.passk import pass_at_k

    rng = np.random.default_rng(1)
    n = np.full(n_prompts, 16)
    c = rng.integers(0, 17, n_prompts)
    t0 = time.perf_counter()
    ours = {k: pass_at_k(n, c, k) for k in (1, 2, 4, 8, 16)}
    dt_ours = time.perf_counter() - t0
    m = min(n_prompts, 200_000)
    t0 = time.perf_counter()
    err = 0.0
    for k in (1, 2, 4, 8, 16):
        for j in range(m):
            nj, cj = int(n[j]), int(c[j])
            ref = 1.0 if nj - cj < k else 1 - math.comb(nj - cj, k) / math.comb(nj, k)
            err = max(err, abs(ref - ours[k][j]))
    dt_comb = (time.perf_counter() - t0) * n_prompts / m
    print(f"\n### pass@k, {n_prompts:,} prompts × 5 k values\n| implementation | seconds | ratio |\n| --- | ---: | ---: |\n"
          f"| `math.comb` loop (peer, extrapolated from {m:,}) | {dt_comb:.2f} | 1.0× |\n"
          f"| rl_select.passk (vectorised log1p product) | {dt_ours:.3f} | {dt_comb / dt_ours:,.0f}× |\n"
          f"max |difference| = {err:.1e}")


def bench_runner(n_jobs: int) -> None:
    """The sandbox's price: time-limited worker processes (2) vs calling the reward in-process."""
    from rl_select.rewards import RewardRunner, score_one

    jobs = [("number", CASES["number"][0], CASES["number"][1], "{}")] * n_jobs
    t0 = time.perf_counter()
    for j in jobs:
        score_one(j)
    dt_in = time.perf_counter() - t0
    with RewardRunner(workers=2, timeout_s=5.0) as runner:
        t0 = time.perf_counter()
        runner.score(jobs)
        dt_pool = time.perf_counter() - t0
    print(f"\n### reward runner, {n_jobs:,} cheap rewards (number)\n| path | rewards/s |\n| --- | ---: |\n"
          f"| in-process, 1 core (no time limit) | {n_jobs / dt_in:,.0f} |\n"
          f"| RewardRunner, 2 workers, per-job time limit | {n_jobs / dt_pool:,.0f} |")


def bench_select_step(n_rollouts: int, per_prompt: int = 16) -> None:
    """The whole ``ovpipe select`` step (read manifests, aggregate, decide, write, report) on a run folder."""
    import tempfile
    from pathlib import Path

    import pyarrow as pa

    from manifests.io import write_part
    from ovpipe.cli import main as ovpipe

    rng = np.random.default_rng(0)
    P = n_rollouts // per_prompt
    pids = np.char.mod("%016x", np.arange(P, dtype=np.uint64)).astype(str)
    correct = (rng.random((P, per_prompt)) < rng.beta(0.6, 0.6, P)[:, None]).ravel()
    pid, idx = pa.array(np.repeat(pids, per_prompt)), pa.array(np.tile(np.arange(per_prompt, dtype=np.int32), P))
    full = lambda v: pa.array(np.full(n_rollouts, v))  # noqa: E731
    with tempfile.TemporaryDirectory() as d:
        run = Path(d)
        write_part(pa.table({"prompt_id": pid, "rollout_idx": idx, "reward": pa.array(correct.astype(np.float64)),
                             "correct": pa.array(correct), "reward_type": full("math"), "status": full("ok"),
                             "error": pa.nulls(n_rollouts, pa.string())}), run / "score/rewards/part-00000.parquet", "rewards")
        write_part(pa.table({"prompt_id": pid, "rollout_idx": idx, "prompt_type": full("answer_only"),
                             "response": full("<answer>1</answer>"), "tokens": pa.array(np.full(n_rollouts, 5, np.int32)),
                             "backend": full("file"), "model": full("m"), "sampling": full("{}")}),
                   run / "rollout/rollouts/part-00000.parquet", "rollouts")
        write_part(pa.table({"prompt_id": pa.array(pids), "source": pa.array(np.full(P, "bench")),
                             "category": pa.array(np.where(np.arange(P) % 2, "a", "b")), "question": pa.array(np.full(P, "q")),
                             "images": pa.array([[]] * P, pa.list_(pa.binary())), "ground_truth": pa.array(np.full(P, "1")),
                             "answer_type": pa.array(np.full(P, "math")), "extra": pa.array(np.full(P, "{}")),
                             "status": pa.array(np.full(P, "ok")), "error": pa.nulls(P, pa.string())}),
                   run / "rl-ingest/rl_prompts/part-00000.parquet", "rl_prompts")
        t0 = time.perf_counter()
        assert ovpipe(["select", "--run-dir", str(run), "--quiet", "--tasks", "1"]) == 0
        dt = time.perf_counter() - t0
    print(f"\n### `ovpipe select` step end to end (tasks=1, incl. report + PNG): {n_rollouts:,} rollouts\n"
          f"| seconds | rollouts/s |\n| ---: | ---: |\n| {dt:.2f} | {n_rollouts / dt:,.0f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv or [])
    bench_rewards(0.5 if a.quick else 2.0)
    bench_runner(5_000 if a.quick else 20_000)
    bench_passk(625_000)
    bench_select(1_000_000 if a.quick else 10_000_000)
    bench_select_step(1_000_000 if a.quick else 10_000_000)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
