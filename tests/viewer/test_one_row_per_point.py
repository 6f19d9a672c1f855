"""SQL over a run cannot double-count: every view carries the step folder of its rows, a per-sample view is
keyed by (folder, sample_id) with ingest's repeated copies in ``sample_duplicates``, and the map's colours
are one entry per point — on the demo corpus, whose ingest marks a repeated sample ``duplicate``."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from manifests.catalog import run_report, run_sql
from manifests.io import read_manifest, write_part


def _step(run, folder, step):
    d = run / folder
    (d / "completions").mkdir(parents=True, exist_ok=True)
    (d / "completions" / "finalized").touch()
    (d / "executor.json").write_text(json.dumps({"step": step, "tasks": 1, "config_hash": "0" * 16, "inputs": {}}))
    return d


@pytest.fixture(scope="module")
def curated_run(ingested_run, tmp_path_factory):
    """The demo ingest, and downstream manifests as embed → dedup / align / index leave them: one row per
    samples row (the repeated copy's row too, with the same id and status ``duplicate``, as embed-images writes)."""
    run = tmp_path_factory.mktemp("keys") / "run"
    shutil.copytree(ingested_run / "ingest", run / "ingest")
    s = read_manifest(run, "samples", columns=["sample_id", "status", "source"]).to_pylist()
    assert sum(r["status"] == "duplicate" for r in s) == 1              # the demo's repeated sample
    ids, status = [r["sample_id"] for r in s], [r["status"] if r["status"] in ("ok", "duplicate") else "skipped"
                                                for r in s]
    n = len(s)
    write_part({"sample_id": ids, "file": [None] * n, "row": list(range(n)), "status": status, "error": [None] * n},
               _step(run, "embed-images", "embed-images") / "image_embeddings" / "part-00000.parquet",
               "image_embeddings")
    write_part({"sample_id": ids, "cluster": [i % 3 for i in range(n)], "duplicate_of": [None] * n,
                "similarity": [0.5] * n, "status": status, "error": [None] * n},
               _step(run, "dedup", "dedup") / "dedup" / "part-00000.parquet", "dedup")
    write_part({"sample_id": ids, "source": [r["source"] for r in s], "text_kind": ["caption"] * n,
                "score": np.linspace(0, 1, n).tolist(), "threshold": [0.1] * n, "status": status, "error": [None] * n},
               _step(run, "align", "align") / "alignment" / "part-00000.parquet", "alignment")
    inm = [st != "skipped" for st in status]
    write_part({"sample_id": ids, "position": list(range(n)), "x": np.arange(n, dtype=float).tolist(),
                "y": np.zeros(n).tolist(), "cluster": [0] * n, "in_map": inm, "status": status},
               _step(run, "index", "index") / "embedding_map" / "part-00000.parquet", "embedding_map")
    shutil.copytree(run / "ingest", run / "ingest-again")                    # a second ingest folder of the same files
    return run


def _one(run, sql):
    return run_sql(run, sql).fetchall()[0][0]


def test_samples_join_dedup_counts_each_dedup_row_once(curated_run):
    run = curated_run
    # one ingest folder is read: the other is another step's copy of the same files
    q = "SELECT count(*) FROM (SELECT * FROM samples WHERE folder = 'ingest') JOIN dedup USING (sample_id)"
    assert _one(run, q) == _one(run, "SELECT count(*) FROM dedup")
    three = ("SELECT count(*) FROM (SELECT * FROM samples WHERE folder = 'ingest') s JOIN dedup d USING (sample_id) "
             "JOIN alignment a USING (sample_id)")
    assert _one(run, three) == _one(run, "SELECT count(DISTINCT sample_id) FROM alignment")
    assert _one(run, "SELECT count(*) FROM sample_duplicates") == 2               # one per ingest folder
    # the key of a per-sample view is (folder, sample_id)
    assert _one(run, "SELECT count(*) FROM (SELECT folder, sample_id FROM samples GROUP BY ALL HAVING count(*) > 1)") == 0
    assert _one(run, "SELECT count(DISTINCT folder) FROM samples") == 2


def test_every_view_names_the_step_folder_and_the_report_groups_by_it(curated_run):
    rows = run_sql(curated_run, "SELECT folder, count(*) FROM samples GROUP BY 1 ORDER BY 1").fetchall()
    assert [f for f, _ in rows] == ["ingest", "ingest-again"] and rows[0][1] == rows[1][1]
    assert run_sql(curated_run, "SELECT DISTINCT folder FROM dedup").fetchall() == [("dedup",)]
    report = dict((t, r.fetchall()) for t, r in run_report(curated_run))
    by_status = report["samples by status"]
    assert {r[0] for r in by_status} == {"ingest", "ingest-again"}
    assert ("ingest", "demo", "duplicate") in {r[:3] for r in by_status}     # the copies are still reported


def test_map_colours_are_one_entry_per_point(curated_run):
    from viewer.catalog import RunCatalog
    from viewer.similarity import colours, map_colours, map_layout

    cat = RunCatalog(curated_run)
    _, positions = map_layout(cat)
    n = len(positions)
    assert n == _one(curated_run, "SELECT count(*) FROM embedding_map WHERE in_map")
    for colour in colours(cat):
        body = map_colours(cat, colour)
        k = int.from_bytes(body[:4], "little")
        head = json.loads(body[4:4 + k])
        assert head["n"] == n and len(body) - 4 - k == n, colour            # one uint8 code a point


def test_rollouts_of_two_steps_are_two_rows_of_the_report(tmp_path):
    run = tmp_path / "run"
    for folder, n, backend in (("rollout", 4, "transformers"), ("rollout-vlm", 2, "vllm")):
        keys = [(p, i) for p in ("p0", "p1") for i in range(n)]
        write_part({"prompt_id": [p for p, _ in keys], "rollout_idx": [i for _, i in keys],
                    "prompt_type": ["answer_only"] * len(keys), "response": ["x"] * len(keys),
                    "tokens": [3] * len(keys), "backend": [backend] * len(keys), "model": ["m"] * len(keys),
                    "sampling": ["{}"] * len(keys)},
                   _step(run, folder, "rollout") / "rollouts" / "part-00000.parquet", "rollouts")
    rows = dict((t, r.fetchall()) for t, r in run_report(run))["rollouts per step"]
    assert [(r[0], r[3], r[4]) for r in rows] == [("rollout", 2, 8), ("rollout-vlm", 2, 4)]
