"""The LLM trains on the demo's packed shards; batches are built exactly as packed; resume is exact."""
import json
import multiprocessing
import shutil

import numpy as np
import torch


def test_collate_labels_masks_and_boundaries(packed_demo):
    from manifests import read_manifest
    from pretrain.data import iter_batches

    packs = {p["pack_id"]: p for p in read_manifest(packed_demo, "packs").to_pylist()}
    b = next(iter_batches(packed_demo, "pack", micro_batch=3))
    T = b.tokens.shape[1]
    assert int(b.cu_seqlens[-1]) == T and len(b.cu_seqlens) >= 4
    assert torch.equal(b.labels[0, :-1], b.tokens[0, 1:])
    ends = b.cu_seqlens[1:].long() - 1
    assert (b.loss_mask[0, ends] == 0).all()                  # no target across a sample boundary
    assert (b.position_ids[0, b.cu_seqlens[:-1].long()] == 0).all()
    from packing.shards import iter_packed, packed_shards

    first3 = [seq.pack_id for seq, _ in zip(iter_packed(packed_shards(packed_demo)[0]), range(3))]
    assert T == sum(packs[i]["total_tokens"] for i in first3)   # exactly the packs' tokens, no padding


def test_stage1_changes_only_the_projector(megatron_single, packed_demo, tmp_path):
    from pretrain.recipes import RECIPES
    from pretrain.train import train
    from pretrain.trainer.build import image_pad_id
    from pretrain.trainer.config import TrainConfig
    from pretrain.model.vlm import VLM

    a = tmp_path / "s1"
    shutil.copytree(packed_demo, a)
    torch.manual_seed(0)
    init = VLM(RECIPES["tiny"], image_pad_id(a, None), backend="sdpa").state_dict()
    out = train(TrainConfig(run_dir=a, recipe="tiny", stage="1", steps=4, micro_batch=2, lr=1e-2), log=lambda *_: None)
    assert all(m["images"] > 0 for m in out["metrics"])            # images really went through the tower
    from pretrain.trainer.checkpoint import load_state_dict

    after = load_state_dict(out["checkpoint"], "tiny")        # megatron dist_checkpointing round trip
    changed = {k for k, v in after.items() if not k.endswith("_extra_state") and not torch.equal(v, init[k])}
    assert changed and all(k.startswith("projector.") for k in changed)
    assert any(k.startswith("projector.") for k in changed)


