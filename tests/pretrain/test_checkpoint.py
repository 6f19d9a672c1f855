"""Atomic, rotating checkpoint folders (``pretrain.trainer.checkpoint``) and the save policy — no model needed:
the folder rules are the same whatever megatron writes inside."""
import json
import os
import signal

import pytest

from pretrain.trainer import checkpoint as ck


def _save(root, step, keep=2, payload=b"x"):
    tmp = ck.begin(root, step)
    (tmp / "shard.distcp").write_bytes(payload * 100)          # what megatron's writers put there
    return ck.commit(root, step, keep)


def test_save_renames_into_place_then_points_latest_and_keeps_k(tmp_path):
    root = tmp_path / "dist_ckpt"
    for s in (2, 4, 6, 8):
        final = _save(root, s, keep=2)
        assert final.name == f"iter_{s:07d}" and (final / "step.json").exists()
        assert (root / "latest").read_text().strip() == final.name
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000006", "iter_0000008", "latest"]
    assert ck.newest(root) == (8, root / "iter_0000008")
    assert ck.resolve(root) == root / "iter_0000008"


def test_half_written_saves_are_skipped_with_one_log_line(tmp_path):
    root = tmp_path / "dist_ckpt"
    _save(root, 2)
    ck.begin(root, 4)                                             # killed while megatron wrote
    (root / "iter_0000006").mkdir()                               # a damaged folder without step.json
    lines = []
    assert ck.newest(root, log=lines.append) == (2, root / "iter_0000002")
    assert len(lines) == 1 and ".tmp-iter_0000004" in lines[0] and "iter_0000006" in lines[0]
    # the next save clears the killed temp folder and rewrites that step whole
    _save(root, 4)
    assert not (root / ".tmp-iter_0000004").exists() and ck.newest(root, log=None)[0] == 4


def test_a_kill_between_rename_and_pointer_still_resumes_from_the_newest(tmp_path):
    root = tmp_path / "dist_ckpt"
    _save(root, 2)
    tmp = ck.begin(root, 4)
    (tmp / "step.json").write_text(json.dumps({"step": 4}))
    os.rename(tmp, root / "iter_0000004")                         # killed before `latest` moved
    assert (root / "latest").read_text().strip() == "iter_0000002"
    assert ck.newest(root, log=None) == (4, root / "iter_0000004")
    _save(root, 4)                                                # the rerun saves step 4 again: replaced
    assert ck.newest(root, log=None)[0] == 4 and (root / "latest").read_text().strip() == "iter_0000004"


def test_resume_point_never_falls_back_to_the_previous_stage(tmp_path):
    own, prev = tmp_path / "stage-1.5" / "dist_ckpt", tmp_path / "stage-1" / "dist_ckpt"
    _save(prev, 10)
    assert ck.resume_point(own, prev, lambda p: True, log=None) == ("previous", 0, prev / "iter_0000010")
    _save(own, 2)
    _save(own, 4)
    assert ck.resume_point(own, prev, lambda p: True, log=None) == ("resume", 4, own / "iter_0000004")
    # the newest does not read back: the older one is used, and the log says so
    lines = []
    assert ck.resume_point(own, prev, lambda p: p.name != "iter_0000004", log=lines.append)[:2] == ("resume", 2)
    assert any("iter_0000004" in x and "not readable" in x for x in lines)
    # none reads back: an error naming them, not a silent restart from stage 1
    with pytest.raises(ck.CheckpointError, match="iter_0000002.*iter_0000004|iter_0000004.*iter_0000002"):
        ck.resume_point(own, prev, lambda p: False, log=None)
    # an iter_ folder without step.json was whole once (renamed) and is damaged now: an error too
    (own / "iter_0000004" / "step.json").unlink()
    with pytest.raises(ck.CheckpointError, match="iter_0000004"):
        ck.resume_point(own, prev, lambda p: p.name != "iter_0000002", log=None)
    # only the temp folder of a killed first save: the stage never saved one whole, it starts as before
    half = tmp_path / "stage-2" / "dist_ckpt"
    ck.begin(half, 6)
    lines = []
    assert ck.resume_point(half, own, lambda p: True, log=lines.append) == ("previous", 0, own / "iter_0000002")
    assert ".tmp-iter_0000006" in lines[0]          # one line for it (the next is about the previous stage)


def test_legacy_single_folder_checkpoint_still_loads(tmp_path):
    old = tmp_path / "dist_ckpt"
    old.mkdir()
    (old / "step.json").write_text(json.dumps({"step": 7}))
    assert ck.newest(old) == (7, old) and ck.resolve(old) == old


def test_save_policy_steps_minutes_and_signals(monkeypatch):
    p = ck.SavePolicy(every_steps=3)
    assert [p.decide(s)[0] for s in range(1, 7)] == [False, False, True, False, False, True]
    t = [1000.0]
    monkeypatch.setattr(ck.time, "monotonic", lambda: t[0])
    p = ck.SavePolicy(every_minutes=2)
    t[0] += 119
    assert p.decide(1) == (False, False)
    t[0] += 2
    assert p.decide(2) == (True, False)
    p.saved()
    assert p.decide(3) == (False, False)
    p.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)                      # Slurm's warning before the time limit
        assert p.signalled == signal.SIGUSR1 and p.decide(4) == (True, True)
    finally:
        p.restore()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
