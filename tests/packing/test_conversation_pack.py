"""lengths → pack on conversation samples (caption pairs, multi-turn, multi-image, text-only, broken
rows, one conversation longer than seq_len), written straight into a `samples` manifest: task-count
independence, the loader's sequences against the manifests, loss tokens, images and grids, copies."""
import io
import json
import shutil

import numpy as np
import pytest

from manifests import read_manifest
from manifests.conversation import caption_turns, sample_id
from manifests.io import write_part, write_table
from ovpipe.cli import main

SEQ = 384
CAPTIONS = ["a red circle on a white background.", "two blue stars.", "a teal cross next to a lime ring.",
            "a small yellow square.", "an orange triangle and a purple circle.", "a grey ring."]
QA = [("How many shapes are there?", "There are two shapes."), ("Which colour is the left one?", "It is red."),
      ("Is there a star?", "Yes, at the top."), ("What is on the right?", "A blue square.")]


def _png(h: int, w: int, colour) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, format="PNG")
    return buf.getvalue()


def write_conversation_samples(root, step: str = "ingest-conv", source: str = "conv"):
    """A `samples` manifest of conversations with images as files (and one in a Parquet file).
    Returns the rows written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    img_dir = root / "images"
    img_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    counter = iter(range(10_000))

    def image(h, w, where="file"):
        k = next(counter)
        data = _png(h, w, tuple(int(x) for x in rng.integers(0, 255, 3)))
        if where == "parquet":
            path = img_dir / f"images-{k}.parquet"
            pq.write_table(pa.table({"id": [0, 1], "image": [b"", data]}), path)
            return data, {"file": str(path), "container": "parquet", "offset": 1, "size": len(data), "column": "image",
                          "index": -1, "format": "png", "width": w, "height": h}
        path = img_dir / f"{k:04d}.png"
        path.write_bytes(data)
        return data, {"file": str(path), "container": "file", "offset": 0, "size": len(data), "column": None,
                      "index": -1, "format": "png", "width": w, "height": h}

    convs = []  # (category, turns, [(bytes, addr)], status)
    for i, cap in enumerate(CAPTIONS):
        where = "parquet" if i == 2 else "file"
        convs.append(("caption", caption_turns(cap), [image(60 + 20 * i, 90 + 10 * i, where)], "ok"))
    for i in range(3):  # multi-turn with a system turn, an image in the first user turn
        turns = [("system", "Answer briefly."), ("user", f"<image>\n{QA[i][0]}"), ("assistant", QA[i][1])]
        for q, a in QA[i + 1:]:
            turns += [("user", q), ("assistant", a)]
        convs.append(("qa", turns, [image(120, 160 + 8 * i)], "ok"))
    for i in range(2):  # two images in one turn, a third in a later turn
        turns = [("user", "<image><image>Are these the same shape?"), ("assistant", "No, they are not."),
                 ("user", f"And this one <image> number {i}?"), ("assistant", "A star.")]
        convs.append(("comparison", turns, [image(56, 56), image(100, 200), image(150, 90)], "ok"))
    for i in range(3):
        convs.append(("text", [("user", f"What is {i} + {i}?"), ("assistant", f"It is {2 * i}.")], [], "ok"))
    long = [("system", "You are a patient tutor.")]
    for k in range(14):  # ~ 30 tokens a pair: longer than SEQ as a whole
        long += [("user", f"<image>Question {k}: which shapes do you see here, and what colours do they have?"),
                 ("assistant", f"Answer {k}: a red circle, a blue star and a small teal cross.")]
    convs.append(("qa", long, [image(56, 56) for _ in range(14)], "ok"))
    convs.append(("qa", [("user", "<image><image>Compare."), ("assistant", "Same.")], [image(56, 56)], "image_mismatch"))
    convs.append(("caption", caption_turns("a lost image."), [], "missing_image"))

    rows = []
    for cat, turns, imgs, status in convs:
        sid = sample_id([b for b, _ in imgs], turns)
        first = imgs[0][1] if imgs else None
        rows.append({"sample_id": sid, "source": source, "shard": first["file"] if first else "", "key": sid,
                     "shard_format": first["container"] if first else "", "offset": first["offset"] if first else -1,
                     "size": first["size"] if first else 0, "image_format": first["format"] if first else "",
                     "width": first["width"] if first else 0, "height": first["height"] if first else 0,
                     "caption": turns[-1][1], "category": cat, "n_images": len(imgs),
                     "images": [a for _, a in imgs], "conversation": [{"role": r, "text": t} for r, t in turns],
                     "turns": len(turns), "turn_ratings": None, "status": status,
                     "error": None if status == "ok" else status.replace("_", " ")})
    half = len(rows) // 2  # two parts, as a 2-task ingest writes them
    write_part(rows[:half], root / step / "samples" / "part-00000.parquet", "samples", sort=True)
    write_part(rows[half:], root / step / "samples" / "part-00001.parquet", "samples", sort=True)
    return rows


@pytest.fixture(scope="module")
def conv_run(tmp_path_factory):
    """Run folder: samples, tiny tokenizer, lengths (truncate) and pack (3 tasks each)."""
    from packing.tiny_tokenizer import build_tiny_tokenizer

    run = tmp_path_factory.mktemp("convrun")
    rows = write_conversation_samples(run)
    texts = [t["text"].replace("<image>", "") for r in rows for t in r["conversation"]]
    build_tiny_tokenizer(texts, run / "tokenizer")
    assert main(["lengths", "--set", f"tokenizer={run / 'tokenizer'}", "--set", "samples_steps=[ingest-conv]",
                 "--set", f"seq_len={SEQ}", "--set", "on_too_long=truncate", "--run-dir", str(run),
                 "--tasks", "3", "--quiet"]) == 0
    assert main(["pack", "--set", f"seq_len={SEQ}", "--set", "packs_per_shard=2", "--run-dir", str(run),
                 "--tasks", "3", "--quiet"]) == 0
    return run, {r["sample_id"]: r for r in rows}


def test_lengths_rows(conv_run):
    run, rows = conv_run
    got = {r["sample_id"]: r for r in read_manifest(run, "lengths").to_pylist()}
    assert set(got) == set(rows)
    st = {}
    for r in got.values():
        st[r["status"]] = st.get(r["status"], 0) + 1
    assert st == {"ok": 14, "truncated": 1, "image_mismatch": 1, "missing_image": 1}
    for sid, r in got.items():
        assert r["total_tokens"] == r["text_tokens"] + r["image_tokens"]
        if r["status"] in ("ok", "truncated"):
            assert 0 < r["target_tokens"] < r["total_tokens"] <= SEQ
        else:
            assert r["total_tokens"] == r["target_tokens"] == r["turns_kept"] == 0
        if r["status"] == "ok":
            assert r["turns_kept"] == rows[sid]["turns"]
        if rows[sid]["category"] == "text" and r["status"] == "ok":
            assert r["image_tokens"] == 0
    (t,) = [r for r in got.values() if r["status"] == "truncated"]
    assert 3 <= t["turns_kept"] < rows[t["sample_id"]]["turns"] and t["turns_kept"] % 2 == 1  # system + whole pairs


def test_lengths_and_packs_do_not_depend_on_the_task_count(conv_run, tmp_path):
    run, _ = conv_run
    one = tmp_path / "one"
    shutil.copytree(run / "ingest-conv", one / "ingest-conv")
    shutil.copytree(run / "tokenizer", one / "tokenizer")
    assert main(["lengths", "--set", f"tokenizer={run / 'tokenizer'}", "--set", "samples_steps=[ingest-conv]",
                 "--set", f"seq_len={SEQ}", "--set", "on_too_long=truncate", "--run-dir", str(one), "--quiet"]) == 0
    assert main(["pack", "--set", f"seq_len={SEQ}", "--set", "packs_per_shard=2", "--run-dir", str(one), "--quiet"]) == 0
    for kind in ("lengths", "packs"):  # every column, the packs' `shard` included
        a, b = tmp_path / f"{kind}-1.parquet", tmp_path / f"{kind}-3.parquet"
        write_table(read_manifest(one, kind), a)
        write_table(read_manifest(run, kind), b)
        assert a.read_bytes() == b.read_bytes(), kind
    # the shards too: named by pack_id range, not by the writing rank, so the same files byte for byte
    assert _tar_shas(one) == _tar_shas(run)
    assert _sequences(one) == _sequences(run)
    four = tmp_path / "four"  # more ranks than some have shards to write
    for d in ("ingest-conv", "lengths"):
        shutil.copytree(one / d, four / d)
    assert main(["pack", "--set", f"seq_len={SEQ}", "--set", "packs_per_shard=2", "--run-dir", str(four),
                 "--tasks", "4", "--quiet"]) == 0
    write_table(read_manifest(four, "packs"), tmp_path / "packs-4.parquet")
    assert (tmp_path / "packs-4.parquet").read_bytes() == (tmp_path / "packs-1.parquet").read_bytes()
    assert _tar_shas(four) == _tar_shas(run)


def _tar_shas(run):
    import hashlib

    from packing.shards import packed_shards

    data = run / "pack" / "data"
    tars = sorted(p.name for p in data.iterdir() if not p.name.endswith(".tar.idx"))  # energon's index beside each
    assert tars == sorted(p.name for p in packed_shards(run))  # no temp files
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in packed_shards(run)}


def _sequences(run):
    from packing.shards import iter_packed, packed_shards

    return {s.pack_id: (s.input_ids.tobytes(), s.loss_mask.tobytes(), s.images, s.image_grids.tobytes(),
                        s.images_per_sample) for sh in packed_shards(run) for s in iter_packed(sh)}


def test_every_pack_against_the_manifests(conv_run):
    from packing.shards import iter_packed, packed_shards
    from packing.tokens import ImageTokenConfig, image_grid

    run, rows = conv_run
    lengths = {r["sample_id"]: r for r in read_manifest(run, "lengths").to_pylist()}
    packs = {p["pack_id"]: p for p in read_manifest(run, "packs").to_pylist()}
    img_cfg = ImageTokenConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    pad = json.loads((run / "tokenizer" / "tokenizer.json").read_text())
    pad = next(t["id"] for t in pad["added_tokens"] if t["content"] == "<|image_pad|>")
    seen = set()
    for shard in packed_shards(run):
        for seq in iter_packed(shard):
            p = packs[seq.pack_id]
            assert len(seq.input_ids) == p["total_tokens"] == seq.total_tokens
            assert seq.sample_ids == p["sample_ids"]
            assert int(seq.loss_mask.sum()) == sum(lengths[s]["target_tokens"] for s in seq.sample_ids)
            assert len(seq.images_per_sample) == len(seq.sample_ids)
            assert sum(seq.images_per_sample) == len(seq.images) == len(seq.image_grids)
            k = 0
            for s, n_img, lo, hi in zip(seq.sample_ids, seq.images_per_sample, seq.cu_seqlens[:-1], seq.cu_seqlens[1:]):
                row = rows[s]
                kept_turns = row["conversation"][:lengths[s]["turns_kept"]]
                assert n_img == sum(t["text"].count("<image>") for t in kept_turns)
                addrs = row["images"][:n_img]
                for b, g, a in zip(seq.images[k:k + n_img], seq.image_grids[k:k + n_img], addrs):
                    from manifests.conversation import read_image

                    assert b == read_image(a)
                    gh, gw = image_grid(np.array([a["height"]]), np.array([a["width"]]), img_cfg)
                    assert g.tolist() == [int(gh[0]), int(gw[0])]
                # image pads of this sample = Σ grid/4, and never in the loss
                ids, m = seq.input_ids[lo:hi], seq.loss_mask[lo:hi]
                assert (ids == pad).sum() == sum(int(g[0] * g[1]) // 4 for g in seq.image_grids[k:k + n_img])
                assert not m[ids == pad].any()
                assert (ids == pad).sum() + 2 * n_img == lengths[s]["image_tokens"]
                # the cost's counts: the images of the kept turns, their tower tokens squared
                tower = seq.image_grids[k:k + n_img].prod(axis=1).astype(np.int64) + 1
                assert (lengths[s]["images"], lengths[s]["vit_sq"]) == (n_img, int((tower ** 2).sum()))
                k += n_img
            tower = seq.image_grids.prod(axis=1).astype(np.int64) + 1
            assert (p["images"], p["vit_tokens"], p["vit_sq"]) == (len(seq.images), tower.sum(), (tower ** 2).sum())
            seen.update(seq.sample_ids)
    assert seen == {s for s, r in lengths.items() if r["status"] in ("ok", "truncated")}
    assert len(seen) == 15


def test_mixed_copies_and_two_samples_steps(conv_run, tmp_path):
    """copies_from=mixed sums the mix's copies per sample; a sample ingested by two steps is one item."""
    run, rows = conv_run
    r2 = tmp_path / "mixrun"
    for d in ("ingest-conv", "tokenizer"):
        shutil.copytree(run / d, r2 / d)
    shutil.copytree(run / "ingest-conv", r2 / "ingest-again")
    assert main(["lengths", "--set", f"tokenizer={run / 'tokenizer'}", "--set", "samples_steps=[ingest-conv, ingest-again]",
                 "--set", f"seq_len={SEQ}", "--run-dir", str(r2), "--tasks", "2", "--quiet"]) == 0
    rows2 = read_manifest(r2, "lengths").to_pylist()
    ok = sorted(r["sample_id"] for r in rows2 if r["status"] == "ok")
    assert len(ok) == 2 * 14  # every ok row of both steps is measured
    long = [r for r in rows2 if r["status"] == "too_long"]  # on_too_long=drop: the long one is not cut
    assert len(long) == 2 and all(r["total_tokens"] > SEQ and r["turns_kept"] == 0 for r in long)
    ids = sorted(set(ok))
    mixed = [{"sample_id": s, "source": src, "category": "x", "copies": 1 + (i % 2)}
             for i, s in enumerate(ids[:6]) for src in ("a", "b")]
    write_part(mixed, r2 / "mix" / "mixed" / "part-00000.parquet", "mixed", sort=True)
    assert main(["pack", "--set", f"seq_len={SEQ}", "--set", "copies_from=mixed", "--run-dir", str(r2),
                 "--tasks", "2", "--quiet"]) == 0
    seen = {}
    for p in read_manifest(r2, "packs").to_pylist():
        for s in p["sample_ids"]:
            seen[s] = seen.get(s, 0) + 1
    assert seen == {s: 2 * (1 + i % 2) for i, s in enumerate(ids[:6])}
    assert main(["pack", "--name", "pack-all", "--set", f"seq_len={SEQ}", "--set", "write_shards=false",
                 "--run-dir", str(r2), "--quiet"]) == 0
    every = [s for p in read_manifest(r2, "packs", step="pack-all").to_pylist() for s in p["sample_ids"]]
    assert sorted(every) == ids  # once each, though two steps hold it
    # a mix that drew none of these samples: an empty pack step, not a crash
    write_part([{"sample_id": "f" * 16, "source": "a", "category": "x", "copies": 3}],
               r2 / "mix-other" / "mixed" / "part-00000.parquet", "mixed")
    assert main(["pack", "--name", "pack-none", "--set", f"seq_len={SEQ}", "--set", "copies_from=mixed",
                 "--set", "mix_step=mix-other", "--run-dir", str(r2), "--tasks", "2", "--quiet"]) == 0
    assert read_manifest(r2, "packs", step="pack-none").num_rows == 0
    assert "Packed 0 items" in (r2 / "pack-none" / "report.md").read_text()


