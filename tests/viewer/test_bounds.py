"""No viewer parameter makes a page do unbounded work: every number is bounded (a 400 naming the bound), ``/packs``
computes its figures in DuckDB and reads back only what it shows, and a lasso of huge numbers is refused (not a
500). The routes over the index (``/duplicates``' page, the map's background build) are tested in test_meaning.py,
beside the run they need."""
from __future__ import annotations

import json

import numpy as np
import pytest


@pytest.mark.parametrize("query,says", [
    ("dp=200000", "dp=200000: between 0 and 4096"),
    ("mb=1000", "mb=1000: between 0 and 64"),
    ("ga=99999999", "ga=99999999: between 0 and 4096"),
    ("at=1" + "0" * 30, "between 0 and"),
    ("dp=4096&mb=64&ga=64", "at most 16384 packs"),
])
def test_packs_layout_is_bounded(view_client, query, says):
    r = view_client.get(f"/packs?step=pack&{query}")
    assert r.status_code == 400 and says in r.text, (r.status_code, r.text[:300])


@pytest.fixture(scope="module")
def many_packs(tmp_path_factory):
    """A run with one pack step of 5,000 packs, lognormal costs, ids in a shuffled order across two parts."""
    from manifests.io import write_part

    run = tmp_path_factory.mktemp("many-packs") / "run"
    d = run / "pack"
    (d / "completions").mkdir(parents=True)
    (d / "completions" / "finalized").touch()
    (d / "executor.json").write_text(json.dumps({"step": "pack", "tasks": 2, "config_hash": "0" * 16, "inputs": {}}))
    (d / "config.json").write_text(json.dumps({"seq_len": 256}))
    n = 5000
    cost = np.random.default_rng(0).lognormal(0, 1, n)
    ids = np.random.default_rng(1).permutation(n)
    for part, sl in enumerate((ids[:2600], ids[2600:])):
        write_part({"pack_id": sl.tolist(), "sample_ids": [[f"{i:016x}"] for i in sl], "lengths": [[64]] * len(sl),
                    "offsets": [[0]] * len(sl), "total_tokens": [64] * len(sl), "shard": ["pack-000000.tar"] * len(sl),
                    "attn_sq": [4096] * len(sl), "images": [0] * len(sl), "vit_tokens": [0] * len(sl),
                    "vit_sq": [0] * len(sl), "cost": cost[sl].tolist()},
                   d / "packs" / f"part-{part:05d}.parquet", "packs")
    return run, cost


def test_packs_figures_come_from_duckdb_not_the_cost_column(many_packs, monkeypatch):
    """The page's straggler loss and one step's ranks are numpy's ``straggler_loss`` / ``step_rank`` over the
    costs, while no query hands Python more rows than the page shows (50 listed packs, one step of 24, 50 bins)."""
    from starlette.testclient import TestClient

    from packing.compute_balance import step_rank, straggler_loss
    from viewer import pages
    from viewer.app import create_app
    from viewer.catalog import RunCatalog

    run, cost = many_packs
    returned = []
    real = RunCatalog.rows

    def counted(self, sql, params=(), **kw):
        got = real(self, sql, params, **kw)
        returned.append(len(got))
        return got

    monkeypatch.setattr(RunCatalog, "rows", counted)
    client = TestClient(create_app(run), base_url="http://127.0.0.1")
    r = client.get("/packs?step=pack&dp=4&mb=2&ga=3&at=7")
    assert r.status_code == 200
    assert returned and max(returned) <= 51, returned
    d = pages.step_ranks(RunCatalog(run), "pack",
                         f"read_parquet('{(run / 'pack' / 'packs').as_posix()}/part-*.parquet')",
                         {"dp": 4, "mb": 2, "ga": 3, "at": 7})
    assert d["loss"] == pytest.approx(straggler_loss(cost, 4, 2, 3), rel=1e-9)
    assert f"{100 * d['loss']:.2f}%" in r.text
    _, rank_of = step_rank(len(cost), 4, 2, 3)
    want = {k: [p for p in range(7 * 24, 8 * 24) if rank_of[p] == k] for k in range(4)}
    assert {x["rank"]: x["packs"] for x in d["ranks"]} == want
    assert [x["cost"] for x in d["ranks"]] == pytest.approx([cost[want[k]].sum() for k in range(4)])


def test_a_lasso_of_huge_numbers_is_refused_not_a_server_error():
    from viewer import similarity as sim

    with pytest.raises(sim.QueryError, match="outside"):
        sim.region_sql(lasso="0,0;1e308,1;-1e308,2")
    # a near-flat edge: the slope is never written into the SQL, so no inf can reach it
    sql = sim.region_sql(lasso="0,0;1e6,1e-300;0,1")
    assert "inf" not in sql.lower() and "nan" not in sql.lower()


