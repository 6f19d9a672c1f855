"""The demo's RL loop per seed: grpo on the export's splits, then rollout, score and select on the trained model;
pass@1 before and after on the trained prompts and on the held-out ones, GRPO's steps/s and generation tokens/s.

    python -m bench.bench_grpo_loop --run runs/demo [--seeds 0 1 2] [--tag NAME --set FIELD=VALUE ...]

``--run`` is a run folder where ``make demo`` finished (its ``export``, ``select`` and the exported model). Seed
0's folders are the demo's own (``grpo``, ``rollout-grpo``, ``score-grpo``, ``select-grpo``), reused when they
are there; every other seed trains and re-selects in its own folders (``grpo-s1``, ``rollout-grpo-s1``, …) with
``configs/demo/grpo.yaml`` and ``--set seed=S``. Before and after are two fresh draws with the same rollout seeds
(``LOOP_SEED`` 1, as ``make demo``: ``select-base`` is the start model, ``select-grpo*`` the trained one), so the
difference is the policy's alone and free of the first selection's upward bias on the prompts it kept.
``--set`` overrides a grpo field for every seed (an lr sweep: ``--tag lr1e-4 --set learning_rate=0.0001``); with
``--tag`` every seed, 0 included, trains in its own folders (``grpo-NAME-s0``, …).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def suffix(seed: int, tag: str) -> str:
    return f"-{tag}-s{seed}" if tag else ("" if seed == 0 else f"-s{seed}")


def loop(run: Path, seed: int, model: str, stages: str, tag: str = "", sets: tuple[str, ...] = ()) -> dict:
    from ovpipe.cli import main

    sfx = suffix(seed, tag)
    common = ["--run-dir", str(run), "--quiet"]
    steps = [
        ["grpo", "--name", f"grpo{sfx}", "--config", "configs/demo/grpo.yaml", "--set", f"model={model}",
         "--set", f"stages={stages}", "--set", f"seed={seed}", *(x for kv in sets for x in ("--set", kv))],
        ["rollout", "--name", f"rollout-grpo{sfx}", "--config", "configs/demo/rollout.yaml",
         "--set", f"model={run.resolve()}/grpo{sfx}/model", "--set", "seed=1", "--tasks", "2", "--workers", "2"],
        ["score", "--name", f"score-grpo{sfx}", "--config", "configs/demo/score.yaml",
         "--set", f"rollouts_step=rollout-grpo{sfx}", "--tasks", "2", "--workers", "2"],
        ["select", "--name", f"select-grpo{sfx}", "--config", "configs/demo/select.yaml",
         "--set", f"rewards_step=score-grpo{sfx}", "--set", f"rollouts_step=rollout-grpo{sfx}", "--tasks", "2",
         "--workers", "2"],
    ]
    for argv in steps:
        assert main([*argv, *common]) == 0, argv
    return {"grpo": f"grpo{sfx}", "select": f"select-grpo{sfx}"}


def figures(run: Path, grpo: str, after: str) -> dict:
    import pyarrow.parquet as pq

    from ovpipe.summary import _mean, _pass_at_1

    info = json.loads((run / grpo / "grpo.json").read_text())
    trained = {pid for ids in (info.get("prompts") or {}).values() for pid in ids}
    for s in [] if trained else info["splits"]:
        trained |= {r["prompt_id"] for r in pq.read_table(run / "export" / "verl" / f"{s}.parquet",
                                                          columns=["extra_info"]).column("extra_info").to_pylist()}
    b, a = _pass_at_1(run / "select-base"), _pass_at_1(run / after)
    held = [p for p, (reason, _) in _pass_at_1(run / "select").items() if reason == "held_out"]
    out = {}
    for name, ids in (("trained", sorted(trained)), ("held_out", held)):
        out[name] = {"n": len(ids), "before": _mean(b[i][1] for i in ids), "after": _mean(a[i][1] for i in ids)}
    m = pq.read_table(next((run / grpo / "grpo_metrics").glob("part-*.parquet")),
                      columns=["step_time_s", "generate_tokens_per_s", "generated_tokens"]).to_pylist()
    out["steps"] = len(m)
    out["steps_per_s"] = len(m) / sum(r["step_time_s"] for r in m)
    out["generate_tokens_per_s"] = statistics.median(r["generate_tokens_per_s"] for r in m)
    out["tokens_per_s"] = sum(r["generated_tokens"] for r in m) / sum(r["step_time_s"] for r in m)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/demo")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--quick", action="store_true", help="(bench's flag) seed 0 only")
    ap.add_argument("--tag", default="", help="the folders' name for a run with --set overrides")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="FIELD=VALUE for grpo, every seed")
    a = ap.parse_args(argv)
    run = Path(a.run)
    if not (run / "export" / "verl").is_dir():
        print(f"bench_grpo_loop: {run} has no export: run make demo first")
        return 0
    from demo.rl import grpo_stages

    stages = "[" + ", ".join(grpo_stages(run)) + "]"
    model = json.loads((run / "rollout" / "config.json").read_text())["model"]
    rows = {}
    for seed in ([0] if a.quick else a.seeds):
        if a.sets and not a.tag:
            ap.error("--set needs --tag (the folders of an override run are its own)")
        sfx = suffix(seed, a.tag)
        if not (run / f"select-grpo{sfx}" / "stats.json").exists():
            loop(run, seed, model, stages, a.tag, tuple(a.sets))
        rows[seed] = figures(run, f"grpo{sfx}", f"select-grpo{sfx}")
    print(f"run {run}; model {model}; stages {stages}; overrides {a.sets or 'none'}")
    print(f"{'seed':>4} {'trained n':>9} {'before':>7} {'after':>7} {'Δ pts':>6} {'held-out n':>10} {'before':>7} "
          f"{'after':>7} {'Δ pts':>6} {'steps/s':>8} {'gen tok/s':>9}")
    for seed, r in rows.items():
        t, h = r["trained"], r["held_out"]
        print(f"{seed:>4} {t['n']:>9} {t['before']:>7.3f} {t['after']:>7.3f} {100 * (t['after'] - t['before']):>+6.1f} "
              f"{h['n']:>10} {h['before']:>7.3f} {h['after']:>7.3f} {100 * (h['after'] - h['before']):>+6.1f} "
              f"{r['steps_per_s']:>8.3f} {r['generate_tokens_per_s']:>9.1f}")
    mean = lambda k, g: statistics.mean(100 * (r[g]["after"] - r[g]["before"]) for r in rows.values())  # noqa: E731
    print(f"mean over seeds: trained {mean(0, 'trained'):+.1f} points (goal ≥ +10), held-out "
          f"{mean(0, 'held_out'):+.1f} points (goal ≥ 0)")
    print(json.dumps(rows, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
