"""SortedRL on vLLM with a LLaMA-3.1-8B-shaped model, at the paper's §4.4.1 shape: baseline, on-policy, partial
(issue 64 item 4). The device half of ``bench/bench_sortedrl.py`` (which measures the same three runs on the CPU).

    python -m bench.bench_sortedrl_gpu --out DIR [--n 512 --batches 4 --slots 128 --max-len 2048]   # a GPU, vLLM
    python -m bench.bench_sortedrl_gpu --out DIR --engine transformers --max-len 1024               # a GPU, no vLLM
    python -m bench.bench_sortedrl_gpu --dry-run [--out DIR]                                           # the CPU

The model: LLaMA-3.1-8B's shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14,336, vocab 128,256,
rope θ 500,000; 8.03 B parameters, counted from the shapes) as a transformers ``LlamaConfig`` saved to
``--model-dir``, its weights random: vLLM's ``load_format: dummy`` fills them on the card (no 16 GB checkpoint to
write or carry), and the lengths are imposed (each request's ``max_tokens`` from the workload, ``ignore_eos``), so
what the weights say does not matter, only what a step costs. Prompts are token ids (``skip_tokenizer_init``).

The workload: ``n`` samples in ``batches`` update batches on ``slots`` engine slots (the paper: 512, 4, 128),
prompts of ``prompt_len`` random tokens, output lengths from the lognormal ``bench_grpo`` fitted to the paper's
baseline (median 1,200, σ 1.2, capped at 8,192), scaled to ``--max-len`` as ``bench_sortedrl`` scales them (the
paper's 8,192 at full scale would take ≈ 15 min a run on one card; 2,048 keeps the three runs inside one device call).
One engine serves the three runs in turn (``grpo.sortedrl.synchronous_rollout``, ``run_sorted`` on-policy and
partial, over ``grpo.engines.vllm.VllmEngine``), after a warm-up request. Per run: the bubble ratio (eq. 4, all
steps and the final drain's part), output tokens/s (trained tokens over engine time) and × the baseline's, wasted
tokens, engine steps; and the step time against the running count (is a step's cost flat in the batch, the
memory-bound regime the issue's throughput goal names?), beside ``grpo.rollout_sim``'s prediction for the same
lengths on its LLaMA-3.1-8B H100 roofline.

``--engine transformers``: the same three runs on transformers' continuous batching on the card
(``grpo.engines.cb``), the model made there with random bf16 weights — the engine a device can run where vLLM cannot
be installed (this project's device image has none, and its wheel is far over what a device call carries). Its step
costs the framework's Python and paged attention, not vLLM's kernels, so its figures are the controller on a real
GPU engine in the memory-bound regime, not vLLM's own throughput. The JSON is rewritten after each run, so a run cut
off by the device's limit keeps what it measured (``measured_so_far``).

``--dry-run`` (the CPU, no vLLM): builds and saves the 8B config and counts its parameters, builds the full
workload's request plan and checks it (batch size, every budget within the model length, the token totals), then
runs the same three runs through the same driver on transformers' continuous batching with a LLaMA of the same
proportions at toy size (``TINY``) on a scaled-down plan, checking the accounting (partial: every generated token
trained once; on-policy: generated = trained + wasted; no batch of on-policy mixes versions). Its figures are
plumbing, not measurements. Device script: ``bench/gpu/sortedrl_h200.sh`` (``DRY=1`` runs this dry run).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

# meta-llama/Llama-3.1-8B's config.json, the fields that set the cost of a step
LLAMA31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                  rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
                  hidden_act="silu", head_dim=128)
# the same proportions at toy size (GQA 4:1, intermediate 3.5× hidden), for the CPU dry run
TINY = dict(LLAMA31_8B, vocab_size=512, hidden_size=64, intermediate_size=224, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096, bos_token_id=1,
            eos_token_id=2)


def llama_config(shape: dict):
    from transformers import LlamaConfig

    s = dict(shape)
    theta = s.pop("rope_theta")
    return LlamaConfig(**s, rope_parameters={"rope_type": "default", "rope_theta": theta}, torch_dtype="bfloat16")


def param_count(cfg) -> int:
    """Parameters of a LLaMA of this config, counted from its shapes (``LlamaForCausalLM``'s modules: embeddings,
    per layer q/k/v/o, gate/up/down and two norms, the final norm, an untied head) — what instantiating it on the meta
    device counts (tests/grpo/test_sortedrl_gpu_dry.py checks the two agree on the toy shape), without the seconds
    that costs at 32 layers."""
    h, i, v, layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    attn = h * cfg.num_attention_heads * hd * 2 + 2 * h * cfg.num_key_value_heads * hd
    per_layer = attn + 3 * h * i + 2 * h
    return v * h * (1 if cfg.tie_word_embeddings else 2) + layers * per_layer + h


def save_model_dir(cfg, out: Path) -> Path:
    """``config.json`` (and ``generation_config.json``) for vLLM's dummy loader: the weights are made on the card."""
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out)
    # the keys an older transformers (the one a vLLM build pins) reads too: rope θ and the dtype at the top level
    path = out / "config.json"
    d = json.loads(path.read_text())
    if "rope_theta" in (d.get("rope_parameters") or {}):       # an older one would keep its default 10,000
        d["rope_theta"] = d["rope_parameters"]["rope_theta"]
    d.setdefault("torch_dtype", d.get("dtype", "bfloat16"))
    path.write_text(json.dumps(d, indent=2))
    return out


