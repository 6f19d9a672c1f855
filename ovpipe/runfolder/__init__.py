"""The run folder: ``RUN/<step>/{config.json, executor.json, completions/, stats/, logs/, running/, <kind>/}``.

A task is done when its completion marker exists, written last, after the task's parts and stats; a
rerun skips done tasks and redoes the others from scratch. What keeps two commands, a dead upstream or
a killed parent from corrupting a step lives in one module each, lowest first (the import contract in
pyproject.toml holds this order):

* ``lock``: ``step_lock``, the ``flock`` a command holds on ``RUN/<step>/.lock`` (re-entrant, names its holder);
* ``markers``: completion, failure, log and stats files per task (map rank, reduce, apply rank, finalize);
* ``cleanup``: clearing a folder for ``--overwrite`` and the ``.tmp-*`` files a killed writer left;
* ``heartbeat``: ``running/{rank}`` markers and their heartbeat — a running task told from a killed one;
* ``upstream``: the input steps a step reads, their config hashes, and staleness;
* ``prepare``: creating or re-opening a step folder for a run, and the no-op rerun (``up_to_date``);
* ``status``: ``ovpipe status``.
"""
from __future__ import annotations

from pathlib import Path


class RunFolderError(RuntimeError):
    """A run-folder rule refuses the command (a locked step, an unfinished or changed input, a changed config)."""


def step_dir(run_dir: Path, step: str) -> Path:
    return Path(run_dir) / step
