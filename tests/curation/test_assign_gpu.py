"""The GPU top-K (fp16 candidates, fp32 rescoring, certificate): the algorithm on the CPU, the ids on a GPU."""
import numpy as np
import pytest
import torch

torch.set_num_threads(2)


def _unit(rng, n, d, fp16=False):
    x = rng.standard_normal((n, d)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float16).astype(np.float32) if fp16 else x


def _check_exact(X, C, s, i, k):
    """ids are the fp32 top-k, except where two scores tie within float error; scores are the ids' scores."""
    full = X.astype(np.float64) @ C.T.astype(np.float64)
    ref = np.argsort(-full, axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(full, ref, 1)
    nxt = -np.sort(-full, axis=1)[:, k] if C.shape[0] > k else np.full(len(X), -np.inf)
    gaps = np.diff(np.c_[top, nxt], axis=1)
    ties = (np.abs(gaps) < 1e-6).any(1)
    assert (i[~ties] == ref[~ties]).all(), np.flatnonzero((i != ref).any(1) & ~ties)[:5]
    np.testing.assert_allclose(s, np.take_along_axis(full, i, 1), atol=1e-5)
    return ties.mean()


@pytest.mark.parametrize("layout", ["strided", "contiguous"])
@pytest.mark.parametrize("fp16_inputs", [True, False])
@pytest.mark.parametrize("V,tile", [(2000, 512), (1000, 65536), (77, 64), (20, 64)])
def test_certified_fp16_candidates_give_the_fp32_top_k(fp16_inputs, V, tile, layout):
    from curation.assign_gpu import GpuTopK, topk_tiles

    rng = np.random.default_rng(V)
    X, C = _unit(rng, 300, 48, fp16_inputs), _unit(rng, V, 48, fp16_inputs)
    search = GpuTopK(C, 10, "cpu", concept_tile=tile, layout=layout)
    assert search.keys_exact == fp16_inputs
    s, i = topk_tiles(search, X, image_tile=128)
    assert s.shape == i.shape == (300, min(10, V))
    assert (np.diff(s, axis=1) <= 0).all()
    _check_exact(X, C, s, i, min(10, V))


@pytest.mark.parametrize("layout", ["strided", "contiguous"])
def test_fp16_inputs_give_what_the_same_values_in_fp32_give(layout, monkeypatch):
    """Keys and queries handed over as fp16 arrays (the shards' dtype) are uploaded as fp16 and widened on
    the device: the same ids and scores, bit for bit, as their values in fp32; so are keys uploaded in
    several chunks."""
    import curation.assign_gpu as ag

    rng = np.random.default_rng(11)
    X, C = _unit(rng, 200, 40, True), _unit(rng, 1500, 40, True)
    ref = ag.topk_tiles(ag.GpuTopK(C, 10, "cpu", concept_tile=256, layout=layout), X, 64)
    monkeypatch.setattr(ag, "UPLOAD_ROWS", 128)
    for keys, queries in [(C.astype(np.float16), X.astype(np.float16)), (C.astype(np.float16), X),
                          (C, X.astype(np.float16)), (C, X)]:
        search = ag.GpuTopK(keys, 10, "cpu", concept_tile=256, layout=layout)
        assert search.keys_exact and search.kx is search.k16
        s, i = ag.topk_tiles(search, queries, 64)
        np.testing.assert_array_equal(i, ref[1])
        np.testing.assert_array_equal(s, ref[0])
    _check_exact(X, C, *ref, 10)


def test_keys_uploaded_in_chunks_keep_an_fp32_copy_only_when_they_need_one(monkeypatch):
    """Keys that are not fp16 numbers, first met in a later chunk: rescoring still reads their fp32
    values (earlier chunks included), so the result is the single-chunk one."""
    import curation.assign_gpu as ag

    rng = np.random.default_rng(12)
    X = _unit(rng, 100, 32)
    C = np.concatenate([_unit(rng, 300, 32, True), _unit(rng, 500, 32)])   # inexact from row 300 on
    ref = ag.topk_tiles(ag.GpuTopK(C, 10, "cpu", concept_tile=128), X, 50)
    monkeypatch.setattr(ag, "UPLOAD_ROWS", 128)
    search = ag.GpuTopK(C, 10, "cpu", concept_tile=128)
    assert not search.keys_exact and search.kx.dtype == torch.float32
    np.testing.assert_array_equal(search.kx.numpy(), C)
    assert search.k16.shape[0] % ag.GROUP == 0 and not search.k16[len(C):].any()
    s, i = ag.topk_tiles(search, X, 50)
    np.testing.assert_array_equal(i, ref[1])
    np.testing.assert_array_equal(s, ref[0])
    _check_exact(X, C, s, i, 10)


def test_the_fp32_recompute_never_returns_a_padding_row():
    """Every score negative: the zero rows that pad the fp16 keys to a multiple of GROUP would beat them."""
    from curation.assign_gpu import GpuTopK

    rng = np.random.default_rng(13)
    C = np.abs(_unit(rng, 70, 16, True))                  # 70 keys: 58 padding rows
    search = GpuTopK(C, 10, "cpu", concept_tile=64)
    Q = torch.from_numpy(-np.abs(_unit(rng, 5, 16)))
    s, i = search.exact(Q)
    assert (i < 70).all() and (s < 0).all()
    full = Q.numpy().astype(np.float64) @ C.T.astype(np.float64)
    np.testing.assert_array_equal(i, np.argsort(-full, axis=1, kind="stable")[:, :10])


def test_a_crowd_at_the_cut_is_recomputed_in_fp32():
    """Keys that differ by less than fp16 can tell apart: the fp16 candidates cannot vouch for the
    order, the certificate fails and the rows are recomputed exactly."""
    from curation.assign_gpu import GpuTopK

    rng = np.random.default_rng(3)
    base = _unit(rng, 1, 64)[0]
    crowd = [base + 1e-5 * rng.standard_normal(64).astype(np.float32) for _ in range(200)]
    C = np.stack(crowd + list(_unit(rng, 300, 64)))
    X = np.stack([base, -base, _unit(rng, 1, 64)[0]]).astype(np.float32)
    search = GpuTopK(C, 10, "cpu", concept_tile=128)
    Q, out, _ = search.submit(X)
    assert out.numpy()[0, 20] == 0          # row 0: not certified by the fp16 pass
    s, i = search.result((Q, out, None))
    full = X.astype(np.float64) @ C.T.astype(np.float64)
    np.testing.assert_array_equal(i[0], np.argsort(-full[0], kind="stable")[:10])
    _check_exact(X[1:], C, s[1:], i[1:], 10)
    X16 = X.astype(np.float16)                        # fp16 queries: recomputed too, as their fp32 values
    s16, i16 = GpuTopK(C, 10, "cpu", concept_tile=128)(X16)
    s32, i32 = GpuTopK(C, 10, "cpu", concept_tile=128)(X16.astype(np.float32))
    np.testing.assert_array_equal(i16, i32)
    np.testing.assert_array_equal(s16, s32)


def test_searcher_pipelines_batches_on_cpu_too():
    from curation.assign import AssignConfig, Searcher

    rng = np.random.default_rng(0)
    X, C = _unit(rng, 50, 16), _unit(rng, 300, 16)
    search = Searcher(C, AssignConfig(k=5, image_tile=16), "cpu")
    h1, h2 = search.submit(X[:25]), search.submit(X[25:])
    s = np.concatenate([search.result(h1)[0], search.result(h2)[0]])
    np.testing.assert_allclose(s, -np.sort(-(X @ C.T), axis=1)[:, :5], atol=1e-5)


def test_auto_backend_does_not_leave_a_gpu_to_faiss_cpu():
    from curation.assign import resolve_backend

    faiss = pytest.importorskip("faiss")
    want = "faiss" if hasattr(faiss, "StandardGpuResources") else "torch"
    assert resolve_backend("auto", "cuda") == want
    assert resolve_backend("auto", "cpu") == "faiss"


@pytest.mark.gpu
def test_gpu_assign_returns_the_cpu_ids():
    from curation.assign import AssignConfig, Searcher, topk_torch

    rng = np.random.default_rng(0)
    X, C = _unit(rng, 3000, 256, True), _unit(rng, 20000, 256, True)   # fp16 numbers, as the shards hold
    cfg = AssignConfig(k=10, backend="torch", image_tile=1024, concept_tile=4096)
    s_cpu, i_cpu = topk_torch(X, C, 10, image_tile=1024, concept_tile=4096, device="cpu")
    s_gpu, i_gpu = Searcher(C, cfg, "cuda")(X[:1024])
    s_all, i_all = topk_torch(X, C, 10, image_tile=1024, concept_tile=4096, device="cuda")
    assert (i_all[:1024] == i_gpu).all()
    assert (i_all == i_cpu).mean() >= 0.99998
    np.testing.assert_allclose(s_all, s_cpu, atol=1e-5)
    _check_exact(X, C, s_all, i_all, 10)


@pytest.mark.gpu
def test_gpu_fp16_inputs_and_chunked_upload_match_fp32_inputs(monkeypatch):
    import curation.assign_gpu as ag

    rng = np.random.default_rng(1)
    X, C = _unit(rng, 5000, 128, True), _unit(rng, 30000, 128, True)
    s32, i32 = ag.topk_tiles(ag.GpuTopK(C, 10, "cuda", 8192), X, 2048)
    monkeypatch.setattr(ag, "UPLOAD_ROWS", 4096)
    search = ag.GpuTopK(C.astype(np.float16), 10, "cuda", 8192)
    assert search.keys_exact
    s16, i16 = ag.topk_tiles(search, X.astype(np.float16), 2048)
    np.testing.assert_array_equal(i16, i32)
    np.testing.assert_array_equal(s16, s32)
    inexact = _unit(rng, 30000, 128)
    search = ag.GpuTopK(inexact, 10, "cuda", 8192)
    assert not search.keys_exact and torch.equal(search.kx.cpu(), torch.from_numpy(inexact))
    _check_exact(X[:500], inexact, *ag.topk_tiles(search, X[:500], 256), 10)
