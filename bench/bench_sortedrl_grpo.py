"""GRPO with and without SortedRL on the demo, at equal steps and seeds (issue 64: "rollout time a step, the bubble,
and the reward curve; training quality must stay within seed noise").

    python -m bench.bench_sortedrl_grpo --demo-run runs/demo [--steps 12] [--seeds 0 1 2] [--work /tmp/i64runs]
                                        [--out bench/results]

The demo's RL stage is `ovpipe grpo --config configs/demo/grpo.yaml` on the stage-2 VLM over the export's splits.
SortedRL's engine (transformers' continuous batching) runs a causal LM on text, so the policy here is the demo's
stage-2 model's *language half* — its trained Qwen3 weights (the checkpoint's ``model.*`` / ``lm_head`` keys, the
same architecture: the multimodal rotary of a text-only sequence is the 1-D one) with its tokenizer and chat
template — on the demo export's answer-only split with the ``<image>`` placeholder removed (the pictures cannot
reach a text model; the policy can still learn the answers' prior, which is the signal measured). Everything else is
configs/demo/grpo.yaml (32 rollouts a step = 4 prompts × 8, ≤ 16 tokens, lr 3e-4), except ``top_k: 0`` for every
run: the continuous-batching engine samples from the full distribution, and the comparison needs one sampler.

Runs (each ``--steps`` optimizer steps, one generation per step):

* ``grpo``: TRL's own generation (``model.generate``, one padded batch): GRPO without SortedRL;
* ``cb_sync``: ``sortedrl: {mode: on_policy, group_batches: 1}`` — the controller on the same engine with a group of
  one batch, so no early termination is possible: the synchronous baseline *on the SortedRL engine*, which
  separates the engine's cost from the scheduling's;
* ``on_policy`` and ``partial``: ``sortedrl: {mode: …, group_batches: 2}``;
* ``partial_unweighted``: partial with the behaviour weights off (its stale tokens trained at weight 1), the
  ablation that says what the weights do.

Per run (medians over steps, then means over seeds): the optimizer step's time (``step_time_s``), rollout time a
step (``generate_s``: TRL's generation + scoring; for SortedRL runs also the engine's own time), the bubble a step (SortedRL: the paper's eq. 4 over the call's engine steps, ``rollout_bubble_ratio``; TRL's
padded ``generate``: a batch of Q = 32 rows decodes until its longest completion, so the same eq. 4 is
``1 − mean length / max length``), the reward curve (``reward_mean``: the scaled reward, −5 … +5, of the rollouts
each step trains), and the final policy's accuracy on fresh samples (16 a prompt from the saved model, the same
sampler and seed for every run) — the quality check, since a SortedRL step's reward is of the batch it *trains*,
the first groups to finish, not of a fresh draw. Partial runs' behaviour-weight figures (``behave_*``) too.
Writes ``bench_sortedrl_grpo.txt`` and ``.json`` to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

RUNS: dict[str, dict] = {
    "grpo": {},
    "cb_sync": {"mode": "on_policy", "group_batches": 1},
    "on_policy": {"mode": "on_policy", "group_batches": 2},
    "partial": {"mode": "partial", "group_batches": 2},
    # ablation: partial with its stale tokens trained at weight 1 (the trainer's behaviour weights switched off)
    "partial_unweighted": {"mode": "partial", "group_batches": 2},
}
UNWEIGHTED = {"partial_unweighted"}
SPLIT = "stage1-answer-only"


def text_lm(vlm: Path, out: Path) -> Path:
    """The language half of the demo's stage-2 VLM as a ``Qwen3ForCausalLM`` folder (weights, tokenizer, template)."""
    import shutil

    import torch
    from safetensors.torch import load_file
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    if (out / "config.json").exists():
        return out
    tc = json.loads((vlm / "config.json").read_text())["text_config"]
    keys = {k: tc[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                               "tie_word_embeddings", "max_position_embeddings")}
    cfg = Qwen3Config(**keys, rope_parameters={"rope_type": "default", "rope_theta": tc["rope_theta"]},
                      eos_token_id=tc["eos_token_id"], pad_token_id=tc.get("pad_token_id"), bos_token_id=None)
    sd = {k: v for k, v in load_file(str(vlm / "model.safetensors")).items()
          if k.startswith(("model.embed_tokens", "model.layers", "model.norm", "lm_head"))}
    model = Qwen3ForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"{vlm}: the language half does not map onto Qwen3 (missing {missing}, extra {unexpected})")
    model.tie_weights()
    tok = PreTrainedTokenizerFast.from_pretrained(vlm)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float32).save_pretrained(out)
    tok.save_pretrained(out)
    tc_path = out / "tokenizer_config.json"       # a text model: no processor to look for
    tc_json = json.loads(tc_path.read_text())
    tc_json.pop("processor_class", None)
    tc_path.write_text(json.dumps(tc_json, indent=1))
    if (vlm / "chat_template.jinja").exists():
        shutil.copy(vlm / "chat_template.jinja", out / "chat_template.jinja")
    if tok.pad_token is None:
        raise RuntimeError(f"{vlm}: the tokenizer has no pad token")
    return out


