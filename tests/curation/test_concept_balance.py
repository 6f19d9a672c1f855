import numpy as np
import pyarrow as pa
import pytest

from curation.concept_balance import BalanceConfig, balance, inverse_frequency_weights, metaclip_probs, solve_t, uniform_draws
from manifests import read_manifest
from manifests.io import write_part
from ovpipe.cli import main


def test_metaclip_formula_by_hand():
    # counts: concept 0 → 4 images, concept 1 → 1 image, concept 2 → 2 images; t = 2
    concepts = np.array([[0, 1], [0, 2], [0, 2], [0, 0]])
    counts = np.bincount(concepts.ravel(), minlength=3)
    assert counts.tolist() == [5, 1, 2]
    p = metaclip_probs(concepts, counts, t=2.0)
    p0, p1, p2 = 2 / 5, 1.0, 1.0
    assert np.allclose(p, [1 - (1 - p0) * (1 - p1), 1 - (1 - p0) * (1 - p2), 1 - (1 - p0) * (1 - p2),
                           1 - (1 - p0) ** 2])


def test_inverse_frequency_formula_by_hand():
    concepts = np.array([[0, 1], [0, 0]])
    counts = np.array([3, 1])
    w = inverse_frequency_weights(concepts, counts, alpha=1.0)
    assert np.allclose(w, [(1 / 3 + 1) / 2, 1 / 3])
    w2 = inverse_frequency_weights(concepts, counts, alpha=0.5)
    assert np.allclose(w2, [(3 ** -0.5 + 1) / 2, 3 ** -0.5])


def test_solve_t_hits_target():
    rng = np.random.default_rng(0)
    concepts = rng.zipf(1.5, size=(5000, 3)) % 400
    counts = np.bincount(concepts.ravel(), minlength=400)
    t = solve_t(concepts, counts, 1500)
    assert abs(metaclip_probs(concepts, counts, t).sum() - 1500) < 1.0


@pytest.mark.parametrize("method", ["inverse_frequency", "metaclip"])
@pytest.mark.parametrize("replacement", [True, False])
def test_balance_lifts_tail_and_hits_target(method, replacement):
    rng = np.random.default_rng(1)
    n, V = 20000, 300
    p = 1 / np.arange(1, V + 1) ** 1.2
    concepts = rng.choice(V, size=(n, 3), p=p / p.sum())
    ids = pa.array([f"{i:016x}" for i in range(n)])
    cfg = BalanceConfig(method=method, replacement=replacement, target_size=8000, seed=3)
    w, copies, before, after, _ = balance(concepts, uniform_draws(ids, 3), V, cfg)
    assert abs(copies.sum() - 8000) < 400
    def entropy(c):
        q = c[c > 0] / c.sum()
        return -(q * np.log(q)).sum()
    assert entropy(after) > entropy(before)
    assert before.sum() == 3 * n


def _assignments(run, n=600, V=50, parts=3, seed=0):
    rng = np.random.default_rng(seed)
    p = 1 / np.arange(1, V + 1) ** 1.3
    c = rng.choice(V, size=(n, 4), p=p / p.sum()).astype(np.int32)
    ids = [f"{x:016x}" for x in rng.integers(0, 2 ** 63, n)]
    bounds = [(a[0], a[-1] + 1) for a in np.array_split(np.arange(n), parts)]
    for k, (lo, hi) in enumerate(bounds):
        write_part({"sample_id": ids[lo:hi], "concept_ids": [list(r) for r in c[lo:hi]],
                    "scores": [[0.5] * 4 for _ in range(lo, hi)]},
                   run / "assign" / "assignments" / f"part-{k:05d}.parquet", "assignments")
    write_part({"concept_id": np.arange(V, dtype=np.int32), "text": [f"c{i}" for i in range(V)],
                "file": ["x"] * V, "row": np.arange(V, dtype=np.int32)},
               run / "embed-concepts" / "concepts" / "part-00000.parquet", "concepts")


def test_balance_step_is_task_count_invariant_and_counts_match_duckdb(tmp_path):
    from manifests.catalog import connect

    a, b = tmp_path / "a", tmp_path / "b"
    _assignments(a)
    _assignments(b)
    assert main(["balance", "--run-dir", str(a), "--tasks", "1", "--quiet"]) == 0
    assert main(["balance", "--run-dir", str(b), "--tasks", "3", "--workers", "2", "--quiet"]) == 0
    assert read_manifest(a, "balanced").equals(read_manifest(b, "balanced"))
    assert read_manifest(a, "concept_counts").equals(read_manifest(b, "concept_counts"))
    con = connect(a)
    diff = con.execute("""
        WITH g AS (SELECT c AS concept_id, count(*) AS n FROM (SELECT unnest(concept_ids) AS c FROM assignments) GROUP BY 1),
             a AS (SELECT c AS concept_id, sum(copies) AS n FROM
                   (SELECT unnest(concept_ids) AS c, copies FROM assignments JOIN balanced USING (sample_id)) GROUP BY 1)
        SELECT count(*) FROM concept_counts k LEFT JOIN g USING (concept_id) LEFT JOIN a USING (concept_id)
        WHERE k.count_before != coalesce(g.n, 0) OR k.count_after != coalesce(a.n, 0)""").fetchone()[0]
    assert diff == 0
