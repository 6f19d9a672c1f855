"""embed-images' decode pipeline: the split preprocess, the batch cuts, threads vs worker processes,
task counts, and (on a GPU) nvJPEG against the CPU decode."""
import io
import shutil

import numpy as np
import pytest
import torch

from manifests import read_manifest
from manifests.io import manifest_files
from ovpipe.cli import main

torch.set_num_threads(2)


def _photo(rng, w, h):
    """A smooth random image (a noise image makes an unrealistically large JPEG)."""
    from PIL import Image

    small = rng.integers(0, 255, (max(2, h // 16), max(2, w // 16), 3), dtype=np.uint8)
    return Image.fromarray(small).resize((w, h), Image.BICUBIC)


def _tiny_clip_model(device: str = "cpu"):
    """(net, preprocess) of the registered tiny open_clip model, seeded, in eval mode."""
    import open_clip

    from curation.clip import register_configs

    register_configs()
    torch.manual_seed(0)
    net, _, preprocess = open_clip.create_model_and_transforms("ovpipe-tiny-clip", pretrained=None, device=device)
    return net.eval(), preprocess


def _jpeg_rows(tmp_path, rng, sizes) -> list[dict]:
    """One JPEG file per (w, h) and its ``samples``-style row."""
    rows = []
    for i, (w, h) in enumerate(sizes):
        p = tmp_path / f"{i}.jpg"
        _photo(rng, w, h).save(p, "JPEG", quality=90)
        rows.append({"sample_id": f"{i:016x}", "images": [{"container": "file", "file": str(p)}]})
    return rows


@pytest.mark.parametrize("size", [64, 224])
def test_split_preprocess_is_bit_identical_to_the_whole_transform(size):
    import open_clip

    from curation.decode import split_preprocess

    preprocess = open_clip.image_transform(size, is_train=False)
    pre = split_preprocess(preprocess)
    assert pre.mean is not None and pre.resize == size and pre.crop == (size, size)
    assert type(pre.to_uint8.transforms[-1]).__name__ == "CenterCrop"     # the crop runs on the tensor
    rng = np.random.default_rng(0)
    for w, h in [(90, 50), (640, 480), (333, 777)]:
        im = _photo(rng, w, h)
        x = pre.to_uint8(im)
        assert x.dtype == torch.uint8 and x.shape == (3, size, size)
        for mode in ("L", "RGBA", "P", "CMYK"):          # a mode change commutes with the moved crop
            other = im.convert(mode)
            assert torch.equal(pre.finish(pre.to_uint8(other)[None])[0], preprocess(other)), mode
        assert torch.equal(pre.finish(x[None])[0], preprocess(im))


def test_batches_are_cut_at_global_row_multiples(ingested_run):
    from curation.decode import manifest_batches
    from curation.embed import SAMPLE_COLUMNS

    ids = read_manifest(ingested_run, "samples", columns=["sample_id"]).column("sample_id").to_pylist()
    files = [str(f) for f in manifest_files(ingested_run, "samples", "ingest")]
    for lo, hi in [(0, 200), (37, 150), (64, 65), (10, 30)]:
        got = list(manifest_batches(files, SAMPLE_COLUMNS, lo, hi, 32))
        assert sum((t.column("sample_id").to_pylist() for t in got), []) == ids[lo:hi]
        ends = np.cumsum([t.num_rows for t in got]) + lo
        assert all(e % 32 == 0 for e in ends[:-1]) and ends[-1] == hi and all(t.num_rows <= 32 for t in got)


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    net, _ = _tiny_clip_model()
    ckpt = tmp_path_factory.mktemp("clip") / "tiny.pt"
    torch.save({"state_dict": net.state_dict()}, ckpt)
    return str(ckpt)


def _embeddings(run):
    t = read_manifest(run, "image_embeddings").to_pylist()
    shards = {}
    vec = {}
    for r in t:
        if r["status"] == "ok":
            shards.setdefault(r["file"], np.load(run / r["file"]))
            vec[r["sample_id"]] = shards[r["file"]][r["row"]]
    return [(r["sample_id"], r["status"], r["error"]) for r in t], vec


def test_threads_and_worker_processes_give_the_same_step_output_at_any_task_count(ingested_run, tiny_clip, tmp_path):
    common = ["--set", "model=ovpipe-tiny-clip", "--set", f"pretrained={tiny_clip}", "--set", "batch_size=16",
              "--set", "decode_workers=2", "--quiet"]
    runs = {}
    for name, extra in [("threads-1", ["--tasks", "1", "--set", "decode=threads"]),
                        ("processes-3", ["--tasks", "3", "--set", "decode=processes", "--set", "prefetch=1",
                                         "--set", "decode_unit=5"])]:
        run = tmp_path / name
        shutil.copytree(ingested_run / "ingest", run / "ingest")
        assert main(["embed-images", "--run-dir", str(run), *common, *extra]) == 0
        runs[name] = _embeddings(run)
    (rows1, v1), (rows3, v3) = runs["threads-1"], runs["processes-3"]
    assert rows1 == rows3
    assert sum(s == "ok" for _, s, _ in rows1) == 195 and len(rows1) == 200
    assert any(s == "decode_error" for _, s, _ in rows1) or any(s != "ok" for _, s, _ in rows1)
    assert v1.keys() == v3.keys()
    for k in v1:   # batches are cut at global row numbers; only a slice's edge batches differ in size
        np.testing.assert_allclose(v1[k].astype(np.float32), v3[k].astype(np.float32), atol=2e-3)


def test_embed_rows_keeps_a_corrupt_image_as_an_error_row(tmp_path):
    from curation.decode import DecodeConfig
    from curation.embed import embed_rows

    net, preprocess = _tiny_clip_model()
    rng = np.random.default_rng(1)
    rows = []
    for i in range(7):
        p = tmp_path / f"{i}.jpg"
        if i == 3:
            p.write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
        else:
            _photo(rng, 120 + 10 * i, 90).save(p, "JPEG", quality=90)
        rows.append({"sample_id": f"{i:016x}", "images": [{"container": "file", "file": str(p)}]})
    for mode, unit in (("threads", 32), ("processes", 32), ("processes", 2), ("processes", 1)):
        emb, errors = embed_rows(rows, net, preprocess, "cpu", 3,
                                 DecodeConfig(decode=mode, decode_workers=2, prefetch=1, decode_unit=unit))
        assert [e is None for e in errors] == [i != 3 for i in range(7)], errors
        assert emb.shape == (6, net.visual.output_dim)
        np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1, atol=1e-5)
        if mode == "threads":
            ref = emb
        else:
            np.testing.assert_array_equal(ref, emb)


def _same_batch(got, want):
    assert got["rows"] == want["rows"]
    assert got["pos"] == want["pos"] and got["jpeg_pos"] == want["jpeg_pos"] and got["errors"] == want["errors"]
    assert (got["x"] is None) == (want["x"] is None)
    if want["x"] is not None:
        assert got["x"].dtype == want["x"].dtype and torch.equal(got["x"], want["x"])
    assert len(got["jpeg"]) == len(want["jpeg"]) and all(torch.equal(a, b) for a, b in zip(got["jpeg"], want["jpeg"]))


@pytest.mark.parametrize("unit,workers", [(3, 2), (1, 3), (8, 2), (64, 2)])
def test_decode_units_reassemble_into_the_batches_one_worker_prepares(tmp_path, unit, workers):
    """Worker processes decoding units of a batch give back, batch by batch, exactly what
    ``prepare_batch`` makes of the whole batch: rows, positions, pixels, JPEG bytes, errors (corrupt
    files, text-only samples and rows not ``ok`` included), also for the short last batch."""
    import open_clip

    from curation.decode import DecodeConfig, RowDecoder, decoded_batches, list_batches, prepare_batch, split_preprocess

    pre = split_preprocess(open_clip.image_transform(32, is_train=False))
    dec = RowDecoder(pre.to_uint8, None, 0.5)           # some rows left as JPEG bytes, the others decoded
    rng = np.random.default_rng(7)
    rows = []
    for i in range(21):
        p = tmp_path / f"{i}.{'png' if i % 6 == 5 else 'jpg'}"
        if i in (4, 13):
            p.write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
        else:
            im = _photo(rng, 60 + 3 * i, 40 + 2 * i)
            im.save(p, "PNG") if p.suffix == ".png" else im.save(p, "JPEG", quality=90)
        r = {"sample_id": f"{i:016x}", "status": "ok", "error": None,
             "images": [{"container": "file", "file": str(p)}]}
        if i == 9:
            r["images"] = []                            # text-only: becomes no_image
        if i == 10:
            r["status"], r["error"] = "too_small", "x"
        rows.append(r)

    def fresh():
        return [dict(r) for r in rows]

    want = [prepare_batch(b, dec) for b in list_batches(fresh(), 8)]
    got = list(decoded_batches(lambda: list_batches(fresh(), 8), dec,
                               DecodeConfig(decode="processes", decode_workers=workers, prefetch=1, decode_unit=unit)))
    assert len(got) == len(want) == 3
    assert any(w["errors"] for w in want) and any(w["jpeg"] for w in want) and any(w["pos"] for w in want)
    for g, w in zip(got, want):
        _same_batch(g, w)
    assert [r["status"] for r in got[1]["rows"]][1:3] == ["no_image", "too_small"]


def test_decode_unit_must_be_positive():
    from curation.embed import EmbedImagesConfig

    with pytest.raises(ValueError, match="decode_unit"):
        EmbedImagesConfig(decode_unit=0)
    assert EmbedImagesConfig().decode_unit == 256


def test_decode_workers_default_to_the_cpus_the_task_may_use_but_one(monkeypatch):
    """Unset, the GPU path's worker processes take every CPU of the task's affinity mask (what a Slurm task
    was given) but the one that feeds the GPU, at most 32; threads (the CPU path) stay at 8; a set count is
    kept."""
    import os

    from curation.decode import CPU_THREADS, MAX_WORKERS, DecodeConfig
    from curation.embed import EmbedImagesConfig

    def workers(device, **kw):
        return DecodeConfig(**kw).resolve(device).decode_workers

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert workers("cuda") == workers("cpu", decode="processes") == 15
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(224)))     # a whole node, unbound
    assert workers("cuda") == MAX_WORKERS == 32
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert workers("cuda") == 1
    assert workers("cpu") == workers("cuda", decode="threads") == CPU_THREADS == 8
    assert workers("cuda", decode_workers=5) == 5
    assert EmbedImagesConfig().decode_workers is None
    with pytest.raises(ValueError, match="decode_workers"):
        EmbedImagesConfig(decode_workers=0)


