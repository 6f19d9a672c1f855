"""`ovpipe pretrain` / `export-model` / `import-model` under the run folder's rules: the stage's lock,
finalized and unchanged inputs, a changed config refused naming the field, `ovpipe status` at the
current step."""
import io
import json
import shutil
import subprocess
import sys
import time

from ovpipe.cli import main
from ovpipe.runfolder.status import print_status

ARGS = ["--recipe", "tiny", "--stage", "1.5", "--init", "scratch", "--steps", "2", "--micro-batch", "1",
        "--lr", "0.003"]


def _status(run):
    buf = io.StringIO()
    rc = print_status(run, out=buf)
    return rc, buf.getvalue()


def _hold_lock(sdir, seconds):
    """Another command holding the stage's lock (a second process: flock is per open file)."""
    code = ("import sys, time; from pathlib import Path; from ovpipe.runfolder.lock import step_lock\n"
            "with step_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(float(sys.argv[2]))\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(sdir), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_pretrain_refuses_an_unfinalized_or_changed_pack(packed_demo, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(packed_demo, run)
    fin = run / "pack" / "completions" / "finalized"
    fin.unlink()
    assert main(["pretrain", *ARGS, "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "'pack'" in err and "not finalized" in err
    fin.touch()
    # the stage was prepared on this pack (the core's prepare, as the command does); then pack is rerun
    # with another config
    from ovpipe.runfolder.prepare import prepare
    from pretrain.stage import STEP, StageConfig

    cfg = StageConfig(recipe="tiny", stage="1.5", steps=2, micro_batch=1, lr=0.003, init="scratch")
    prepare(run, STEP, cfg, 1, name="pretrain/stage-1.5")
    meta = json.loads((run / "pack" / "executor.json").read_text())
    meta["config_hash"] = "0123456789abcdef"
    (run / "pack" / "executor.json").write_text(json.dumps(meta))
    assert main(["pretrain", *ARGS, "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "input step 'pack' was rerun with another config" in err and "--overwrite" in err


def test_second_command_lock_config_change_status_and_export(packed_demo, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(packed_demo, run)
    sdir = run / "pretrain" / "stage-1.5"
    holder = _hold_lock(sdir, 4)
    try:
        assert main(["pretrain", *ARGS, "--run-dir", str(run)]) == 2      # a second command refuses
        err = capsys.readouterr().err
        assert "locked by pid" in err and "--wait-lock" in err
        t0 = time.time()
        assert main(["pretrain", *ARGS, "--run-dir", str(run), "--wait-lock"]) == 0   # waits, then trains
        assert time.time() - t0 > 1
    finally:
        holder.wait(30)
    rc, text = _status(run)
    assert rc == 0 and "pretrain/stage-1.5" in text and "at step 2/2" in text, text
    line = next(ln for ln in text.splitlines() if ln.startswith("pretrain/stage-1.5"))
    assert line.split()[1] == "1/1" and line.split()[-1] == "yes"
    cfg = json.loads((sdir / "executor.json").read_text())
    assert cfg["inputs"] == {"pack": json.loads((run / "pack" / "executor.json").read_text())["config_hash"]}
    capsys.readouterr()                      # and in SQL, a row of the steps table like any step's
    assert main(["sql", str(run), "SELECT step, tasks_done, finalized, inputs FROM steps "
                 "WHERE folder = 'pretrain/stage-1.5'", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"step": "pretrain", "tasks_done": 1, "finalized": True,
                                                   "inputs": ["pack"]}
    capsys.readouterr()
    assert main(["pretrain", *ARGS, "--run-dir", str(run)]) == 0          # same config: a no-op
    assert "already done" in capsys.readouterr().out
    changed = [a if a != "0.003" else "0.001" for a in ARGS]
    assert main(["pretrain", *changed, "--run-dir", str(run)]) == 2
    assert "lr: 0.003 → 0.001" in capsys.readouterr().err
    # export reads only a finished stage: unfinish it (a killed run) and it refuses, naming the stage
    (sdir / "completions" / "finalized").unlink()
    assert main(["export-model", "--run-dir", str(run), "--stage", "1.5", "--out", str(tmp_path / "hf")]) == 2
    assert "'pretrain/stage-1.5' is not finalized" in capsys.readouterr().err
    # rerunning the same command finishes it from its last checkpoint, without training a step again
    lines = (sdir / "metrics.jsonl").read_text().count("\n")
    assert main(["pretrain", *ARGS, "--run-dir", str(run)]) == 0
    assert (sdir / "completions" / "finalized").exists() and (sdir / "metrics.jsonl").read_text().count("\n") == lines
