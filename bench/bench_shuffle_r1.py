"""Shuffle-R1's claims (arXiv 2508.05612, Tab. 5's ablations) measured with `ovpipe grpo` itself, at equal steps and
seeds, on the word-copy demo task (``demo.rl_words``: a random one-layer Qwen3, "say W" → W, 6 words trained, 4
held out, pass@1 exact from the logits).

    python -m bench.bench_shuffle_r1 [--quick] [--steps 20] [--seeds 0 1 2] [--out bench/results]

Runs, each one optimizer step = the 6 training prompts once, 48 rollouts trained in 6 micro-batches of 8:

* ``grpo``: 8 rollouts a prompt (48 generated, 48 trained) — the baseline;
* ``grpo_16``: 16 rollouts a prompt, all 96 trained — GRPO on Shuffle-R1's wider pool, as a control;
* ``shuffle_r1``: 16 generated, PTS keeps 4 pairs a prompt (α = 0.5: 48 trained), ABS draws S = 8 sub-samplings of
  T = 3 pairs (24 = 8 × 3) by advantage weight;
* ``pts_only``, ``unbiased_shuffle`` (ABS with uniform weights), ``static_reorder`` — the paper's ablations.

Per run: the reward curve (the mean scaled reward of the step's generated rollouts, −5 … +5), trained and held-out
pass@1 after training, token utilization (the trained batch's tokens with a non-zero gradient, Fig. 5c), the
share of |A| < 0.1, and the step time against ``grpo``'s (medians over steps, then means over seeds); the reshaper's
own time as a share of its step. Writes ``bench_shuffle_r1.md``, ``.json`` and ``.png`` (reward curves) to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RUNS: dict[str, dict] = {
    "grpo": dict(num_generations=8, batch_size=48),
    "grpo_16": dict(num_generations=16, batch_size=96),
    "shuffle_r1": dict(num_generations=16, batch_size=96, shuffle_r1={"variant": "shuffle_r1"}),
    "pts_only": dict(num_generations=16, batch_size=96, shuffle_r1={"variant": "pts_only"}),
    "unbiased_shuffle": dict(num_generations=16, batch_size=96, shuffle_r1={"variant": "unbiased_shuffle"}),
    "static_reorder": dict(num_generations=16, batch_size=96, shuffle_r1={"variant": "static_reorder"}),
}
COMMON = ["micro_batch=8", "max_completion_length=1", "learning_rate=0.02", "stages=[answer_only]",
          "reward_workers=1", "save_every=1000"]


def one_run(name: str, seed: int, steps: int, lm: Path, work: Path) -> dict:
    import pyarrow.parquet as pq

    from demo.rl_words import HELD_OUT_WORDS, TRAIN_WORDS, pass_at_1, rows
    from demo.word_lm import write_split
    from ovpipe.cli import main
    from rl_select.rollout import TEMPLATES

    run = work / f"{name}-seed{seed}"
    write_split(run, "stage1-answer-only", rows())
    sets = COMMON + [f"steps={steps}", f"seed={seed}", f"model={lm}"]
    sets += [f"{k}={json.dumps(v) if isinstance(v, dict) else v}" for k, v in RUNS[name].items()]
    t0 = time.perf_counter()
    rc = main(["grpo", "--run-dir", str(run), *[x for s in sets for x in ("--set", s)], "--quiet"])
    if rc:
        raise RuntimeError(f"{name} seed {seed}: ovpipe grpo exited {rc}")
    wall = time.perf_counter() - t0
    m = pq.read_table(next((run / "grpo" / "grpo_metrics").glob("part-*.parquet"))).to_pylist()
    extras = [json.loads(r["extras"]) for r in m]
    prompt = TEMPLATES["answer_only"]
    model = run / "grpo" / "model"
    return {
        "run": name, "seed": seed, "wall_s": wall,
        "reward": [r["reward_mean"] for r in m],
        "token_utilization": [r["token_utilization"] for r in m],
        "small_advantage_share": [r["small_advantage_share"] for r in m],
        "step_time_s": [r["step_time_s"] for r in m],
        "reshape_time_s": [e.get("reshape_time_s") for e in extras],
        "rollouts_trained": [e.get("reshape_rows_out", e.get("generated_rollouts")) for e in extras],
        "pass1_train": pass_at_1(model, [prompt.format(question=f"say {w}") for w in TRAIN_WORDS], TRAIN_WORDS),
        "pass1_held_out": pass_at_1(model, [prompt.format(question=f"say {w}") for w in HELD_OUT_WORDS],
                                    HELD_OUT_WORDS),
    }


def summarise(results: list[dict], lm0: dict) -> list[dict]:
    base = {r["seed"]: float(np.median(r["step_time_s"])) for r in results if r["run"] == "grpo"}
    out = []
    for name in RUNS:
        rs = [r for r in results if r["run"] == name]
        if not rs:
            continue
        ratio = [float(np.median(r["step_time_s"])) / base[r["seed"]] for r in rs if r["seed"] in base]
        resh = [float(np.median([t for t in r["reshape_time_s"] if t is not None]) / np.median(r["step_time_s"]))
                for r in rs if any(t is not None for t in r["reshape_time_s"])]
        half = max(1, len(rs[0]["reward"]) // 2)

        def ms(xs):
            return float(np.mean(xs)), float(np.std(xs))

        out.append({
            "run": name, "seeds": [r["seed"] for r in rs],
            "rollouts_trained_per_step": float(np.mean([np.mean(r["rollouts_trained"]) for r in rs])),
            "pass1_train": ms([r["pass1_train"] for r in rs]), "pass1_held_out": ms([r["pass1_held_out"] for r in rs]),
            "reward_first_half": ms([np.mean(r["reward"][:half]) for r in rs]),
            "reward_last_half": ms([np.mean(r["reward"][half:]) for r in rs]),
            "token_utilization": ms([np.mean(r["token_utilization"]) for r in rs]),
            "small_advantage_share": ms([np.mean(r["small_advantage_share"]) for r in rs]),
            "step_time_vs_grpo": ms(ratio) if ratio else None,
            "reshape_share_of_step": ms(resh) if resh else None,
        })
    return out


def table(summary: list[dict], lm0: dict) -> str:
    def f(x, pct=False):
        if x is None:
            return "—"
        m, s = x
        return f"{m:.1%} ± {s:.1%}" if pct else f"{m:.3f} ± {s:.3f}"

    lines = [f"Before training (the random policy, mean over seeds): pass@1 trained {lm0['train']:.3f}, "
             f"held-out {lm0['held_out']:.3f}.", "",
             "| run | rollouts trained / step | pass@1 trained | pass@1 held-out | reward, 1st half | reward, 2nd half "
             "| token utilization | \\|A\\| < 0.1 | step time vs grpo | reshaper / step |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in summary:
        t = s["step_time_vs_grpo"]
        lines.append(f"| {s['run']} | {s['rollouts_trained_per_step']:.0f} | {f(s['pass1_train'])} | "
                     f"{f(s['pass1_held_out'])} | {f(s['reward_first_half'])} | {f(s['reward_last_half'])} | "
                     f"{f(s['token_utilization'], True)} | {f(s['small_advantage_share'], True)} | "
                     f"{'—' if t is None else f'{t[0]:.2f}× ± {t[1]:.2f}'} | "
                     f"{f(s['reshape_share_of_step'], True)} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for name in RUNS:
        rs = [r for r in results if r["run"] == name]
        if not rs:
            continue
        x = np.arange(1, len(rs[0]["reward"]) + 1)
        for a, key in zip(ax, ("reward", "token_utilization")):
            y = np.array([r[key] for r in rs], dtype=float)
            a.plot(x, y.mean(0), label=name)
            a.fill_between(x, y.min(0), y.max(0), alpha=0.12)
    ax[0].set(xlabel="optimizer step", ylabel="mean scaled reward of the generated rollouts",
              title="reward (mean over seeds; band: min–max)")
    ax[1].set(xlabel="optimizer step", ylabel="share of trained tokens with A ≠ 0", title="token utilization")
    ax[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="2 steps, one seed, three runs")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--out", type=Path, default=None, help="write the .md/.json/.png here")
    a = ap.parse_args(argv or [])
    if a.quick:
        a.steps, a.seeds, a.runs = 2, [0], ["grpo", "shuffle_r1", "pts_only"]
    import torch

    from demo.rl_words import HELD_OUT_WORDS, TRAIN_WORDS, pass_at_1, word_lm
    from rl_select.rollout import TEMPLATES

    torch.set_num_threads(2)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    commit += " (with local changes)" if dirty else ""
    results, lm0 = [], {"train": [], "held_out": []}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_shuffle_r1-") as tmp:
        work = Path(tmp)
        # the process's first training run pays TRL's and torch's lazy start-up: one step, not recorded
        one_run("grpo", a.seeds[0], 1, word_lm(work / "lm-warm-up"), work / "warm-up")
        for seed in a.seeds:
            lm = word_lm(work / f"lm-seed{seed}", seed=seed)
            prompt = TEMPLATES["answer_only"]
            lm0["train"].append(pass_at_1(lm, [prompt.format(question=f"say {w}") for w in TRAIN_WORDS], TRAIN_WORDS))
            lm0["held_out"].append(pass_at_1(lm, [prompt.format(question=f"say {w}") for w in HELD_OUT_WORDS],
                                             HELD_OUT_WORDS))
            for name in a.runs:
                results.append(one_run(name, seed, a.steps, lm, work))
                r = results[-1]
                print(f"{name} seed {seed}: pass@1 {r['pass1_train']:.3f} / {r['pass1_held_out']:.3f}, "
                      f"{r['wall_s']:.0f} s", file=sys.stderr, flush=True)
    lm0 = {k: float(np.mean(v)) for k, v in lm0.items()}
    summary = summarise(results, lm0)
    cmd = "python -m bench.bench_shuffle_r1 " + " ".join(argv or [])
    head = (f"### Shuffle-R1 ablations (Tab. 5) with `ovpipe grpo`, word-copy demo task\n\n"
            f"Command: `{cmd.strip()}`; seeds {a.seeds}; {a.steps} optimizer steps a run; commit {commit}; "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads 2 "
            f"(a shared machine: times are ratios within this one run); total {time.perf_counter() - t0:.0f} s.\n")
    text = head + "\n" + table(summary, lm0) + "\n"
    print(text)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "bench_shuffle_r1.md").write_text(text)
        (a.out / "bench_shuffle_r1.json").write_text(json.dumps({"command": cmd.strip(), "commit": commit,
                                                                 "steps": a.steps, "seeds": a.seeds,
                                                                 "before": lm0, "summary": summary,
                                                                 "runs": results}, indent=1) + "\n")
        plot(results, a.out / "bench_shuffle_r1.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
