"""Conversation packs in the trainer: text-only micro-batches under megatron DDP's overlapped gradient
reduction, labels that follow the per-turn loss mask, and --epochs / packs-consumed accounting.

The packs (``conftest.conversation_run``) alternate text-only and image micro-batches, starting
text-only; every token's role is known."""
import json
import math
import shutil

import numpy as np
import pytest
import torch

VISION = ("vision.", "projector.")


def _copy(conversation_run, tmp_path, name):
    run, info = conversation_run
    dst = tmp_path / name
    shutil.copytree(run, dst)
    return dst, info


def test_labels_are_exactly_the_assistant_turns(conversation_run):
    """Every assistant token and the <|im_end|> closing its turn is a target, nothing else is: no
    user or system text, no header, no <|image_pad|>, no vision marker, never across samples."""
    from packing.tokens import load_tokenizer
    from pretrain.data import iter_batches

    run, info = conversation_run
    tok = load_tokenizer(str(run / "tokenizer"))
    b = next(iter_batches(run, "pack-conv", micro_batch=len(info), epochs=1))     # all packs, one sequence
    tags = [t for pid in sorted(info) for _, tg in info[pid] for t in tg]
    assert b.tokens.shape[1] == len(tags) and b.n_packs == len(info) == 6 and b.n_samples == 10
    assert b.n_images == 5 and len(b.images) == 5
    # the token predicted at position i is token i + 1: the label mask, moved onto the predicted token
    target = np.zeros(len(tags), bool)
    target[1:] = b.loss_mask[0, :-1].numpy() > 0
    want = np.array([t in ("assistant", "end-assistant") for t in tags])
    assert want.sum() > 0 and np.array_equal(target, want)
    assert torch.equal(b.labels[0, :-1], b.tokens[0, 1:])
    never = {tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>",
                                                      "<|im_start|>")}
    trained = set(b.labels[0][b.loss_mask[0] > 0].tolist())
    assert trained and not trained & never
    assert {tags[i] for i in np.flatnonzero(target)} == {"assistant", "end-assistant"}
    ends = b.cu_seqlens[1:].long() - 1
    assert (b.loss_mask[0, ends] == 0).all()


def test_text_only_dummy_adds_exactly_zero(megatron_single, conversation_run):
    """The dummy image changes neither the loss nor any LLM gradient, by exactly nothing; it gives the
    vision tower and projector zero gradients where they would otherwise have none."""
    from pretrain.data import iter_batches
    from pretrain.recipes import RECIPES
    from pretrain.trainer.build import image_pad_id
    from pretrain.model.vlm import VLM

    run, _ = conversation_run
    b = next(iter_batches(run, "pack-conv", micro_batch=1, epochs=1))           # pack 0: text only
    assert b.n_images == 0 and b.images == []
    torch.manual_seed(0)
    model = VLM(RECIPES["tiny"], image_pad_id(run, None), backend="sdpa")
    model.set_trainable("all")
    out = {}
    for dummy in (True, False):
        model.zero_grad(set_to_none=True)
        model.text_only_dummy = dummy
        loss = (model(b) * b.loss_mask).sum() / b.loss_mask.sum()
        loss.backward()
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        out[dummy] = (loss.detach(), grads)
    assert torch.equal(out[True][0], out[False][0]) and torch.isfinite(out[True][0])
    for n, g in out[True][1].items():
        if not dict(model.named_parameters())[n].requires_grad:
            assert g is None and out[False][1][n] is None, n
        elif n.startswith(VISION):
            assert g is not None and not g.any(), n              # present, and exactly zero
            assert out[False][1][n] is None
        else:
            assert torch.equal(g, out[False][1][n]), n


def _probe(log):
    def on_step(rec, ddp):
        grads = {n: p.main_grad.clone() for n, p in ddp.module.named_parameters() if p.requires_grad}
        log.append((rec, grads, ddp.ddp_config.overlap_grad_reduce))
    return on_step