def test_the_decode_config_resolves_every_auto_value_in_one_place(monkeypatch):
    """``DecodeConfig.resolve(device)``: a GPU's defaults (worker processes, the CPU JPEG decode, drafted,
    torch's resize), a CPU's (threads, PIL's full decode and resize, bit-identical to open_clip), set
    values kept, and a resolved config resolved again unchanged. The step's config builds the same
    value from its fields of the same names."""
    import dataclasses
    import os

    from curation.decode import DecodeConfig
    from curation.embed import EmbedImagesConfig

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    gpu, cpu = DecodeConfig().resolve("cuda:0"), DecodeConfig().resolve("cpu")
    assert gpu == DecodeConfig("processes", 15, 2, 256, "cpu", 1.0, True, True)
    assert cpu == DecodeConfig("threads", 8, 2, 256, "cpu", 1.0, False, False)
    assert gpu.resolve("cpu") == gpu and cpu.resolve("cuda") == cpu
    mine = DecodeConfig("processes", 3, 4, 16, "nvjpeg", 0.5, False, False)
    assert mine.resolve("cuda") == mine
    with pytest.raises(dataclasses.FrozenInstanceError):
        gpu.decode = "threads"
    cfg = EmbedImagesConfig(decode="threads", decode_workers=3, prefetch=4, decode_unit=16, jpeg_draft=True)
    assert cfg.decode_config() == DecodeConfig("threads", 3, 4, 16, "auto", 1.0, True, None)
    assert [f.name for f in dataclasses.fields(DecodeConfig)] == [
        "decode", "decode_workers", "prefetch", "decode_unit", "jpeg_decode", "nvjpeg_share", "jpeg_draft",
        "fast_resize"]