def plan(n: int, batches: int, slots: int, max_len: int, prompt_len: int, vocab: int, seed: int,
         model_len: int) -> tuple[list, dict]:
    """The request plan: one ``Entry`` a sample (its random prompt ids, its imposed budget), checked."""
    from bench.bench_sortedrl import entries, workload_lengths

    if n % batches:
        raise ValueError(f"--n {n} is not {batches} whole batches")
    if slots < 1 or slots > n:
        raise ValueError(f"--slots {slots} must be in 1..{n}")
    lengths = workload_lengths(n, max_len, seed)
    if lengths.max() > max_len or lengths.min() < 1:
        raise AssertionError("a budget outside 1..max_len")
    if prompt_len + max_len > model_len:
        raise ValueError(f"prompt {prompt_len} + max_len {max_len} exceed the model length {model_len}")
    es = entries(lengths, prompt_len, vocab, seed)
    return es, {"n": n, "batches": batches, "batch_size": n // batches, "slots": slots, "max_len": max_len,
                "prompt_len": prompt_len, "output_tokens": int(lengths.sum()), "median": float(np.median(lengths)),
                "p90": float(np.percentile(lengths, 90)), "longest": int(lengths.max()),
                "capped_share": float((lengths == max_len).mean())}


def fresh(es, offset: int):
    """The plan's entries afresh, their ids shifted: one engine serves the three runs, and a request id is used once."""
    from grpo.sortedrl import Entry

    return [Entry(e.prompt_id + offset, e.target_len, prompt_ids=list(e.prompt_ids)) for e in es]


def check_accounting(mode: str, run, total: int) -> None:
    """What the three runs must satisfy whatever the engine (the issue's 'what must hold')."""
    trained = run.trained_tokens
    if trained != total:
        raise AssertionError(f"{mode}: {trained} tokens trained, the plan has {total}")
    if mode == "partial" and (run.generated_tokens != trained or run.wasted_tokens):
        raise AssertionError(f"partial: generated {run.generated_tokens} ≠ trained {trained} (or waste)")
    if mode == "on_policy":
        if run.generated_tokens != trained + run.wasted_tokens:
            raise AssertionError(f"on_policy: generated {run.generated_tokens} ≠ trained + wasted")
        if any(len(set(v for vs in versions for v in vs)) > 1 for _, versions in run.schedule):
            raise AssertionError("on_policy: a batch mixes policy versions")