@pytest.mark.parametrize("stage", ["2", "1"])
def test_text_only_steps_under_overlapped_grad_reduce(megatron_single, conversation_run, tmp_path, stage):
    """Stage 2 (everything trains) and stage 1 (projector only), one pack per step, half the steps
    without any image (the first one too): megatron's DDP with overlap_grad_reduce must not assert,
    the loss stays finite, and on text-only steps the vision / projector gradients are exactly 0."""
    from pretrain.train import train
    from pretrain.trainer.config import TrainConfig

    run, info = _copy(conversation_run, tmp_path, f"s{stage}")
    seen = []
    out = train(TrainConfig(run_dir=run, recipe="tiny", stage=stage, steps=len(info), micro_batch=1, lr=1e-3,
                            data="pack-conv"), log=lambda *_: None, on_step=_probe(seen))
    assert [r["images"] for r in out["metrics"]] == [0, 2, 0, 2, 0, 1]
    for rec, grads, overlap in seen:
        assert overlap and math.isfinite(rec["loss"]) and math.isfinite(rec["grad_norm"])
        vis = [g for n, g in grads.items() if n.startswith(VISION)]
        assert vis                                              # trainable vision-side parameters exist
        if rec["images"] == 0:
            assert not any(g.any() for g in vis), rec["step"]
        else:
            assert any(g.any() for g in vis), rec["step"]
    trainable = set(seen[0][1])
    if stage == "1":
        assert trainable and all(n.startswith("projector.") for n in trainable)
    else:
        assert any(n.startswith("vision.") for n in trainable) and any(n.startswith("llm.") for n in trainable)


def test_without_the_dummy_megatron_ddp_asserts(megatron_single, conversation_run, tmp_path, monkeypatch):
    """The failure the dummy image prevents: with overlap_grad_reduce, a text-only first step leaves
    the vision/projector parameters out of the bucket's reference count and megatron's DDP asserts."""
    from pretrain.train import train
    from pretrain.trainer.config import TrainConfig
    from pretrain.model.vlm import VLM

    run, _ = _copy(conversation_run, tmp_path, "nodummy")
    orig = VLM.set_trainable

    def no_dummy(self, which):
        orig(self, which)
        self.text_only_dummy = False

    monkeypatch.setattr(VLM, "set_trainable", no_dummy)
    with pytest.raises(AssertionError) as e:
        train(TrainConfig(run_dir=run, recipe="tiny", stage="2", steps=3, micro_batch=1, lr=1e-3, data="pack-conv"),
              log=lambda *_: None)
    assert e.traceback[-1].path.name == "param_and_grad_buffer.py"       # megatron's bucket bookkeeping


def test_epochs_derive_steps_and_metrics_count_packs(megatron_single, conversation_run, tmp_path):
    """--epochs 1.5 over 6 packs at GBS 2 (1 pack × 2 accumulated) is ceil(4.5) = 5 steps; each step
    records the packs and source samples it consumed, in metrics.jsonl and train_metrics."""
    from manifests import read_manifest
    from pretrain.train import train
    from pretrain.trainer.config import TrainConfig

    run, info = _copy(conversation_run, tmp_path, "ep")
    lines = []
    out = train(TrainConfig(run_dir=run, recipe="tiny", stage="2", epochs=1.5, micro_batch=1, grad_accum=2, lr=1e-3,
                            data="pack-conv"), log=lines.append)
    per_pack = [len(info[p]) for p in sorted(info)] * 2                        # the stream runs on into epoch 2
    assert [m["step"] for m in out["metrics"]] == [1, 2, 3, 4, 5]
    assert [m["packs"] for m in out["metrics"]] == [2] * 5
    assert [m["samples"] for m in out["metrics"]] == [sum(per_pack[2 * i:2 * i + 2]) for i in range(5)]
    assert out["plan"]["packs"] == 6 and out["plan"]["samples"] == 10 and out["plan"]["steps"] == 5
    assert "10 samples → 6 packs" in lines[0] and "GBS 2 packs × 5 steps" in lines[0] and "1.67 epochs" in lines[0]
    assert "consumed 10 packs" in lines[-1] and f"({sum(per_pack[:10])} samples" in lines[-1]
    jl = [json.loads(x) for x in (run / "pretrain" / "stage-2" / "metrics.jsonl").read_text().splitlines()]
    assert [m["packs"] for m in jl] == [2] * 5
    tm = read_manifest(run, "train_metrics").to_pylist()
    assert [r["samples"] for r in tm] == [m["samples"] for m in out["metrics"]]
    stage = json.loads((run / "pretrain" / "stage-2" / "stage.json").read_text())
    assert (stage["data"], stage["epochs"], stage["steps"], stage["data_packs"]) == ("pack-conv", 1.5, 5, 6)


