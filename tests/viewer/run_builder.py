"""The viewer tests' run, written as plain functions so that the fuzzer (``tests/fuzz/targets.py``, the bench
included) builds the same one: the session's real ``ingest`` over the demo corpus, and beside it the manifests of
the later steps written with the manifest writer (concepts chosen per sample, balance copies, packs with their
shard, two pretrain stages' metrics, an RL selection), so each page has something known to show without running
the models; then vectors the test plants (a near-duplicate pair, one marked ``duplicate_of`` the other; an image
placed on a text's vector through a seeded tiny CLIP; concept vectors) and the real ``index`` step over them."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

QUERY = "a handwritten receipt"
N_CONCEPTS = 6


def _step(run, folder: str, step: str, inputs: dict | None = None, config: dict | None = None):
    d = run / folder
    (d / "completions").mkdir(parents=True, exist_ok=True)
    (d / "completions" / "00000").touch()
    (d / "completions" / "finalized").touch()
    (d / "executor.json").write_text(json.dumps({"step": step, "tasks": 1, "config_hash": "0" * 16,
                                                 "inputs": inputs or {}}))
    (d / "config.json").write_text(json.dumps(config or {}))
    (d / "stats.json").write_text(json.dumps({"counters": {"rows": 1}}))
    return d


def write_view_run(ingested_run: Path, run: Path) -> dict:
    """``run`` (new): ``ingested_run``'s ingest and the later steps' manifests. What the tests know about it:
    ``known`` (a sample in pack 0 with its top concept), ``prompt`` (a kept prompt id), ``ok``, ``copies``, ``top``,
    ``packs``."""

    from manifests.io import read_manifest, write_part
    from packing.shards import write_shard

    run.mkdir(parents=True)
    shutil.copytree(ingested_run / "ingest", run / "ingest")
    samples = read_manifest(run, "samples", columns=["sample_id", "status", "images"]).to_pylist()
    ok = sorted(s["sample_id"] for s in samples if s["status"] == "ok")
    rng = np.random.default_rng(0)

    d = _step(run, "embed-concepts", "embed-concepts")
    names = ["red circle", "blue square", "green star", "pink ring", "teal bar", "gray cross"]
    write_part({"concept_id": list(range(N_CONCEPTS)), "text": names, "file": ["c.npy"] * N_CONCEPTS,
                "row": list(range(N_CONCEPTS))}, d / "concepts" / "part-00000.parquet", "concepts")
    d = _step(run, "assign", "assign")
    top = [[int(i % N_CONCEPTS), int((i + 1) % N_CONCEPTS)] for i in range(len(ok))]
    write_part({"sample_id": ok, "concept_ids": top, "scores": [[0.9, 0.5]] * len(ok)},
               d / "assignments" / "part-00000.parquet", "assignments")
    d = _step(run, "balance", "balance")
    copies = [int(i // N_CONCEPTS % 3) for i in range(len(ok))]    # 0: dropped; every concept has both
    write_part({"sample_id": ok, "weight": [1.0] * len(ok), "copies": copies},
               d / "balanced" / "part-00000.parquet", "balanced")
    before = np.bincount([c for t in top for c in t], minlength=N_CONCEPTS)
    after = np.bincount([c for t, k in zip(top, copies) for c in t for _ in range(k)], minlength=N_CONCEPTS)
    write_part({"concept_id": list(range(N_CONCEPTS)), "text": names, "count_before": before.tolist(),
                "count_after": after.tolist()}, d / "concept_counts" / "part-00000.parquet", "concept_counts")
    d = _step(run, "lengths", "lengths")
    write_part({"sample_id": ok, "source": ["demo"] * len(ok), "text_tokens": [20] * len(ok),
                "image_tokens": [44] * len(ok), "total_tokens": [64] * len(ok), "target_tokens": [8] * len(ok),
                "turns_kept": [2] * len(ok), "images": [1] * len(ok), "vit_sq": [177 ** 2] * len(ok),
                "status": ["ok"] * len(ok), "error": [None] * len(ok),
                "source_sample_id": ok}, d / "lengths" / "part-00000.parquet", "lengths")

    # Packs of 4 samples of 64 tokens in a 256-token sequence; the loss mask on each sample's last 8 tokens.
    d = _step(run, "pack", "pack", config={"seq_len": 256})
    kept = [s for s, k in zip(ok, copies) if k > 0][:40]
    packs = [kept[i:i + 4] for i in range(0, len(kept), 4)]
    mask = np.zeros(256, np.uint8)
    for k in range(4):
        mask[k * 64 + 56:(k + 1) * 64] = 1
    entries = [{"pack_id": j, "sample_ids": p, "lengths": [64] * len(p), "offsets": [64 * k for k in range(len(p))],
                "seq_len": 256, "ids": np.zeros(64 * len(p), np.int32), "mask": mask[:64 * len(p)],
                "images": [], "exts": [], "grids": [], "image_counts": [0] * len(p)} for j, p in enumerate(packs)]
    (d / "data").mkdir()
    write_shard(d / "data" / "pack-000000.tar", entries)
    write_part({"pack_id": list(range(len(packs))), "sample_ids": packs, "lengths": [[64] * len(p) for p in packs],
                "offsets": [[64 * k for k in range(len(p))] for p in packs], "total_tokens": [64 * len(p) for p in packs],
                "shard": ["pack-000000.tar"] * len(packs), "attn_sq": [64 * 64 * len(p) for p in packs],
                "images": [len(p) for p in packs], "vit_tokens": [177 * len(p) for p in packs],
                "vit_sq": [177 ** 2 * len(p) for p in packs], "cost": [1.0 + j for j in range(len(packs))]},
               d / "packs" / "part-00000.parquet", "packs")

    # Stage 1.5 reads `pack` two packs a step for 3 steps: pack 0 is step 1's, pack 5 is step 3's.
    for stage in ("1", "1.5"):
        sd = _step(run, f"pretrain/stage-{stage}", "pretrain", inputs={"pack": "0" * 16})
        (sd / "stage.json").write_text(json.dumps({"stage": stage, "data": "pack" if stage == "1.5" else "pack-align",
                                                   "global_batch": 2, "steps": 3}))
    steps = 3
    write_part({"stage": ["1.5"] * steps, "step": list(range(1, steps + 1)), "loss": [5.0, 4.0, 3.5],
                "lr": [1e-3] * steps, "grad_norm": [1.0] * steps, "tokens_per_s": [100.0] * steps,
                "mfu": [0.01, 0.02, None], "tokens": [512] * steps, "images": [8] * steps, "packs": [2] * steps,
                "samples": [8] * steps, "hfu": [0.02] * steps, "step_s": [1.0] * steps, "data_wait_s": [0.1] * steps,
                "fwd_bwd_s": [0.8] * steps, "optimizer_s": [0.1] * steps},
               run / "pretrain" / "train_metrics" / "part-00000.parquet", "train_metrics")

    # RL: three prompts, one with an image; 4 rollouts each.
    from PIL import Image
    import io

    buf = io.BytesIO()
    Image.new("RGB", (32, 24), (200, 30, 30)).save(buf, "PNG")
    pids = ["p0", "p1", "p2"]
    d = _step(run, "rl-ingest", "rl-ingest")
    write_part({"prompt_id": pids, "source": ["geo"] * 3, "category": ["math"] * 3,
                "question": ["<image>What colour?", "2+2?", "3+3?"], "images": [[buf.getvalue()], [], []],
                "ground_truth": ["red", "4", "6"], "answer_type": ["choice", "number", "number"], "extra": ["{}"] * 3,
                "status": ["ok"] * 3, "error": [None] * 3}, d / "rl_prompts" / "part-00000.parquet", "rl_prompts")
    d = _step(run, "rollout", "rollout")
    keys = [(p, i) for p in pids for i in range(4)]
    write_part({"prompt_id": [p for p, _ in keys], "rollout_idx": [i for _, i in keys],
                "prompt_type": ["answer_only"] * 12, "response": [f"answer {p}.{i}" for p, i in keys],
                "tokens": [5] * 12, "backend": ["rule"] * 12, "model": ["tiny"] * 12, "sampling": ["{}"] * 12},
               d / "rollouts" / "part-00000.parquet", "rollouts")
    correct = {"p0": [1, 0, 0, 1], "p1": [1, 1, 1, 1], "p2": [0, 0, 0, 0]}
    d = _step(run, "score", "score")
    write_part({"prompt_id": [p for p, _ in keys], "rollout_idx": [i for _, i in keys],
                "reward": [float(correct[p][i]) for p, i in keys], "correct": [bool(correct[p][i]) for p, i in keys],
                "reward_type": ["rule"] * 12, "status": ["ok"] * 12, "error": [None] * 12},
               d / "rewards" / "part-00000.parquet", "rewards")
    d = _step(run, "select", "select")
    write_part({"prompt_id": pids, "source": ["geo"] * 3, "category": ["math"] * 3, "n": [4] * 3,
                "correct": [2, 4, 0], "pass_at_1": [0.5, 1.0, 0.0], "pass_at_n": [1.0, 1.0, 0.0],
                "gap": [0.5, 0.0, 0.0], "mean_reward": [0.5, 1.0, 0.0], "pass_at_k": [None] * 3,
                "kept": [True, False, False], "reason": ["kept", "too_easy", "too_hard"], "split": [None] * 3},
               d / "selection" / "part-00000.parquet", "selection")
    return {"run": run, "known": packs[0][0], "known_concept": names[top[ok.index(packs[0][0])][0]],
            "prompt": "p0", "ok": ok, "copies": dict(zip(ok, copies)), "top": dict(zip(ok, top)), "packs": packs}


def write_meaning_run(view_run: dict, run: Path) -> dict:
    """``run`` (new): a copy of the view run with image and concept vectors, a dedup and the real ``index`` step."""
    import open_clip
    import torch

    from curation.clip import register_configs
    from curation.concepts import embed_texts
    from curation.embed import EmbedImagesConfig
    from manifests.io import write_part
    from ovpipe.cli import main
    from ovpipe.config import config_json

    shutil.copytree(view_run["run"], run)
    ok = view_run["ok"]
    register_configs()
    torch.manual_seed(0)
    net, _, _ = open_clip.create_model_and_transforms("ovpipe-tiny-clip", pretrained=None)
    ckpt = run.parent / "tiny-clip.pt"
    torch.save({"state_dict": net.state_dict()}, ckpt)
    text = embed_texts([QUERY], ["{}"], net.eval(), open_clip.get_tokenizer("ovpipe-tiny-clip"), "cpu", 1)[0]

    rng = np.random.default_rng(0)
    d = len(text)
    centres = rng.standard_normal((4, d))
    x = centres[np.arange(len(ok)) % 4] + 0.8 * rng.standard_normal((len(ok), d))
    kept, twin, planted = 0, 1, 2
    x[twin] = x[kept] + 0.02 * rng.standard_normal(d)
    x[planted] = text * np.linalg.norm(x[planted]) + 0.05 * rng.standard_normal(d)
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)
    emb = run / "embed-images"
    (emb / "data").mkdir(parents=True)
    (emb / "completions").mkdir()
    (emb / "completions" / "finalized").touch()
    np.save(emb / "data" / "emb-00000.npy", x)
    write_part({"sample_id": ok, "file": ["embed-images/data/emb-00000.npy"] * len(ok), "row": list(range(len(ok))),
                "status": ["ok"] * len(ok), "error": [None] * len(ok)},
               emb / "image_embeddings" / "part-00000.parquet", "image_embeddings")
    (emb / "config.json").write_text(config_json(EmbedImagesConfig(model="ovpipe-tiny-clip", pretrained=str(ckpt))))
    (emb / "executor.json").write_text(json.dumps({"step": "embed-images", "tasks": 1, "config_hash": "x",
                                                   "outputs": ["image_embeddings"]}))
    cos = float(x[twin].astype(np.float32) @ x[kept].astype(np.float32))
    dd = run / "dedup"
    dd.mkdir()
    write_part({"sample_id": ok, "cluster": [0] * len(ok),
                "duplicate_of": [ok[kept] if i == twin else None for i in range(len(ok))],
                "similarity": [cos if i == twin else None for i in range(len(ok))],
                "status": ["near_duplicate" if i == twin else "ok" for i in range(len(ok))],
                "error": [None] * len(ok)}, dd / "dedup" / "part-00000.parquet", "dedup")
    np.save(run / "c.npy", centres.astype(np.float16))        # the concepts manifest names row k of c.npy
    assert main(["index", "--run-dir", str(run), "--quiet"]) == 0
    return {"run": run, "kept": ok[kept], "twin": ok[twin], "planted": ok[planted], "ok": ok}
