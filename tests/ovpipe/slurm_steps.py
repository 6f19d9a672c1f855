"""Steps used only by the Slurm tests (registered through OVPIPE_EXTRA_STEPS, which sbatch
exports to the jobs)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ovpipe.step import Step, TaskContext


@dataclass
class CountConfig:
    pass


def count_ok(cfg: CountConfig, task: TaskContext) -> None:
    t = task.read_input_slice("samples")
    task.stats.inc("ok", sum(1 for s in t.column("status").to_pylist() if s == "ok"))


COUNT = Step("count-ok", CountConfig, count_ok, inputs=("samples",))


@dataclass
class SleepConfig:
    flag: str = ""      # first run sleeps until signalled; a run that finds the flag file finishes
    seconds: float = 120.0


def sleepy(cfg: SleepConfig, task: TaskContext) -> None:
    flag = Path(cfg.flag)
    if flag.exists():
        task.stats.inc("second_run")
        return
    flag.write_text("started")
    time.sleep(cfg.seconds)


SLEEPY = Step("sleepy", SleepConfig, sleepy)