def test_a_global_batch_sets_the_accumulation_and_trains_as_it_would(megatron_single, conversation_run, tmp_path):
    """global_batch (megatron's --global-batch-size) at one DP rank and one pack per micro-batch is two
    micro-batches per step: the same losses and grad norms as grad_accum=2, recorded in stage.json."""
    from pretrain.train import train
    from pretrain.trainer.config import TrainConfig

    common = dict(recipe="tiny", stage="2", steps=2, micro_batch=1, lr=1e-3, data="pack-conv")
    runs = {}
    for name, kw in (("accum", {"grad_accum": 2}), ("global", {"global_batch": 2})):
        run, _ = _copy(conversation_run, tmp_path, name)
        out = train(TrainConfig(run_dir=run, **common, **kw), log=lambda *_: None)
        runs[name] = [(m["loss"], m["grad_norm"], m["packs"]) for m in out["metrics"]]
        stage = json.loads((run / "pretrain" / "stage-2" / "stage.json").read_text())
        assert (stage["grad_accum"], stage["global_batch"]) == (2, 2)
    assert runs["global"] == runs["accum"] and [p for _, _, p in runs["accum"]] == [2, 2]


def test_plan_and_the_pack_stream(conversation_run):
    """steps = ceil(E × packs / GBS); the pack stream runs on across epochs; skip = resume."""
    from pretrain.data import iter_batches, plan_data

    run, info = conversation_run
    p = plan_data(run, "pack-conv", micro_batch=2, grad_accum=2, dp=2, epochs=3)      # GBS 8, 18 packs
    assert (p.packs, p.samples, p.gbs, p.steps) == (6, 10, 8, 3) and p.epochs == 4.0
    assert plan_data(run, "pack-conv", 1, 1, 1, epochs=0.1 * 30 / 6).steps == 3          # 0.5 × 6: no float creep
    assert plan_data(run, "pack-conv", 1, 1, 1, steps=4).epochs == 4 / 6
    with pytest.raises(ValueError, match="--steps and --epochs"):
        plan_data(run, "pack-conv", 1, 1, 1, steps=4, epochs=1)
    with pytest.raises(FileNotFoundError, match="--epochs needs the pack count"):
        plan_data(run, "no-such-step", 1, 1, 1, epochs=1)
    ids = [b.tokens[0, :8].tolist() for b in iter_batches(run, "pack-conv", micro_batch=4, epochs=2)]
    assert len(ids) == 3                                     # 12 packs of 2 epochs in 3 micro-batches of 4
    one = [b.tokens[0].tolist() for b in iter_batches(run, "pack-conv", micro_batch=1, epochs=2)]
    assert [b.tokens[0].tolist() for b in iter_batches(run, "pack-conv", micro_batch=4, epochs=2)][1] == \
        sum(one[4:8], [])                                    # packs 4, 5 of epoch 1 and 0, 1 of epoch 2
    rank1 = list(iter_batches(run, "pack-conv", micro_batch=1, epochs=1, rank=1, world=2, skip=1))
    assert [b.tokens[0].tolist() for b in rank1] == [one[3], one[5]]


@pytest.mark.slow
def test_data_parallel_rank_without_images(megatron_single, conversation_run, tmp_path):
    """DP=2 with one pack per micro-batch: rank 0 gets packs 0, 2, 4 — never an image — and rank 1
    the image packs. With overlap_grad_reduce both ranks reduce every bucket every step, and the
    run equals one process accumulating the same two micro-batches (``pretrain.train``'s command line, in this
    process)."""
    import os
    import subprocess
    import sys

    import pretrain.train

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                            "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    got = {}
    for name, nproc, accum in (("dp1", 1, "2"), ("dp2", 2, "1")):
        run, _ = _copy(conversation_run, tmp_path, name)
        args = ["--run-dir", str(run), "--stage", "2", "--data", "pack-conv", "--epochs", "2", "--micro-batch", "1",
                "--grad-accum", accum, "--lr", "1e-3", "--fp32", "--metrics-out", str(run / "m.json")]
        if nproc == 1:
            assert pretrain.train.main(args) == 0
        else:
            r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                f"--nproc-per-node={nproc}", "-m", "pretrain.train", *args], env=env,
                               capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, r.stderr[-4000:]
        got[name] = json.loads((run / "m.json").read_text())["metrics"]
    assert [m["images"] for m in got["dp2"]] == [2, 2, 1, 2, 2, 1] and [m["packs"] for m in got["dp2"]] == [2] * 6
    for a, b in zip(got["dp1"], got["dp2"]):
        assert abs(a["loss"] - b["loss"]) <= 2e-6 * a["loss"]
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]