def text_split(demo_run: Path, run: Path) -> None:
    """The export's answer-only split, text only: ``<image>`` placeholders and the pictures left out."""
    import pyarrow.parquet as pq

    t = pq.read_table(demo_run / "export" / "verl" / f"{SPLIT}.parquet")
    rows = t.to_pylist()
    for r in rows:
        r["prompt"] = [{**m, "content": m["content"].replace("<image>\n", "").replace("<image>", "")}
                       for m in r["prompt"]]
        r["images"] = []
    out = run / "export" / "verl"
    out.mkdir(parents=True, exist_ok=True)
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows, schema=t.schema), out / f"{SPLIT}.parquet")


def grpo(run: Path, lm: Path, seed: int, steps: int, sortedrl: dict, unweighted: bool = False,
         lr: float | None = None) -> float:
    from ovpipe.cli import main

    from grpo.trainer import OvpipeGRPOTrainer

    sets = [f"model={lm}", "stages=[answer_only]", f"seed={seed}", f"steps={steps}", "top_k=0",
            f"save_every={steps}", "cpu_threads=1", *([f"learning_rate={lr}"] if lr else [])]
    if sortedrl:
        sets.append("sortedrl={" + ", ".join(f"{k}: {v}" for k, v in sortedrl.items()) + "}")
    t0 = time.perf_counter()
    add = OvpipeGRPOTrainer._add_behaviour_weights
    if unweighted:                         # the run is in this process: the ablation swaps the method for its span
        OvpipeGRPOTrainer._add_behaviour_weights = lambda self, batch, inputs: None
    try:
        rc = main(["grpo", "--run-dir", str(run), "--config", "configs/demo/grpo.yaml", "--quiet",
                   *[x for s in sets for x in ("--set", s)]])
    finally:
        OvpipeGRPOTrainer._add_behaviour_weights = add
    if rc != 0:
        raise RuntimeError(f"grpo failed in {run} (rc {rc})")
    return time.perf_counter() - t0


