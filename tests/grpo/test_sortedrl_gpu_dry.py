"""The GPU half of SortedRL prepared (bench/bench_sortedrl_gpu.py), dry-run on the CPU: the LLaMA-3.1-8B shape is
built and saved for vLLM's dummy loader (8.03 B parameters), the paper's request plan is checked, and the same three
runs go through the same driver on transformers' continuous batching with a toy LLaMA, their accounting checked."""
from __future__ import annotations

import json


def test_the_device_script_dry_runs_on_the_cpu(tmp_path):
    from bench.bench_sortedrl_gpu import main

    assert main(["--dry-run", "--model-dir", str(tmp_path / "m"), "--out", str(tmp_path)]) == 0
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                "intermediate_size", "vocab_size", "rope_theta")} == {
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14336, "vocab_size": 128256, "rope_theta": 500000.0}
    assert not list((tmp_path / "m").glob("*.safetensors"))            # the weights are vLLM's dummy loader's
    r = json.loads((tmp_path / "sortedrl_gpu_dry.json").read_text())
    assert r["dry_run"] and "measured" not in r                         # nothing recorded as a measurement
    p = r["plan"]
    assert (p["n"], p["batch_size"], p["slots"], p["parameters"]) == (512, 128, 128, 8_030_261_248)
    assert 1 <= p["median"] <= p["longest"] <= p["max_len"] == 2048
    toy = r["toy"]                                                     # accounting checked inside: it ran through
    assert toy["partial"]["wasted_tokens"] == 0 and toy["on_policy"]["wasted_tokens"] > 0
    assert toy["partial"]["resumed_rollouts"] > 0 and toy["baseline"]["resumed_rollouts"] == 0
    assert {m["trained_tokens"] for m in toy.values()} == {r["toy_plan"]["output_tokens"]}
    assert set(r["simulated"]) == {"baseline", "on_policy", "partial"}


def test_the_parameter_count_is_the_models():
    import torch
    from transformers import LlamaForCausalLM

    from bench.bench_sortedrl_gpu import LLAMA31_8B, TINY, llama_config, param_count

    for shape in (TINY, dict(TINY, tie_word_embeddings=True)):
        cfg = llama_config(shape)
        with torch.device("meta"):
            assert param_count(cfg) == sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    assert param_count(llama_config(LLAMA31_8B)) == 8_030_261_248          # LLaMA-3.1-8B's published 8.03 B
