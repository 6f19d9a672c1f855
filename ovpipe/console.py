"""What a step shows on the terminal: its progress bars and one summary line. Everything else a task
prints — third-party warnings (megatron's "Transformer Engine and Apex are not installed",
transformers deprecations, torch.distributed notices), C++ log lines, stray prints — goes to the
task's log file (``RUN/<step>/logs/task_*.log``), where a failure's traceback already goes.

``task_output(log_file)`` points file descriptors 1 and 2 at the log for the duration of a task (so
output from C extensions and child processes is caught too, not only Python's ``warnings``), and keeps
a handle on the real terminal for the progress bars (``terminal()``). ``--verbose`` on a step, or
``OVPIPE_VERBOSE=1`` in the environment (inherited by pool workers, Slurm tasks and torchrun ranks),
leaves the terminal alone and shows everything.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

VERBOSE_ENV = "OVPIPE_VERBOSE"
_terminal = None         # a text stream on the terminal while a task's output goes to its log


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def set_verbose(on: bool) -> None:
    if on:
        os.environ[VERBOSE_ENV] = "1"


def terminal():
    """Where progress bars write: the real terminal, also while ``task_output`` redirects stderr."""
    return _terminal if _terminal is not None else sys.stderr


@contextlib.contextmanager
def task_output(log_file: Path):
    """Send fds 1 and 2 (and with them ``print``, ``warnings`` and C-level writes) to ``log_file``,
    appended, until the block ends; nested calls and ``verbose()`` leave things as they are."""
    global _terminal
    if verbose() or _terminal is not None:
        yield
        return
    log_file = Path(log_file)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    for s in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            s.flush()
    saved = [os.dup(1), os.dup(2)]
    _terminal = os.fdopen(os.dup(2), "w", buffering=1, errors="replace")
    fd = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    streams = sys.stdout, sys.stderr
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        # Python-level streams too, for a host that replaced sys.stdout / sys.stderr (a notebook, pytest)
        sys.stdout = sys.stderr = open(log_file, "a", buffering=1, errors="replace")
        yield
    finally:
        for s in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                s.flush()
        if sys.stdout is not streams[0]:
            with contextlib.suppress(Exception):
                sys.stdout.close()
        sys.stdout, sys.stderr = streams
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for d in saved:
            os.close(d)
        term, _terminal = _terminal, None
        with contextlib.suppress(Exception):
            term.close()


@contextlib.contextmanager
def warnings_to(log_file: Path):
    """Python ``warnings`` (only) appended to ``log_file`` until the block ends: for the part of a command
    that imports heavy libraries before any task's ``task_output`` (the pretrain launcher)."""
    import warnings

    if verbose():
        yield
        return
    log_file = Path(log_file)
    old = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(log_file, "a") as f:
            f.write(warnings.formatwarning(message, category, filename, lineno, line))

    import logging

    # torch logs "No CUDA runtime is found" through its own handler when megatron imports cpp_extension
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = old
        quiet.setLevel(level)
