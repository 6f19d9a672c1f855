"""Properties of `dedup` over generated vectors (tests/fuzz/strategies.py: rows that are zero, NaN, ±inf,
subnormal, overflowing or exact repeats, among unit ones): every row comes out once with a status, a bad
vector touches no other row, a set of identical vectors keeps at most one row, a rerun gives the same bytes,
and no task dies — at a row budget (`max_cluster_rows`) small enough that clusters are split again."""
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from dedup_fixtures import embedded_run  # noqa: E402
from test_dedup import _merged_bytes  # noqa: E402

from tests.fuzz.strategies import vector_rows  # noqa: E402

ENGINE = {"cluster_rows": 1000, "max_cluster_rows": 12, "report_eps": [0.05]}   # one cluster, split again


def _embedded(drawn) -> np.ndarray:
    """The drawn rows as embed would have written the good ones: unit length (the bad ones as drawn)."""
    x, kinds = drawn
    x = x.astype(np.float64)
    good = np.array([k in ("normal", "dup") for k in kinds])
    with np.errstate(invalid="ignore", over="ignore"):
        x[good] /= np.linalg.norm(x[good], axis=1, keepdims=True)
    return x.astype(np.float32)


def _check(x: np.ndarray, cluster, dup_of, sim, bad) -> None:
    n = len(x)
    assert len(cluster) == len(dup_of) == len(sim) == n
    assert np.array_equal(cluster < 0, bad)
    kept = dup_of < 0
    assert kept[bad].all() and not np.isin(dup_of[~kept], np.flatnonzero(bad)).any()
    assert kept[dup_of[~kept]].all()                          # a duplicate points at a kept row
    assert np.isfinite(sim[~kept]).all() and (sim[~kept] > 0.95).all() and (sim[~kept] <= 1.0 + 1e-3).all()
    rows = {}
    for i in np.flatnonzero(~bad):
        rows.setdefault(x[i].tobytes(), []).append(i)
    for same in rows.values():                                # identical vectors: one kept at most, one target
        assert kept[same].sum() <= 1 and len({int(dup_of[i]) if dup_of[i] >= 0 else i for i in same}) == 1


@settings(max_examples=12)
@given(drawn=vector_rows(dim=8, max_rows=40), areas=st.lists(st.integers(1, 4), min_size=40, max_size=40))
def test_dedup_in_memory_any_vectors(drawn, areas):
    from curation.dedup import DedupConfig, bad_vectors, dedup_vectors

    x = _embedded(drawn)
    area = np.array(areas[:len(x)], np.int64)
    cfg = DedupConfig(**ENGINE)
    cluster, dup_of, sim, removed = dedup_vectors(x, area, cfg)
    _check(x, cluster, dup_of, sim, bad_vectors(x))
    assert removed[0.95] == (dup_of >= 0).sum()
    again = dedup_vectors(x, area, cfg)
    assert np.array_equal(again[1], dup_of) and np.array_equal(again[2], sim, equal_nan=True)


@pytest.mark.slow
@settings(max_examples=4)
@given(drawn=vector_rows(dim=8, min_rows=2, max_rows=40))
def test_dedup_step_any_vectors_every_row_once_same_bytes_at_1_and_3_tasks(drawn):
    from manifests import read_manifest
    from ovpipe.cli import main

    x = _embedded(drawn)
    args = ["--quiet", "--set", "report_pairs=0", *[f"--set={k}={v}" for k, v in ENGINE.items()]]
    with tempfile.TemporaryDirectory() as tmp:
        tmp, out = Path(tmp), []
        for tasks in (1, 3):
            run = tmp / f"t{tasks}"
            with np.errstate(over="ignore"):                    # stored as fp16: an overflowing row is inf
                ids = embedded_run(run, x, parts=2, bad=1)
            assert main(["dedup", "--run-dir", str(run), "--tasks", str(tasks), *args]) == 0
            out.append(_merged_bytes(run, tmp))
        assert out[0] == out[1]
        rows = read_manifest(tmp / "t1", "dedup").to_pylist()
        assert len(rows) == len(x) + 1 and {r["sample_id"] for r in rows} >= set(ids)
        assert all(r["status"] in ("ok", "near_duplicate", "bad_vector", "decode_error") for r in rows)
        status = {r["sample_id"]: r["status"] for r in rows}
        from curation.dedup import bad_vectors

        with np.errstate(over="ignore"):
            bad = bad_vectors(x.astype(np.float16))              # as stored
        assert [status[s] == "bad_vector" for s in ids] == bad.tolist()
