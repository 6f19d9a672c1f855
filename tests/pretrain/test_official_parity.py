"""ovpipe's VLM against the official ``LLaVAOneVision1_5_ForConditionalGeneration`` (lmms-engine's
modeling file, installed ``--no-deps``, loaded by ``llava_ov.official``), both ways, in fp32:

* a stage trained a few steps, exported, loaded by the official class: logits on the samples of
  the same packs (one image, one image multi-turn, two images, text only) agree to 1e-4;
* a tiny model saved by the official class, imported by ovpipe: the forwards agree the same way;
* the exported processor + chat template tokenize each conversation exactly as packing counted it.

Two notes the tests encode (docs/hf_format.md):
* transformers >= 5.9 no longer applies a remote-code class's ``_checkpoint_conversion_mapping``, so
  a folder in the published layout (``visual.*``, ``model.*``) is loaded here with the class's own
  mapping passed as ``key_mapping`` — what transformers < 5.9 (lmms-engine's pin) does by itself —
  and the tower's rotary ``inv_freq``, which transformers 5 leaves uninitialised for this class, is
  rebuilt (``llava_ov.official.from_pretrained`` / ``repair_buffers``);
* lmms-engine 0.1.4's RICE tower strips the class tokens with the pre-class-token offsets, so every
  image after the first *in one tower call* loses its last patch and gains the next image's class
  token (nemo-automodel's re-implementation fixed it). ovpipe keeps each image's own patches, which
  is what the official tower gives when it sees one image per call; the two-image sample is compared
  that way, and with both images in one official call only up to the second image.
"""
import importlib.util
import re
import shutil
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(__import__("llava_ov.official", fromlist=["files"]).files() is None,
                                reason="lmms-engine is not installed (make install adds it, --no-deps)")


@pytest.fixture(scope="module")
def official():
    from llava_ov.official import load

    return load()


def _our_logits(model, b):
    from pretrain.model.llm import packed_seq_params

    with torch.no_grad():
        emb = model.embed(b.tokens, b.position_ids, b.images)
        return model.llm(None, b.position_ids, attention_mask=None, decoder_input=emb,
                         packed_seq_params=packed_seq_params(b.cu_seqlens, b.max_seqlen))[0]


def _samples(b, image_token_id, vision_start_id):
    """Per sample of a packed batch: (token ids, its images, its slice)."""
    images = list(b.images)
    for i in range(len(b.cu_seqlens) - 1):
        lo, hi = int(b.cu_seqlens[i]), int(b.cu_seqlens[i + 1])
        ids = b.tokens[0, lo:hi]
        n = int((ids == vision_start_id).sum())
        yield ids, [images.pop(0) for _ in range(n)], slice(lo, hi)


def _official_logits(model, ids, images, one_call=True):
    """The official forward on one sample. ``one_call``: all its images through the tower in one
    call (``forward(input_ids, pixel_values, image_grid_thw)``); else one tower call per image
    (``get_image_features``), spliced in at the image tokens, then ``forward(inputs_embeds=...)``."""
    from llava_ov.convert import patchify

    with torch.no_grad():
        if not images:
            return model(input_ids=ids[None]).logits[0]
        pv, grids = zip(*(patchify(x) for x in images))
        if one_call:
            return model(input_ids=ids[None], pixel_values=torch.cat(pv), image_grid_thw=torch.cat(grids)).logits[0]
        emb = model.get_input_embeddings()(ids[None])
        feats = torch.cat([model.model.get_image_features(p, g) for p, g in zip(pv, grids)])
        emb[0, ids == model.config.image_token_id] = feats.to(emb.dtype)
        return model(inputs_embeds=emb).logits[0]


def _compare_packs(ours, theirs, run, tok):
    """Every sample of packs 1 (one image; one image, multi-turn) and 3 (two images; text only):
    returns the largest |our logit − official logit| per number of images in the sample."""
    from pretrain.data import iter_batches

    pad, vstart = tok.convert_tokens_to_ids("<|image_pad|>"), tok.convert_tokens_to_ids("<|vision_start|>")
    worst = {}
    for pid, b in enumerate(iter_batches(run, "pack-conv", micro_batch=1, epochs=1)):
        if pid not in (1, 3):
            continue
        mine = _our_logits(ours, b)
        for ids, images, sl in _samples(b, pad, vstart):
            n = len(images)
            if n == 2:          # one tower call per image: the whole sample; both in one call: up to image 2
                ref = _official_logits(theirs, ids, images, one_call=False)
                upto = int(torch.nonzero(ids == vstart)[1]) + 1
                one_call = _official_logits(theirs, ids, images, one_call=True)
                assert (mine[sl][:upto] - one_call[:upto]).abs().max().item() <= 1e-4
            else:
                ref = _official_logits(theirs, ids, images)
            d = (mine[sl] - ref).abs().max().item()
            assert d <= 1e-4, (n, d)
            worst[n] = max(worst.get(n, 0.0), d)
    assert set(worst) == {0, 1, 2}                              # text only, one image, two images
    print(f"max |logit difference| by images per sample: {worst}")
    return worst