def test_shard_of_text_only_samples(tmp_path):
    """A pack without any image: empty image lists all the way through."""
    from packing.shards import iter_packed, write_shard

    ids = np.arange(7, dtype=np.int32)
    write_shard(tmp_path / "pack-00000-00000.tar", [{
        "pack_id": 3, "sample_ids": ["a" * 16, "b" * 16], "lengths": [4, 3], "offsets": [0, 4], "seq_len": 8,
        "ids": ids, "mask": (ids % 2).astype(np.uint8), "images": [], "exts": [], "grids": [], "image_counts": [0, 0]}])
    (seq,) = list(iter_packed(tmp_path / "pack-00000-00000.tar"))
    assert seq.images == [] and seq.image_grids.shape == (0, 2) and seq.images_per_sample == [0, 0]
    assert seq.input_ids.tolist() == ids.tolist() and seq.cu_seqlens.tolist() == [0, 4, 7]
    with pytest.raises(ValueError, match="image_counts"):
        write_shard(tmp_path / "bad.tar", [{"pack_id": 0, "sample_ids": ["a" * 16], "lengths": [1], "offsets": [0],
                                            "seq_len": 8, "ids": ids[:1], "mask": ids[:1].astype(np.uint8),
                                            "images": [b"x"], "exts": ["png"], "grids": [(2, 2)], "image_counts": [0]}])


def test_config_validation():
    from packing.lengths import LengthsConfig
    from packing.pack import PackConfig

    for bad, field in [({"batch_size": 0}, "batch_size"), ({"patch_size": 0}, "patch_size"),
                       ({"merge_size": -1}, "merge_size"), ({"min_pixels": 0}, "min_pixels"),
                       ({"samples_steps": []}, "samples_steps"), ({"samples_steps": ["a", "a"]}, "samples_steps")]:
        with pytest.raises(ValueError, match=field):
            LengthsConfig(tokenizer="t", **bad)
    with pytest.raises(ValueError, match="mix_step"):
        PackConfig(copies_from="mixed", mix_step="")