def test_loss_falls_and_resume_is_exact(megatron_single, packed_demo, tmp_path):
    from pretrain.train import train
    from pretrain.trainer.config import TrainConfig

    torch.set_num_threads(2)
    children = set(multiprocessing.active_children())
    a = tmp_path / "a"
    shutil.copytree(packed_demo, a)
    cfg = dict(recipe="tiny", stage="1.5", steps=12, micro_batch=2, lr=3e-3)
    full = train(TrainConfig(run_dir=a, **cfg), log=lambda *_: None)["metrics"]
    first, last = np.mean([m["loss"] for m in full[:3]]), np.mean([m["loss"] for m in full[-3:]])
    assert last < first
    # interrupted after 6 steps, then resumed: identical losses for steps 7..12
    b = tmp_path / "b"
    shutil.copytree(packed_demo, b)
    train(TrainConfig(run_dir=b, stop_after=6, **cfg), log=lambda *_: None)  # killed
    ck = b / "pretrain" / "stage-1.5" / "dist_ckpt" / "iter_0000006"
    assert json.loads((ck / "step.json").read_text())["step"] == 6 and (ck / "metadata.json").exists()
    assert (ck.parent / "latest").read_text().strip() == "iter_0000006"
    # the lr schedule is defined over the full 12 steps: resume with the same total
    rest = train(TrainConfig(run_dir=b, **cfg), log=lambda *_: None)["metrics"]
    assert [m["step"] for m in rest] == list(range(7, 13))
    # a save writes in the training process: it leaves no process behind (megatron's writer would otherwise
    # spawn a Manager server for its results queue, a fresh interpreter per rank: pretrain.trainer.checkpoint)
    assert set(multiprocessing.active_children()) <= children
    assert [m["loss"] for m in rest] == [m["loss"] for m in full[6:]]          # fp32: bit for bit
    assert [m["grad_norm"] for m in rest] == [m["grad_norm"] for m in full[6:]]
    lines = [json.loads(x) for x in (b / "pretrain" / "stage-1.5" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, 13))
    assert all(k in lines[0] for k in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu"))


def test_metrics_manifest_and_report(megatron_single, packed_demo, tmp_path):
    from manifests.catalog import connect
    from pretrain.train import train
    from pretrain.trainer.config import TrainConfig

    run = tmp_path / "m"
    shutil.copytree(packed_demo, run)
    train(TrainConfig(run_dir=run, recipe="tiny", stage="1", steps=3, micro_batch=1, lr=1e-2), log=lambda *_: None)
    con = connect(run)
    rows = con.execute("SELECT stage, step, loss, packs, samples FROM train_metrics ORDER BY step").fetchall()
    assert [r[:2] for r in rows] == [("1", 1), ("1", 2), ("1", 3)]
    assert [r[3] for r in rows] == [1, 1, 1] and all(r[4] >= 1 for r in rows)    # one pack per step, its samples
    from pathlib import Path

    import manifests

    sql = (Path(manifests.__file__).parent / "queries" / "40_pretrain_loss_by_stage.sql").read_text()
    (stage, steps, first, last, *_), = con.execute(sql).fetchall()
    assert (stage, steps) == ("1", 3) and abs(first - rows[0][2]) < 1e-3 and abs(last - rows[-1][2]) < 1e-3
    # HFU and the step's time split beside MFU, as metrics.jsonl records them; the report's data-wait share
    split = con.execute("SELECT mfu, hfu, step_s, data_wait_s, fwd_bwd_s, optimizer_s FROM train_metrics "
                        "ORDER BY step").fetchall()
    jl = [json.loads(x) for x in (run / "pretrain" / "stage-1" / "metrics.jsonl").read_text().splitlines()]
    assert split == [tuple(m[k] for k in ("mfu", "hfu", "step_s", "data_wait_s", "fwd_bwd_s", "optimizer_s"))
                     for m in jl]
    assert all(0 < mfu <= hfu and 0 < wait + fb + opt <= step for mfu, hfu, step, wait, fb, opt in split)
    values = con.execute(sql).fetchone()
    report = dict(zip([d[0] for d in con.description], values))
    assert abs(report["data_wait_share"] - sum(r[3] for r in split) / sum(r[2] for r in split)) < 1e-4


def test_metrics_manifest_keeps_older_records(tmp_path):
    """A resumed stage's metrics.jsonl may start with records written before a field existed: their
    rows hold NULL there, not a made-up value."""
    from manifests import read_manifest
    from pretrain.trainer.metrics import data_wait_share, write_metrics_manifest

    old = {"step": 1, "loss": 6.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "mfu": 0.1, "tokens": 5,
           "images": 1}
    new = {**old, "step": 2, "packs": 1, "samples": 2, "hfu": 0.2, "step_s": 2.0, "data_wait_s": 0.5,
           "fwd_bwd_s": 1.2, "optimizer_s": 0.3}
    jl = tmp_path / "metrics.jsonl"
    jl.write_text(json.dumps(old) + "\n" + json.dumps(new) + "\n")
    rows = write_metrics_manifest(tmp_path, "1.5", jl)
    got = read_manifest(tmp_path, "train_metrics").to_pylist()
    assert got == rows and got[0]["hfu"] is None and got[0]["data_wait_s"] is None and got[0]["packs"] is None
    assert got[1]["hfu"] == 0.2 and got[1]["optimizer_s"] == 0.3
    assert data_wait_share(got) == 0.25                  # over the records that hold the split


def test_pixels_apply_exif_orientation():
    """A photo stored landscape with EXIF orientation 6 (rotate 90°) is trained upright: ingest
    records it as displayed (portrait), packing counts that grid, and `pixels` transposes it."""
    import io

    from PIL import Image

    from curation.image_header import inspect_image
    from pretrain.data import pixels

    stored = Image.new("RGB", (56, 28), (255, 0, 0))
    stored.paste((0, 0, 255), (0, 0, 28, 28))            # left half blue as stored
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    stored.save(buf, format="JPEG", exif=exif.tobytes(), quality=95)
    status, w, h, *_ = inspect_image(buf.getvalue(), "header")
    assert (status, w, h) == ("ok", 28, 56)               # as displayed
    x = pixels(buf.getvalue(), grid_h=4, grid_w=2)        # the grid of a 56 x 28 (h x w) image
    assert x.shape == (3, 56, 28)
    top, bottom = x[:, :28].mean(dim=(1, 2)), x[:, 28:].mean(dim=(1, 2))
    assert top[2] > top[0] and bottom[0] > bottom[2]      # rotated 90° clockwise: stored left half on top
