"""GRPO-side systems: SortedRL bubble ratio / throughput on a simulated engine, Shuffle-R1 symptoms.

    python -m bench.bench_grpo [--quick]

SortedRL: 512 samples in 4 batches, lognormal output lengths (median 600, σ 1.1, capped at 8192),
engine of Q slots decoding one token per sequence per step; baseline (synchronous batches) vs
on-policy vs partial SortedRL on the same lengths. Shuffle-R1: a batch of 64 groups × 8 rollouts
with binary rewards drawn per prompt from a Beta(0.4, 0.4) success rate (many flat groups, as in
practice), before and after PTS + ABS.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def main(argv: list[str] | None = None) -> int:
    import torch

    from grpo.loss import group_advantages
    from grpo.shuffle_r1 import reshape_batch, symptoms
    from grpo.sortedrl import simulate

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv or [])
    print("\n### SortedRL (simulated engine, 512 samples, 4 batches)")
    print("| Q | mode | bubble ratio | output tokens/s (Δt = 1 s) | wasted tokens | steps |\n| ---: | --- | ---: | ---: | ---: | ---: |")
    for Q in ([128] if a.quick else [64, 128, 256]):
        for r in simulate(512, 4, Q, 8192, seed=0):
            print(f"| {Q} | {r.mode} | {r.bubble_ratio:.1%} | {r.tokens_per_step:.1f} | {r.wasted_tokens:,} | {r.steps:,} |")
    rng = np.random.default_rng(0)
    G, n = 64, 8
    p = rng.beta(0.4, 0.4, G)
    rewards = (rng.random((G, n)) < p[:, None]).astype(np.float32).ravel()
    gid = np.repeat(np.arange(G), n)
    adv = group_advantages(torch.tensor(rewards), torch.tensor(gid)).numpy()
    idx = reshape_batch(adv, gid, alpha=0.5, S=8, seed=0)
    b, af = symptoms(adv), symptoms(adv[idx])
    print("\n### Shuffle-R1 on a 64 × 8 batch")
    print("| | advantage collapsing (|A| < 0.1) | rollouts with non-zero gradient |\n| --- | ---: | ---: |")
    print(f"| before | {b['advantage_collapsing']:.1%} | {b['nonzero_gradient_share']:.1%} |")
    print(f"| after PTS + ABS | {af['advantage_collapsing']:.1%} | {af['nonzero_gradient_share']:.1%} |")
    import time

    from rl_select.gym import GAMES, VecEnv, games, score_actions

    print("\n### VLM-Gym: environment throughput (one core)\n| game | env steps/s (VecEnv × 64) | renders/s | parallel-action scores/s |\n| --- | ---: | ---: | ---: |")
    for game in GAMES:
        env = VecEnv(game, 64, seed=0)
        t0 = time.perf_counter()
        steps = 0
        while time.perf_counter() - t0 < (0.3 if a.quick else 1.0):
            acts = []
            for st in env.states:
                legal = games.legal_actions(st)
                x = legal[0] if legal else None
                acts.append("<answer>none</answer>" if x is None else f"<answer>{x}</answer>" if game == "2048"
                            else f"<answer>({x[0][0]},{x[0][1]}),({x[1][0]},{x[1][1]})</answer>")
            env.step(acts)
            steps += len(acts)
        sps = steps / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(20):
            env.observations()
        rps = 20 * 64 / (time.perf_counter() - t0)
        st = env.states[0]
        t0 = time.perf_counter()
        for _ in range(20):
            score_actions(st, ["<answer>up</answer>", "<answer>(0,0),(0,1)</answer>"] * 8)
        aps = 20 * 16 / (time.perf_counter() - t0)
        print(f"| {game} | {sps:,.0f} | {rps:,.0f} | {aps:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
