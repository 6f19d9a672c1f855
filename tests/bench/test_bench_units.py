"""The benchmarks' peak-memory figures are in the unit their tables print. ``ovpipe.mapreduce.vmhwm_bytes`` returns
bytes; a caller that divides by 2**20 and prints GiB reports 1024 times the peak (as the packing bench once did:
"345.13 GiB" on a 24 GiB machine)."""
from __future__ import annotations

import resource


def test_packing_bench_peak_is_in_gib(tmp_path):
    from bench.bench_packing import demo_like, ours

    got = ours(demo_like(2_000), 1024, tmp_path)["peak_rss_gib"]
    # every child this process has waited for, the bench's spawned packer among them: ru_maxrss in KiB
    children_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2 ** 20
    assert 0.01 < got <= children_gib, (got, children_gib)    # a Python with numpy and pyarrow: > 10 MiB


def test_layout_quality_is_whole_where_the_map_is_the_space_and_chance_where_it_is_shuffled():
    import numpy as np

    from bench.bench_layout import quality

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3000, 2))
    x /= np.linalg.norm(x, axis=1, keepdims=True)              # on the circle, cosine order = map distance order
    label = (np.arctan2(x[:, 1], x[:, 0]) // 0.5).astype(int)
    same = quality(x, label, x.astype(np.float32))
    assert same["knn_kept"] > 0.999 and abs(same["same_centre_map"] - same["same_centre_1024"]) < 1e-3
    assert same["global_rho"] > 0.99
    shuffled = quality(x, label, x[rng.permutation(len(x))].astype(np.float32))
    assert shuffled["knn_kept"] < 0.02 and abs(shuffled["global_rho"]) < 0.1
