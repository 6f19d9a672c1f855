"""The ``index`` step over given vectors: the same bytes at 1 and 3 tasks, a row's nearest neighbour is itself
(or its planted twin), every ``image_embeddings`` row gets a map row, and a bad config fails naming its field."""
from __future__ import annotations

import numpy as np
import pytest

from tests.curation.dedup_fixtures import embedded_run, unit


def _vectors(n=1200, d=64, seed=0):
    rng = np.random.default_rng(seed)
    centres = unit(rng.standard_normal((12, d)))
    return unit(centres[rng.integers(0, 12, n)] + 0.4 * rng.standard_normal((n, d)))


def _files(step_dir):
    return {p.relative_to(step_dir).as_posix(): p.read_bytes() for p in sorted(step_dir.rglob("*"))
            if p.is_file() and p.parts[-2] in ("data", "reduced")}


@pytest.mark.parametrize("kind", ["flat", "ivfpq"])
def test_index_bytes_at_1_and_3_tasks_and_twins_are_neighbours(tmp_path, kind):
    import faiss

    from manifests.io import read_manifest
    from ovpipe.cli import main

    x = _vectors()
    x[7] = unit(x[3:4] + 0.01 * np.random.default_rng(1).standard_normal((1, x.shape[1])))[0]   # 7 is 3's twin
    got = {}
    for tasks in (1, 3):
        run = tmp_path / f"t{tasks}"
        ids = embedded_run(run, x, parts=3, bad=5)
        assert main(["index", "--run-dir", str(run), "--tasks", str(tasks), "--set", f"kind={kind}",
                     "--set", "nlist=8", "--set", "pq_bytes=16", "--set", "map_rows=500", "--quiet"]) == 0
        got[tasks] = _files(run / "index"), read_manifest(run, "embedding_map")
    assert got[1][0] == got[3][0] and got[1][1].equals(got[3][1])
    got = got[1][0]
    assert {"data/index.faiss", "data/ids.npy", "reduced/xy.npy"} <= set(got)

    index = faiss.read_index(str(run / "index" / "data" / "index.faiss"))
    order = np.load(run / "index" / "data" / "ids.npy")
    _, nn = index.search(x[[3, 7]], 2)
    pos = {f"{u:016x}": p for p, u in enumerate(order.tolist())}
    assert set(nn[0]) == set(nn[1]) == {pos[ids[3]], pos[ids[7]]}
    m = read_manifest(run, "embedding_map").to_pydict()
    ok = np.array(m["status"]) == "ok"
    x_ok = np.array([v is not None for v in m["x"]])
    assert len(ok) == len(x) + 5 and (x_ok == ok).all()
    assert 300 < sum(m["in_map"]) < 700 and not np.array(m["in_map"])[~ok].any()


@pytest.mark.parametrize("field,value", [("kind", "hnsw"), ("spread", 2.0), ("nprobe", 0)])
def test_bad_config_names_its_field(field, value):
    from curation.index import IndexConfig

    with pytest.raises(ValueError, match=field):
        IndexConfig(**{field: value})


def test_nan_and_zero_vectors_are_bad_vectors_not_indexed(tmp_path):
    """An ``ok`` row whose vector is NaN or all zeros has no cosine: ``bad_vector`` in ``embedding_map`` (no place,
    not on the map, no index position), as ``align`` and ``dedup`` mark it — never ``in_map`` with null
    coordinates, nor a "more like this" at cosine 0. The same bytes at 1 and 2 tasks."""
    from manifests.io import read_manifest
    from ovpipe.cli import main

    x = _vectors(n=400)
    x[5] = np.nan
    x[9] = 0.0
    got = {}
    for tasks in (1, 2):
        run = tmp_path / f"t{tasks}"
        ids = embedded_run(run, x, parts=2)
        assert main(["index", "--run-dir", str(run), "--tasks", str(tasks), "--set", "kind=flat", "--set", "nlist=4",
                     "--set", "map_rows=1000", "--quiet"]) == 0
        got[tasks] = _files(run / "index"), read_manifest(run, "embedding_map")
    assert got[1][0] == got[2][0] and got[1][1].equals(got[2][1])
    m = {r["sample_id"]: r for r in got[1][1].to_pylist()}
    for k in (5, 9):
        r = m[ids[k]]
        assert (r["status"], r["position"], r["x"], r["in_map"]) == ("bad_vector", -1, None, False), r
    good = [r for r in m.values() if r["status"] == "ok"]
    assert len(good) == 398 and all(r["x"] is not None and r["position"] >= 0 for r in good)
    indexed = np.load(run / "index" / "data" / "ids.npy")
    assert len(indexed) == 398 and int(ids[5], 16) not in indexed.tolist()
    assert sorted(r["position"] for r in good) == list(range(398))
