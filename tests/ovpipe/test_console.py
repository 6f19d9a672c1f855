"""The terminal shows a step's progress and one summary line; third-party warnings, C-level log lines
and stray prints go to the task log (``--verbose`` shows them); `make demo`'s output check catches
noise and missing summary lines."""
import subprocess
import sys
from pathlib import Path

import pytest

from ovpipe.cli import main

REPO = Path(__file__).resolve().parents[2]
NOISE = ("Transformer Engine and Apex", "stray print", "C-level log line", "stderr from Python")


@pytest.fixture
def noisy_step(monkeypatch):
    monkeypatch.setenv("OVPIPE_EXTRA_STEPS", "t-noisy=tests.ovpipe.noisy_steps:NOISY")
    monkeypatch.delenv("OVPIPE_VERBOSE", raising=False)
    monkeypatch.syspath_prepend(str(REPO))


def _cli(*args, **env):
    """The CLI as a user runs it: its own process, real file descriptors, Python's default warnings."""
    import os

    env = {**os.environ, "OVPIPE_EXTRA_STEPS": "t-noisy=tests.ovpipe.noisy_steps:NOISY",
           "PYTHONPATH": str(REPO), **env}
    env.pop("OVPIPE_VERBOSE", None) if "OVPIPE_VERBOSE" not in env else None
    r = subprocess.run([sys.executable, "-m", "ovpipe.cli", *args], capture_output=True, text=True, env=env,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr
    return r.stdout, r.stderr


@pytest.mark.parametrize("workers", [1, 2])
def test_task_noise_goes_to_the_log(tmp_path, workers):
    run = tmp_path / "run"
    out, err = _cli("t-noisy", "--run-dir", str(run), "--tasks", "2", "--workers", str(workers))
    for text in NOISE:
        assert text not in out + err, text
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("t-noisy: ok 6, other 2 (broken 2) — 2 task(s)"), lines
    for rank in (0, 1):
        log = (run / "t-noisy" / "logs" / f"task_{rank:05d}.log").read_text()
        assert all(text in log for text in NOISE), log


def test_verbose_shows_everything(tmp_path):
    out, err = _cli("t-noisy", "--run-dir", str(tmp_path / "run"), "--verbose")
    assert all(text in out + err for text in NOISE)
    out, err = _cli("t-noisy", "--run-dir", str(tmp_path / "run2"), OVPIPE_VERBOSE="1")
    assert all(text in out + err for text in NOISE)


def test_summary_of_a_run(tmp_path, capfd, noisy_step):
    run = tmp_path / "run"
    assert main(["t-noisy", "--run-dir", str(run), "--quiet"]) == 0
    capfd.readouterr()
    assert main(["summary", str(run)]) == 0
    out = capfd.readouterr().out
    assert "t-noisy: ok 3, other 1 (broken 1)" in out and f"run folder: {run}" in out


def test_demo_output_check(tmp_path, noisy_step):
    run = tmp_path / "run"
    assert main(["t-noisy", "--run-dir", str(run), "--quiet"]) == 0
    check = [sys.executable, str(REPO / "scripts" / "check_demo_output.py")]
    log = tmp_path / "out.log"
    log.write_text(f"t-noisy: ok 3 — 1 task(s), 0.1 s → {run / 't-noisy'}\n")
    assert subprocess.run([*check, str(log), str(run)]).returncode == 0
    log.write_text("t-noisy: ok 3 → x\n/x/y.py:3: UserWarning: something\n")
    r = subprocess.run([*check, str(log), str(run)], capture_output=True, text=True)
    assert r.returncode == 1 and "UserWarning" in r.stderr
    log.write_text("nothing\n")
    r = subprocess.run([*check, str(log), str(run)], capture_output=True, text=True)
    assert r.returncode == 1 and "no summary line for step t-noisy" in r.stderr


@pytest.mark.parametrize("cmd", ["summary", "status", "report", "sql"])
def test_a_missing_run_folder_is_an_error_for_every_reader(tmp_path, capsys, cmd):
    from ovpipe.cli import main

    missing = tmp_path / "no-such-run"
    assert main([cmd, str(missing), *(["SELECT 1"] if cmd == "sql" else [])]) == 2
    assert f"run folder {missing} does not exist" in capsys.readouterr().err