@pytest.fixture(scope="module")
def exported(megatron_single, conversation_run, tmp_path_factory):
    """Stage 2 trained 2 steps on the conversation packs, exported with ``ovpipe export-model``."""
    from ovpipe.cli import main
    from pretrain.train import train
    from pretrain.trainer.config import TrainConfig

    src, _ = conversation_run
    tmp = tmp_path_factory.mktemp("export")
    run = tmp / "run"
    shutil.copytree(src, run)
    out = train(TrainConfig(run_dir=run, recipe="tiny", stage="2", steps=2, micro_batch=1, lr=1e-2, data="pack-conv"),
                log=lambda *_: None)
    assert main(["export-model", "--run-dir", str(run), "--stage", "2", "--out", str(tmp / "hf")]) == 0
    return run, tmp / "hf", out["checkpoint"]


def test_export_folder_layout(exported, capsys):
    import json

    from safetensors import safe_open

    _, hf, _ = exported
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["model_type"] == "llavaonevision1_5"
    assert cfg["architectures"] == ["LLaVAOneVision1_5_ForConditionalGeneration"]
    assert cfg["auto_map"]["AutoModelForCausalLM"] == \
        "modeling_llavaonevision1_5.LLaVAOneVision1_5_ForConditionalGeneration"
    for f in ("modeling_llavaonevision1_5.py", "configuration_llavaonevision1_5.py", "generation_config.json",
              "preprocessor_config.json", "tokenizer.json", "chat_template.jinja", "model.safetensors.index.json"):
        assert (hf / f).exists(), f
    index = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    keys = set()
    for f in set(index.values()):
        with safe_open(str(hf / f), "pt") as s:
            keys |= set(s.keys())
    assert keys == set(index)
    assert {k.split(".")[0] for k in keys} == {"visual", "model", "lm_head"}
    assert "visual.merger.mlp.0.weight" in keys and "visual.blocks.0.attn.qkv.weight" in keys


