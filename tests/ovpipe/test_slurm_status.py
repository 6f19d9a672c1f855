"""The state of a step's Slurm chain (what `--wait` prints and `ovpipe status` shows) from the completion
markers and squeue's rows — squeue's rows given here, so no cluster is needed."""
import json

from ovpipe.executors.slurm import chain_status, describe_chain, describe_failure
from ovpipe.runfolder import markers

RECORD = {"ranks": [0, 1, 2, 3], "apply_ranks": [0, 1, 2, 3], "array": "12", "reduce": "13", "apply": "14",
          "merge": "15", "chain": [{"phase": "map", "job": "12", "after": ["9"]},
                                   {"phase": "reduce", "job": "13", "after": ["12"]},
                                   {"phase": "apply", "job": "14", "after": ["13"]},
                                   {"phase": "merge", "job": "15", "after": ["14"]}]}


def _step(tmp_path, done=()):
    sdir = tmp_path / "balance"
    (sdir / "completions").mkdir(parents=True)
    (sdir / "logs").mkdir()
    for r in done:
        (sdir / "completions" / f"{r:05d}").touch()
    (sdir / "slurm_jobs.json").write_text(json.dumps(RECORD))
    return sdir


def test_running_chain(tmp_path):
    sdir = _step(tmp_path, done=(0,))
    rows = [("12", "1", "RUNNING", "None"), ("12", "2", "RUNNING", "None"), ("12", "3", "PENDING", "JobArrayTaskLimit"),
            ("13", "", "PENDING", "Dependency"), ("14", "", "PENDING", "Dependency"), ("15", "", "PENDING", "Dependency")]
    st = chain_status(sdir, rows=rows)
    assert [s["state"] for s in st] == ["running", "pending", "pending", "pending"]
    assert (st[0]["done"], st[0]["running"], st[0]["pending"]) == ([0], [1, 2], [3])
    assert describe_chain(st) == ("map 12 running 1/4 (2 running, 1 pending) (afterok:9) → reduce 13 pending "
                                  "(afterok:12) → apply 14 pending 0/4 (afterok:13) → merge 15 pending (afterok:14)")
    assert describe_failure(sdir, st) == ""


def test_failed_rank_cancels_the_rest(tmp_path):
    """Rank 2 raised (its failures/ file, its logs); the jobs afterok on the array were cancelled."""
    sdir = _step(tmp_path, done=(0, 1, 3))
    markers.write_failure(sdir, 2, "Traceback (most recent call last):\n  ...\nValueError: bad row group\n")
    (sdir / "logs" / "task_00002.log").write_text("boom\n")
    (sdir / "logs" / "slurm-12_2.out").write_text("boom\n")
    rows = [("12", "2", "FAILED", "NonZeroExitCode"), ("13", "", "CANCELLED", "DependencyNeverSatisfied")]
    st = chain_status(sdir, rows=rows)
    assert [s["state"] for s in st] == ["failed", "failed", "failed", "failed"]   # 14, 15: purged, never ran
    text = describe_failure(sdir, st)
    assert text.splitlines()[:3] == [
        "map job 12: rank 2 failed (FAILED NonZeroExitCode)",
        f"  rank 2: ValueError: bad row group — logs: {sdir / 'logs' / 'task_00002.log'}, "
        f"{sdir / 'logs' / 'slurm-12_2.out'}",
        "reduce job 13 failed (CANCELLED DependencyNeverSatisfied)"]
    assert "  reduce: (no log: never started)" in text


def test_done_from_markers_after_squeue_forgot_the_jobs(tmp_path):
    sdir = _step(tmp_path, done=(0, 1, 2, 3))
    markers.mark_reduced(sdir)
    for r in range(4):
        markers.mark_done(sdir, r, "apply")
    (sdir / "completions" / markers.FINALIZED).touch()
    st = chain_status(sdir, rows=[])
    assert [s["state"] for s in st] == ["done"] * 4
    # squeue cannot answer (no controller): what the markers do not show is unknown, not failed
    (sdir / "completions" / markers.FINALIZED).unlink()
    assert chain_status(sdir, rows=None)[-1]["state"] == "unknown"
