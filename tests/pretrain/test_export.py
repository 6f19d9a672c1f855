"""A trained stage exports as one folder in the published LLaVA-OneVision-1.5 layout, whatever the
TP/PP layout its dist checkpoint was saved at, with the tokenizer and image settings the training
used (found through the run folder). Parity with the official class: test_official_parity.py."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch


def _tensors(folder):
    from pretrain.import_model import read_safetensors

    return read_safetensors(folder)


def test_export_is_the_trained_stage_with_its_training_inputs(megatron_single, packed_demo, tmp_path, capsys):
    from ovpipe.cli import main
    from pretrain.trainer.checkpoint import load_state_dict
    from llava_ov.convert import published_state_dict
    from pretrain.recipes import RECIPES
    from pretrain.train import train
    from pretrain.trainer.config import TrainConfig

    run = tmp_path / "run"
    shutil.copytree(packed_demo, run)
    out = train(TrainConfig(run_dir=run, recipe="tiny", stage="1.5", steps=2, micro_batch=1, lr=1e-2),
                log=lambda *_: None)
    assert main(["export-model", "--run-dir", str(run), "--stage", "1.5", "--out", str(tmp_path / "hf"),
                 "--max-shard-size", "100KB"]) == 0
    printed = capsys.readouterr().out
    hf = tmp_path / "hf"
    assert f"--model llava_onevision1_5 --model_args pretrained={hf.resolve()}" in printed
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1                      # sharded, every shard indexed
    want = published_state_dict(load_state_dict(out["checkpoint"], "tiny"), RECIPES["tiny"])
    got = _tensors(hf)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    lengths = json.loads((run / "lengths" / "config.json").read_text())
    pre = json.loads((hf / "preprocessor_config.json").read_text())
    assert (pre["min_pixels"], pre["max_pixels"], pre["patch_size"], pre["merge_size"], pre["temporal_patch_size"]) == \
        (lengths["min_pixels"], lengths["max_pixels"], lengths["patch_size"], lengths["merge_size"], 1)
    assert pre["processor_class"] == "Qwen2_5_VLProcessor"
    info = json.loads((hf / "ovpipe_export.json").read_text())
    assert info["tokenizer"] == lengths["tokenizer"] and info["recipe"] == "tiny" and info["step"] == 2
    assert (hf / "tokenizer.json").read_bytes() == (run / "tokenizer" / "tokenizer.json").read_bytes()
    gen = json.loads((hf / "generation_config.json").read_text())
    from packing.tokens import load_tokenizer

    assert gen["eos_token_id"] == load_tokenizer(str(run / "tokenizer")).convert_tokens_to_ids("<|im_end|>")
    # tokenizer_config.json in the layout of the released folders, which transformers 4.x reads too (lmms-eval's
    # 4.57 fails on 5.x's list-valued extra_special_tokens); the venv's 5.x reads it as the training tokenizer
    tcfg = json.loads((hf / "tokenizer_config.json").read_text())
    assert tcfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "extra_special_tokens" not in tcfg
    trained, ours = load_tokenizer(str(run / "tokenizer")), load_tokenizer(str(hf))
    assert tcfg["additional_special_tokens"] == trained.extra_special_tokens
    for text in ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>A red  circle?<|im_end|>\n",
                 "naïve e\u0301 日本語 \t 123"):     # combining marks: where Qwen2Tokenizer's own pattern differs
        assert ours(text).input_ids == trained(text).input_ids
    assert ours.chat_template == trained.chat_template


def test_export_without_a_recipe_or_tokenizer_says_which(megatron_single, tmp_path, capsys):
    from ovpipe.cli import main

    assert main(["export-model", "--run-dir", str(tmp_path), "--stage", "0", "--out", str(tmp_path / "hf")]) == 2
    assert "give --recipe" in capsys.readouterr().err


@pytest.mark.slow
def test_export_from_a_pipeline_parallel_checkpoint(megatron_single, conversation_run, tmp_path):
    """Stage 2 trained at PP=2 (two gloo processes under torchrun): the export holds the same tensors
    as the checkpoint read back at TP=1/PP=1, and the official class loads it with nothing missing. The export
    and the read-back run in this process, as one process (``megatron_single``)."""
    from llava_ov.convert import published_state_dict
    from llava_ov.official import files
    from ovpipe.cli import main
    from pretrain.recipes import RECIPES
    from pretrain.trainer.checkpoint import load_state_dict

    src, _ = conversation_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "ovpipe.cli", "pretrain", "--recipe", "tiny", "--stage", "2", "--init",
                        "scratch", "--run-dir", str(run), "--pp", "2", "--steps", "1", "--micro-batch", "1", "--data",
                        "pack-conv", "--distributed-optimizer", "off"], env=env, timeout=300, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert json.loads((run / "pretrain" / "stage-2" / "stage.json").read_text())["pp"] == 2
    assert main(["export-model", "--run-dir", str(run), "--stage", "2", "--out", str(tmp_path / "hf")]) == 0
    want = published_state_dict(load_state_dict(run / "pretrain" / "stage-2" / "dist_ckpt", "tiny"), RECIPES["tiny"])
    got = _tensors(tmp_path / "hf")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    if files() is not None:
        from llava_ov.official import from_pretrained

        _, info = from_pretrained(tmp_path / "hf", output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