def test_official_class_loads_export_and_logits_match(exported, official, conversation_run):
    from packing.tokens import load_tokenizer
    from pretrain.trainer.checkpoint import load_model
    from pretrain.recipes import RECIPES
    from pretrain.trainer.build import image_pad_id
    from pretrain.model.vlm import VLM

    from llava_ov.official import from_pretrained

    run, hf, ckpt = exported
    theirs, info = from_pretrained(hf, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    theirs.eval()
    ours = VLM(RECIPES["tiny"], image_pad_id(run, None), backend="sdpa").eval()
    load_model(ckpt, ours)
    _compare_packs(ours, theirs, run, load_tokenizer(str(run / "tokenizer")))


def test_trust_remote_code_loads_the_export(exported, official):
    """The quick start's path: ``AutoModelForCausalLM`` / ``AutoProcessor`` through the folder's
    ``auto_map`` and its own copy of the modeling files, then ``generate``."""
    from transformers import AutoModelForCausalLM, AutoProcessor

    from llava_ov.official import repair_buffers

    _, hf, _ = exported
    mapping = official.LLaVAOneVision1_5_ForConditionalGeneration._checkpoint_conversion_mapping
    model, info = AutoModelForCausalLM.from_pretrained(str(hf), trust_remote_code=True, dtype=torch.float32,
                                                       key_mapping=mapping, output_loading_info=True)
    assert type(model).__name__ == "LLaVAOneVision1_5_ForConditionalGeneration"
    assert type(model).__module__ != official.__name__            # the folder's copy, not the wheel's
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert repair_buffers(model) == 1
    proc = AutoProcessor.from_pretrained(str(hf), trust_remote_code=True)
    assert type(proc).__name__ == "Qwen2_5_VLProcessor"
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is two plus two?"}]}]
    prompt = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    inputs = proc(text=[prompt], return_tensors="pt")
    inputs.pop("mm_token_type_ids", None)    # transformers 5's processor adds it; the official forward has no such input
    n = inputs["input_ids"].shape[1]
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert n < out.shape[1] <= n + 4


def test_official_checkpoint_imports_and_forwards_agree(megatron_single, official, conversation_run, tmp_path):
    """The reverse: the official class saves a tiny checkpoint (``save_pretrained``), ovpipe imports
    it into a stage folder, and our forward agrees with the official one on the same packs."""
    import json

    from packing.tokens import load_tokenizer
    from pretrain.trainer.checkpoint import load_model
    from pretrain.import_model import import_llava_ov
    from llava_ov.convert import config_dict
    from pretrain.recipes import RECIPES
    from pretrain.trainer.build import image_pad_id
    from pretrain.model.vlm import VLM

    src, _ = conversation_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    tok = load_tokenizer(str(run / "tokenizer"))
    torch.manual_seed(5)
    cfg = official.configuration.Llavaonevision1_5Config(**config_dict(RECIPES["tiny"], tok))
    theirs = official.LLaVAOneVision1_5_ForConditionalGeneration(cfg).eval()
    with torch.no_grad():     # non-trivial norms and biases, a tied output layer (the tiny recipe ties)
        for n, p in theirs.named_parameters():
            if "norm" in n or "ln_q" in n or n.endswith("bias"):
                p.add_(torch.rand_like(p) * 0.5)
        theirs.lm_head.weight = theirs.model.language_model.embed_tokens.weight
    # lmms-engine declares its tied weights as a list (transformers 4); transformers 5's save wants the mapping
    theirs._tied_weights_keys = {"lm_head.weight": "model.language_model.embed_tokens.weight"}
    theirs.save_pretrained(str(tmp_path / "official"))
    ck = import_llava_ov(run, "tiny", str(tmp_path / "official"), stage="1.5")
    assert ck == run / "pretrain" / "stage-1.5" / "dist_ckpt"
    assert json.loads((ck.parent / "imported.json").read_text())["recipe"] == "tiny"
    ours = VLM(RECIPES["tiny"], image_pad_id(run, None), backend="sdpa").eval()
    assert load_model(ck, ours) == 0
    _compare_packs(ours, theirs, run, tok)


def test_config_that_does_not_match_the_recipe_names_the_field(megatron_single, exported, tmp_path, capsys):
    import json

    from pretrain.import_model import import_llava_ov

    _, hf, _ = exported
    bad = tmp_path / "bad"
    shutil.copytree(hf, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["vision_config"]["depth"] = 3
    cfg["text_config"]["hidden_size"] = 32
    (bad / "config.json").write_text(json.dumps(cfg))
    want = r"vision_config.depth=3 \(recipe: 2\).*text_config.hidden_size=32 \(recipe: 64\)"
    with pytest.raises(ValueError, match=want):
        import_llava_ov(tmp_path / "run", "tiny", str(bad), stage="2")
    assert not (tmp_path / "run").exists()
    from ovpipe.cli import main                     # the CLI: one line naming the fields, exit 2, nothing written

    assert main(["import-model", "--run-dir", str(tmp_path / "run"), "--llava-ov", str(bad), "--stage", "2"]) == 2
    assert re.search(want, capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_export_reimports_bit_for_bit(megatron_single, exported, tmp_path):
    """export → import into another run → the same tensors as the trained stage."""
    from pretrain.trainer.checkpoint import load_state_dict
    from pretrain.import_model import import_llava_ov

    _, hf, ckpt = exported
    ck = import_llava_ov(tmp_path / "run2", "tiny", str(hf), stage="2")
    a, b = load_state_dict(ckpt, "tiny"), load_state_dict(ck, "tiny")
    keys = [k for k in a if not k.endswith("_extra_state")]
    assert keys and all(torch.equal(a[k], b[k]) for k in keys)


def test_processor_tokenizes_as_packing_counted(exported):
    """The exported processor + chat template on each conversation of the test packs (caption pairs
    with the caption prompt, as ``lengths`` counts them): the same token ids as packing's
    ``encode_conversation``, the same image grid, and the pixels our loader feeds the tower."""
    import io

    from PIL import Image
    from transformers import AutoProcessor

    from manifests.conversation import to_messages
    from packing.tokens import CAPTION_PROMPT, encode_conversation, prompted_turns
    from pretrain.data import pixels
    from llava_ov.convert import patchify

    spec = importlib.util.spec_from_file_location("_pretrain_conftest", Path(__file__).with_name("conftest.py"))
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)                  # the conversations the test packs are made of
    CONVERSATIONS, _png = conf.CONVERSATIONS, conf._png
    run, hf, _ = exported
    proc = AutoProcessor.from_pretrained(str(hf))
    for name, (turns, sizes) in CONVERSATIONS.items():
        ids, _, _, _ = encode_conversation(proc.tokenizer, turns, sizes, caption_prompt=CAPTION_PROMPT)
        pngs = [_png(h, w, (40 * i + 20, 90, 200)) for i, (h, w) in enumerate(sizes)]
        text = proc.apply_chat_template(to_messages(prompted_turns(turns, len(sizes), CAPTION_PROMPT)), tokenize=False)
        out = proc(text=[text], images=[Image.open(io.BytesIO(p)) for p in pngs] or None, return_tensors="pt")
        assert out["input_ids"][0].tolist() == ids.tolist(), name
        for k, (png, (h, w)) in enumerate(zip(pngs, sizes)):
            pv, grid = patchify(pixels(png, h // 14, w // 14))
            assert out["image_grid_thw"][k].tolist() == grid[0].tolist(), name
            lo = int(out["image_grid_thw"][:k].prod(-1).sum())
            assert torch.allclose(out["pixel_values"][lo:lo + len(pv)], pv, atol=1e-5), name
