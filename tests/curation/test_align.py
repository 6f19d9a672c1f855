"""`align`: the image–text CLIP score through the embed step's own model, the per-source percentile cut,
conversations scored on their first turn, the same bytes at any task count."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dedup_fixtures import embedded_run  # noqa: E402

from curation.align import AlignConfig, percentile_threshold, text_of  # noqa: E402
from manifests import read_manifest  # noqa: E402
from manifests.io import write_table  # noqa: E402
from ovpipe.cli import main  # noqa: E402

COLOURS = ["red", "blue", "green", "teal", "pink", "gold"]
SHAPES = ["circle", "star", "square", "cross", "heart", "moon"]


def _tiny_clip(path: Path):
    import open_clip

    from curation.clip import load_clip, register_configs

    register_configs()
    torch.manual_seed(0)
    net, _, _ = open_clip.create_model_and_transforms("ovpipe-tiny-clip", pretrained=None)
    torch.save({"state_dict": net.state_dict()}, path)
    return load_clip("ovpipe-tiny-clip", str(path), "cpu")


def test_percentile_threshold_is_the_bin_edge_below_the_share():
    hist = np.zeros(4096, np.int64)
    hist[[100, 200, 300, 400]] = [5, 5, 5, 85]
    t = percentile_threshold(hist, 10)            # 10 of 100 rows: the bin at 200 holds the 10th
    assert t == pytest.approx(-1 + 2 * 200 / 4096)
    assert np.isnan(percentile_threshold(np.zeros(4096, np.int64), 5))


def test_conversation_text_is_the_first_user_and_assistant_turn():
    row = {"category": "instruct", "caption": "x", "conversation": [
        {"role": "system", "text": "be brief"}, {"role": "user", "text": "<image>\nWhat is it?"},
        {"role": "assistant", "text": "A red  star."}, {"role": "user", "text": "And?"}]}
    assert text_of(row) == ("What is it? A red star.", "first_turn", None)
    assert text_of(row, "skip") == (None, None, "skipped_conversation")
    assert text_of({"category": "caption", "caption": "  ", "conversation": []}) == (None, None, "no_text")
    with pytest.raises(ValueError, match="threshold and percentile"):
        AlignConfig(threshold=0.2, percentile=5)


def test_scores_cut_and_bytes_at_1_and_2_tasks(tmp_path):
    net, _, tokenizer, _ = _tiny_clip(tmp_path / "tiny.pt")
    rng = np.random.default_rng(0)
    captions = [f"a {COLOURS[i % 6]} {SHAPES[(i // 6) % 6]} and a {COLOURS[(i * 5) % 6]} {SHAPES[i % 5]}"
                for i in range(40)]
    with torch.no_grad():
        img = torch.nn.functional.normalize(net.encode_text(tokenizer(captions)), dim=-1).numpy()
    img = img + rng.normal(scale=0.02, size=img.shape)     # an image vector near its caption's
    img /= np.linalg.norm(img, axis=1, keepdims=True)
    shown = list(captions)
    mismatched = set(range(0, 40, 5))
    for k in mismatched:                                   # a caption of another sample
        shown[k] = captions[(k + 21) % 40]
    conv = [None] * 40
    conv[7] = [("user", "<image>\nDescribe it."), ("assistant", captions[7])]
    sources = ["web" if k % 2 else "books" for k in range(40)]
    out = []
    for tasks in (1, 2):
        run = tmp_path / f"t{tasks}"
        ids = embedded_run(run, img.astype(np.float32), parts=2, bad=2, captions=shown, sources=sources,
                           conversations=conv)
        emb_cfg = run / "embed-images" / "config.json"
        emb_cfg.write_text(emb_cfg.read_text().replace('"pretrained": ""', f'"pretrained": "{tmp_path / "tiny.pt"}"'))
        assert main(["align", "--run-dir", str(run), "--tasks", str(tasks), "--quiet", "--set", "percentile=20",
                     "--set", "batch_size=64"]) == 0
        f = tmp_path / f"t{tasks}.parquet"
        write_table(read_manifest(run, "alignment"), f)
        out.append(f.read_bytes())
    assert out[0] == out[1]
    rows = {r["sample_id"]: r for r in read_manifest(tmp_path / "t1", "alignment").to_pylist()}
    assert sum(r["status"] == "decode_error" and r["score"] is None for r in rows.values()) == 2
    # the score is the cosine of the stored fp16 image vector and the text through the same tower
    with torch.no_grad():
        txt = torch.nn.functional.normalize(net.encode_text(tokenizer(shown)), dim=-1).numpy()
    stored = img.astype(np.float16).astype(np.float32)
    stored /= np.linalg.norm(stored, axis=1, keepdims=True)
    want = (stored * txt).sum(1)
    k7 = rows[ids[7]]
    assert k7["text_kind"] == "first_turn"
    for k, sid in enumerate(ids):
        if k != 7:
            assert rows[sid]["text_kind"] == "caption" and rows[sid]["score"] == pytest.approx(want[k], abs=2e-5)
    # per source, at most 20% below the cut, and every one of them below it
    for src in ("web", "books"):
        mine = [r for r in rows.values() if r["source"] == src and r["score"] is not None]
        low = [r for r in mine if r["status"] == "low_alignment"]
        assert 0 < len(low) <= 0.2 * len(mine)
        assert all(r["score"] < r["threshold"] for r in low)
        assert all(r["score"] >= r["threshold"] for r in mine if r["status"] == "ok")
    low_ids = {ids.index(s) for s, r in rows.items() if r["status"] == "low_alignment"}
    assert low_ids <= mismatched | {7}, low_ids - mismatched     # what the cut marks are the planted mismatches
    assert (tmp_path / "t1" / "align" / "scores.png").stat().st_size > 1000
    assert "| books |" in (tmp_path / "t1" / "align" / "report.md").read_text()


def test_streams_cut_differently_are_paired_row_for_row():
    import pyarrow as pa

    from curation.align import aligned

    rows = pa.table({"x": list(range(10))})
    left = rows.to_batches(max_chunksize=3)
    right = [rows.slice(0, 4).to_batches()[0], rows.slice(4, 1).to_batches()[0], rows.slice(5).to_batches()[0]]
    pairs = list(aligned(left, right))
    assert all(a.num_rows == b.num_rows for a, b in pairs)
    assert [v for a, _ in pairs for v in a.column("x").to_pylist()] == list(range(10))
    assert [v for _, b in pairs for v in b.column("x").to_pylist()] == list(range(10))
    with pytest.raises(ValueError, match="different row counts"):
        list(aligned(left, right[:2]))


def _small_run(run: Path, tiny: Path, net, tokenizer, n: int = 24, bad_rows=()) -> list[str]:
    """``n`` samples whose image vectors lie near their caption's (two sources), rows ``bad_rows`` replaced
    by a zero, a NaN and an inf vector in turn; the embed step pointed at the tiny CLIP checkpoint."""
    captions = [f"a picture number {i} of {COLOURS[i % 6]} {SHAPES[i % 5]}s" for i in range(n)]
    with torch.no_grad():
        img = torch.nn.functional.normalize(net.encode_text(tokenizer(captions)), dim=-1).numpy()
    img = img + np.random.default_rng(1).normal(scale=0.05, size=img.shape)
    img = (img / np.linalg.norm(img, axis=1, keepdims=True)).astype(np.float32)
    for k, row in enumerate(bad_rows):
        img[row] = [0.0, np.nan, 0.0][k % 3]
        if k % 3 == 2:
            img[row, 0] = np.inf
    ids = embedded_run(run, img, parts=2, bad=1, captions=captions, sources=["web" if i % 2 else "books"
                                                                             for i in range(n)])
    cfg = run / "embed-images" / "config.json"
    cfg.write_text(cfg.read_text().replace('"pretrained": ""', f'"pretrained": "{tiny}"'))
    return ids


def _bytes(run: Path, out: Path) -> bytes:
    write_table(read_manifest(run, "alignment"), out)
    return out.read_bytes()


def test_a_zero_nan_or_inf_image_vector_is_a_bad_vector_row_and_the_rest_are_scored(tmp_path):
    net, _, tokenizer, _ = _tiny_clip(tmp_path / "tiny.pt")
    ids = _small_run(tmp_path / "run", tmp_path / "tiny.pt", net, tokenizer, bad_rows=(0, 5, 13))
    assert main(["align", "--run-dir", str(tmp_path / "run"), "--tasks", "2", "--quiet",
                 "--set", "percentile=20"]) == 0
    rows = {r["sample_id"]: r for r in read_manifest(tmp_path / "run", "alignment").to_pylist()}
    assert len(rows) == 25
    for k in (0, 5, 13):
        assert rows[ids[k]]["status"] == "bad_vector" and rows[ids[k]]["score"] is None and rows[ids[k]]["error"]
    scored = [r for r in rows.values() if r["score"] is not None]
    assert len(scored) == 21 and all(-1 <= r["score"] <= 1 for r in scored)
    stats = json.loads((tmp_path / "run" / "align" / "stats.json").read_text())["counters"]
    assert stats["status/bad_vector"] == 3


@pytest.mark.slow
def test_apply_is_retried_to_the_same_bytes_from_every_point_it_can_die_at(tmp_path, monkeypatch):
    """A try of apply rank 0 dies while writing its part, after publishing it (before its marker), and the
    finalize dies after removing the spent scores: each rerun finishes with the bytes of a run that never
    died."""
    import dataclasses

    import curation.align as align
    from manifests.io import PartWriter

    net, _, tokenizer, _ = _tiny_clip(tmp_path / "tiny.pt")
    args = ["--tasks", "2", "--quiet", "--set", "percentile=20"]
    _small_run(tmp_path / "ref", tmp_path / "tiny.pt", net, tokenizer)
    assert main(["align", "--run-dir", str(tmp_path / "ref"), *args]) == 0
    want = _bytes(tmp_path / "ref", tmp_path / "ref.parquet")
    run = tmp_path / "run"
    _small_run(run, tmp_path / "tiny.pt", net, tokenizer)
    real_write = PartWriter.write

    def dies_mid_part(self, data):
        if self.path.parent.name == "alignment":          # the part, not the map's uncut scores
            real_write(self, data)
            raise RuntimeError("killed while writing the part")
        return real_write(self, data)

    with monkeypatch.context() as m:                        # 1. inside the part: nothing is published
        m.setattr(PartWriter, "write", dies_mid_part)
        assert main(["align", "--run-dir", str(run), *args]) != 0
    assert not list((run / "align" / "alignment").glob("part-*"))
    with monkeypatch.context() as m:                        # 2. the part published, the marker not yet
        m.setenv("OVPIPE_FAIL_RANKS", "align/apply:0")
        assert main(["align", "--run-dir", str(run), *args]) != 0
    assert (run / "align" / "alignment" / "part-00000.parquet").exists()
    assert not (run / "align" / "completions" / "apply-00000").exists()
    def dies_after_cleanup(cfg, task):
        align.write_report(cfg, task)
        raise RuntimeError("killed after removing the scores")

    with monkeypatch.context() as m:                        # 3. the finalize, after removing the spent scores
        m.setattr(align, "STEP", dataclasses.replace(align.STEP, finalize=dies_after_cleanup))
        assert main(["align", "--run-dir", str(run), *args]) != 0
    assert not list((run / "align" / "partials").glob("scores-*"))
    assert main(["align", "--run-dir", str(run), *args]) == 0
    assert (run / "align" / "completions" / "finalized").exists()
    assert _bytes(run, tmp_path / "run.parquet") == want


@pytest.mark.slow
def test_align_any_image_vectors_every_row_once_same_bytes_at_1_and_2_tasks(tmp_path):
    """Generated image vectors (tests/fuzz/strategies.py: zero, NaN, ±inf, subnormal, overflowing, repeated
    rows among unit ones): no task dies, every sample comes out once with a status, a bad vector is a
    ``bad_vector`` row, every score is a cosine, and 1 and 2 tasks give the same bytes."""
    import tempfile

    from hypothesis import given, settings

    from curation.dedup import bad_vectors
    from tests.fuzz.strategies import vector_rows

    net, _, tokenizer, _ = _tiny_clip(tmp_path / "tiny.pt")

    @settings(max_examples=3)
    @given(drawn=vector_rows(dim=128, min_rows=2, max_rows=24))
    def prop(drawn):
        x, kinds = drawn
        x = x.astype(np.float64)
        good = np.array([k in ("normal", "dup") for k in kinds])
        with np.errstate(over="ignore", invalid="ignore"):           # a "dup" may repeat a NaN row
            x[good] /= np.linalg.norm(x[good], axis=1, keepdims=True)
            x = x.astype(np.float32)
            bad = bad_vectors(x.astype(np.float16))
        with tempfile.TemporaryDirectory() as tmp:
            out = []
            for tasks in (1, 2):
                run = Path(tmp) / f"t{tasks}"
                with np.errstate(over="ignore"):
                    ids = embedded_run(run, x, parts=2, bad=1, captions=[f"a {COLOURS[i % 6]} thing" for i in
                                                                         range(len(x))])
                cfg = run / "embed-images" / "config.json"
                cfg.write_text(cfg.read_text().replace('"pretrained": ""', f'"pretrained": "{tmp_path / "tiny.pt"}"'))
                assert main(["align", "--run-dir", str(run), "--tasks", str(tasks), "--quiet",
                             "--set", "percentile=20"]) == 0
                out.append(_bytes(run, Path(tmp) / f"t{tasks}.parquet"))
            assert out[0] == out[1]
            rows = {r["sample_id"]: r for r in read_manifest(Path(tmp) / "t1", "alignment").to_pylist()}
            assert len(rows) == len(x) + 1 and set(ids) <= set(rows)
            assert [rows[s]["status"] == "bad_vector" for s in ids] == bad.tolist()
            assert all(-1.0001 <= r["score"] <= 1.0001 for r in rows.values() if r["score"] is not None)
            assert all(r["status"] in ("ok", "low_alignment", "bad_vector", "decode_error") for r in rows.values())

    prop()
