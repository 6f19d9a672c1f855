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


@dataclass
class NumbersConfig:
    n: int = 10         # the numbers 0..n-1, cut by the reduce into one range per apply rank


def cut_numbers(cfg: NumbersConfig, task: TaskContext) -> None:
    import numpy as np

    from ovpipe.step import slice_bounds

    task.write_reduced("ranges", lo=np.array([slice_bounds(cfg.n, r, task.world_size)[0]
                                              for r in range(task.world_size)] + [cfg.n]))


def write_numbers(cfg: NumbersConfig, task: TaskContext) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    lo = task.read_reduced("ranges")["lo"]
    out = task.part_path("numbers")
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"x": list(range(int(lo[task.rank]), int(lo[task.rank + 1])))}), out)
    task.stats.inc("numbers", int(lo[task.rank + 1] - lo[task.rank]))


# A reduce-first step (no map phase): the reduce cuts the work, each apply rank writes its range.
NUMBERS = Step("numbers", NumbersConfig, reduce=cut_numbers, apply=write_numbers, outputs=("numbers",))