def run_three(engine, es: list, slots: int, batch_size: int, modes=("baseline", "on_policy", "partial"),
              on_mode=None) -> dict:
    """The three runs on one engine; ``on_mode(out)`` after each (the device run saves what it has so far)."""
    from bench.bench_sortedrl import step_growth
    from grpo.sortedrl import run_sorted, synchronous_rollout

    engine.admit("warmup", list(es[0].prompt_ids), 4)          # one-off allocations, graph capture
    while engine.has_work():
        engine.step()
    total = sum(e.target_len for e in es)
    out = {}
    for k, mode in enumerate(modes):
        t0 = time.perf_counter()
        run = (synchronous_rollout(engine, fresh(es, k * 10**6), slots, batch_size) if mode == "baseline"
               else run_sorted(engine, [fresh(es, k * 10**6)], slots, batch_size, mode))
        wall = time.perf_counter() - t0
        check_accounting(mode, run, total)
        out[mode] = {"engine_s": run.time_s, "wall_s": wall, "bubble_ratio": run.bubble_ratio,
                     "drain_bubble": run.drain_bubble, "tokens_per_s": run.tokens_per_s,
                     "generated_tokens": run.generated_tokens, "trained_tokens": run.trained_tokens,
                     "wasted_tokens": run.wasted_tokens, "steps": len(run.steps),
                     "resumed_rollouts": sum(len(e.versions) > 1 for b in run.batches for e in b),
                     "step_s_by_running": step_growth(run.steps)}
        print(f"{mode}: {run.time_s:.1f} s engine, bubble {run.bubble_ratio:.1%}, {run.tokens_per_s:,.0f} tokens/s, "
              f"wasted {run.wasted_tokens}", file=sys.stderr)
        if on_mode is not None:
            on_mode(out)
    for mode in out:
        out[mode]["throughput_x_baseline"] = out[mode]["tokens_per_s"] / out["baseline"]["tokens_per_s"]
    return out


def simulated(es: list, slots: int, batch_size: int) -> dict:
    """``grpo.rollout_sim``'s prediction for the same lengths on its LLaMA-3.1-8B H100 roofline."""
    from grpo.rollout_sim import LLAMA31_8B_H100, simulate_baseline, simulate_sorted

    lengths = np.array([e.target_len for e in es])
    prompts = np.array([len(e.prompt_ids) for e in es])
    res = {"baseline": simulate_baseline(lengths, prompts, slots, batch_size, LLAMA31_8B_H100)}
    for mode in ("on_policy", "partial"):
        res[mode] = simulate_sorted(lengths, prompts, slots, batch_size, mode, LLAMA31_8B_H100)
    return {m: {"time_s": r.time_s, "bubble_ratio": r.bubble_ratio, "tokens_per_s": r.tokens_per_s,
                "wasted_tokens": r.wasted_tokens} for m, r in res.items()}


def vllm_engine(folder: Path, slots: int, max_len: int, seed: int, gpu_memory_utilization: float = 0.85):
    """``grpo.engines.vllm`` over the saved config: random weights (``load_format: dummy``), bf16, token ids in and
    out (no tokenizer), EOS ignored, ``slots`` sequences at once."""
    from grpo.engines.vllm import VllmEngine

    return VllmEngine(str(folder), slots=slots, max_len=max_len, seed=seed, ignore_eos=True,
                      engine_args={"load_format": "dummy", "skip_tokenizer_init": True, "dtype": "bfloat16",
                                   "gpu_memory_utilization": gpu_memory_utilization})


def cb_engine(cfg, slots: int, max_len: int, seed: int, device: str = "cuda", dtype: str = "bfloat16",
              max_batch_tokens: int = 8192):
    """``grpo.engines.cb`` (transformers' continuous batching) over a LLaMA of ``cfg``'s shape with random weights,
    made on ``device`` in ``dtype`` (no checkpoint: the lengths are imposed, only a step's cost matters), EOS
    ignored, ``slots`` requests at once, prefill chunks of up to ``max_batch_tokens`` a step. The engine a device
    can run where vLLM cannot be carried (its wheel and kernels are far over what a device call carries)."""
    import torch
    from transformers import LlamaForCausalLM

    from grpo.engines.cb import ContinuousBatchingEngine

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    return ContinuousBatchingEngine(model, slots=slots, max_len=max_len, seed=seed, ignore_eos=True,
                                    max_batch_tokens=max_batch_tokens)


