"""A pretrain stage under the run folder's rules (``ovpipe/runfolder/``), like every other step.

``RUN/pretrain/stage-<S>/`` is the stage's step folder: ``config.json`` + ``executor.json`` (config
hash, the input folders' config hashes), ``.lock``, ``running/00000`` (host, pid, Slurm job; its mtime
the heartbeat), ``progress.json`` (the last logged step), ``failures/00000``, and
``completions/00000`` + ``completions/finalized`` once the stage ends — so ``ovpipe status`` shows it
running, done, failed or stale (killed) at its current step.

- ``prepare`` (the launcher, under the stage's lock; ``--wait-lock`` waits for a holder) refuses while
  the stage is running (a Slurm job of an earlier submit), refuses an input folder — the pack step it
  reads, the previous stage — that is unfinalized, or changed since the stage started, naming it,
  and refuses a changed config naming ``field: old → new`` unless ``--overwrite`` (which discards
  the stage's checkpoints). A finished stage with the same config and inputs is a no-op.
- ``tracking`` (rank 0 of the training job, local or Slurm) re-checks the inputs at start, writes the
  running marker and progress, and on exit the completion (done), a failure (an exception), or
  nothing (saved and stopped on a signal: resumed by rerunning the command or a Slurm requeue).

The config holds what changes the result: recipe, stage, steps or epochs, data, micro-batch, global
batch, lr, seed. The layout (TP/PP/CP/DP split of the same global batch) is not in it: checkpoints
reshard, so a stage may resume at another layout.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path

from ovpipe.config import config_hash, config_json
from ovpipe.runfolder import RunFolderError, heartbeat, lock, markers, upstream
from ovpipe.step import save_json

PROGRESS = "progress.json"


@dataclasses.dataclass(frozen=True)
class StageRunConfig:
    recipe: str
    stage: str
    steps: int | None
    epochs: float | None
    data: str
    micro_batch: int
    global_batch: int          # packs per optimizer step: micro_batch × grad_accum × DP
    lr: float | None
    seed: int = 0


def stage_dir(run_dir: Path, stage: str) -> Path:
    return Path(run_dir) / "pretrain" / f"stage-{stage}"


def input_folders(run_dir: Path, stage: str, data: str) -> list[str]:
    """Run-relative folders the stage reads: its pack step, and the previous stage when it exists
    as a step folder (a stage imported or trained under these rules)."""
    from pretrain.recipes import PREVIOUS

    out = [data]
    if stage in PREVIOUS and (stage_dir(run_dir, PREVIOUS[stage]) / "executor.json").exists():
        out.append(f"pretrain/stage-{PREVIOUS[stage]}")
    return out


def _meta(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "executor.json").read_text())
    except (OSError, ValueError):
        return None


def input_hashes(run_dir: Path, stage: str, data: str) -> dict:
    """``{folder: config hash}``; raises ``RunFolderError`` naming an input that is missing or not
    finalized. A folder without ``executor.json`` (made by hand or by another tool) is external."""
    out = {}
    for name in input_folders(run_dir, stage, data):
        d = Path(run_dir) / name
        if not d.is_dir():
            raise RunFolderError(f"pretrain stage {stage}: its input {name!r} does not exist in "
                                           f"{run_dir}; run it first (or give --data)")
        meta = _meta(d)
        if meta is None:
            out[name] = upstream.EXTERNAL
            continue
        # an input whose Slurm job is still queued or running is accepted: this stage's job is afterok on it
        if not markers.is_finalized(d) and not upstream.slurm_pending(d):
            raise RunFolderError(
                f"pretrain stage {stage}: its input {name!r} is not finalized "
                f"({len(markers.done_ranks(d))}/{meta.get('tasks')} ranks done); finish it first")
        out[name] = meta.get("config_hash")
    return out


def _field_changes(old: dict, new: dict) -> list[str]:
    return [f"{k}: {json.dumps(old.get(k))} → {json.dumps(new.get(k))}"
            for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def _input_changes(have: dict, want: dict) -> list[str]:
    out = []
    for k in sorted(set(have) | set(want)):
        if have.get(k) != want.get(k):
            out.append(f"input {k!r} " + ("is new" if k not in have else "is gone" if k not in want else
                                          f"changed since the stage started (config hash {have[k]} → {want[k]})"))
    return out


def prepare(run_dir: Path, cfg: StageRunConfig, overwrite: bool = False) -> str:
    """Check and (re)write the stage's step folder; returns ``"done"`` (nothing to do) or ``"run"``.
    Call under ``runfolder.lock.step_lock(stage_dir(...))``."""
    sdir = stage_dir(run_dir, cfg.stage)
    sdir.mkdir(parents=True, exist_ok=True)
    live = heartbeat.running_ranks(sdir)
    if live:
        info = next(iter(live.values()))
        raise RunFolderError(
            f"{sdir}: the stage is still training (pid {info.get('pid')} on {info.get('host')}"
            + (f", slurm job {info['slurm_job']}" if info.get("slurm_job") else "") + "); wait for it or stop it first")
    inputs = input_hashes(run_dir, cfg.stage, cfg.data)
    want = {"step": "pretrain", "tasks": 1, "config_hash": config_hash(cfg), "outputs": [], "inputs": inputs,
            "phases": ["map"]}
    have = _meta(sdir)
    if have is not None and have.get("step") == "import-model":   # imported weights: the stage starts from them
        import shutil

        shutil.rmtree(sdir / "completions", ignore_errors=True)
        have = None
    if have is not None:
        try:
            old_cfg = json.loads((sdir / "config.json").read_text())
        except (OSError, ValueError):
            old_cfg = {}
        fields = _field_changes(old_cfg, json.loads(config_json(cfg))) if have.get("config_hash") != want[
            "config_hash"] else []
        upstream = _input_changes(have.get("inputs") or {}, inputs)
        if (fields or upstream) and not overwrite:
            parts = ([f"the config changed ({'; '.join(fields)})"] if fields else []) + upstream
            raise RunFolderError(
                f"{sdir}: {'; '.join(parts)}; rerun with --overwrite to discard this stage's checkpoints "
                f"and start it over, or use another --run-dir")
        if not (fields or upstream) and markers.is_finalized(sdir) and not overwrite:
            return "done"
    if overwrite:
        _clear(sdir)
    (sdir / "config.json").write_text(config_json(cfg))
    save_json(sdir / "executor.json", want)
    return "run"


def _clear(sdir: Path) -> None:
    """``--overwrite``: everything but the lock file (held by us), checkpoints included."""
    import shutil

    for p in sdir.iterdir():
        if p.name == lock.LOCK_NAME:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


class _StageMarker(heartbeat.RunningMarker):
    """The running marker, whose heartbeat also copies the last logged step into ``progress.json``."""

    def __init__(self, sdir: Path):
        super().__init__(sdir, 0)
        self.sdir = Path(sdir)

    def _beat(self):
        while not self._stop.wait(self.heartbeat_s):
            write_progress(self.sdir)
            with contextlib.suppress(OSError):
                os.utime(self.path)


def write_progress(sdir: Path) -> dict | None:
    """``progress.json``: the last record of ``metrics.jsonl`` (step, loss) and the planned steps."""
    try:
        with open(Path(sdir) / "metrics.jsonl", "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 4096))
            last = json.loads(f.read().decode(errors="replace").strip().splitlines()[-1])
        steps = json.loads((Path(sdir) / "stage.json").read_text()).get("steps")
    except (OSError, ValueError, IndexError):
        return None
    rec = {"step": last.get("step"), "steps": steps, "loss": last.get("loss")}
    with contextlib.suppress(OSError):
        save_json(Path(sdir) / PROGRESS, rec)
    return rec


@contextlib.contextmanager
def tracking(run_dir: Path, stage: str, rank0: bool):
    """Around the training of rank 0 when the stage folder was prepared (``executor.json``): inputs
    re-checked, running marker, then done / failed. Other ranks, and runs made without the launcher
    (``python -m pretrain.train`` by hand, tests), pass through."""
    sdir = stage_dir(run_dir, stage)
    if not rank0 or not (sdir / "executor.json").exists():
        yield lambda rc: None
        return
    upstream.check_inputs_current(run_dir, sdir)
    (sdir / "completions").mkdir(parents=True, exist_ok=True)
    result = {}
    try:
        with _StageMarker(sdir):
            yield lambda rc: result.update(rc=rc)
    except BaseException as e:
        if not isinstance(e, (KeyboardInterrupt, SystemExit)):
            import traceback

            markers.write_failure(sdir, 0, "".join(traceback.format_exception(e)))
        raise
    finally:
        write_progress(sdir)
    if result.get("rc") == 0:
        markers.mark_done(sdir, 0)
        (sdir / "completions" / markers.FINALIZED).touch()



# ------------------------------------------------------------------ export-model / import-model

def check_exportable(run_dir: Path, stage: str) -> None:
    """``export-model`` reads a stage: refuse one that is training, failed or was killed (it has a
    step folder and is not finalized), naming it. A stage imported or trained before these rules
    (no ``executor.json``) is read as it is."""
    sdir = stage_dir(run_dir, stage)
    if _meta(sdir) is None or markers.is_finalized(sdir):
        return
    live = heartbeat.running_ranks(sdir)
    what = "still training" if live else "failed" if markers.failure_path(sdir, 0).exists() else \
        "not finished (killed or pre-empted: rerun its `ovpipe pretrain` command to resume it)"
    raise RunFolderError(f"pretrain stage {stage} ({sdir}) is {what}; export a finished stage")


@dataclasses.dataclass(frozen=True)
class ImportConfig:
    source: str                # the folder(s) imported, resolved
    format: str                # llava-onevision-1.5 | qwen3+mlcd
    recipe: str


def prepare_import(run_dir: Path, stage: str, cfg: ImportConfig, overwrite: bool = False) -> str:
    """``import-model`` writes a stage's checkpoint: refuse a stage that trained (or imported
    something else) unless ``--overwrite``, naming what differs; ``"done"`` when the same import is
    already there. Call under the stage's lock."""
    sdir = stage_dir(run_dir, stage)
    sdir.mkdir(parents=True, exist_ok=True)
    if heartbeat.running_ranks(sdir):
        raise RunFolderError(f"{sdir}: the stage is training; stop it before importing into it")
    have = _meta(sdir)
    want = {"step": "import-model", "tasks": 1, "config_hash": config_hash(cfg), "outputs": [], "inputs": {},
            "phases": ["map"]}
    from pretrain import checkpoint

    trained = have is not None and have.get("step") != "import-model"
    if have is not None and have.get("config_hash") == want["config_hash"] and markers.is_finalized(sdir) \
            and not overwrite:
        return "done"
    if not overwrite and (trained or (have is None and checkpoint.has_any(sdir / "dist_ckpt"))
                          or (have is not None and have.get("config_hash") != want["config_hash"])):
        try:
            old = json.loads((sdir / "config.json").read_text())
        except (OSError, ValueError):
            old = {}
        diff = _field_changes(old, json.loads(config_json(cfg))) if not trained else [
            f"step: {json.dumps(have.get('step'))} → \"import-model\""]
        raise RunFolderError(
            f"{sdir}: already holds checkpoints" + (f" ({'; '.join(diff)})" if diff else "")
            + "; rerun with --overwrite to replace them, or import into another stage / --run-dir")
    _clear(sdir)
    (sdir / "config.json").write_text(config_json(cfg))
    save_json(sdir / "executor.json", want)
    return "run"


def finish_import(run_dir: Path, stage: str) -> None:
    sdir = stage_dir(run_dir, stage)
    (sdir / "completions").mkdir(parents=True, exist_ok=True)
    markers.mark_done(sdir, 0)
    (sdir / "completions" / markers.FINALIZED).touch()
