"""`dedup`: semantic near-duplicates by k-means + cosine inside clusters, the keep rule, byte-identical
output at any task count, and `balance` skipping what it marks."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from dedup_fixtures import embedded_run, unit  # noqa: E402

from curation.dedup import DedupConfig, greedy_keep  # noqa: E402
from manifests import read_manifest  # noqa: E402
from manifests.io import write_part, write_table  # noqa: E402
from ovpipe.cli import main  # noqa: E402


def test_greedy_keep_compares_with_kept_rows_only_and_picks_the_closest():
    # rows in keep order: 1 ≈ 0, 2 ≈ 1 but not 0 (a chain), 3 ≈ 0 and ≈ 2 (closer to 2, which is kept)
    i = np.array([0, 1, 0, 2])
    j = np.array([1, 2, 3, 3])
    s = np.array([0.99, 0.98, 0.97, 0.995], np.float32)
    dup_of, sim = greedy_keep(4, i, j, s, 0.95)
    assert dup_of.tolist() == [-1, 0, -1, 2]          # 2 is kept: its only neighbour above the cut (1) was removed
    assert sim[1] == np.float32(0.99) and sim[3] == np.float32(0.995) and np.isnan(sim[[0, 2]]).all()
    assert greedy_keep(4, i, j, s, 0.985)[0].tolist() == [-1, 0, -1, 2]
    assert greedy_keep(4, i, j, s, 0.999)[0].tolist() == [-1, -1, -1, -1]


def planted_set(n_groups=30, per_group=24, d=48, seed=0):
    """Groups of distinct near-neighbours (pairwise cosine ≈ 0.85–0.92: the same kind of picture), and
    planted copies of a third of the rows at cosine ≈ 0.97–0.995 (what resizing, recompression or a small
    crop leave of a CLIP vector). A copy is smaller (a resize or crop) or, a recompression, as large."""
    rng = np.random.default_rng(seed)
    centres = unit(rng.normal(size=(n_groups, d)))
    members = unit(np.repeat(centres, per_group, 0) * 2.6 + rng.normal(size=(n_groups * per_group, d)) * 0.17)
    n = len(members)
    src = rng.choice(n, n // 3, replace=False)
    noise = rng.normal(size=(len(src), d))
    noise -= (noise * members[src]).sum(1, keepdims=True) * members[src]          # orthogonal to the original
    noise = unit(noise)
    cos = rng.uniform(0.97, 0.995, len(src))[:, None]
    copies = members[src] * cos + noise * np.sqrt(1 - cos ** 2)
    vectors = np.concatenate([members, copies]).astype(np.float32)
    areas = np.r_[np.full(n, 10_000), np.where(np.arange(len(src)) % 3 == 0, 10_000, 2_500)]
    truth = {n + k: int(o) for k, o in enumerate(src)}                # copy row → original row
    return vectors, areas, truth


def _merged_bytes(run: Path, tmp: Path, kind: str = "dedup") -> bytes:
    out = tmp / f"{run.name}-{kind}.parquet"
    write_table(read_manifest(run, kind), out)
    return out.read_bytes()


def test_planted_near_duplicates_found_with_precision_and_recall_above_095(tmp_path):
    vectors, areas, truth = planted_set()
    run = tmp_path / "run"
    ids = embedded_run(run, vectors, areas, parts=2, bad=2)
    assert main(["dedup", "--run-dir", str(run), "--tasks", "2", "--quiet", "--set", "cluster_rows=120",
                 "--set", "eps=0.05", "--set", "report_pairs=0"]) == 0
    rows = read_manifest(run, "dedup").to_pylist()
    assert len(rows) == len(vectors) + 2 and sum(r["status"] == "decode_error" for r in rows) == 2
    row_of = {s: k for k, s in enumerate(ids)}
    found = {row_of[r["sample_id"]]: row_of[r["duplicate_of"]] for r in rows if r["status"] == "near_duplicate"}
    pairs = {frozenset(p) for p in truth.items()}
    hit = sum(frozenset(p) in pairs for p in found.items())
    precision, recall = hit / len(found), hit / len(truth)
    print(f"near_duplicate: precision {precision:.3f}, recall {recall:.3f} ({len(found)} marked, {len(truth)} planted)")
    assert precision >= 0.95 and recall >= 0.95
    # the keep rule: the larger image stays; at equal size the lower sample_id
    for dup, kept in found.items():
        if frozenset((dup, kept)) in pairs:
            assert (areas[kept], -kept) > (areas[dup], -dup), (dup, kept)
    sims = [r["similarity"] for r in rows if r["status"] == "near_duplicate"]
    assert min(sims) > 0.95 and all(r["similarity"] is None for r in rows if r["status"] != "near_duplicate")
    report = (run / "dedup" / "report.md").read_text()
    assert f"| 0.05 (the step's) | 0.95 | {len(found)} |" in report


def test_same_bytes_at_1_2_4_tasks_and_a_cluster_split_again(tmp_path):
    vectors, areas, truth = planted_set(n_groups=12, per_group=20, seed=1)
    out = []
    for tasks in (1, 2, 4):
        run = tmp_path / f"t{tasks}"
        embedded_run(run, vectors, areas, parts=3, bad=1)
        # max_cluster_rows below the mean cluster: every cluster is split again by k-means
        assert main(["dedup", "--run-dir", str(run), "--tasks", str(tasks), "--quiet",
                     "--set", "cluster_rows=100", "--set", "max_cluster_rows=60", "--set", "report_pairs=0"]) == 0
        out.append(_merged_bytes(run, tmp_path))
    assert out[0] == out[1] == out[2]
    rows = read_manifest(tmp_path / "t1", "dedup").to_pylist()
    assert sum(r["status"] == "near_duplicate" for r in rows) >= 0.9 * len(truth)


def test_bad_config_fails_naming_the_field():
    with pytest.raises(ValueError, match="eps"):
        DedupConfig(eps=0)
    with pytest.raises(ValueError, match="report_eps"):
        DedupConfig(report_eps=[1.5])
    with pytest.raises(ValueError, match="cluster_rows"):
        DedupConfig(cluster_rows=0)


def test_balance_skips_near_duplicates_and_bad_vectors_through_its_declared_input(tmp_path):
    vectors, areas, truth = planted_set(n_groups=8, per_group=15, seed=2)
    vectors[3] = np.nan                                          # its concepts were assigned from a NaN vector
    run = tmp_path / "run"
    ids = embedded_run(run, vectors, areas, parts=2)
    assert main(["dedup", "--run-dir", str(run), "--quiet", "--set", "cluster_rows=60", "--set", "report_pairs=0"]) == 0
    rng = np.random.default_rng(0)
    concepts = rng.integers(0, 20, size=(len(ids), 3)).astype(np.int32)
    write_part({"sample_id": ids, "concept_ids": [list(c) for c in concepts], "scores": [[0.5] * 3] * len(ids)},
               run / "assign" / "assignments" / "part-00000.parquet", "assignments")
    write_part({"concept_id": np.arange(20, dtype=np.int32), "text": [f"c{i}" for i in range(20)],
                "file": ["x"] * 20, "row": np.arange(20, dtype=np.int32)},
               run / "embed-concepts" / "concepts" / "part-00000.parquet", "concepts")
    outs = []
    for tasks in (1, 3):
        assert main(["balance", "--name", f"balance-{tasks}", "--run-dir", str(run), "--tasks", str(tasks), "--quiet",
                     "--set", "dedup_step=dedup"]) == 0
        outs.append((read_manifest(run, "balanced", step=f"balance-{tasks}"),
                     read_manifest(run, "concept_counts", step=f"balance-{tasks}")))
    assert outs[0][0].equals(outs[1][0]) and outs[0][1].equals(outs[1][1])
    status = {r["sample_id"]: r["status"] for r in read_manifest(run, "dedup").to_pylist()}
    dup = {s for s, v in status.items() if v in ("near_duplicate", "bad_vector")}
    assert "near_duplicate" in status.values() and list(status.values()).count("bad_vector") == 1
    bal = outs[0][0].to_pylist()
    assert len(bal) == len(ids)                                  # every row is there; the skipped get no copy
    assert all(r["copies"] == 0 and r["weight"] == 0 for r in bal if r["sample_id"] in dup)
    kept = np.array([s not in dup for s in ids])
    before = np.bincount(concepts[kept].ravel(), minlength=20)
    assert outs[0][1].column("count_before").to_pylist() == before.tolist()
    assert sum(r["copies"] for r in bal) == pytest.approx(kept.sum(), abs=0.1 * kept.sum())


@pytest.mark.parametrize("block_rows", [7, 64, 1000])
def test_block_keep_equals_the_greedy_keep_over_every_pair(block_rows):
    from curation.dedup import keep_blocks, similar_pairs

    rng = np.random.default_rng(block_rows)
    base = unit(rng.normal(size=(40, 16)))
    x = unit(np.repeat(base, 6, 0) + rng.normal(size=(240, 16)) * rng.uniform(0.01, 0.12, (240, 1)))
    thresholds = [0.99, 0.95, 0.9]
    got = keep_blocks(x, thresholds, block_rows)
    i, j, s = similar_pairs(x, 0.9, block_rows)
    for t in thresholds:
        want_d, want_s = greedy_keep(len(x), i, j, s, t)
        assert (want_d >= 0).sum() > 10
        assert got[t][0].tolist() == want_d.tolist()
        assert np.array_equal(got[t][1], want_s, equal_nan=True)


def closest_call(x: np.ndarray, dup_of: np.ndarray, t: float) -> float:
    """How near the keep of ``x`` at threshold ``t`` came to another outcome, in exact (float64) cosines: over
    the rows, the least of |best − t| and, where the best kept earlier row is above ``t``, its lead over the
    second best. A computation whose cosines are each within half of this of the exact ones keeps the same rows."""
    S = x.astype(np.float64) @ x.astype(np.float64).T
    least = np.inf
    for j in range(1, len(x)):
        v = np.sort(S[j, np.flatnonzero(dup_of[:j] == -1)])[::-1]
        if len(v):
            least = min(least, abs(v[0] - t), v[0] - v[1] if v[0] > t and len(v) > 1 else np.inf)
    return float(least)


def fp32_cosine_error(d: int) -> float:
    """The bound on an fp32 dot product of two unit vectors of ``d`` fp32 numbers, in any summation order:
    γ_d = d·u/(1 − d·u), u = 2⁻²⁴ (Higham, Accuracy and Stability of Numerical Algorithms, §3.1). The inputs are
    the same fp32 numbers on both devices (the step widens its fp16 shards to fp32, which is exact), so the
    CPU and GPU cosines differ by at most 2·γ_d, and only in their summation order."""
    u = 2.0 ** -24
    return d * u / (1 - d * u)


@pytest.mark.gpu
def test_on_the_gpu_the_same_keep_and_the_planted_pairs_found():
    """k-means on the GPU (faiss, where it has GPUs) and the cosines in torch on CUDA: the block keep equals the
    CPU's row for row, and the whole computation finds the planted pairs. No tolerance: each device's cosine is
    within γ_48 = 2.9e-6 of the exact one (``fp32_cosine_error``; full fp32 matmuls, torch's default — TF32 would
    round inputs to 2⁻¹¹ and allow ~1e-3), and the fixture's closest call is ~0.014 (checked here), so a
    disagreement in any row is a bug, not rounding."""
    import torch

    from curation.dedup import dedup_vectors, keep_blocks

    vectors, areas, truth = planted_set()
    x = unit(vectors)
    cpu_d, cpu_s = keep_blocks(x, [0.95], 64, "cpu")[0.95]
    assert (cpu_d >= 0).sum() == len(truth)           # every planted copy is a duplicate: the rows compared matter
    assert closest_call(x, cpu_d, 0.95) > 2 * fp32_cosine_error(x.shape[1])
    assert torch.cuda.is_available() and torch.get_float32_matmul_precision() == "highest"
    gpu_d, gpu_s = keep_blocks(x, [0.95], 64, "cuda")[0.95]
    assert np.array_equal(cpu_d, gpu_d)
    assert np.allclose(cpu_s, gpu_s, rtol=0, atol=2 * fp32_cosine_error(x.shape[1]), equal_nan=True)
    _, dup_of, _, _ = dedup_vectors(x, areas, DedupConfig(cluster_rows=120), device="cuda")
    found = {frozenset((int(j), int(dup_of[j]))) for j in np.flatnonzero(dup_of >= 0)}
    pairs = {frozenset(p) for p in truth.items()}
    assert len(found & pairs) >= 0.95 * len(pairs) and len(found & pairs) >= 0.95 * len(found)