@pytest.mark.parametrize("field, value", [("decode", "gpu"), ("decode_workers", 0), ("prefetch", 0),
                                          ("decode_unit", 0), ("jpeg_decode", "pil"), ("nvjpeg_share", 1.5)])
def test_a_bad_decode_field_is_refused_before_any_work_naming_it(tmp_path, capsys, field, value):
    from curation.decode import DecodeConfig

    with pytest.raises(ValueError, match=field):
        DecodeConfig(**{field: value})
    run = tmp_path / "run"
    assert main(["embed-images", "--set", f"{field}={value}", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert field in err and str(value) in err
    assert not run.exists()


def test_jpeg_draft_stays_within_bf16_of_the_full_decode(tmp_path):
    from curation.decode import DecodeConfig
    from curation.embed import embed_rows

    net, preprocess = _tiny_clip_model()
    rows = _jpeg_rows(tmp_path, np.random.default_rng(4), [(640, 480), (1024, 768), (300, 500), (90, 60)])
    full, _ = embed_rows(rows, net, preprocess, "cpu", 4, DecodeConfig(decode="threads", decode_workers=2))
    draft, _ = embed_rows(rows, net, preprocess, "cpu", 4,
                          DecodeConfig(decode="threads", decode_workers=2, jpeg_draft=True))
    assert (full * draft).sum(1).min() > 0.99
    assert np.array_equal(full[3], draft[3])          # smaller than the crop: no DCT scaling


@pytest.mark.parametrize("size", [64, 224])
def test_the_tensor_head_is_within_two_levels_of_pils(size):
    """``fast_resize``: torch's uint8 antialiased resize + the crop give open_clip's head's shape and its
    pixels within two uint8 levels (a quarter of a level on average), for landscape, portrait, square,
    already-sized and smaller images."""
    import open_clip

    from curation.decode import TensorHead, split_preprocess, tensor_head

    pre = split_preprocess(open_clip.image_transform(size, is_train=False))
    head = tensor_head(pre)
    assert isinstance(head, TensorHead) and head.mode == "bicubic"
    rng = np.random.default_rng(5)
    for w, h in [(640, 480), (333, 777), (300, 300), (size, size + 37), (90, 50), (size + 1, size)]:
        im = _photo(rng, w, h)
        want, got = pre.to_uint8(im), head(im)
        assert got.dtype == torch.uint8 and got.shape == want.shape == (3, size, size), (w, h)
        diff = (got.int() - want.int()).abs()
        assert diff.max() <= 2 and diff.float().mean() < 0.25, (w, h, diff.max(), diff.float().mean())
        assert torch.equal(head(im.convert("L")), head(im.convert("L").convert("RGB")))     # any mode: RGB first


def test_fast_resize_stays_within_bf16_of_pils_and_is_the_gpu_default(tmp_path):
    from curation.decode import DecodeConfig, TensorHead, make_decoder, split_preprocess
    from curation.embed import embed_rows

    assert DecodeConfig().resolve("cuda").fast_resize and not DecodeConfig().resolve("cpu").fast_resize
    net, preprocess = _tiny_clip_model()
    pre = split_preprocess(preprocess)
    assert isinstance(make_decoder(pre, "cpu", DecodeConfig(fast_resize=True)).to_uint8, TensorHead)
    assert make_decoder(pre, "cpu").to_uint8 is pre.to_uint8
    assert isinstance(make_decoder(pre, "cuda").to_uint8, TensorHead)       # (building it needs no GPU)
    rows = _jpeg_rows(tmp_path, np.random.default_rng(6), [(640, 480), (1024, 768), (300, 500), (90, 60)])
    rows.append({"sample_id": "broken", "images": [{"container": "file", "file": str(tmp_path / "missing.jpg")}]})
    full, err = embed_rows(rows, net, preprocess, "cpu", 4, DecodeConfig(decode="threads", decode_workers=2))
    fast, err_fast = embed_rows(rows, net, preprocess, "cpu", 4, DecodeConfig(
        decode="processes", decode_workers=2, jpeg_draft=True, fast_resize=True))
    assert (full * fast).sum(1).min() > 0.99 and len(fast) == 4
    assert err_fast[:4] == [None] * 4 and err_fast[4] is not None and err[4] is not None


def test_nvjpeg_share_splits_rows_by_sample_id():
    from curation.decode import RowDecoder

    rows = [{"sample_id": f"{i:016x}"} for i in range(4000)]
    half = RowDecoder(None, None, 0.5)
    picked = [half.to_gpu(r) for r in rows]
    assert 0.45 < np.mean(picked) < 0.55 and picked == [half.to_gpu(r) for r in rows]
    assert not any(RowDecoder(None, None, 0.0).to_gpu(r) for r in rows)
    assert all(RowDecoder(None, None, 1.0).to_gpu(r) for r in rows)


@pytest.mark.gpu
def test_nvjpeg_decode_matches_the_cpu_decode_within_bf16(tmp_path):
    from curation.decode import DecodeConfig
    from curation.embed import embed_rows

    net, preprocess = _tiny_clip_model("cuda")
    rng = np.random.default_rng(2)
    rows = []
    for i, (w, h) in enumerate([(640, 480), (800, 600), (1024, 768), (500, 700), (300, 300), (1200, 800)] * 3):
        p = tmp_path / f"{i}.{'png' if i % 5 == 4 else 'jpg'}"   # PNGs take the CPU fallback
        im = _photo(rng, w, h)
        im.save(p, "PNG") if p.suffix == ".png" else im.save(p, "JPEG", quality=90)
        rows.append({"sample_id": f"{i:016x}", "images": [{"container": "file", "file": str(p)}]})
    (tmp_path / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    rows.append({"sample_id": "bad", "images": [{"container": "file", "file": str(tmp_path / "bad.jpg")}]})
    cpu, err_cpu = embed_rows(rows, net, preprocess, "cuda", 8,
                              DecodeConfig(decode="threads", decode_workers=2, jpeg_decode="cpu"))
    gpu, err_gpu = embed_rows(rows, net, preprocess, "cuda", 8,
                              DecodeConfig(decode="processes", decode_workers=2, jpeg_decode="nvjpeg"))
    half, err_half = embed_rows(rows, net, preprocess, "cuda", 8, DecodeConfig(
        decode="processes", decode_workers=2, jpeg_decode="nvjpeg", nvjpeg_share=0.5))
    assert [e is None for e in err_cpu] == [e is None for e in err_gpu] == [e is None for e in err_half] \
        == [True] * 18 + [False]
    for got in (gpu, half):
        cos = (cpu * got).sum(1)
        assert cos.min() > 0.99, cos
        np.testing.assert_allclose(cpu, got, atol=3e-2)


def test_a_batch_split_between_nvjpeg_and_cpu_workers_keeps_row_order(tmp_path):
    """The nvJPEG path's assembly, run with torchvision's CPU JPEG decoder in nvJPEG's place: every row
    of a half-and-half run equals the same row of the all-CPU or the all-'GPU' run, whichever decoded it."""
    from curation.decode import DecodeConfig, RowDecoder, decoded_batches, embed_batches, list_batches, split_preprocess

    net, preprocess = _tiny_clip_model()
    pre = split_preprocess(preprocess)
    rng = np.random.default_rng(5)
    rows = []
    for i in range(20):
        p = tmp_path / f"{i}.{'png' if i % 7 == 6 else 'jpg'}"
        im = _photo(rng, 200 + 13 * i, 150 + 7 * i)
        im.save(p, "PNG") if p.suffix == ".png" else im.save(p, "JPEG", quality=90)
        rows.append({"sample_id": f"{i:016x}", "images": [{"container": "file", "file": str(p)}]})

    def run(share):
        dec = RowDecoder(pre.to_uint8, None, share)
        threads = DecodeConfig(decode="threads", decode_workers=2)
        out = [e for _, _, e in embed_batches(decoded_batches(lambda: list_batches(rows, 8), dec, threads), net,
                                              pre, "cpu")]
        return np.concatenate(out), dec

    cpu, _ = run(0.0)
    gpu, _ = run(1.0)
    half, dec = run(0.5)
    picked = [dec.to_gpu(r) and i % 7 != 6 for i, r in enumerate(rows)]
    assert 0 < sum(picked) < len(rows)
    assert not np.allclose(cpu, gpu, atol=1e-6)          # the two decoders differ, so the check means something
    for i, g in enumerate(picked):
        np.testing.assert_allclose(half[i], (gpu if g else cpu)[i], atol=1e-6, err_msg=f"row {i}")


@pytest.mark.gpu
def test_reassembled_batches_are_pinned_for_the_gpu(tmp_path):
    import open_clip

    from curation.decode import DecodeConfig, RowDecoder, decoded_batches, list_batches, prepare_batch, split_preprocess

    pre = split_preprocess(open_clip.image_transform(32, is_train=False))
    dec = RowDecoder(pre.to_uint8)
    rng = np.random.default_rng(8)
    rows = []
    for i in range(10):
        p = tmp_path / f"{i}.jpg"
        _photo(rng, 50 + i, 40).save(p, "JPEG", quality=90)
        rows.append({"sample_id": f"{i:016x}", "images": [{"container": "file", "file": str(p)}]})
    want = [prepare_batch(b, dec) for b in list_batches([dict(r) for r in rows], 8)]
    got = list(decoded_batches(lambda: list_batches([dict(r) for r in rows], 8), dec,
                               DecodeConfig(decode="processes", decode_workers=2, prefetch=1, decode_unit=3), "cuda"))
    for g, w in zip(got, want):
        assert g["x"].is_pinned()
        _same_batch(g, w)


def test_a_decode_worker_prepares_its_first_unit_as_it_starts():
    """torch calls iter() on the dataset as a worker starts, and sends requests only once every worker is
    forked: the first unit is prepared at iter(), the rest on request, in order, each with its offset."""
    from curation.decode import _iterable_dataset

    calls = []

    def prepare(piece):
        calls.append(list(piece))
        return {"rows": list(piece)}

    ds = _iterable_dataset()(lambda: iter([[1, 2, 3], [4, 5]]), prepare, 2)
    it = iter(ds)
    assert calls == [[1, 2]]
    out = list(it)
    assert calls == [[1, 2], [3], [4, 5]]
    assert [(u["rows"], u["offset"], u["last"]) for u in out] == [([1, 2], 0, False), ([3], 2, True), ([4, 5], 0, True)]
    assert list(iter(_iterable_dataset()(lambda: iter([]), prepare, 2))) == []


def _alone(net, pre, x, device):
    """One batch embedded on its own, synchronously: what the pipelined loop must return for it."""
    from curation.clip import autocast

    with torch.inference_mode(), autocast(device):
        e = net.encode_image(pre.finish(x.to(device)))
    return torch.nn.functional.normalize(e.float(), dim=-1).cpu().numpy()


def test_the_embedding_pipeline_records_the_decode_and_where_the_host_waited(tmp_path):
    from functools import partial

    from curation.decode import DecodeConfig, list_batches, split_preprocess
    from curation.embed import embedded_batches
    from ovpipe.step import Stats

    net, preprocess = _tiny_clip_model()
    pre = split_preprocess(preprocess)
    rows = _jpeg_rows(tmp_path, np.random.default_rng(11), [(120 + 7 * i, 90 + 5 * i) for i in range(12)])
    stats = Stats()
    got = list(embedded_batches(partial(list_batches, rows, 4), net, preprocess, "cpu",
                                DecodeConfig(decode="threads", decode_workers=2), stats))
    assert stats.info["decode"] == "threads x2, jpeg cpu"
    assert [len(pos) for _, pos, _ in got] == [4, 4, 4] and stats.counters["embedded"] == 12
    assert stats.timings["wait_input"] > 0 and stats.timings["wait_device"] >= 0
    for batch, _, e in got:
        np.testing.assert_array_equal(e, _alone(net, pre, batch["x"], "cpu"))


@pytest.mark.gpu
def test_the_pipelined_gpu_loop_returns_each_batchs_own_embeddings(tmp_path):
    """On a GPU, batch k goes up on a side stream while batch k-1's forward runs, and each batch's
    embeddings are copied into pinned memory behind its own forward: every batch's result equals that
    batch embedded alone, synchronously, bit for bit (a missing stream wait would hand back another
    batch's pixels or a half-copied result)."""
    from curation.decode import DecodeConfig, RowDecoder, decoded_batches, embed_batches, list_batches, split_preprocess

    net, preprocess = _tiny_clip_model("cuda")
    pre = split_preprocess(preprocess)
    rows = _jpeg_rows(tmp_path, np.random.default_rng(12), [(120 + 7 * i, 90 + 5 * i) for i in range(40)])
    got = list(embed_batches(decoded_batches(lambda: list_batches(rows, 4), RowDecoder(pre.to_uint8),
                                             DecodeConfig(decode="processes", decode_workers=2), "cuda"),
                             net, pre, "cuda"))
    assert len(got) == 10
    for batch, pos, e in got:
        assert batch["x"].is_pinned() and pos == [0, 1, 2, 3]
        np.testing.assert_array_equal(e, _alone(net, pre, batch["x"], "cuda"))