def table(meas: dict, sim: dict) -> str:
    rows = ["| mode | bubble, all steps (drain) | sim | output tokens/s | × baseline | sim × baseline | wasted | steps |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for m, r in meas.items():
        rows.append(f"| {m} | {r['bubble_ratio']:.1%} ({r['drain_bubble']:.1%}) | {sim[m]['bubble_ratio']:.1%} | "
                    f"{r['tokens_per_s']:,.0f} | {r['throughput_x_baseline']:.2f} | "
                    f"{sim[m]['tokens_per_s'] / sim['baseline']['tokens_per_s']:.2f} | {r['wasted_tokens']:,} | "
                    f"{r['steps']:,} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="the CPU: no vLLM; the plan, and a toy run on CB")
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default="/tmp/llama31-8b-shape")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--engine", choices=("vllm", "transformers"), default="vllm",
                    help="vllm (LLMEngine, dummy weights) or transformers (continuous batching on the card, random "
                         "weights: where vllm is not importable)")
    ap.add_argument("--out", default=None, help="write sortedrl_gpu.json (and the table) here")
    a = ap.parse_args(argv)
    cfg = llama_config(LLAMA31_8B)
    params = param_count(cfg)
    if not 8.0e9 < params < 8.1e9:
        raise AssertionError(f"the LLaMA-3.1-8B shape has {params:,} parameters, not 8.03 B")
    folder = save_model_dir(cfg, Path(a.model_dir))
    es, info = plan(a.n, a.batches, a.slots, a.max_len, a.prompt_len, cfg.vocab_size, a.seed,
                    cfg.max_position_embeddings)
    info.update(model="LLaMA-3.1-8B shape, random weights", parameters=params, model_dir=str(folder))
    print(f"8B shape: {params:,} parameters, config in {folder}; plan: {json.dumps(info)}", file=sys.stderr)
    sim = simulated(es, a.slots, a.n // a.batches)
    result = {"plan": info, "simulated": sim, "engine": a.engine, "command": "python -m bench.bench_sortedrl_gpu " +
              " ".join(argv if argv is not None else sys.argv[1:])}
    out_path = Path(a.out) / ("sortedrl_gpu_dry.json" if a.dry_run else "sortedrl_gpu.json") if a.out else None

    def save(partial: dict | None = None) -> None:
        if out_path is not None:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps({**result, **({"measured_so_far": partial} if partial else {})}, indent=1))
    if a.dry_run:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)                              # a toy forward: threads only add their overhead
        n, b, q, ml, pl = 16, 4, 4, 16, 4                     # the same shape of plan, toy sizes
        tes, tinfo = plan(n, b, q, ml, pl, TINY["vocab_size"], a.seed, TINY["max_position_embeddings"])
        # the device's transformers engine (cb_engine), on the CPU in fp32 with the toy shape
        eng = cb_engine(llama_config(TINY), q, pl + ml, a.seed, device="cpu", dtype="float32",
                        max_batch_tokens=q * (pl + ml))
        try:
            result.update(dry_run=True, toy_plan=tinfo, toy=run_three(eng, tes, q, n // b))
        finally:
            eng.close()
            torch.set_num_threads(threads)
    else:
        import torch

        t0 = time.perf_counter()
        engine = (vllm_engine(folder, a.slots, a.prompt_len + a.max_len, a.seed, a.gpu_memory_utilization)
                  if a.engine == "vllm" else cb_engine(cfg, a.slots, a.prompt_len + a.max_len, a.seed))
        result.update(device=torch.cuda.get_device_name(0), engine_start_s=time.perf_counter() - t0)
        save()
        result["measured"] = run_three(engine, es, a.slots, a.n // a.batches, on_mode=save)
        result["table"] = table(result["measured"], sim)
        print(result["table"])
        engine.close()
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