def final_accuracy(run: Path, samples: int, seed: int = 1234, folder: Path | None = None) -> float:
    """Share of correct answers over ``samples`` fresh draws a prompt from the trained model (top-k off, T = 1);
    ``folder``: another model over the same run's prompts (the policy before training)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.step import GRPOStepConfig, stage_dataset
    from rl_select.rewards import score_one

    folder = folder or run / "grpo" / "model"
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ds = stage_dataset(GRPOStepConfig(model=str(folder), stages=["answer_only"]), run, "answer_only")
    correct = total = 0
    torch.manual_seed(seed)
    for row in ds:
        text = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids.repeat(samples, 1), do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                                 max_new_tokens=16, pad_token_id=tok.pad_token_id)
        for seq in out[:, ids.shape[1]:]:
            r = score_one((row["answer_type"], tok.decode(seq, skip_special_tokens=True), row["ground_truth"],
                           row["reward_params"]))
            correct += bool(r[1])
            total += 1
    return correct / total


def read_metrics(run: Path) -> list[dict]:
    import pyarrow.parquet as pq

    rows = pq.read_table(next((run / "grpo" / "grpo_metrics").glob("part-*.parquet"))).to_pylist()
    out = []
    for r in sorted(rows, key=lambda r: r["step"]):
        e = json.loads(r["extras"] or "{}")
        lm, lx = r["completion_len_mean"], r["completion_len_max"]
        out.append({"step": r["step"], "reward": r["reward_mean"], "generate_s": r["generate_s"],
                    "step_s": r["step_time_s"], "len_mean": lm,
                    "engine_s": e.get("rollout_engine_s"),
                    "bubble": e["rollout_bubble_ratio"] if "rollout_bubble_ratio" in e else 1 - lm / lx,
                    "wasted": e.get("rollout_wasted_tokens"), "stale": e.get("behave_stale_token_share"),
                    "w_mean": e.get("behave_weight_mean"), "w_max": e.get("behave_weight_max"),
                    "capped": e.get("behave_capped_share")})
    return out


def summarise(results: dict, steps: int, initial: float) -> list[str]:
    def ms(xs):
        xs = [x for x in xs if x is not None]
        return (float(np.mean(xs)), float(np.std(xs))) if xs else (float("nan"), float("nan"))

    lines = ["| run | step s | rollout s/step | engine s/step | bubble | wasted tokens/step | reward, first 3 steps | "
             f"reward, last 3 steps | final accuracy (± seed std) | gain over the initial {initial:.1%} | "
             "stale tokens | behaviour w mean / max | capped |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, seeds in results.items():
        per = [s["metrics"] for s in seeds.values()]
        gen = ms([np.median([m["generate_s"] for m in p]) for p in per])
        step = ms([np.median([m["step_s"] for m in p]) for p in per])
        eng = ms([np.median([m["engine_s"] for m in p]) if p[0]["engine_s"] is not None else None for p in per])
        bub = ms([np.mean([m["bubble"] for m in p]) for p in per])
        wasted = ms([(p[-1]["wasted"] or 0) / len(p) if p[0]["wasted"] is not None else None for p in per])
        first = ms([np.mean([m["reward"] for m in p[:3]]) for p in per])
        last = ms([np.mean([m["reward"] for m in p[-3:]]) for p in per])
        acc = ms([s["accuracy"] for s in seeds.values()])
        stale = ms([np.mean([m["stale"] or 0 for m in p]) if p[0]["stale"] is not None else None for p in per])
        wm = ms([np.mean([m["w_mean"] for m in p if m["w_mean"] is not None]) if any(m["w_mean"] for m in p)
                 else None for p in per])
        wx = ms([max(m["w_max"] for m in p if m["w_max"] is not None) if any(m["w_max"] for m in p) else None
                 for p in per])
        cap = ms([np.mean([m["capped"] for m in p if m["capped"] is not None]) if any(m["w_mean"] for m in p)
                  else None for p in per])

        def f(x, fmt="{:.2f}"):
            return "—" if np.isnan(x[0]) else fmt.format(x[0])
        lines.append(f"| {name} | {f(step)} | {f(gen)} | {f(eng)} | {f(bub, '{:.1%}')} | {f(wasted, '{:.0f}')} | "
                     f"{first[0]:+.2f} ± {first[1]:.2f} | {last[0]:+.2f} ± {last[1]:.2f} | "
                     f"{acc[0]:.1%} ± {acc[1]:.1%} | {(acc[0] - initial) * 100:+.1f} points | {f(stale, '{:.1%}')} | "
                     f"{f(wm, "{:.3f}")} / {f(wx, "{:.3f}")} | {f(cap, '{:.1%}')} |")
    lines.append("")
    lines.append("Reward curve (mean scaled reward a step over the seeds, −5 … +5):")
    lines.append("| run | " + " | ".join(str(i + 1) for i in range(steps)) + " |")
    lines.append("| --- |" + " ---: |" * steps)
    for name, seeds in results.items():
        curve = np.mean([[m["reward"] for m in s["metrics"]] for s in seeds.values()], axis=0)
        lines.append(f"| {name} | " + " | ".join(f"{x:+.2f}" for x in curve) + " |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--demo-run", default="runs/demo", help="a demo run with export/verl and pretrain/hf-stage-2")
    ap.add_argument("--work", default="/tmp/bench_sortedrl_grpo", help="where the runs are written")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--eval-samples", type=int, default=16)
    ap.add_argument("--lr", type=float, default=None, help="the learning rate (default: configs/demo/grpo.yaml's); a "
                    "larger one moves the policy further a step, so partial mode's stale tokens lag it more")
    ap.add_argument("--out", default=None, help="write bench_sortedrl_grpo.txt/.json here")
    a = ap.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch

    torch.set_num_threads(1)
    demo, work = Path(a.demo_run).resolve(), Path(a.work)
    lm = text_lm(demo / "pretrain" / "hf-stage-2", work / "text-lm")
    results: dict = {}
    t_all = time.perf_counter()
    for seed in a.seeds:                       # interleaved: a load spike on the shared machine hits every run alike
        for name in a.runs:
            run = work / f"{name}-s{seed}"
            if (run / "grpo" / "model" / "config.json").exists():
                wall = None
            else:
                text_split(demo, run)
                wall = grpo(run, lm, seed, a.steps, RUNS[name], name in UNWEIGHTED, a.lr)
            results.setdefault(name, {})[seed] = {"metrics": read_metrics(run), "wall_s": wall,
                                                  "accuracy": final_accuracy(run, a.eval_samples)}
            print(f"{name} seed {seed}: {wall and round(wall, 1)} s, accuracy "
                  f"{results[name][seed]['accuracy']:.1%}", file=sys.stderr)
    # the policy before training, on the same prompts, sampler and seed: what the runs' accuracies moved from
    initial = final_accuracy(work / f"{a.runs[0]}-s{a.seeds[0]}", a.eval_samples, folder=lm)
    lines = summarise(results, a.steps, initial)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    head = [f"# bench_sortedrl_grpo — commit {commit}, {platform.machine()} CPU, {os.cpu_count()} cores "
            f"(shared with other jobs), torch threads 1; {time.perf_counter() - t_all:.0f} s in all",
            f"# python -m bench.bench_sortedrl_grpo " + " ".join(argv if argv is not None else sys.argv[1:]),
            f"# policy: the language half of {demo}/pretrain/hf-stage-2; split {SPLIT} without its images; "
            f"{a.steps} steps × 32 rollouts, seeds {a.seeds}, learning rate {a.lr or 'the config\'s'}", ""]
    text = "\n".join(head + lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "bench_sortedrl_grpo.txt").write_text(text)
        (Path(a.out) / "bench_sortedrl_grpo.json").write_text(json.dumps(
            {"commit": commit, "steps": a.steps, "seeds": a.seeds, "initial_accuracy": initial, "results": results},
            indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
