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
