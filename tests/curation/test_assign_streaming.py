"""``assign`` streams its slice: embeddings are gathered from memory-mapped ``.npy`` shards batch by
batch, so a task's peak memory does not grow with the number of embedding rows, and the output
equals exact top-K over all vectors at once, for any task count."""
import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from manifests.io import read_manifest, write_part


def _unit(rng, n, d):
    x = rng.standard_normal((n, d), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _make_run(run, n, d=256, V=64, shards=2, seed=0, bad_every=0):
    """A run folder with external ``concepts`` and ``image_embeddings`` manifests + fp16 shards."""
    rng = np.random.default_rng(seed)
    C = _unit(rng, V, d).astype(np.float16)
    (run / "embed-concepts" / "data").mkdir(parents=True)
    np.save(run / "embed-concepts" / "data" / "c.npy", C)
    write_part({"concept_id": list(range(V)), "text": [f"c{i}" for i in range(V)],
                "file": ["embed-concepts/data/c.npy"] * V, "row": list(range(V))},
               run / "embed-concepts" / "concepts" / "part-00000.parquet", "concepts")
    (run / "embed-images" / "data").mkdir(parents=True)
    ids = np.array(sorted({f"{x:016x}" for x in rng.integers(0, 2**63, n + 100)})[:n])
    X = np.empty((0, d), np.float16)
    for s, part in enumerate(np.array_split(np.arange(n), shards)):
        status = np.array(["ok"] * len(part), dtype=object)
        if bad_every:
            status[::bad_every] = "decode_error"
        ok = status == "ok"
        E = _unit(rng, int(ok.sum()), d).astype(np.float16)
        np.save(run / "embed-images" / "data" / f"emb-{s:05d}.npy", E)
        X = np.concatenate([X, E])
        rows = np.full(len(part), -1, np.int32)
        rows[ok] = np.arange(ok.sum())
        write_part({"sample_id": ids[part].tolist(),
                    "file": [f"embed-images/data/emb-{s:05d}.npy" if o else None for o in ok],
                    "row": rows, "status": status.tolist(), "error": [None if o else "bad" for o in ok]},
                   run / "embed-images" / "image_embeddings" / f"part-{s:05d}.parquet", "image_embeddings",
                   sort=False)
    ok_ids = read_manifest(run, "image_embeddings").filter(pa.compute.equal(
        read_manifest(run, "image_embeddings").column("status"), "ok")).column("sample_id").to_pylist()
    return ok_ids, X.astype(np.float32), C.astype(np.float32)


CHILD = """import sys, manifests.io as io
io.PARQUET_OPTS["row_group_size"] = 1 << 16
from ovpipe.cli import main
sys.exit(main(["assign", "--run-dir", sys.argv[1], "--tasks", sys.argv[2], "--workers", "1", "--set", "k=5",
               "--set", "backend=faiss", "--set", "image_tile=" + sys.argv[3]]))
"""
PARENT = """import resource, subprocess, sys
rc = subprocess.call([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
"""


def _assign_peak_mib(run, tasks=1, tile=2048) -> float:
    """Peak RSS (MiB) of a child process running ``ovpipe assign`` (in-process: one worker), from the
    parent's RUSAGE_CHILDREN. Row groups of 64K rows instead of 1M: the part writer holds one row group
    of output before writing it (a bound independent of the corpus, but above this test's sizes)."""
    out = subprocess.run([sys.executable, "-c", PARENT, CHILD, str(run), str(tasks), str(tile)],
                         capture_output=True, text=True, timeout=300)
    rc, peak = out.stdout.split()[-2:]
    assert rc == "0", out.stderr[-3000:]
    return float(peak)


def test_assign_peak_memory_does_not_grow_with_embedding_rows(tmp_path):
    small, large = tmp_path / "small", tmp_path / "large"
    _make_run(small, 20_000)
    _make_run(large, 400_000)       # fp16 shards: 205 MB; loaded whole as fp32 they would be 410 MB
    p_small, p_large = _assign_peak_mib(small), _assign_peak_mib(large)
    # Generous: a 2048-row batch is 2 MiB, a 64K-row output row group ~10 MB; the whole large corpus loaded
    # (fp32 + the mapped fp16 pages kept) would be 600 MB more.
    assert p_large - p_small < 100, (p_small, p_large)
    assert read_manifest(large, "assignments").num_rows == 400_000


@pytest.mark.parametrize("tasks", [1, 3])
def test_streamed_assign_equals_exact_topk_over_all_vectors(tmp_path, tasks):
    from ovpipe.cli import main

    ok_ids, X, C = _make_run(tmp_path, 5_000, d=32, V=300, shards=3, bad_every=7)
    assert main(["assign", "--run-dir", str(tmp_path), "--tasks", str(tasks), "--workers", "1",
                 "--set", "k=5", "--set", "backend=torch", "--set", "image_tile=333"]) == 0
    got = read_manifest(tmp_path, "assignments")
    assert got.column("sample_id").to_pylist() == ok_ids
    S = X @ C.T
    ref = np.argsort(-S, axis=1, kind="stable")[:, :5]
    ids = np.array(got.column("concept_ids").to_pylist())
    top = np.sort(S, axis=1)[:, ::-1]
    ties = (np.abs(np.diff(top[:, :6], axis=1)) < 1e-6).any(axis=1)
    assert (ids[~ties] == ref[~ties]).all()
    assert np.allclose(np.array(got.column("scores").to_pylist()), np.take_along_axis(S, ids, 1), atol=1e-5)
    stats = json.loads((tmp_path / "assign" / "stats.json").read_text())["counters"]
    assert stats["images"] == len(ok_ids) and stats["skipped/decode_error"] == 5_000 - len(ok_ids)


def test_npy_shards_gather_reads_rows_and_releases(tmp_path):
    from curation.assign import NpyShards

    a = np.arange(60, dtype=np.float16).reshape(20, 3)
    b = -np.arange(30, dtype=np.float16).reshape(10, 3)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    sh = NpyShards(tmp_path)
    got = sh.gather(["a.npy", "b.npy", "a.npy"], [19, 0, 2])
    assert got.dtype == np.float32 and (got == np.stack([a[19], b[0], a[2]]).astype(np.float32)).all()
    sh.release(keep={"a.npy"})
    assert list(sh._open) == ["a.npy"]
    with pytest.raises(IndexError, match="b.npy"):
        sh.gather(["b.npy"], [10])
    sh.close()
    assert not sh._open


def test_npy_row_writer_appends_blocks_into_one_npy(tmp_path):
    from curation.embed import NpyRowWriter

    rng = np.random.default_rng(0)
    blocks = [rng.standard_normal((n, 4)).astype(np.float32) for n in (3, 0, 5, 1)]
    w = NpyRowWriter(tmp_path / "emb.npy")
    for b in blocks:
        w.write(b)
    w.close()
    got = np.load(tmp_path / "emb.npy")
    assert got.dtype == np.float16 and (got == np.concatenate(blocks).astype(np.float16)).all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["emb.npy"]
    empty = NpyRowWriter(tmp_path / "none.npy")
    empty.close(dim=4)
    assert np.load(tmp_path / "none.npy").shape == (0, 4)
    bad = NpyRowWriter(tmp_path / "bad.npy")
    bad.write(blocks[0])
    with pytest.raises(ValueError, match="width"):
        bad.write(np.zeros((2, 3)))
    bad.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["emb.npy", "none.npy"]


@pytest.mark.parametrize("backend", ["faiss", "torch"])
def test_index_filled_block_by_block_equals_the_whole_matrix(tmp_path, backend):
    from curation.assign import CONCEPT_COLUMNS, AssignConfig, Searcher, concept_blocks
    from manifests.io import read_manifest

    _, X, C = _make_run(tmp_path, 500, d=32, V=300, shards=1)
    cfg = AssignConfig(k=5, backend=backend)
    cids, blocks = concept_blocks(read_manifest(tmp_path, "concepts", columns=CONCEPT_COLUMNS), tmp_path, block_rows=7)
    assert (cids == np.arange(300)).all()
    s1, i1 = Searcher(blocks, cfg, "cpu", n_keys=len(cids))(X)
    s2, i2 = Searcher(C, cfg, "cpu")(X)
    assert (i1 == i2).all() and np.allclose(s1, s2)


def test_gather_in_the_shards_own_dtype(tmp_path):
    """The GPU path reads the fp16 shards as they are (``dtype=None``): the same values, half the bytes."""
    from curation.assign import NpyShards

    a = (np.arange(60, dtype=np.float32) / 7).astype(np.float16).reshape(20, 3)
    np.save(tmp_path / "a.npy", a)
    sh = NpyShards(tmp_path)
    native, f32 = sh.gather(["a.npy"] * 3, [4, 0, 19], None), sh.gather(["a.npy"] * 3, [4, 0, 19])
    assert native.dtype == np.float16 and f32.dtype == np.float32 and (native.astype(np.float32) == f32).all()
    assert sh.gather([], [], None).shape == (0, 0)
    sh.close()


def test_fp16_blocks_fill_the_gpu_search_like_fp32(tmp_path):
    """``concept_blocks(dtype=None)`` → the fp16 matrix ``GpuTopK`` takes (run here on the CPU device): the
    same ids and scores as the fp32 blocks."""
    from curation.assign import CONCEPT_COLUMNS, concept_blocks
    from curation.assign_gpu import GpuTopK
    from manifests.io import read_manifest

    _, X, _ = _make_run(tmp_path, 300, d=32, V=300, shards=1)
    concepts = read_manifest(tmp_path, "concepts", columns=CONCEPT_COLUMNS)
    out = []
    for dtype in (None, np.float32):
        _, blocks = concept_blocks(concepts, tmp_path, block_rows=7, dtype=dtype)
        blocks = list(blocks)
        assert blocks[0].dtype == (np.float16 if dtype is None else np.float32)
        out.append(GpuTopK(np.concatenate(blocks), 5, "cpu", concept_tile=128)(X.astype(np.float16)))
    assert (out[0][1] == out[1][1]).all() and (out[0][0] == out[1][0]).all()
