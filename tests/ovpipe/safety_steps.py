"""Tiny steps for the run-safety tests (registered through OVPIPE_EXTRA_STEPS)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ovpipe.step import Step, TaskContext


@dataclass
class SlowConfig:
    seconds: float = 0.0   # how long each rank sleeps at most...
    flag: str = ""         # ...stopping as soon as this file exists
    tag: str = "a"         # changes the config (and its hash) without changing the work


def slow(cfg: SlowConfig, task: TaskContext) -> None:
    end = time.monotonic() + cfg.seconds
    while time.monotonic() < end and not (cfg.flag and Path(cfg.flag).exists()):
        time.sleep(min(0.05, max(0.0, end - time.monotonic())))
    out = task.part_path("things")
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"rank": [task.rank], "tag": [cfg.tag]}), out)
    task.stats.inc("things")


SLOW = Step("t-slow", SlowConfig, slow, outputs=("things",))


@dataclass
class DownConfig:
    things_step: str = ""  # the step folder whose `things` to read (empty: any)


def down(cfg: DownConfig, task: TaskContext) -> None:
    task.stats.inc("ran")


DOWN = Step("t-down", DownConfig, down, inputs={"things": "things_step"})
