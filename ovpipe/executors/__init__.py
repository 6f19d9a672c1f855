"""Executors: one task body (``task.run_task``), two ways to schedule it (local pool, Slurm array)."""
from ovpipe.executors.task import run_task, finalize_step
from ovpipe.executors.local import LocalExecutor
from ovpipe.executors.slurm import SlurmExecutor, SlurmOptions


def get_executor(name: str, **kwargs):
    if name == "local":
        return LocalExecutor(**kwargs)
    if name == "slurm":
        return SlurmExecutor(**kwargs)
    raise ValueError(f"--executor must be 'local' or 'slurm', got {name!r}")


__all__ = ["run_task", "finalize_step", "LocalExecutor", "SlurmExecutor", "SlurmOptions", "get_executor"]
