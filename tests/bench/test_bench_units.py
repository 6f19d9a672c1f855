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
