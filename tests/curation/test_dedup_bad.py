"""`dedup` on vectors no cosine can be computed from, and on identical vectors in any number: a NaN, inf or
zero vector becomes a `bad_vector` row and touches no other row; one of a set of identical vectors stays,
however many there are, whatever `max_cluster_rows` is."""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from dedup_fixtures import embedded_run, unit  # noqa: E402
from test_dedup import planted_set  # noqa: E402

from manifests import read_manifest  # noqa: E402
from ovpipe.cli import main  # noqa: E402


def test_bad_vectors_get_their_status_and_identical_sets_keep_one(tmp_path):
    vectors, areas, truth = planted_set(n_groups=6, per_group=20, seed=4)
    n = len(vectors)
    bad = np.stack([np.full(vectors.shape[1], np.nan), np.zeros(vectors.shape[1]), vectors[0] * 0])
    bad[2, 3] = np.inf                                    # one infinite component
    same = np.repeat(unit(np.ones((1, vectors.shape[1]))), 130, 0)   # 130 identical vectors: > 2 × 50
    x = np.concatenate([vectors, bad, same]).astype(np.float32)
    # the bad rows first in keep order (the largest images), the identical set's largest in its middle
    area = np.r_[areas, [10**9] * 3, np.where(np.arange(130) == 64, 10**6, 100)]
    run = tmp_path / "run"
    ids = embedded_run(run, x, area, parts=2, bad=1)
    assert main(["dedup", "--run-dir", str(run), "--tasks", "2", "--quiet", "--set", "cluster_rows=100",
                 "--set", "max_cluster_rows=50", "--set", "block_rows=16", "--set", "report_pairs=0"]) == 0
    rows = read_manifest(run, "dedup").to_pylist()
    assert len(rows) == len(x) + 1 and len({r["sample_id"] for r in rows}) == len(rows)
    by = {r["sample_id"]: r for r in rows}
    for k in range(n, n + 3):
        r = by[ids[k]]
        assert r["status"] == "bad_vector" and r["error"] and r["duplicate_of"] is None, r
    assert not {r["duplicate_of"] for r in rows} & {ids[k] for k in range(n, n + 3)}
    assert all(np.isfinite(r["similarity"]) for r in rows if r["similarity"] is not None)
    group = [by[ids[k]] for k in range(n + 3, len(x))]
    kept = [r for r in group if r["status"] == "ok"]
    assert [r["sample_id"] for r in kept] == [ids[n + 3 + 64]]
    assert all(r["duplicate_of"] == ids[n + 3 + 64] and r["similarity"] == 1.0 for r in group if r is not kept[0])
    row_of = {s: k for k, s in enumerate(ids)}
    found = {frozenset((row_of[r["sample_id"]], row_of[r["duplicate_of"]])) for r in rows
             if r["status"] == "near_duplicate"}
    hit = len(found & {frozenset(p) for p in truth.items()})
    assert hit >= 0.9 * len(truth), (hit, len(truth))
    stats = (run / "dedup" / "stats.json").read_text()
    assert '"status/bad_vector": 3' in stats.replace(" ", "").replace('":', '": ')


def test_the_budget_changes_nothing_where_no_pair_crosses_a_split():
    """Distinct vectors (no two near) and 40 identical ones, at a budget of 16 rows: files of the hash pass
    and every cluster are split again; the distinct rows all stay, one of the 40, as with no budget."""
    from curation.dedup import DedupConfig, dedup_vectors

    rng = np.random.default_rng(0)
    x = np.concatenate([unit(rng.normal(size=(300, 16))), np.repeat(unit(rng.normal(size=(1, 16))), 40, 0)])
    x = x[rng.permutation(len(x))]
    area = np.full(len(x), 100)
    for m in (16, 10**6):
        _, dup_of, sim, removed = dedup_vectors(x, area, DedupConfig(cluster_rows=150, max_cluster_rows=m,
                                                                     report_eps=[0.05]))
        same = np.flatnonzero((x == x[np.argmax((x[:, None] == x[None]).all(-1).sum(1))]).all(1))
        assert len(same) == 40 and (dup_of[same] < 0).sum() == 1, m
        assert (dup_of >= 0).sum() == 39 and set(dup_of[dup_of >= 0].tolist()) == {int(same[0])}, m
        assert removed[0.95] == 39 and np.all(sim[dup_of >= 0] == 1.0)
