"""Three-phase steps (map → reduce → apply) on `balance`: byte-identical to the whole-corpus
computation for 1, 3 and 8 tasks, resume per phase, `ovpipe status` per phase, numpy's summation order."""
import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from curation.concept_balance import BalanceConfig, balance, uniform_draws
from manifests import read_manifest
from manifests.io import write_part, write_table
from ovpipe import mapreduce
from ovpipe.cli import main
from ovpipe.runfolder import markers, status


def test_pairwise_sum_is_numpy_sum_bit_for_bit():
    rng = np.random.default_rng(0)
    for n in [1, 7, 8, 9, 127, 128, 129, 1000, 4099, 70_001]:
        x = rng.random(n) * rng.choice([1.0, 1e-9, 1e9], n)    # magnitudes that expose any other order
        for leaf in (128, 136, 1000, None):
            got = mapreduce.pairwise_sum(n, lambda lo, hi: x[lo:hi], leaf=leaf)
            assert got == np.sum(x), (n, leaf)
    assert mapreduce.pairwise_sum(0, lambda lo, hi: np.zeros(0)) == 0.0


def write_corpus(run, n=3000, V=120, K=6, parts=3, canonical=True, seed=0):
    """`assignments` + `concepts` parts. canonical: the parts are contiguous ranges of the sorted ids
    (what `assign` writes); otherwise every part spans the whole id range (DuckDB sorts them)."""
    rng = np.random.default_rng(seed)
    p = 1 / np.arange(1, V + 1) ** 1.2
    c = rng.choice(V, size=(n, K), p=p / p.sum()).astype(np.int32)
    ids = np.array([f"{x:016x}" for x in rng.integers(0, 2 ** 63, n)])
    if canonical:
        order = np.argsort(ids, kind="stable")
        ids, c = ids[order], c[order]
    for k, part in enumerate(np.array_split(np.arange(n), parts)):
        write_part({"sample_id": ids[part].tolist(), "concept_ids": [list(r) for r in c[part]],
                    "scores": [[0.5] * K] * len(part)},
                   run / "assign" / "assignments" / f"part-{k:05d}.parquet", "assignments", sort=True)
    write_part({"concept_id": np.arange(V, dtype=np.int32), "text": [f"c{i}" for i in range(V)],
                "file": ["x"] * V, "row": np.arange(V, dtype=np.int32)},
               run / "embed-concepts" / "concepts" / "part-00000.parquet", "concepts")
    return ids, c, V


def reference_bytes(ids, c, V, cfg: BalanceConfig, tmp):
    """The whole-corpus computation (what every rank used to do): `balance()` on the canonical arrays."""
    order = np.argsort(ids, kind="stable")
    ids, c = ids[order], c[order].astype(np.int64)
    if cfg.count_top:
        c = c[:, :cfg.count_top]
    w, copies, before, after, _ = balance(c, uniform_draws(pa.array(ids), cfg.seed), V, cfg)
    bal = tmp / "ref-balanced.parquet"
    write_table(pa.table({"sample_id": pa.array(ids), "weight": pa.array(w),
                          "copies": pa.array(copies.astype(np.int32))}), bal)
    cc = tmp / "ref-cc.parquet"
    write_table(pa.table({"concept_id": pa.array(np.arange(V, dtype=np.int32)),
                          "text": pa.array([f"c{i}" for i in range(V)]),
                          "count_before": pa.array(before), "count_after": pa.array(after)}), cc)
    return bal.read_bytes(), cc.read_bytes()


def merged_bytes(run, tmp):
    out = []
    for kind in ("balanced", "concept_counts"):
        f = tmp / f"got-{kind}.parquet"
        write_table(read_manifest(run, kind), f)
        out.append(f.read_bytes())
    return tuple(out)


CONFIGS = {
    "inverse_frequency": [],
    "metaclip_without_replacement": ["--set", "method=metaclip", "--set", "replacement=false",
                                     "--set", "target_size=1200", "--set", "count_top=4"],
    "inverse_frequency_without_replacement": ["--set", "replacement=false", "--set", "target_size=1000",
                                              "--set", "alpha=0.5", "--set", "seed=5"],
}


