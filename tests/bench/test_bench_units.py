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


def test_sortedrl_bench_takes_each_steps_minimum_over_identical_rounds():
    """bench_sortedrl's estimator: rounds of one mode run the same steps, so each step's time is its minimum over
    the rounds (a pause lands on one step of one round); rounds that ran different schedules are refused."""
    import pytest

    from bench.bench_sortedrl import per_step_min
    from grpo.sortedrl import EngineRun, Entry, StepLog

    def run(times, running=(4, 4, 2), batch_ids=(0, 1)):
        r = EngineRun("partial", 4, steps=[StepLog(n, t, i == 2, 0, 10 * i, n) for i, (n, t) in
                                           enumerate(zip(running, times))])
        r.batches = [[Entry(i, 3) for i in batch_ids]]
        return r

    best = per_step_min([run([1.0, 5.0, 1.0]), run([4.0, 1.0, 2.0]), run([2.0, 2.0, 0.5])])
    assert [s.seconds for s in best.steps] == [1.0, 1.0, 0.5] and best.time_s == 2.5
    assert [s.running for s in best.steps] == [4, 4, 2]
    # the bubble of the minimum steps: (0·1 + 0·1 + 2·0.5) / (2.5 · 4)
    assert best.bubble_ratio == pytest.approx(0.1)
    with pytest.raises(RuntimeError, match="different schedules"):
        per_step_min([run([1, 1, 1]), run([1, 1, 1], running=(4, 3, 2))])
    with pytest.raises(RuntimeError, match="different batches"):
        per_step_min([run([1, 1, 1]), run([1, 1, 1], batch_ids=(0, 2))])
