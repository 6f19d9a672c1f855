"""Local executor: determinism across task/worker counts, resume after a killed rank, refusals."""
import os
from pathlib import Path

import pytest

from manifests import read_manifest
from manifests.io import write_table
from ovpipe.cli import main


def _ingest(demo, run, *extra):
    return main(["ingest", "--set", f'inputs=["{demo}/shards/*.tar"]', "--set", "source=demo",
                 "--run-dir", str(run), "--quiet", *extra])


def _merged_bytes(run: Path, tmp: Path) -> bytes:
    out = tmp / f"merged-{run.name}.parquet"
    write_table(read_manifest(run, "samples"), out)
    return out.read_bytes()


def test_tasks4_workers2_equals_tasks1(demo_corpus, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert _ingest(demo_corpus, a, "--tasks", "4", "--workers", "2") == 0
    assert _ingest(demo_corpus, b, "--tasks", "1") == 0
    assert len(list((a / "ingest" / "samples").glob("part-*.parquet"))) == 4
    assert _merged_bytes(a, tmp_path) == _merged_bytes(b, tmp_path)
    st = (a / "ingest" / "stats.json").read_text()
    assert '"samples": 200' in st


def test_killed_rank_rerun_completes_only_missing(demo_corpus, tmp_path, monkeypatch, capsys):
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert _ingest(demo_corpus, ref, "--tasks", "4") == 0
    monkeypatch.setenv("OVPIPE_FAIL_RANKS", "ingest:2")
    assert _ingest(demo_corpus, run, "--tasks", "4") == 1
    assert "rank 2" in capsys.readouterr().err
    comp = run / "ingest" / "completions"
    assert sorted(p.name for p in comp.iterdir()) == ["00000", "00001", "00003"]
    assert main(["status", str(run)]) == 1
    assert "task_00002.log" in capsys.readouterr().out
    logs = run / "ingest" / "logs"
    mtimes = {r: (logs / f"task_{r:05d}.log").stat().st_mtime_ns for r in (0, 1, 3)}
    monkeypatch.delenv("OVPIPE_FAIL_RANKS")
    assert _ingest(demo_corpus, run, "--tasks", "4") == 0
    for r, m in mtimes.items():  # completed ranks were not redone
        assert (logs / f"task_{r:05d}.log").stat().st_mtime_ns == m
    assert (comp / "00002").exists() and (comp / "finalized").exists()
    assert _merged_bytes(run, tmp_path) == _merged_bytes(ref, tmp_path)
    assert main(["status", str(run)]) == 0


def test_changed_task_count_or_config_refused(demo_corpus, tmp_path, capsys):
    run = tmp_path / "run"
    assert _ingest(demo_corpus, run, "--tasks", "2") == 0
    assert _ingest(demo_corpus, run, "--tasks", "3") == 2
    assert "task count changed" in capsys.readouterr().err
    assert _ingest(demo_corpus, run, "--tasks", "2", "--set", "verify=full") == 2
    assert "config changed" in capsys.readouterr().err
    assert _ingest(demo_corpus, run, "--tasks", "3", "--overwrite") == 0
    assert len(list((run / "ingest" / "completions").glob("0*"))) == 3
