"""GRPO-side systems: SortedRL's headline figure on the paper's workload, Shuffle-R1 symptoms, VLM-Gym speed.

    python -m bench.bench_grpo [--quick]

SortedRL (``grpo.rollout_sim``): the paper's §4.4.1 workload (512 samples in 4 batches, at most 8K generated
tokens, the same lengths in every mode) on an engine whose decode step takes a memory-bound engine's time
(LLaMA-3.1-8B on one H100), beside the paper's figures; then each modelling choice varied alone from that
row. ``--quick`` leaves out the variations. Shuffle-R1: the paper's batch of 512 prompts × 16 rollouts with binary
rewards drawn per prompt from a Beta(0.4, 0.4) success rate (many flat groups, as in practice), before and after
each variant of the paper's Tab. 5 (``grpo.shuffle_r1.VARIANTS``).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def sortedrl_tables(quick: bool = False) -> None:
    import dataclasses

    from grpo.rollout_sim import PAPER, EngineTime, Workload, fit_lengths, run_workload

    fits = fit_lengths()
    _, median, sigma, _, _ = fits[0]
    w = Workload(median=median, sigma=sigma)
    print("\n### SortedRL on the paper's workload (§4.4.1: 512 samples, 4 batches of 128, ≤ 8K tokens, Q = 128)")
    print(f"Engine: {w.engine.name}, decode step = weights + KV reads at HBM bandwidth. Output lengths: lognormal "
          f"(median {median:.0f}, σ {sigma}), capped at 8,192, fitted to the paper's baseline row only "
          f"(bubble 74%, 3,987 tokens/s); the SortedRL rows are predictions.")
    print("| mode | bubble ratio | paper | output tokens/s | paper | gain | paper | wasted tokens (of generated) "
          "| bubble in the final drain |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    r = run_workload(w)
    base = r["baseline"].tokens_per_s
    for m, x in r.items():
        pb, pt = PAPER[m]
        print(f"| {m} | {x.bubble_ratio:.1%} | {pb:.1%} | {x.tokens_per_s:,.0f} | {pt:,.0f} | "
              f"{x.tokens_per_s / base - 1:+.1%} | {pt / PAPER['baseline'][1] - 1:+.1%} | "
              f"{x.wasted_tokens:,} ({x.wasted_tokens / x.generated_tokens:.0%}) | {x.drain_bubble:.1%} |")
    if quick:
        return
    ridge = [f for f in fits if f[0] < 0.02]
    variations = [("engine step time", "Δt = 1", dict(engine=EngineTime.unit())),
                  ("engine step time", "memory-bound (row above)", {}),
                  ("running slots Q", "64", dict(Q=64)), ("running slots Q", "256", dict(Q=256)),
                  ("early termination", "at 1.5 batches of completions", dict(terminate_at=1.5)),
                  ("lengths", "median 600, σ 1.1 (the earlier guess)", dict(median=600, sigma=1.1)),
                  ("lengths", "25% truncated at 8K", dict(capped_share=0.25))]
    variations += [("lengths", f"median {m:.0f}, σ {s} (baseline fit within 2%)", dict(median=m, sigma=s))
                   for _, m, s, _, _ in ridge[1:4]]
    variations += [("re-prefill of resumed partials", "off (KV kept)", dict(reprefill=False)),
                   ("prefill cost", "none", dict(engine=dataclasses.replace(w.engine, prefill_s_per_token=0.0))),
                   ("window", "stream: the next group already cached, clock stops at the 4th batch",
                    dict(window="stream"))]
    print("\n### SortedRL: each modelling choice varied alone from the row above")
    print("| choice | setting | baseline bubble | on-policy bubble | partial bubble | on-policy gain | partial gain |"
          "\n| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    print("| paper | | 74.0% | 5.8% | 3.4% | +7.6% | +39.4% |")
    for choice, setting, change in variations:
        r = run_workload(dataclasses.replace(w, **change))
        b = r["baseline"].tokens_per_s
        print(f"| {choice} | {setting} | {r['baseline'].bubble_ratio:.1%} | {r['on_policy'].bubble_ratio:.1%} | "
              f"{r['partial'].bubble_ratio:.1%} | {r['on_policy'].tokens_per_s / b - 1:+.1%} | "
              f"{r['partial'].tokens_per_s / b - 1:+.1%} |")


def shuffle_r1_table() -> None:
    import torch

    from grpo.loss import group_advantages
    from grpo.shuffle_r1 import VARIANTS, reshape_indices
    from grpo.symptoms import nonzero_grad_rollout_share, small_advantage_share, token_utilization

    rng = np.random.default_rng(0)
    G, n = 512, 16                                  # the paper's batch: 512 prompts × 16 rollouts
    p = rng.beta(0.4, 0.4, G)
    rewards = (rng.random((G, n)) < p[:, None]).astype(np.float32).ravel()
    gid = np.repeat(np.arange(G), n)
    adv = group_advantages(torch.tensor(rewards), torch.tensor(gid)).numpy()
    tokens = rng.integers(64, 1024, len(adv))       # completion lengths, for the token share
    print(f"\n### Shuffle-R1 on the paper's batch ({G} prompts × {n} rollouts, α = 0.5, S = 8)")
    print("| batch | rollouts trained | pairs kept | S × T | distinct pairs | advantage collapsing (|A| < 0.1) "
          "| rollouts with non-zero gradient | token utilization |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: "
          "| ---: |")
    print(f"| GRPO (all generated) | {len(adv):,} | | | | {small_advantage_share(adv):.1%} | "
          f"{nonzero_grad_rollout_share(adv):.1%} | {token_utilization(adv, tokens):.1%} |")
    for name, kw in VARIANTS.items():
        idx, info = reshape_indices(adv, n, 0.5, 8, rng=np.random.default_rng(0), **kw)
        print(f"| {name} | {len(idx):,} | {info['pairs_kept']:,} | {info['S']} × {info['T']} | "
              f"{info['distinct_pair_share']:.1%} | {small_advantage_share(adv[idx]):.1%} | "
              f"{nonzero_grad_rollout_share(adv[idx]):.1%} | {token_utilization(adv[idx], tokens[idx]):.1%} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv or [])
    sortedrl_tables(a.quick)
    shuffle_r1_table()
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
                acts.append("<answer>none</answer>" if x is None else f"<answer>{games.format_action(game, x)}</answer>")
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
            score_actions(st, ["<answer>0</answer>", "<answer>(0, 0) (0, 1)</answer>"] * 8)
        aps = 20 * 16 / (time.perf_counter() - t0)
        print(f"| {game} | {sps:,.0f} | {rps:,.0f} | {aps:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
