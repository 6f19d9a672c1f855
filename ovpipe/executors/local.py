"""Local executor: the incomplete ranks in a process pool on this machine, with a tqdm bar."""
from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from ovpipe import runfolder
from ovpipe.executors.task import TaskFailed, finalize_step, run_task


class LocalExecutor:
    def __init__(self, workers: int = 1, progress: bool = True):
        self.workers = max(1, workers)
        self.progress = progress

    def run(self, step, run_dir: Path, tasks: int, name: str | None = None) -> dict:
        name = name or step.name
        sdir = run_dir / name
        pending = runfolder.pending_ranks(sdir, tasks)
        failures: list[str] = []
        from tqdm import tqdm

        bar = tqdm(total=tasks, initial=tasks - len(pending), desc=name, unit="task",
                   disable=not self.progress, leave=False)
        if self.workers == 1 or len(pending) <= 1:
            # In-process: cheaper than a pool for one worker, same task body.
            for rank in pending:
                try:
                    run_task(step.name, run_dir, rank, tasks, self.workers, name)
                except TaskFailed as e:
                    failures.append(str(e))
                bar.update(1)
        else:
            # spawn, not fork: DuckDB/polars/torch thread pools do not survive fork.
            ctx = mp.get_context("spawn")
            with ProcessPoolExecutor(max_workers=min(self.workers, len(pending)), mp_context=ctx) as pool:
                futs = {pool.submit(run_task, step.name, str(run_dir), r, tasks, 1, name): r for r in pending}
                for fut in as_completed(futs):
                    try:
                        fut.result()
                    except TaskFailed as e:
                        failures.append(str(e))
                    except Exception as e:  # a worker that died (OOM-kill, segfault)
                        failures.append(f"{name} rank {futs[fut]} died: {e!r}")
                    bar.update(1)
        bar.close()
        if failures:
            raise TaskFailed(f"{len(failures)} of {tasks} tasks failed; rerun the same command to retry them:\n  "
                             + "\n  ".join(sorted(failures)))
        return finalize_step(step.name, run_dir, name)