def test_step_ranks_follow_pack_id_order_when_ids_have_gaps(tmp_path):
    """Pack ids 0, 3, 6, …: a pack's stream position is its rank in pack_id order (the window in DuckDB), so the
    figures are the dense stream's."""
    from manifests.io import write_part
    from packing.compute_balance import straggler_loss
    from viewer import pages
    from viewer.catalog import RunCatalog

    n = 120
    cost = np.random.default_rng(2).lognormal(0, 0.5, n)
    d = tmp_path / "run" / "pack"
    ids = [3 * i for i in range(n)]
    write_part({"pack_id": ids, "sample_ids": [[f"{i:016x}"] for i in ids], "lengths": [[64]] * n,
                "offsets": [[0]] * n, "total_tokens": [64] * n, "shard": ["pack-000000.tar"] * n,
                "attn_sq": [4096] * n, "images": [0] * n, "vit_tokens": [0] * n, "vit_sq": [0] * n,
                "cost": cost.tolist()}, d / "packs" / "part-00000.parquet", "packs")
    src = f"read_parquet('{(d / 'packs').as_posix()}/part-*.parquet')"
    got = pages.step_ranks(RunCatalog(tmp_path / "run"), "pack", src, {"dp": 4, "mb": 1, "ga": 2, "at": 3})
    assert got["loss"] == pytest.approx(straggler_loss(cost, 4, 1, 2), rel=1e-9)
    assert [x["packs"] for x in got["ranks"]] == [[ids[24 + r], ids[28 + r]] for r in range(4)]


def test_packs_page_figure_covers_the_runs_epochs_of_the_balanced_stream(tmp_path):
    """ovpipe issue 67: 1,003 packs balanced for DP 4 × 2 (groups of 8, 3 left over), read by a stage for ~3 epochs.
    The page's straggler loss is the mean over the stage's steps of the balanced stream (every epoch's whole
    groups, the leftover carried) — as low as epoch 1's, far below pack_id order replayed — and a step of epoch 2
    shows the packs the stream reads there; ``consumed_by`` names the steps that read a leftover pack."""
    from manifests.io import write_part
    from packing.compute_balance import epoch_start, order, straggler_loss, stream_packs
    from viewer import pages
    from viewer.catalog import RunCatalog, consumed_by, pretrain_stages

    n, dp, ga, gbs, steps = 1003, 4, 2, 8, 380
    raw = np.random.default_rng(3).lognormal(0, 0.5, n)
    cost = raw[order(raw, dp, 1, ga)]
    run = tmp_path / "run"
    d = run / "pack"
    write_part({"pack_id": list(range(n)), "sample_ids": [[f"{i:016x}"] for i in range(n)], "lengths": [[64]] * n,
                "offsets": [[0]] * n, "total_tokens": [64] * n, "shard": ["pack-000000.tar"] * n,
                "attn_sq": [4096] * n, "images": [0] * n, "vit_tokens": [0] * n, "vit_sq": [0] * n,
                "cost": cost.tolist()}, d / "packs" / "part-00000.parquet", "packs")
    (d / "config.json").write_text(json.dumps({"seq_len": 256, "balance_dp": dp, "balance_grad_accum": ga}))
    (run / "pretrain" / "stage-1.5").mkdir(parents=True)
    (run / "pretrain" / "stage-1.5" / "stage.json").write_text(
        json.dumps({"stage": "1.5", "data": "pack", "global_batch": gbs, "steps": steps}))
    src = f"read_parquet('{(d / 'packs').as_posix()}/part-*.parquet')"
    at = int(epoch_start(1, n, gbs)) + 5                                   # epoch 2's sixth step
    got = pages.step_ranks(RunCatalog(run), "pack", src, {"dp": dp, "mb": 1, "ga": ga, "at": at})
    stream = stream_packs(n, gbs, 0, steps * gbs)
    rc = cost[stream].reshape(steps, ga, dp).sum(axis=1)                    # micro-batch k → rank k mod dp
    assert got["from_stages"] and got["steps"] == steps and got["epochs"] == pytest.approx(steps * gbs / n)
    assert got["loss"] == pytest.approx(float(np.mean(rc.max(axis=1) / rc.mean(axis=1) - 1)), rel=1e-9)
    replayed = straggler_loss(np.tile(cost, 4)[:steps * gbs], dp, 1, ga)
    assert got["loss"] < straggler_loss(cost, dp, 1, ga) * 1.5 < replayed / 3
    step = stream[at * gbs:(at + 1) * gbs]
    assert {x["rank"]: x["packs"] for x in got["ranks"]} == {r: step[r::dp].tolist() for r in range(dp)}
    leftover = n - 1
    want = [q // gbs + 1 for q in np.flatnonzero(stream == leftover)]
    assert want and [c["step"] for c in consumed_by(pretrain_stages(run), "pack", leftover, n, gbs)] == want

