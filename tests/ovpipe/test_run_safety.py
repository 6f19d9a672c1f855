"""Run safety: the step lock, upstream checks, running/stale status, no orphan
workers, no leftover temp files. Each test is a drill that used to fail."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ovpipe.cli import main
from ovpipe.runfolder import RunFolderError, cleanup, lock, markers, prepare, status

HERE = Path(__file__).parent
REPO = HERE.parent.parent
STEPS = "t-slow=safety_steps:SLOW,t-down=safety_steps:DOWN"


@pytest.fixture(autouse=True)
def steps_env(monkeypatch):
    monkeypatch.setenv("OVPIPE_EXTRA_STEPS", STEPS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("OVPIPE_FAIL_RANKS", raising=False)
    sys.path.insert(0, str(HERE))
    yield
    sys.path.remove(str(HERE))


def _cli(run, step="t-slow", *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ovpipe.cli", step, "--run-dir", str(run), "--quiet", *extra],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(cond, timeout=30.0, what="condition"):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _running_pids(sdir: Path) -> dict[int, int]:
    out = {}
    for p in (sdir / "running").glob("0*"):
        try:
            out[int(p.name)] = json.loads(p.read_text())["pid"]
        except (OSError, ValueError):
            pass
    return out


# ---------------------------------------------------------------------------------------- lock

def test_second_identical_command_refuses_naming_the_holder(tmp_path, capsys):
    run = tmp_path / "run"
    flag = tmp_path / "flag"
    a = _cli(run, "t-slow", "--tasks", "2", "--set", "seconds=20", "--set", f"flag={flag}")
    try:
        sdir = run / "t-slow"
        _wait_for(lambda: (sdir / "running" / "00000").exists(), what="A's rank 0 to start")
        # B, the same command one second later: refused, names A, touches nothing.
        assert main(["t-slow", "--run-dir", str(run), "--quiet", "--tasks", "2", "--set", "seconds=20",
                     "--set", f"flag={flag}"]) == 2
        err = capsys.readouterr().err
        assert "locked" in err and f"pid {a.pid}" in err and "--wait-lock" in err
        assert not (sdir / "completions" / "00000").exists()
        flag.write_text("go")   # A's ranks stop sleeping
    finally:
        out, err = a.communicate(timeout=60)
    assert a.returncode == 0, err
    assert markers.is_finalized(run / "t-slow")
    # The lock died with A: the same command is now a no-op that succeeds.
    assert main(["t-slow", "--run-dir", str(run), "--quiet", "--tasks", "2", "--set", "seconds=20",
                 "--set", f"flag={flag}"]) == 0


def test_wait_lock_waits_for_the_holder(tmp_path, monkeypatch, capsys):
    """With ``wait=True`` a locked step blocks in ``flock`` until the holder lets go, then holds the lock.
    The holder lets go only when told, and it is told exactly as the waiter blocks: no timing involved."""
    import fcntl
    import types

    sdir = tmp_path / "run" / "t-slow"
    letting_go = tmp_path / "letting-go"
    code = ("import sys; from pathlib import Path; from ovpipe.runfolder import lock\n"
            f"with lock.step_lock({str(sdir)!r}):\n"
            "    print('held', flush=True)\n"
            "    sys.stdin.readline()\n"
            f"    Path({str(letting_go)!r}).write_text('yes')\n")     # still inside: written before the release
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    blocked = []

    def flock(fd, op):
        if op == fcntl.LOCK_EX:                 # the waiter's blocking call: now let the holder go
            blocked.append(fd)
            holder.stdin.write("go\n")
            holder.stdin.flush()
        return fcntl.flock(fd, op)

    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(lock.StepLocked, match=f"pid {holder.pid}"):
            with lock.step_lock(sdir):
                pass
        monkeypatch.setattr(lock, "fcntl", types.SimpleNamespace(
            flock=flock, LOCK_EX=fcntl.LOCK_EX, LOCK_NB=fcntl.LOCK_NB, LOCK_UN=fcntl.LOCK_UN))
        with lock.step_lock(sdir, wait=True):
            assert len(blocked) == 1                        # it waited, once
            assert letting_go.read_text() == "yes"          # and got the lock only after the holder let go
            assert json.loads((sdir / ".lock").read_text())["pid"] == os.getpid()
            with lock.step_lock(sdir):    # re-entrant in one process
                pass
        err = capsys.readouterr().err
        assert f"is locked by pid {holder.pid}" in err and "waiting for it" in err
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert holder.returncode == 0
    assert (sdir / ".lock").read_text() == ""  # released: no holder recorded


# ------------------------------------------------------------------------------------ upstream

def test_downstream_refuses_unfinalized_or_changed_upstream(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    monkeypatch.setenv("OVPIPE_FAIL_RANKS", "t-slow:1")
    assert main(["t-slow", "--run-dir", str(run), "--quiet", "--tasks", "2"]) == 1
    capsys.readouterr()
    # the upstream is 1/2 done and never finalized: the downstream must not start
    assert main(["t-down", "--run-dir", str(run), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "'t-slow' is not finalized" in err and "1/2" in err
    assert not (run / "t-down" / "completions" / "finalized").exists()

    monkeypatch.delenv("OVPIPE_FAIL_RANKS")
    assert main(["t-slow", "--run-dir", str(run), "--quiet", "--tasks", "2"]) == 0
    assert main(["t-down", "--run-dir", str(run), "--quiet"]) == 0
    meta = json.loads((run / "t-down" / "executor.json").read_text())
    up_hash = json.loads((run / "t-slow" / "executor.json").read_text())["config_hash"]
    assert meta["inputs"] == {"t-slow": up_hash}

    # the upstream is redone with another config: the downstream is stale and says why
    assert main(["t-slow", "--run-dir", str(run), "--quiet", "--tasks", "2", "--set", "tag=b", "--overwrite"]) == 0
    from ovpipe.config import load_config
    from ovpipe.registry import get_step

    down = get_step("t-down")
    cfg = load_config(down.config, {})
    assert prepare.up_to_date(run, down, cfg, 1) is None    # not a no-op any more
    capsys.readouterr()
    assert main(["t-down", "--run-dir", str(run), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "'t-slow'" in err and "another config" in err and "--overwrite" in err
    with pytest.raises(RunFolderError) as e:
        prepare.prepare(run, down, cfg, 1)
    assert "'t-slow'" in str(e.value) and "another config" in str(e.value) and "--overwrite" in str(e.value)
    from ovpipe.executors import LocalExecutor

    prepare.prepare(run, down, cfg, 1, overwrite=True)
    LocalExecutor(progress=False).run(down, run, 1)
    new_hash = json.loads((run / "t-slow" / "executor.json").read_text())["config_hash"]
    assert json.loads((run / "t-down" / "executor.json").read_text())["inputs"] == {"t-slow": new_hash}


def test_task_rechecks_upstream_when_it_starts(tmp_path):
    """A task (e.g. a Slurm array task starting late) refuses an upstream changed since prepare."""
    from ovpipe.executors.task import TaskFailed, run_task

    run = tmp_path / "run"
    assert main(["t-slow", "--run-dir", str(run), "--quiet"]) == 0
    assert main(["t-down", "--run-dir", str(run), "--quiet"]) == 0
    (run / "t-down" / "completions" / "00000").unlink()
    (run / "t-slow" / "completions" / "finalized").unlink()
    with pytest.raises(TaskFailed, match="'t-slow' is not finalized"):
        run_task("t-down", run, 0, 1)


def test_external_inputs_and_named_folders(tmp_path):
    run = tmp_path / "run"
    # parts written by hand (no executor.json): an external input, accepted as is
    (run / "ext" / "things").mkdir(parents=True)
    pq.write_table(pa.table({"rank": [0]}), run / "ext" / "things" / "part-00000.parquet")
    assert main(["t-down", "--run-dir", str(run), "--quiet"]) == 0
    assert json.loads((run / "t-down" / "executor.json").read_text())["inputs"] == {"ext": "external"}
    # a second folder of the same kind: all of them, unless the config names one
    assert main(["t-slow", "--run-dir", str(run), "--quiet"]) == 0
    assert main(["t-down", "--run-dir", str(run), "--quiet", "--name", "down-all"]) == 0
    assert sorted(json.loads((run / "down-all" / "executor.json").read_text())["inputs"]) == ["ext", "t-slow"]
    assert main(["t-down", "--run-dir", str(run), "--quiet", "--name", "down-ext", "--set", "things_step=ext"]) == 0
    assert json.loads((run / "down-ext" / "executor.json").read_text())["inputs"] == {"ext": "external"}
    # a new input folder appearing later invalidates the step that read "all of them"
    assert main(["t-down", "--run-dir", str(run), "--quiet"]) == 2


# ------------------------------------------------------------------------ status, temp files

def test_status_running_vs_stale_and_temp_files_removed(tmp_path, capsys):
    run = tmp_path / "run"
    flag = tmp_path / "flag"
    a = _cli(run, "t-slow", "--set", "seconds=30", "--set", f"flag={flag}")
    sdir = run / "t-slow"
    try:
        _wait_for(lambda: (sdir / "running" / "00000").exists(), what="rank 0 to start")
        st = status.step_status(sdir)
        assert [r for r, _ in st["running"]] == [0] and st["failed"] == [] and st["stale"] == []
        assert status.print_status(run) == 0
        assert "rank 0 running: pid" in capsys.readouterr().out
    finally:
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=30)
    st = status.step_status(sdir)
    assert [r for r, _ in st["stale"]] == [0] and st["running"] == [] and st["failed"] == []
    assert status.print_status(run) == 1
    assert "rank 0 killed (stale" in capsys.readouterr().out

    # what a kill mid-write or a full disk leaves behind
    (sdir / "things").mkdir(exist_ok=True)
    leftovers = [sdir / "things" / ".tmp-99999-part-00000.parquet", sdir / "stats" / ".tmp-99999-00000.json",
                 sdir / "data" / ".tmp-99999-shard.tar"]
    for p in leftovers:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * 100)
    flag.write_text("go")
    assert main(["t-slow", "--run-dir", str(run), "--quiet", "--set", "seconds=30", "--set", f"flag={flag}"]) == 0
    assert not any(p.exists() for p in leftovers)
    assert list(sdir.rglob(".tmp-*")) == []
    st = status.step_status(sdir)
    assert st["done"] == 1 and st["stale"] == [] and st["finalized"]
    assert not (sdir / "running" / "00000").exists()


def test_restarted_rank_removes_only_its_own_temp_files(tmp_path):
    sdir = tmp_path / "s"
    mine = [sdir / "things" / ".tmp-7-part-00003.parquet", sdir / "stats" / ".tmp-7-00003.json",
            sdir / "chunks" / "00003" / ".tmp-7-chunk-000001.parquet"]            # a resumable step's chunk
    other = [sdir / "things" / ".tmp-8-part-00004.parquet", sdir / "stats" / ".tmp-8-00004.json",
             sdir / "chunks" / "00004" / ".tmp-8-chunk-000000.parquet"]
    merges = {r: sdir / "shuffle" / f".merge-{r:05d}-abc{r}" for r in (3, 4)}     # a killed merge level's runs
    for p in mine + other + [m / "level0-00000.parquet" for m in merges.values()]:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.touch()
    assert cleanup.clean_temp_files(sdir, rank=3) == 4
    assert not any(p.exists() for p in mine) and all(p.exists() for p in other)
    assert not merges[3].exists() and merges[4].exists()
    assert cleanup.clean_temp_files(sdir) == 4 and not merges[4].exists()      # no rank running: every one


# ------------------------------------------------------------------------------------- orphans

def test_pool_workers_die_with_their_parent(tmp_path):
    run = tmp_path / "run"
    a = _cli(run, "t-slow", "--tasks", "4", "--workers", "2", "--set", "seconds=60")
    sdir = run / "t-slow"
    try:
        _wait_for(lambda: len(_running_pids(sdir)) == 2, timeout=60, what="two workers to start ranks")
        pids = set(_running_pids(sdir).values())
        assert a.pid not in pids and all(_alive(p) for p in pids)
    finally:
        a.send_signal(signal.SIGKILL)      # only the parent
        a.wait(timeout=30)
    t0 = time.time()
    while any(_alive(p) for p in pids):
        if time.time() - t0 > 5:
            for p in pids:                  # do not leave them behind if the test fails
                if _alive(p):
                    os.kill(p, signal.SIGKILL)
            pytest.fail(f"pool workers {sorted(pids)} outlived their parent by 5 s")
        time.sleep(0.05)