@pytest.mark.parametrize("canonical", [True, False], ids=["canonical-parts", "shuffled-parts"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_balance_is_byte_identical_to_the_whole_corpus_computation_for_1_3_8_tasks(tmp_path, monkeypatch, name,
                                                                                     canonical):
    # a small pairwise leaf: the reduce's streamed sum crosses many chunk boundaries (in-process reduce)
    monkeypatch.setattr(mapreduce, "PAIRWISE_LEAF", 256)
    from ovpipe.config import load_config

    for tasks in (1, 3, 8):
        run = tmp_path / f"t{tasks}"
        ids, c, V = write_corpus(run, canonical=canonical)
        assert main(["balance", "--run-dir", str(run), "--tasks", str(tasks), "--quiet", *CONFIGS[name]]) == 0
        cfg = load_config(BalanceConfig, json.loads((run / "balance" / "config.json").read_text()))
        assert merged_bytes(run, tmp_path) == reference_bytes(ids, c, V, cfg, tmp_path), (name, tasks)
        st = json.loads((run / "balance" / "stats.json").read_text())["counters"]
        assert st["samples"] == len(ids)
        # no task held the corpus: the map ranks left bincounts, the reduce one small artifact
        assert sorted(p.name for p in (run / "balance" / "partials").iterdir()) == sorted(
            [f"counts-{r:05d}.npz" for r in range(tasks)] + [f"after-{r:05d}.npz" for r in range(tasks)])
        assert [p.name for p in (run / "balance" / "reduced").iterdir() if not p.name.startswith(".")] == \
            ["balance.npz"]


def _mtimes(sdir, names):
    return {n: (sdir / "logs" / n).stat().st_mtime_ns for n in names}


def test_resume_redoes_only_the_failed_phase_rank_and_status_shows_phases(tmp_path, monkeypatch, capsys):
    run, ref = tmp_path / "run", tmp_path / "ref"
    write_corpus(run)
    write_corpus(ref)
    assert main(["balance", "--run-dir", str(ref), "--tasks", "3", "--quiet"]) == 0
    sdir = run / "balance"
    monkeypatch.setenv("OVPIPE_FAIL_RANKS", "balance/apply:1")
    assert main(["balance", "--run-dir", str(run), "--tasks", "3", "--quiet"]) == 1
    assert "apply rank 1" in capsys.readouterr().err
    st = status.step_status(sdir)
    assert st["done"] == 3 and st["phases"]["reduce"] == "done"
    assert st["phases"]["apply"]["done"] == 2 and [r for r, _ in st["phases"]["apply"]["failed"]] == [1]
    assert main(["status", str(run)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"├ reduce +done\n +└ apply +2/3 ", out) and "apply rank 1 failed" in out

    logs = ["task_00000.log", "task_00001.log", "task_00002.log", "reduce.log", "apply_00000.log", "apply_00002.log"]
    before = _mtimes(sdir, logs)
    monkeypatch.delenv("OVPIPE_FAIL_RANKS")
    assert main(["balance", "--run-dir", str(run), "--tasks", "3", "--quiet"]) == 0
    assert _mtimes(sdir, logs) == before          # map ranks, the reduce and the other apply ranks not redone
    assert markers.is_finalized(sdir) and not (sdir / "failures" / "apply-00001").exists()
    assert merged_bytes(run, tmp_path) == merged_bytes(ref, tmp_path)
    assert main(["status", str(run)]) == 0

    # a map rank redone (its marker lost) redoes the reduce; the reduce comes out the same, so the
    # apply ranks (whose markers hold the artifact's digest) stay done
    (sdir / "completions" / "00002").unlink()
    apply_logs = ["apply_00000.log", "apply_00001.log", "apply_00002.log"]
    before = _mtimes(sdir, apply_logs + ["task_00000.log", "reduce.log"])
    assert main(["balance", "--run-dir", str(run), "--tasks", "3", "--quiet"]) == 0
    after = _mtimes(sdir, apply_logs + ["task_00000.log", "reduce.log"])
    assert after["reduce.log"] != before["reduce.log"] and after["task_00000.log"] == before["task_00000.log"]
    assert all(after[n] == before[n] for n in apply_logs)
    assert merged_bytes(run, tmp_path) == merged_bytes(ref, tmp_path)

    # a reduce whose artifact changed: every apply rank is pending again
    (sdir / "completions" / "reduced").write_text("another-digest\n")
    assert markers.pending_ranks(sdir, 3, "apply") == [0, 1, 2]


def test_apply_rank_refuses_without_the_reduce(tmp_path):
    from ovpipe.executors.task import TaskFailed, run_task

    run = tmp_path / "run"
    write_corpus(run)
    assert main(["balance", "--run-dir", str(run), "--tasks", "2", "--quiet"]) == 0
    (run / "balance" / "completions" / "reduced").unlink()
    with pytest.raises(TaskFailed, match="reduce has not run"):
        run_task("balance", run, 0, 2, phase="apply")


def test_every_task_records_its_peak_memory(tmp_path):
    """stats.json says what each map rank, the reduce, each apply rank and the finalize needed (VmHWM, reset at the
    start of each task so a pool worker's earlier tasks do not count) — the figure to size a
    cluster's memory per task."""
    import json
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("VmHWM is Linux's")
    run = tmp_path / "run"
    write_corpus(run)
    assert main(["balance", "--run-dir", str(run), "--tasks", "2", "--workers", "2", "--quiet"]) == 0
    info = json.loads((run / "balance" / "stats.json").read_text())["info"]
    keys = {"peak_rss_bytes/00000", "peak_rss_bytes/00001", "peak_rss_bytes/reduce",
            "peak_rss_bytes/apply-00000", "peak_rss_bytes/apply-00001", "peak_rss_bytes/finalize"}
    assert keys <= set(info)
    assert all(10 * 2**20 < info[k] < 4 * 2**30 for k in keys)
    # what a benchmark reads (bench/bench_scale.py): the same figures, by the tasks' marker names
    from ovpipe.executors.task import recorded_peaks

    assert recorded_peaks(run / "balance") == {k.split("/", 1)[1]: info[k] for k in keys}


def test_prefetch_keeps_order_raises_and_stops_early():
    import threading

    from ovpipe.mapreduce import prefetch

    assert list(prefetch(iter(range(1000)), depth=3)) == list(range(1000))

    def failing():
        yield 1
        raise KeyError("boom")

    got = []
    with pytest.raises(KeyError, match="boom"):
        for x in prefetch(failing()):
            got.append(x)
    assert got == [1]
    pulled = []

    def endless():
        i = 0
        while True:
            pulled.append(i)
            yield i
            i += 1

    g = prefetch(endless(), depth=2)
    assert [next(g) for _ in range(5)] == [0, 1, 2, 3, 4]
    g.close()                                    # the producer stops a few items ahead, never runs on
    n = len(pulled)
    assert n <= 5 + 4 and not any(t.name == "ovpipe-prefetch" for t in threading.enumerate())


def test_reduce_first_step_runs_no_map_and_resumes_only_the_failed_apply_rank(tmp_path, monkeypatch, capsys):
    """``Step(reduce=..., apply=...)`` without ``run``: no map rank runs (no marker, no log), the status
    counts the apply ranks under a ``reduce first`` line, and a rerun redoes only what did not finish."""
    import sys

    import pyarrow.parquet as pq

    from ovpipe.executors.task import run_task
    from ovpipe.registry import get_step

    here = str(Path(__file__).parent)
    monkeypatch.setenv("OVPIPE_EXTRA_STEPS", "numbers=slurm_steps:NUMBERS")
    monkeypatch.syspath_prepend(here)
    assert get_step("numbers").phases == ("reduce", "apply")
    run = tmp_path / "run"
    sdir = run / "numbers"
    args = ["numbers", "--run-dir", str(run), "--tasks", "3", "--set", "n=10", "--quiet"]
    monkeypatch.setenv("OVPIPE_FAIL_RANKS", "numbers/apply:1")
    assert main(args) == 1
    assert json.loads((sdir / "executor.json").read_text())["phases"] == ["reduce", "apply"]
    st = status.step_status(sdir)
    assert (st["done"], st["phases"]["reduce"], [r for r, _ in st["failed"]]) == (2, "done", [1])
    assert main(["status", str(run)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"numbers +2/3 .* no\n", out) and re.search(r"└ reduce first +done", out)
    assert "apply rank 1 failed" in out and "├" not in out

    logs = ["reduce.log", "apply_00000.log", "apply_00002.log"]
    before = _mtimes(sdir, logs)
    monkeypatch.delenv("OVPIPE_FAIL_RANKS")
    assert main(args) == 0
    assert _mtimes(sdir, logs) == before          # the reduce and the done apply ranks are not redone
    parts = sorted((sdir / "numbers").glob("part-*.parquet"))
    assert [pq.read_table(p).column("x").to_pylist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert not list((sdir / "logs").glob("task_*")) and not any(p.name.isdigit() for p in (sdir / "completions").iterdir())
    assert json.loads((sdir / "stats.json").read_text())["counters"]["numbers"] == 10
    assert main(["status", str(run)]) == 0
    assert main(args[:-1]) == 0 and "already done" in capsys.readouterr().out   # nothing left: a no-op
    with pytest.raises(ValueError, match="has no map phase"):
        run_task("numbers", run, 0, 3)
    sys.modules.pop("slurm_steps", None)


def test_a_step_needs_run_or_reduce_and_apply():
    from ovpipe.step import Step

    with pytest.raises(ValueError, match="give run"):
        Step("nothing", dict)
    with pytest.raises(ValueError, match="reduce and apply come together"):
        Step("half", dict, reduce=lambda c, t: None)
    assert Step("plain", dict, lambda c, t: None).phases == ("map",)
