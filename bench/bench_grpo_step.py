"""`ovpipe grpo` against a bare TRL script on the same config: what the step costs over TRL alone.

    python -m bench.bench_grpo_step [--quick] [--model HF_FOLDER --run RUN] [--steps N] [--reps R]

Both sides train the same model on the same prompts with the same ``GRPOConfig`` (one generation per optimizer
step, the same batch, group, lengths, learning rate and seed). The bare side is what a TRL user writes: a
``GRPOTrainer`` over a ``datasets.Dataset`` with an in-process reward function (the same registry rule, called
directly). The ovpipe side is the step (``ovpipe grpo`` in-process): the reward through ``RewardRunner``'s worker
processes with a time limit, the batch statistics, the metrics file, the checkpoints it would write anyway are off
on both sides (``save_every`` past the run). Figures: the median optimizer-step time over steps 2… (step 1 pays
the first forward's warm-up), the step's total wall time (model load and the output folder included), and the
ratios. Sides alternate (bare, ovpipe, ovpipe, bare, …) so a machine that drifts loads both alike.

Default model: the word-level LM of the GRPO tests (``demo.word_lm``); ``--model`` + ``--run`` measure a real
folder on a run's export split instead (e.g. the demo's stage-2 export).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def settings(a) -> dict:
    return dict(steps=a.steps, batch_size=a.batch, num_generations=a.group, micro_batch=a.batch,
                max_completion_length=a.max_new, learning_rate=1e-3, temperature=1.0, seed=0)


def bare_trl(model: str, run: Path, split: str, s: dict) -> dict:
    """The bare TRL script: the export split as a Dataset, a plain reward function, TRL's own defaults elsewhere."""
    import io

    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from PIL import Image
    from transformers import AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from inference.backends import load_model
    from manifests.conversation import to_messages
    from rl_select.rewards import resolve
    from rl_select.rollout import TEMPLATES

    t0 = time.perf_counter()
    torch.set_num_threads(2)
    t = pq.read_table(run / "export" / "verl" / f"{split}.parquet").to_pylist()
    rows = []
    for r in t:
        q = next(m["content"] for m in r["prompt"] if m["role"] == "user")
        row = {"prompt": to_messages([("user", TEMPLATES["answer_only"].format(question=q))]),
               "ground_truth": r["reward_model"]["ground_truth"], "answer_type": r["extra_info"]["answer_type"]}
        if r["images"]:
            row["images"] = [Image.open(io.BytesIO(i["bytes"])).convert("RGB") for i in r["images"]]
        else:
            row["prompt"] = [{"role": "user", "content": row["prompt"][0]["content"][0]["text"]}]
        rows.append(row)

    def reward(prompts, completions, ground_truth, answer_type, **_):
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        return [(resolve(a)(x, g, {})[0] - 0.5) * 10 for x, g, a in zip(texts, ground_truth, answer_type)]

    times = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

    m = load_model(model, torch.float32)
    proc = AutoProcessor.from_pretrained(model, trust_remote_code=True)
    from grpo.trainer import drop_unaccepted_outputs     # the one change TRL needs for the published class

    drop_unaccepted_outputs(proc, m)
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(output_dir=out, max_steps=s["steps"], learning_rate=s["learning_rate"],
                         per_device_train_batch_size=s["micro_batch"], gradient_accumulation_steps=1,
                         steps_per_generation=1, num_generations=s["num_generations"],
                         max_completion_length=s["max_completion_length"], temperature=s["temperature"],
                         beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", seed=s["seed"], use_cpu=True,
                         bf16=False,      # TRL's configs default to bf16 autocast; the step trains fp32 on a CPU
                         logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
                         remove_unused_columns=False)
        GRPOTrainer(model=m, reward_funcs=reward, args=cfg, train_dataset=Dataset.from_list(rows),
                    processing_class=proc, callbacks=[Clock()]).train()
    return {"step_s": times, "wall_s": time.perf_counter() - t0}


def ovpipe_step(model: str, src: Path, run: Path, s: dict) -> dict:
    """The step in-process, in a fresh run folder (``run``; its export linked to ``src``'s): a rerun in the same
    folder would find the step done and train nothing."""
    import pyarrow.parquet as pq

    from ovpipe.cli import main

    (run / "export").mkdir(parents=True)
    (run / "export" / "verl").symlink_to((src / "export" / "verl").resolve())
    t0 = time.perf_counter()
    sets = [f"model={model}", "stages=[answer_only]", f"save_every={s['steps'] + 1}", "reward_workers=1",
            *(f"{k}={v}" for k, v in s.items())]
    rc = main(["grpo", "--run-dir", str(run), "--quiet", *(x for kv in sets for x in ("--set", kv))])
    assert rc == 0, rc
    m = pq.read_table(next((run / "grpo" / "grpo_metrics").glob("part-*.parquet")),
                      columns=["step_time_s", "generate_tokens_per_s"]).to_pylist()
    return {"step_s": [r["step_time_s"] for r in m], "wall_s": time.perf_counter() - t0,
            "gen_tokens_per_s": statistics.median(r["generate_tokens_per_s"] for r in m)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model")
    ap.add_argument("--run", help="a run folder whose export step wrote verl/<split>.parquet (with --model)")
    ap.add_argument("--split", default="stage1-answer-only")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=4)
    a = ap.parse_args(argv)
    if a.quick:
        a.steps, a.reps = 4, 1
    tmp = Path(tempfile.mkdtemp(prefix="bench-grpo-step-"))
    if a.model:
        model, src = a.model, Path(a.run)
    else:
        from demo.word_lm import word_lm, write_split

        model, src = str(word_lm(tmp / "lm")), tmp / "run"
        write_split(src, a.split, [{"question": "say yes", "answer": "yes"}, {"question": "say no", "answer": "no"}] * 4)
    s = settings(a)
    res = {"bare": [], "ovpipe": []}
    for i in range(a.reps):
        for side in (("bare", "ovpipe") if i % 2 == 0 else ("ovpipe", "bare")):
            res[side].append(bare_trl(model, src, a.split, s) if side == "bare" else
                             ovpipe_step(model, src, tmp / f"ovpipe-run-{i}", s))
    med = {k: statistics.median(t for r in v for t in r["step_s"][1:]) for k, v in res.items()}
    wall = {k: statistics.median(r["wall_s"] for r in v) for k, v in res.items()}
    print(f"model {model}; {a.steps} steps × {a.batch} rollouts ({a.batch // a.group} prompts × {a.group}), "
          f"≤ {a.max_new} new tokens, {a.reps} rep(s) a side, alternating")
    print(f"{'side':<8} {'median step s':>14} {'wall s':>8}")
    for k in res:
        print(f"{k:<8} {med[k]:>14.3f} {wall[k]:>8.1f}")
    over = med["ovpipe"] / med["bare"] - 1
    print(f"ovpipe over bare TRL: step time {over:+.1%} (goal ≤ +5%), wall {wall['ovpipe'] / wall['bare'] - 1:+.1%}; "
          f"ovpipe generation {statistics.median(r['gen_tokens_per_s'] for r in res['ovpipe']):.0f} tokens/s")
    print(json.dumps({"median_step_s": med, "wall_s": wall, "step_overhead": over}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
