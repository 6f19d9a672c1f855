"""A step that is as noisy as megatron / transformers / torch are at import (registered through
OVPIPE_EXTRA_STEPS by tests/ovpipe/test_console.py)."""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass

from ovpipe.step import Step, TaskContext


@dataclass
class NoisyConfig:
    items: int = 3


def noisy(cfg: NoisyConfig, task: TaskContext) -> None:
    warnings.warn("Transformer Engine and Apex are not installed (a third-party notice)", UserWarning)
    print("a stray print from a library")
    os.write(2, b"W1125 12:29:30.460000 2604 a/c_extension.cpp:183] a C-level log line\n")
    sys.stderr.write("stderr from Python\n")
    with task.progress(cfg.items, unit="item") as p:
        for _ in range(cfg.items):
            p.update(1)
    task.stats.inc("status/ok", cfg.items)
    task.stats.inc("status/broken", 1)


NOISY = Step("t-noisy", NoisyConfig, noisy)
