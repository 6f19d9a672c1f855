"""``ovpipe eval``: lmms-eval's own CLI over an exported folder and a local task folder; the scores as
the ``eval`` manifest (``RUN/eval/eval/part-00000.parquet``, one row per task × metric × filter).

    ovpipe eval --run-dir RUN --set model=RUN/pretrain/hf-stage-2 --set tasks_dir=DEMO_DATA/eval-tasks

lmms-eval 0.7.3 runs with its own transformers 4.57.6 (why: docs/eval.md), pip-installed ``--no-deps
--require-hashes`` from ``requirements/lmms-eval.txt`` into a cache folder outside the venv
(``$OVPIPE_LMMS_EVAL_DIR``, default ``~/.cache/ovpipe/lmms-eval-<hash of the lock>``) and put first on the
subprocess's ``PYTHONPATH``. The step's pre-start check installs it when missing; no registry, no
lmms-eval: the step stops before any work and says why.

The subprocess is ``python -m lmms_eval --model llava_onevision1_5 --model_args pretrained=MODEL,...
--tasks T --include_path TASKS_DIR --output_path RUN/eval/lmms-eval``, run inside ``tasks_dir`` (so a task's
``data_files`` and image paths may be relative to it) with the hub and datasets offline. Its
``<time>_results.json`` becomes the rows: ``value`` is NULL with ``status: undefined`` where lmms-eval
reports none (``"N/A"``, NaN), and a task lmms-eval ran but reported nothing for is a ``no_result`` row.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ovpipe.config import check_local_path, check_range
from ovpipe.step import Step, TaskContext

REQS = Path(__file__).resolve().parents[1] / "requirements" / "lmms-eval.txt"
MODEL_CLASS = "llava_onevision1_5"


class LmmsEvalUnavailable(RuntimeError):
    """lmms-eval could not be installed from the package registry (the reason is pip's)."""


def site_dir() -> Path:
    key = hashlib.sha256(REQS.read_bytes()).hexdigest()[:12]
    base = Path(os.environ.get("OVPIPE_LMMS_EVAL_DIR", Path.home() / ".cache" / "ovpipe"))
    return base / f"lmms-eval-{key}"


def ensure_lmms_eval(timeout: float = 900) -> Path:
    """The cache folder holding lmms-eval and its own transformers, installed from the lock if missing
    (written as ``.partial-<pid>`` and renamed when whole, so concurrent installs never see half a folder)."""
    site = site_dir()
    if (site / ".complete").exists():
        return site
    tmp = site.with_name(f"{site.name}.partial-{os.getpid()}")
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                               "--require-hashes", "--target", str(tmp), "-r", str(REQS)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        shutil.rmtree(tmp, ignore_errors=True)
        raise LmmsEvalUnavailable(f"pip install of {REQS.name} took over {timeout:.0f} s") from None
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise LmmsEvalUnavailable(f"could not pip-install lmms-eval from the package registry: "
                                  f"{proc.stderr.strip()[-300:]}")
    (tmp / ".complete").write_text(site.name)
    try:
        tmp.rename(site)
    except OSError:              # another process finished first: use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return site


def lmms_eval_version(site: Path) -> str:
    found = sorted(site.glob("lmms_eval-*.dist-info"))
    return found[0].name[len("lmms_eval-"):-len(".dist-info")] if found else "unknown"


@dataclass
class EvalConfig:
    model: str = ""                      # an exported folder (ovpipe export-model), e.g. RUN/pretrain/hf-stage-2
    tasks_dir: str = ""                  # lmms-eval task YAMLs (--include_path), e.g. DEMO_DATA/eval-tasks
    tasks: list[str] = field(default_factory=lambda: ["demo_vqa"])  # lmms-eval task names
    device: str = "cpu"  # cpu or cuda
    batch_size: int = 1  # lmms-eval's batch size
    limit: int | None = None             # lmms-eval --limit: the first N docs of each task
    seed: int = 0  # lmms-eval's seed
    timeout_s: float = 3600  # the evaluation's time limit

    def __post_init__(self):
        if not self.model:
            raise ValueError("model: the exported folder to evaluate (ovpipe export-model --out)")
        if not self.tasks_dir:
            raise ValueError("tasks_dir: a folder of lmms-eval task YAMLs (ovpipe demo-data writes eval-tasks/)")
        if not self.tasks or not all(isinstance(t, str) and t.strip() and "," not in t for t in self.tasks):
            raise ValueError(f"tasks: one or more task names (no commas), got {self.tasks!r}")
        check_range(self, "batch_size", 1)
        check_range(self, "limit", 1)
        check_range(self, "seed", 0)
        check_range(self, "timeout_s", 0, lo_open=True)

    def check(self, run_dir) -> None:
        check_local_path("model", self.model)
        if not (Path(self.model) / "config.json").exists():
            raise ValueError(f"model: {self.model!r} has no config.json — not an exported model folder")
        check_local_path("tasks_dir", self.tasks_dir)
        names = {p.stem for p in Path(self.tasks_dir).glob("*.yaml")}
        missing = [t for t in self.tasks if t not in names]
        if missing:
            raise ValueError(f"tasks: {missing} have no <task>.yaml in tasks_dir {self.tasks_dir!r}")
        try:
            ensure_lmms_eval()
        except LmmsEvalUnavailable as e:
            raise ValueError(f"lmms-eval: {e}") from None


def rows_from_results(results: dict, tasks: list[str], model: str, version: str) -> list[dict]:
    """``<time>_results.json`` → one row per task × metric × filter (``"exact_match,none"``)."""
    rows = []
    for task in tasks:
        res = results.get("results", {}).get(task)
        n = (results.get("n-samples", {}).get(task) or {}).get("effective")
        base = {"task": task, "n_samples": n, "model": model, "lmms_eval_version": version}
        if not res:
            rows.append({**base, "metric": None, "filter": None, "value": None, "stderr": None,
                         "status": "no_result"})
            continue
        for key, value in res.items():
            metric, sep, filt = key.partition(",")
            if not sep or "_stderr" in metric:
                continue                      # "alias", and the stderrs (attached to their metric below)
            err = res.get(f"{metric}_stderr,{filt}")
            num = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
            ok = num is not None and math.isfinite(num)
            rows.append({**base, "metric": metric, "filter": filt, "value": float(num) if ok else None,
                         "stderr": float(err) if isinstance(err, (int, float)) and math.isfinite(err) else None,
                         "status": "ok" if ok else "undefined"})
    return rows


def run(cfg: EvalConfig, task: TaskContext) -> None:
    site = ensure_lmms_eval()
    version = lmms_eval_version(site)
    model, tasks_dir = Path(cfg.model).resolve(), Path(cfg.tasks_dir).resolve()
    out = task.data_path("lmms-eval")
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(task.data_path("hf-datasets")),
           "TOKENIZERS_PARALLELISM": "false"}
    args = [f"pretrained={model}"] + ([f"device={cfg.device}", f"device_map={cfg.device}"] if cfg.device else [])
    cmd = [sys.executable, "-m", "lmms_eval", "--model", MODEL_CLASS, "--model_args", ",".join(args),
           "--tasks", ",".join(cfg.tasks), "--include_path", str(tasks_dir), "--batch_size", str(cfg.batch_size),
           "--seed", str(cfg.seed), "--output_path", str(out)]
    if cfg.limit:
        cmd += ["--limit", str(cfg.limit)]
    task.log.info("lmms-eval %s: %s", version, " ".join(cmd))
    with task.stats.timer("lmms_eval"):
        proc = subprocess.run(cmd, cwd=tasks_dir, env=env, capture_output=True, text=True, timeout=cfg.timeout_s)
    (task.step_dir / "lmms-eval.log").write_text(proc.stdout + proc.stderr)
    found = sorted(out.rglob("*_results.json"))
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"lmms-eval exited {proc.returncode} with no results.json "
                           f"(log: {task.step_dir / 'lmms-eval.log'}): {proc.stderr.strip()[-1500:]}")
    rows = rows_from_results(json.loads(found[-1].read_text()), cfg.tasks, str(model), version)
    task.write_part("eval", rows)
    task.stats.inc("metrics", sum(r["status"] == "ok" for r in rows))
    task.stats.inc("undefined", sum(r["status"] != "ok" for r in rows))
    task.stats.info.update({"lmms_eval_version": version, "results_json": str(found[-1])})


STEP = Step("eval", EvalConfig, run, outputs=("eval",), max_tasks=1, check=EvalConfig.check,
            description="lmms-eval (its own CLI and transformers) over an exported model → the eval manifest")
