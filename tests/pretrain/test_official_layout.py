"""A stage trains from a folder in the official LLaVA-OneVision-1.5 layout: the demo's caption packs written
by `pack-official`, read back by `import-packs`, then 3 steps of stage 1 on them."""
import json
import math
import shutil


def test_stage_trains_three_steps_from_an_official_layout_folder(megatron_single, packed_demo, tmp_path):
    from manifests import read_manifest
    from ovpipe.cli import main
    from pretrain.train import train
    from pretrain.trainer.config import TrainConfig

    run = tmp_path / "official"
    shutil.copytree(packed_demo, run)
    common = ["--run-dir", str(run), "--quiet"]
    assert main(["pack-official", "--set", "pack_step=pack-align", *common]) == 0
    assert main(["import-packs", "--set", f"source={run / 'pack-official'}", "--set", f"tokenizer={run / 'tokenizer'}",
                 "--set", "seq_len=512", *common]) == 0
    statuses = read_manifest(run, "imported_packs", step="import-packs").column("status").to_pylist()
    assert statuses and set(statuses) == {"ok"}
    out = train(TrainConfig(run_dir=run, recipe="tiny", stage="1", steps=3, micro_batch=1, lr=1e-2,
                            data="import-packs"), log=lambda *_: None)
    m = out["metrics"]
    assert [r["step"] for r in m] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in m)
    assert all(r["images"] > 0 and r["packs"] == 1 for r in m)
    # the packs it trained on are the imported ones: their samples, as many tokens as the official entries hold
    packs = read_manifest(run, "packs", step="import-packs").to_pylist()
    assert sum(r["samples"] for r in m) == sum(len(p["sample_ids"]) for p in packs[:3])
    assert json.loads((run / "import-packs" / "stats.json").read_text())["counters"]["packs_written"] == len(packs)
