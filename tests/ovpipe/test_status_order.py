"""`ovpipe status` lists the step folders in pipeline order (by their recorded inputs), columns aligned."""
from __future__ import annotations

import io
import json
import os
from pathlib import Path

from ovpipe.runfolder.markers import FINALIZED
from ovpipe.runfolder.status import pipeline_order, print_status


def _step(run: Path, folder: str, inputs: list[str], started: float, tasks: int = 2, done: int = 2) -> None:
    """A step folder as the executors leave it: executor.json (the recorded inputs), logs, completions.
    ``step`` is a name no registry knows, so the staleness check has nothing to resolve."""
    d = run / folder
    for sub in ("completions", "logs", "stats"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    (d / "executor.json").write_text(json.dumps(
        {"step": "hand-made", "tasks": tasks, "config_hash": "x", "outputs": [],
         "inputs": {k: "h" for k in inputs}, "phases": ["map"]}))
    for r in range(tasks):
        log = d / "logs" / f"task_{r:05d}.log"
        log.write_text("ran\n" if r < done else "")     # an empty log: pending, not a killed (stale) rank
        os.utime(log, (started + r, started + r))
    for r in range(done):
        (d / "completions" / f"{r:05d}").touch()
    if done == tasks:
        (d / "completions" / FINALIZED).touch()
    os.utime(d / "executor.json", (started + 100, started + 100))


def _run(tmp_path: Path) -> Path:
    # names that sort differently from the pipeline (assign < balance < embed-images < ingest), a long nested
    # stage folder, a second chain that started later (rl-ingest → score), and an external input ("parts")
    t = 1_700_000_000.0
    _step(tmp_path, "ingest", [], t)
    _step(tmp_path, "embed-images", ["ingest"], t + 10)
    _step(tmp_path, "embed-concepts", [], t + 11)
    _step(tmp_path, "assign", ["embed-images", "embed-concepts"], t + 20)
    _step(tmp_path, "balance", ["assign", "ingest"], t + 30)
    _step(tmp_path, "pack", ["balance", "parts"], t + 40)
    _step(tmp_path, "pretrain/stage-1.5", ["pack", "pretrain/stage-1"], t + 60, tasks=1, done=0)
    _step(tmp_path, "pretrain/stage-1", ["pack"], t + 50, tasks=1, done=1)
    _step(tmp_path, "a-rl-ingest", [], t + 5)                  # no inputs: placed by when it first ran
    _step(tmp_path, "a-score", ["a-rl-ingest", "pretrain/stage-1.5"], t + 70, done=1)
    (tmp_path / "parts").mkdir()                                # external: no executor.json
    return tmp_path


def test_status_lists_steps_in_pipeline_order(tmp_path):
    run = _run(tmp_path)
    order = [str(p.relative_to(run)) for p in pipeline_order(run)]
    assert order == ["ingest", "a-rl-ingest", "embed-images", "embed-concepts", "assign", "balance", "pack",
                     "pretrain/stage-1", "pretrain/stage-1.5", "a-score"]
    out = io.StringIO()
    rc = print_status(run, out)
    lines = out.getvalue().splitlines()
    listed = [ln.split()[0] for ln in lines[1:] if not ln.startswith(" ")]
    assert listed == order
    assert rc == 0          # pending ranks are no error


def test_status_columns_stay_aligned_with_a_long_nested_name(tmp_path):
    run = _run(tmp_path)
    out = io.StringIO()
    print_status(run, out)
    lines = [ln for ln in out.getvalue().splitlines() if not ln.startswith(" ")]
    header = lines[0]
    assert header.split() == ["step", "done", "running", "failed", "killed", "pending", "final"]
    # every count ends where its header does, whatever the length of the step's name (done: "  2/2 ")
    ends = [header.index(col) + len(col) for col in ("running", "failed", "killed", "pending")]
    done = header.index("done")
    for ln in lines[1:]:
        for end in ends:
            assert ln[end - 1] != " " and ln[end] == " ", (ln, header)
        assert "/" in ln[done:done + 4], (ln, header)
    assert len({len(ln.rstrip().rsplit(" ", 1)[0]) for ln in lines[1:]}) == 1, lines
    stage = next(ln for ln in lines if ln.startswith("pretrain/stage-1.5 "))
    assert stage.split()[1:] == ["0/1", "0", "0", "0", "1", "no"]


def test_a_cycle_of_hand_made_folders_still_lists_every_folder(tmp_path):
    t = 1_700_000_000.0
    _step(tmp_path, "b", ["a"], t + 1)
    _step(tmp_path, "a", ["b"], t)
    _step(tmp_path, "c", ["a"], t + 2)
    assert [p.name for p in pipeline_order(tmp_path)] == ["a", "b", "c"]
