"""The kill drill: SIGKILL the training process group at 7 random points — inside a step, inside a
save (megatron's writer slowed down so a kill lands before, during or after its write) — and rerun
the same command (``ovpipe pretrain …``) after each kill. The stage must end with the uninterrupted run's losses, grad
norms and learning rates, bit for bit (fp32, CPU), and leave no half-written checkpoint behind."""
import contextlib
import io
import multiprocessing
import os
import random
import shutil
import signal
import time

import pytest

STEPS, SAVE_EVERY, KILLS, SAVE_DELAY_S = 12, 2, 7, 1.0


def _records(run):
    from ovpipe.summary import stage_metrics   # a step redone after a kill: its last record

    return [(m["step"], m["loss"], m["grad_norm"], m["lr"])
            for m in stage_metrics(run / "pretrain" / "stage-1.5" / "metrics.jsonl")]


def _lines(path):
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow
def test_kill_drill_ends_bit_identical(packed_demo, tmp_path):
    import drill_child  # noqa: F401  (tests/pretrain is on sys.path: rootdir-relative test imports)

    from ovpipe.runfolder.status import print_status
    from pretrain.trainer import checkpoint

    ctx = multiprocessing.get_context("forkserver")
    # the server imports these once and each run is forked from it. By their installed names: Python 3.12's
    # forkserver imports its preload before it applies this process's sys.path, so a test-folder module such
    # as drill_child fails there without a word (each run then imports everything anew, ~4 CPU-s each)
    ctx.set_forkserver_preload(drill_child.PRELOAD)
    ref, run = tmp_path / "ref", tmp_path / "run"
    shutil.copytree(packed_demo, ref)
    shutil.copytree(packed_demo, run)

    live = []

    def start(folder, save_delay_s=SAVE_DELAY_S):
        args = ["--run-dir", str(folder), "--recipe", "tiny", "--stage", "1.5", "--init", "scratch", "--steps", str(STEPS),
                "--micro-batch", "1", "--lr", "3e-3", "--save-every", str(SAVE_EVERY), "--keep", "2"]
        p = ctx.Process(target=drill_child.run, args=(args, str(folder / "drill.log"), str(folder / "saves.log"),
                                                      save_delay_s))
        p.start()
        live.append(p)
        return p

    try:
        _drill(start, ref, run, checkpoint, print_status)
    finally:                                       # a failed assertion leaves no training process behind
        for p in live:
            if p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)


def _drill(start, ref, run, checkpoint, print_status):
    # the uninterrupted run (never killed, so its saves need no slowing down), beside the drill's runs
    uninterrupted = start(ref, save_delay_s=0.0)

    rng = random.Random(24)
    metrics, saves, ckpts = run / "pretrain" / "stage-1.5" / "metrics.jsonl", run / "saves.log", \
        run / "pretrain" / "stage-1.5" / "dist_ckpt"
    kills, in_save, resumed_from = [], 0, []
    while len(kills) < KILLS:
        found = checkpoint.newest(ckpts, log=None)
        at = found[0] if found else 0
        resumed_from.append(at)
        lines0, saves0 = _lines(metrics), _lines(saves)
        # near the end, kill in the first save (no progress) so the drill does not run out of steps
        kind = "save" if STEPS - at <= 2 * SAVE_EVERY else rng.choice(["step", "save"])
        p = start(run)
        if kind == "step":        # after 3 or 4 new steps (the save of the 2nd is done), inside a step or a save
            target, done = rng.choice([3, 4]), lambda: _lines(metrics) - lines0 >= target
        else:                     # inside the 1st or 2nd save of this run
            target = 1 if STEPS - at <= 2 * SAVE_EVERY else rng.choice([1, 2])
            done = lambda: _lines(saves) - saves0 >= target  # noqa: E731
        t0 = time.time()
        while not done() and p.exitcode is None and time.time() - t0 < 300:
            time.sleep(0.02)
        assert p.exitcode is None, f"run ended before kill {len(kills) + 1}: {(run / 'drill.log').read_text()[-2000:]}"
        time.sleep(rng.uniform(0, SAVE_DELAY_S if kind == "save" else 0.4))
        os.killpg(p.pid, signal.SIGKILL)
        p.join(30)
        assert p.exitcode == -signal.SIGKILL
        if not kills:                              # killed: `ovpipe status` says so (exit 1), not "running"
            buf = io.StringIO()
            assert print_status(run, out=buf) == 1 and "stale" in buf.getvalue(), buf.getvalue()
        kills.append((kind, at))
        in_save += kind == "save"
    p = start(run)                                 # the same command, once more: it finishes
    p.join(600)
    assert p.exitcode == 0, (run / "drill.log").read_text()[-3000:]
    uninterrupted.join(600)
    assert uninterrupted.exitcode == 0, (ref / "drill.log").read_text()[-3000:]
    want = _records(ref)
    assert [r[0] for r in want] == list(range(1, STEPS + 1))

    assert _records(run) == want                   # every step: loss, grad norm, lr — bit for bit
    buf = io.StringIO()
    assert print_status(run, out=buf) == 0 and f"at step {STEPS}/{STEPS}" in buf.getvalue(), buf.getvalue()
    assert in_save >= 3 and len(set(resumed_from)) >= 3, (kills, resumed_from)
    left = sorted(p.name for p in ckpts.iterdir())
    assert left == [f"iter_{STEPS - SAVE_EVERY:07d}", f"iter_{STEPS:07d}", "latest"], left
    print(f"kill drill: {len(kills)} kills ({in_save} inside a save), resumed from steps {resumed_from}, "
          f"{STEPS} steps identical to the uninterrupted run")
