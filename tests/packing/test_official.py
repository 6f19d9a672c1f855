"""The official LLaVA-OneVision-1.5 layout both ways: `pack-official` writes a pack step's bins as the official
step 4 does and energon's `get_train_dataset` opens it with the official sample type (a test-only stand-in,
`official_standin/`); every entry's images and texts equal the manifests; each sub-sample's length under the
official encoding follows the documented rule; `import-packs` reads the folder back (and a broken one into
statuses)."""
import io
import json
import shutil
import tarfile

import numpy as np
import pytest
import yaml
from test_conversation_pack import write_conversation_samples

from manifests import read_manifest
from ovpipe.cli import main

SEQ = 128


@pytest.fixture(scope="module")
def official_run(tmp_path_factory):
    from packing.tiny_tokenizer import build_tiny_tokenizer

    run = tmp_path_factory.mktemp("official")
    rows = write_conversation_samples(run)
    build_tiny_tokenizer([t["text"].replace("<image>", "") for r in rows for t in r["conversation"]],
                         run / "tokenizer")
    common = ["--run-dir", str(run), "--quiet"]
    assert main(["lengths", "--set", f"tokenizer={run / 'tokenizer'}", "--set", "samples_steps=[ingest-conv]",
                 "--set", f"seq_len={SEQ}", "--set", "on_too_long=truncate", *common]) == 0
    assert main(["pack", "--set", f"seq_len={SEQ}", "--set", "packs_per_shard=2", *common]) == 0
    assert main(["pack-official", "--tasks", "2", *common]) == 0
    assert main(["pack-official", "--name", "pack-official-1", "--tasks", "1", *common]) == 0
    return run


