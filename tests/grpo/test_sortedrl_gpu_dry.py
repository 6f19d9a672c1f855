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


def test_the_vllm_engine_is_built_with_dummy_weights_and_no_tokenizer(monkeypatch, tmp_path):
    """What the device run hands vLLM, against a stand-in ``vllm`` module (as tests/grpo/test_engines.py)."""
    import sys
    import types

    from bench.bench_sortedrl_gpu import vllm_engine

    got = {}
    vllm = types.ModuleType("vllm")
    vllm.EngineArgs = lambda **kw: kw
    vllm.LLMEngine = types.SimpleNamespace(from_engine_args=lambda kw: got.update(kw) or object())
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    vllm_engine(tmp_path, slots=128, max_len=256 + 2048, seed=0)
    assert got == {"model": str(tmp_path), "seed": 0, "max_num_seqs": 128, "max_model_len": 2304,
                   "enable_prefix_caching": True, "load_format": "dummy", "skip_tokenizer_init": True,
                   "dtype": "bfloat16", "gpu_memory_utilization": 0.85}


def test_the_device_run_on_the_transformers_engine_records_its_engine_and_each_run(tmp_path, monkeypatch):
    """The device path where vLLM is missing (``--engine transformers``), on the CPU: ``cb_engine`` builds the engine
    (here the toy shape at the 8B's vocabulary, fp32, on the CPU, in place of the 8B on the card); the JSON names the
    engine, holds the three runs, and is rewritten after each run with what was measured so far."""
    import torch

    import bench.bench_sortedrl_gpu as g

    real = g.cb_engine
    monkeypatch.setattr(g, "cb_engine", lambda cfg, slots, max_len, seed: real(
        g.llama_config(dict(g.TINY, vocab_size=cfg.vocab_size)), slots, max_len, seed, device="cpu",
        dtype="float32", max_batch_tokens=slots * max_len))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "cpu stand-in")
    seen = []
    write_text = type(tmp_path).write_text

    def recording(self, text, *a, **k):
        if self.name == "sortedrl_gpu.json":
            seen.append(json.loads(text))
        return write_text(self, text, *a, **k)
    monkeypatch.setattr(type(tmp_path), "write_text", recording)
    torch.set_num_threads(1)
    assert g.main(["--engine", "transformers", "--n", "16", "--batches", "4", "--slots", "4", "--max-len", "16",
                   "--prompt-len", "4", "--model-dir", str(tmp_path / "m"), "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "sortedrl_gpu.json").read_text())
    assert r["engine"] == "transformers" and r["device"] == "cpu stand-in" and "dry_run" not in r
    assert set(r["measured"]) == {"baseline", "on_policy", "partial"} and "| partial |" in r["table"]
    assert {m["trained_tokens"] for m in r["measured"].values()} == {r["plan"]["output_tokens"]}
    runs = [sorted(x.get("measured_so_far", {})) for x in seen if "measured" not in x]
    assert runs == [[], ["baseline"], ["baseline", "on_policy"], ["baseline", "on_policy", "partial"]]