@pytest.fixture
def standin(monkeypatch):
    """The official sample types importable, as they are where the official trainer is installed."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "official_standin"))


def _tars(folder):
    out = {}
    for tar in sorted((folder / "data").glob("pack-*.tar")):
        with tarfile.open(tar) as tf:
            for m in tf.getmembers():
                out[f"{tar.name}/{m.name}"] = tf.extractfile(m).read()
    return out


def test_every_sub_sample_has_a_row_and_the_flavour_refuses_what_it_cannot_carry(official_run):
    packs = read_manifest(official_run, "packs", step="pack").to_pylist()
    rows = read_manifest(official_run, "official_packs", step="pack-official").to_pylist()
    assert [(r["pack_id"], r["sample_id"]) for r in rows] == [(p["pack_id"], s) for p in packs for s in p["sample_ids"]]
    samples = {r["sample_id"]: r for r in read_manifest(official_run, "samples", step="ingest-conv").to_pylist()}
    for r in rows:
        s = samples[r["sample_id"]]
        n_img, roles = len(s["images"] or []), [t["role"] for t in s["conversation"]]
        want = ("text_only" if n_img == 0 else "multi_image" if n_img > 1 else
                "ok" if roles == ["user", "assistant"] else "multi_turn")
        assert r["status"] == want, (r, roles, n_img)
        assert (r["official_tokens"] is None) == (r["shard"] is None) == (want != "ok")
    stats = json.loads((official_run / "pack-official" / "stats.json").read_text())["counters"]
    statuses = [r["status"] for r in rows]
    for s in ("ok", "text_only", "multi_image", "multi_turn"):
        assert stats[f"status/{s}"] == statuses.count(s) > 0
    # the same tars, byte for byte, and the same rows at 1 task as at 2
    assert _tars(official_run / "pack-official") == _tars(official_run / "pack-official-1")
    assert read_manifest(official_run, "official_packs", step="pack-official-1").to_pylist() == rows


def test_nv_meta_is_the_official_definition_prepared_by_energon(official_run):
    from megatron.energon.flavors.webdataset.metadata import get_dataset_info

    meta = official_run / "pack-official" / ".nv-meta"
    assert yaml.safe_load((meta / "dataset.yaml").read_text()) == {
        "sample_type": {"__module__": "aiak_training_llm.data.multimodal", "__class__": "PackedCaptioningSample"},
        "part_filter": "sample_loader.py:part_filter", "sample_loader": "sample_loader.py:sample_loader"}
    written = {r["shard"] for r in read_manifest(official_run, "official_packs", step="pack-official").to_pylist()
               if r["shard"]}
    info = get_dataset_info(official_run / "pack-official")["shard_counts"]
    assert sorted(info) == [f"data/{s}" for s in sorted(written)]
    assert sum(info.values()) == json.loads((official_run / "pack-official" / "stats.json").read_text())[
        "counters"]["packs_written"]


def test_energon_opens_it_as_the_official_sample_type_and_it_equals_the_manifests(official_run, standin):
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset
    from PIL import Image

    from manifests.conversation import read_image

    rows = read_manifest(official_run, "official_packs", step="pack-official").to_pylist()
    samples = {r["sample_id"]: r for r in read_manifest(official_run, "samples", step="ingest-conv").to_pylist()}
    want = {}
    for r in rows:
        if r["status"] == "ok":
            want.setdefault(f"{r['pack_id']:012d}", []).append(samples[r["sample_id"]])
    ds = get_train_dataset(official_run / "pack-official", batch_size=None, shuffle_buffer_size=None,
                           max_samples_per_sequence=None, repeat=False,
                           worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    seen = {}
    for s in get_loader(ds):
        assert (type(s).__module__, type(s).__name__) == ("aiak_training_llm.data.multimodal", "PackedCaptioningSample")
        seen[s.__key__] = s
    assert sorted(seen) == sorted(want)
    for key, subs in want.items():
        s = seen[key]
        assert s.captions == [x["conversation"][1]["text"] for x in subs]
        assert s.prompts == ["<image>Describe the image." if x["conversation"][0]["text"] == "<image>"
                             else x["conversation"][0]["text"] for x in subs]
        for img, x in zip(s.images, subs, strict=True):   # energon decodes to CHW floats in [0, 1]
            ref = np.asarray(Image.open(io.BytesIO(read_image(x["images"][0]))).convert("RGB"), np.float32) / 255
            assert np.allclose(img.numpy().transpose(1, 2, 0), ref, atol=1e-6)


def test_official_length_is_ovpipe_length_minus_the_stripped_newline(official_run):
    from packing.official import official_encode, official_text, tail_tokens
    from packing.tokens import load_tokenizer

    tok = load_tokenizer(str(official_run / "tokenizer"))
    assert tail_tokens(tok) == 1   # the template closes every turn with "<|im_end|>\n"
    rows = [r for r in read_manifest(official_run, "official_packs", step="pack-official").to_pylist()
            if r["status"] == "ok"]
    assert rows and all(r["official_tokens"] == r["ovpipe_tokens"] - 1 for r in rows)
    # one sub-sample by hand: the template text without its last newline, the pad expanded to (h'/14)(w'/14)/4
    text = official_text(tok, "<image>Describe the image.", "a grey ring.")
    assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the image.")
    assert text.endswith("assistant\na grey ring.<|im_end|>")
    ids, mask = official_encode(tok, "<image>Describe the image.", "a grey ring.", (56, 84))
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert (ids == pad).sum() == (56 // 14) * (84 // 14) // 4
    assert len(ids) == len(tok(text, add_special_tokens=False)["input_ids"]) - 1 + 6
    answer = tok("a grey ring.", add_special_tokens=False)["input_ids"]
    assert ids[mask == 1].tolist() == answer + [tok.convert_tokens_to_ids("<|im_end|>")]
    # every entry fits seq_len under that encoding
    per_pack = {}
    for r in rows:
        per_pack[r["pack_id"]] = per_pack.get(r["pack_id"], 0) + r["official_tokens"]
    assert max(per_pack.values()) <= SEQ


def test_import_packs_reads_the_official_folder_back_into_ovpipe_packs(official_run, tmp_path):
    from packing.shards import iter_packed, packed_shards

    run = official_run
    assert main(["import-packs", "--set", f"source={run / 'pack-official'}", "--set", f"tokenizer={run / 'tokenizer'}",
                 "--set", f"seq_len={SEQ}", "--run-dir", str(run), "--tasks", "2", "--quiet"]) == 0
    rows = read_manifest(run, "official_packs", step="pack-official").to_pylist()
    by_pack = {}
    for r in rows:
        if r["status"] == "ok":
            by_pack.setdefault(r["pack_id"], []).append(r)
    imported = read_manifest(run, "imported_packs", step="import-packs").to_pylist()
    assert [r["status"] for r in imported] == ["ok"] * len(by_pack)
    # the ovpipe packs the source samples were in: each sub-sample's ids/mask equal its slice there
    src = {p.pack_id: p for f in packed_shards(run, "pack") for p in iter_packed(f)}
    got = [p for f in packed_shards(run, "import-packs") for p in iter_packed(f)]
    assert len(got) == len(by_pack)
    for p, (pid, subs) in zip(got, sorted(by_pack.items()), strict=True):
        assert p.sample_ids == [r["sample_id"] for r in subs]      # a caption pair keeps its ingest id
        o = src[pid]
        for k, sid in enumerate(p.sample_ids):
            j = o.sample_ids.index(sid)
            a, b = slice(p.cu_seqlens[k], p.cu_seqlens[k + 1]), slice(o.cu_seqlens[j], o.cu_seqlens[j + 1])
            assert np.array_equal(p.input_ids[a], o.input_ids[b]) and np.array_equal(p.loss_mask[a], o.loss_mask[b])
        first = np.concatenate([[0], np.cumsum(o.images_per_sample)])
        assert p.images == [o.images[first[o.sample_ids.index(s)]] for s in p.sample_ids]


def test_import_packs_turns_unreadable_entries_into_statuses(official_run, tmp_path, capsys):
    from packing.energon import prepare
    from packing.official import entry, write_meta, write_shard

    good = _tars(official_run / "pack-official")
    img = next(v for k, v in good.items() if k.endswith(".img0.jpg"))
    folder = tmp_path / "broken"
    (folder / "data").mkdir(parents=True)
    entries = [entry("a", ["<image>Describe the image."], ["a cat."], ["x"], [img]),
               {"__key__": "b", "json": b"{not json", "img0.jpg": img},
               {"__key__": "c", "img0.jpg": img,
                "json": json.dumps({"prompts": [], "captions": ["x", "y"], "images": ["1", "2"]}).encode()},
               entry("d", ["<image>Describe the image."], ["a dog."], ["x"], [b"\x89PNG broken"]),
               entry("e", ["no placeholder"], ["a cow."], ["x"], [img]),
               entry("f", ["<image>Describe the image."], ["word " * 200], ["x"], [img])]
    # prepared whole, then damaged in place (energon's own prepare refuses a tar whose json does not parse)
    write_shard(folder / "data" / "pack-000000.tar", [entry(e["__key__"], ["<image>"], ["x"], ["x"], [img])
                                                      for e in entries])
    prepare(folder, 1, tmp_path / "prepare.log", sample_type=None)
    write_meta(folder)
    write_shard(folder / "data" / "pack-000000.tar", entries)
    run = tmp_path / "run"
    assert main(["import-packs", "--set", f"source={folder}", "--set", f"tokenizer={official_run / 'tokenizer'}",
                 "--set", f"seq_len={SEQ}", "--run-dir", str(run), "--quiet"]) == 0
    rows = read_manifest(run, "imported_packs", step="import-packs").to_pylist()
    assert [(r["key"], r["status"]) for r in rows] == [("a", "ok"), ("b", "bad_json"), ("c", "missing_image"),
                                                       ("d", "bad_image"), ("e", "image_mismatch"), ("f", "too_long")]
    assert all(r["error"] for r in rows[1:]) and rows[0]["n_samples"] == 1
    assert read_manifest(run, "packs", step="import-packs").column("pack_id").to_pylist() == [0]
    # a folder energon never prepared is refused before any work, naming the field
    shutil.rmtree(folder / ".nv-meta")
    rc = main(["import-packs", "--set", f"source={folder}", "--set", f"tokenizer={official_run / 'tokenizer'}",
               "--run-dir", str(tmp_path / "run2"), "--quiet"])
    assert rc == 2 and "source" in capsys.readouterr().err and not (tmp_path / "run2" / "import-packs").exists()


QWEN_TEMPLATE = (   # Qwen2-VL's shape: a default system turn, every turn closed by "<|im_end|>\n"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.mark.parametrize("template", ["tiny", "qwen-system"])
def test_official_encode_is_what_the_qwen2vl_processor_gives_the_official_text(official_run, template):
    """The official encoder hands its text and PIL image to transformers' Qwen2-VL processor: our encoding is
    that processor's output token for token, at the recipe's pixel bounds, and ovpipe's count is `tail` more."""
    from PIL import Image
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from packing.chat_codec import Conversations
    from packing.official import official_encode, official_text, tail_tokens
    from packing.tokens import ImageTokenConfig, count_conversations, load_tokenizer

    tok = load_tokenizer(str(official_run / "tokenizer"))
    if template == "qwen-system":
        tok.chat_template = QWEN_TEMPLATE
    img = ImageTokenConfig(min_pixels=56 * 56, max_pixels=112 * 112)
    proc = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=img.min_pixels, max_pixels=img.max_pixels),
                            tokenizer=tok, video_processor=Qwen2VLVideoProcessor(), chat_template=tok.chat_template)
    for (h, w), prompt, caption in [((56, 84), "<image>Describe the image.", "a grey ring."),
                                    ((300, 200), "What is shown? <image>", "two blue stars on a field."),
                                    ((20, 30), "<image>\nDescribe the image.", "a red circle.")]:
        ids, mask = official_encode(tok, prompt, caption, (h, w), img)
        ref = proc(text=[official_text(tok, prompt, caption)], images=[Image.new("RGB", (w, h), (9, 99, 199))],
                   return_tensors="np")["input_ids"][0]
        assert ids.tolist() == ref.tolist()
        ours = count_conversations(tok, Conversations.from_lists([[("user", prompt), ("assistant", caption)]],
                                                                 [[(h, w)]]), img)
        assert ours.total[0] == len(ids) + tail_tokens(tok) and tail_tokens(tok) == 1
        assert mask.sum() == ours.target[0]      # the same loss tokens: the caption and its <|im_end|>


def test_pack_official_refuses_a_pack_step_without_shards_before_any_work(official_run, tmp_path, capsys):
    run = tmp_path / "run"
    for step in ("ingest-conv", "lengths"):
        shutil.copytree(official_run / step, run / step)
    assert main(["pack", "--set", f"seq_len={SEQ}", "--set", "write_shards=false", "--run-dir", str(run), "--quiet"]) == 0
    assert main(["pack-official", "--run-dir", str(run), "--quiet"]) == 2
    assert "pack_step" in capsys.readouterr().err and not (run / "pack-official").exists()


def test_count_for_llava_ov_fills_the_bins_under_the_official_count(official_run, tmp_path, capsys):
    """`pack --set count_for=llava-ov` bins `lengths − tail`: no entry exceeds seq_len under the official
    encoding, the entries are at least as full as under ovpipe's count, the ovpipe packs keep ovpipe's lengths
    (so they may exceed seq_len by one tail per sample) and ovpipe's trainer refuses them; the default keeps
    the hash a PackConfig without the field gives; a wrong value is refused before any work, naming the field."""
    import dataclasses

    from ovpipe.config import config_hash, load_config
    from packing.pack import PackConfig
    from packing.shards import iter_packed, packed_shards
    from pretrain.data import check_pack_step, plan_data

    run = tmp_path / "run"
    for step in ("ingest-conv", "lengths", "pack", "pack-official"):
        shutil.copytree(official_run / step, run / step)
    common = ["--set", f"seq_len={SEQ}", "--set", "packs_per_shard=2", "--run-dir", str(run), "--quiet"]
    assert main(["pack", "--name", "pack-ov", "--set", "count_for=llava-ov", *common]) == 0
    assert main(["pack-official", "--name", "official-ov", "--set", "pack_step=pack-ov", "--run-dir", str(run),
                 "--quiet"]) == 0
    tail = 1
    length = dict(zip(*read_manifest(run, "lengths", step="lengths").select(["sample_id", "total_tokens"])
                      .to_pydict().values()))
    packs = read_manifest(run, "packs", step="pack-ov").to_pylist()
    assert sorted(s for p in packs for s in p["sample_ids"]) == sorted(
        s for p in read_manifest(run, "packs", step="pack").to_pylist() for s in p["sample_ids"])
    for p in packs:     # the bin fits under the official count; the pack holds ovpipe's encoding
        assert p["lengths"] == [length[s] for s in p["sample_ids"]] and p["total_tokens"] == sum(p["lengths"])
        assert p["total_tokens"] - tail * len(p["lengths"]) <= SEQ
    assert max(p["total_tokens"] for p in packs) > SEQ         # the slack used: ovpipe's own trainer must refuse
    assert {q.pack_id: len(q.input_ids) for f in packed_shards(run, "pack-ov") for q in iter_packed(f)} == \
        {p["pack_id"]: p["total_tokens"] for p in packs}
    fill = {}
    for step in ("pack-official", "official-ov"):
        per_entry = {}
        for r in read_manifest(run, "official_packs", step=step).to_pylist():
            if r["status"] == "ok":
                per_entry[r["pack_id"]] = per_entry.get(r["pack_id"], 0) + r["official_tokens"]
        assert max(per_entry.values()) <= SEQ
        fill[step] = sum(per_entry.values()) / (len(per_entry) * SEQ)
        stats = json.loads((run / step / "stats.json").read_text())["counters"]
        assert stats["official_fill"] == round(fill[step], 6)
    assert fill["official-ov"] >= fill["pack-official"]
    assert len(packs) <= len(read_manifest(run, "packs", step="pack").to_pylist())
    assert "llava-ov trainer's count" in (run / "pack-ov" / "report.md").read_text()
    # ovpipe's trainer refuses the llava-ov pack step, in one line naming it; the default one passes
    check_pack_step(run, "pack")
    for call in (lambda: check_pack_step(run, "pack-ov"), lambda: plan_data(run, "pack-ov", 1, 1, 1, steps=1)):
        with pytest.raises(ValueError, match="'pack-ov' was packed for the llava-ov trainer") as e:
            call()
        assert "\n" not in str(e.value)
    assert main(["pretrain", "--recipe", "tiny", "--stage", "1.5", "--init", "scratch", "--steps", "1",
                 "--data", "pack-ov", "--run-dir", str(run)]) == 2
    assert "count_for: llava-ov" in capsys.readouterr().err and not (run / "pretrain").exists()
    # at its default the field is out of the hash: the pack step keeps the hash of a config without it
    without = dataclasses.make_dataclass("PackConfig", [(f.name, f.type, f) for f in dataclasses.fields(PackConfig)
                                                        if f.name != "count_for"])
    made = json.loads((run / "pack" / "executor.json").read_text())["config_hash"]
    cfg = json.loads((run / "pack" / "config.json").read_text())
    assert config_hash(load_config(PackConfig, cfg)) == made == config_hash(
        without(**{k: v for k, v in cfg.items() if k != "count_for"}))
    assert config_hash(load_config(PackConfig, {**cfg, "count_for": "llava-ov"})) != made
    # a wrong value: refused before any work, naming the field
    assert main(["pack", "--name", "pack-bad", "--set", "count_for=official", *common]) == 2
    assert "count_for" in capsys.readouterr().err and not (run / "pack-bad").exists()
    with pytest.raises(ValueError, match="count_for"):
        PackConfig(count_for="official")


def test_count_for_llava_ov_costs_are_the_ones_it_balanced(official_run, tmp_path):
    """With ``count_for: llava-ov`` the balancer costs each bin from the official count (``lengths − tail``);
    the manifest's ``cost`` column is that same cost, so the recorded ``straggler_loss_after`` is the loss of
    the manifest's own costs in its order."""
    from packing.compute_balance import straggler_loss

    run = tmp_path / "run"
    for step in ("ingest-conv", "lengths"):
        shutil.copytree(official_run / step, run / step)
    assert main(["pack", "--set", f"seq_len={SEQ}", "--set", "write_shards=false", "--set", "count_for=llava-ov",
                 "--set", "balance_dp=2", "--run-dir", str(run), "--quiet"]) == 0
    cost = np.array([p["cost"] for p in read_manifest(run, "packs", step="pack").to_pylist()])
    info = json.loads((run / "pack" / "stats.json").read_text())["info"]
    assert len(cost) >= 2 and info["count_shift"] > 0
    assert info["straggler_loss_after"] == pytest.approx(straggler_loss(cost, 2, 1, 1), rel=1e-12, abs=1e-15)
