"""Slurm executor: one ``sbatch --array`` over the incomplete ranks, a follow-up merge job — and for
a three-phase step (``Step.reduce``/``Step.apply``) a reduce job and an apply array between them.

What it does, in order:
1. writes ``RUN/<step>/launch_script.slurm`` (kept: it is what was submitted), whose
   ``--array`` lists only the ranks without a completion marker, throttled with ``%workers``;
2. ``sbatch --parsable`` it, with ``#SBATCH --dependency=afterok:<merge job>`` on any step of the
   same run folder that produces one of this step's inputs and is still queued or running;
3. three-phase steps: ``launch_reduce.slurm`` (one job, ``afterok`` on the map array: partials →
   ``reduced/``), then ``launch_apply.slurm`` (an array, ``afterok`` on the reduce job);
4. submits the merge job ``launch_merge.slurm`` (``afterok`` on the array before it): the step's
   ``finalize`` and merged stats;
5. records the job ids and their chain in ``RUN/<step>/slurm_jobs.json`` (``merge`` is what later
   steps chain on; ``ovpipe status`` prints the chain).

Every script carries its ``#SBATCH --dependency=afterok:…`` line, so the launch scripts themselves
show the chain ``map → reduce → apply → merge``.

Each array task runs the same task body as the local executor. ``--signal=B:USR1@grace`` asks
Slurm to warn the batch shell before the time limit; the trap stops the task and requeues
it (``scontrol requeue``). A requeued rank starts from scratch: its parts are rewritten and
its completion marker comes last, so a half-done rank is never mistaken for a done one.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ovpipe import runfolder
from ovpipe.slurm_jobs import job_active
from ovpipe.step import save_json


@dataclass
class SlurmOptions:
    partition: str | None = None
    time: str = "04:00:00"
    cpus_per_task: int = 1
    mem: str | None = None
    requeue_grace_s: int = 120
    extra: list[str] = field(default_factory=list)     # more "#SBATCH" lines, e.g. "--qos=high"
    env: dict[str, str] = field(default_factory=dict)  # exported in the script


def compress_ranks(ranks: list[int]) -> str:
    """[0,1,2,5,7,8] -> "0-2,5,7-8" (Slurm array syntax)."""
    out, ranks = [], sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)


def _dependency_lines(after: list[str] | None) -> list[str]:
    return [f"#SBATCH --dependency=afterok:{':'.join(after)}", "#SBATCH --kill-on-invalid-dep=yes"] if after else []


def render_launch_script(step_name: str, run_dir: Path, tasks: int, ranks: list[int], workers: int,
                         opts: SlurmOptions, python: str | None = None, name: str | None = None,
                         after: list[str] | None = None, phase: str = "map") -> str:
    """The array script of the ``map`` phase (every step) or the ``apply`` phase (three-phase steps),
    ``afterok`` on the jobs in ``after``."""
    python = python or sys.executable
    name = name or step_name
    sdir = (run_dir / name).resolve()
    run_dir = run_dir.resolve()
    job = name if phase == "map" else f"{name}-{phase}"
    out = "slurm-%A_%a.out" if phase == "map" else f"slurm-{phase}-%A_%a.out"
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=ovpipe-{job}",
        f"#SBATCH --array={compress_ranks(ranks)}%{max(1, workers)}",
        f"#SBATCH --output={sdir}/logs/{out}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --time={opts.time}",
        f"#SBATCH --cpus-per-task={opts.cpus_per_task}",
        f"#SBATCH --signal=B:USR1@{opts.requeue_grace_s}",
        "#SBATCH --requeue",
        *_dependency_lines(after),
    ]
    if opts.partition:
        lines.append(f"#SBATCH --partition={opts.partition}")
    if opts.mem:
        lines.append(f"#SBATCH --mem={opts.mem}")
    lines += [f"#SBATCH {x}" for x in opts.extra]
    what = "" if phase == "map" else f" ({phase} phase: after the reduce, per rank)"
    lines += [
        "",
        f"# ovpipe step {step_name!r}{what}: {tasks} tasks in all; this array holds the {len(ranks)} incomplete ones.",
        "set -uo pipefail",
        "export PYTHONUNBUFFERED=1",
    ]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(opts.env.items())]
    lines += [
        "",
        "# Time limit near (SIGUSR1 from --signal): stop the task and put it back in the queue.",
        "requeue() {",
        '  echo "SIGUSR1: requeueing ${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"',
        '  kill -TERM "$child" 2>/dev/null; wait "$child"',
        '  scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"',
        "  exit 0",
        "}",
        "trap requeue USR1",
        "",
        f"{shlex.quote(python)} -m ovpipe.cli _task {shlex.quote(step_name)} --run-dir {shlex.quote(str(run_dir))} "
        f'--rank "$SLURM_ARRAY_TASK_ID" --world-size {tasks} --name {shlex.quote(name)}'
        + ("" if phase == "map" else f" --phase {phase}") + " &",
        "child=$!",
        'wait "$child"',
        "rc=$?",
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)


def render_single_job(step_name: str, run_dir: Path, phase: str, opts: SlurmOptions, python: str | None = None,
                      name: str | None = None, after: list[str] | None = None) -> str:
    """The one-job script of the ``reduce`` phase (three-phase steps) or the ``merge`` (finalize + stats)."""
    python = python or sys.executable
    name = name or step_name
    sdir = (run_dir / name).resolve()
    run_dir = run_dir.resolve()
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=ovpipe-{name}-{phase}",
        f"#SBATCH --output={sdir}/logs/slurm-{phase}-%j.out",
        "#SBATCH --open-mode=append",
        f"#SBATCH --time={opts.time if phase == 'reduce' else '01:00:00'}",
        f"#SBATCH --cpus-per-task={opts.cpus_per_task}",
        *_dependency_lines(after),
    ]
    if opts.partition:
        lines.append(f"#SBATCH --partition={opts.partition}")
    if opts.mem and phase == "reduce":
        lines.append(f"#SBATCH --mem={opts.mem}")
    lines += [f"#SBATCH {x}" for x in opts.extra]
    flag = " --phase reduce" if phase == "reduce" else ""
    lines += [
        "",
        f"# ovpipe step {step_name!r}: the {phase} job "
        + ("(partials of every map rank → reduced/, once)" if phase == "reduce" else "(finalize, merged stats)"),
        "set -uo pipefail",
        "export PYTHONUNBUFFERED=1",
    ]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(opts.env.items())]
    lines += [f"exec {shlex.quote(python)} -m ovpipe.cli _finalize {shlex.quote(step_name)} "
              f"--run-dir {shlex.quote(str(run_dir))} --name {shlex.quote(name)}{flag}", ""]
    return "\n".join(lines)


def _sbatch(args: list[str]) -> str:
    res = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"sbatch {' '.join(args)} failed: {res.stderr.strip() or res.stdout.strip()}")
    return res.stdout.strip().split(";")[0]


class SlurmExecutor:
    def __init__(self, workers: int = 1, options: SlurmOptions | None = None, wait: bool = False,
                 dependency: str | None = None, poll_s: float = 1.0, progress: bool = True,
                 wait_lock: bool = False):
        self.wait_lock = wait_lock
        self.workers = max(1, workers)
        self.options = options or SlurmOptions()
        self.wait = wait
        self.dependency = dependency
        self.poll_s = poll_s

    def upstream_jobs(self, step, run_dir: Path) -> list[str]:
        """Merge jobs, still live, of the step folders this step reads (``ovpipe.inputs.resolve`` on the
        config ``prepare`` saved: the folders its tasks will read)."""
        from ovpipe.executors.task import load_step_config
        from ovpipe.inputs import input_folders

        cfg = load_step_config(step, run_dir / self._name)
        deps = []
        for folder in input_folders(step, cfg, run_dir, self._name):
            f = run_dir / folder / "slurm_jobs.json"
            if not f.exists():
                continue
            rec = json.loads(f.read_text())
            if rec.get("merge") and job_active(rec["merge"]):
                deps.append(rec["merge"])
        return deps

    def run(self, step, run_dir: Path, tasks: int, name: str | None = None) -> dict:
        """Submit under the step lock (``runfolder.step_lock``); refuses while the jobs of an
        earlier submit of this step folder are still queued or running."""
        run_dir = run_dir.resolve()
        name = self._name = name or step.name
        sdir = run_dir / name
        with runfolder.step_lock(sdir, wait=self.wait_lock):
            prev = sdir / "slurm_jobs.json"
            if prev.exists():
                rec = json.loads(prev.read_text())
                live = [j for j in (rec.get("array"), rec.get("reduce"), rec.get("apply"), rec.get("merge"))
                        if j and job_active(j)]
                if live:
                    raise runfolder.RunFolderError(
                        f"{sdir}: slurm jobs {live} of an earlier submit are still queued or running; "
                        f"wait for them (or scancel them) first")
            return self._submit(step, run_dir, tasks, name, sdir)

    def _submit(self, step, run_dir: Path, tasks: int, name: str, sdir: Path) -> dict:
        pending = runfolder.pending_ranks(sdir, tasks)
        deps = self.upstream_jobs(step, run_dir)
        if self.dependency:
            deps.append(self.dependency)
        python = sys.executable
        record = {"outputs": list(step.outputs), "ranks": pending, "array": None, "merge": None,
                  "submitted_at": time.time(), "chain": []}
        after = deps or None

        def submit(phase: str, script: str, path: Path) -> str:
            nonlocal after
            path.write_text(script)
            job = _sbatch([str(path)])
            record["chain"].append({"phase": phase, "job": job, "after": list(after or [])})
            after = [job]
            return job

        if pending:
            record["array"] = submit("map", render_launch_script(step.name, run_dir, tasks, pending, self.workers,
                                                                 self.options, python, name, after),
                                     sdir / "launch_script.slurm")
        if step.apply is not None:
            # The reduce (unless done and no map rank reruns), then the apply ranks: all of them after a new
            # reduce (a rank whose marker holds the same digest returns at once), else the pending ones.
            if pending or not runfolder.is_reduced(sdir):
                record["reduce"] = submit("reduce", render_single_job(step.name, run_dir, "reduce", self.options,
                                                                      python, name, after),
                                          sdir / "launch_reduce.slurm")
                apply_ranks = list(range(tasks))
            else:
                apply_ranks = runfolder.pending_ranks(sdir, tasks, "apply")
            record["apply_ranks"] = apply_ranks
            if apply_ranks:
                record["apply"] = submit("apply", render_launch_script(step.name, run_dir, tasks, apply_ranks,
                                                                       self.workers, self.options, python, name,
                                                                       after, phase="apply"),
                                         sdir / "launch_apply.slurm")
        if not record["chain"] and runfolder.is_finalized(sdir):
            return {"slurm": record, "nothing_to_do": True}
        record["merge"] = submit("merge", render_single_job(step.name, run_dir, "merge", self.options, python,
                                                            name, after),
                                 sdir / "launch_merge.slurm")
        save_json(sdir / "slurm_jobs.json", record)
        if self.wait:
            self.wait_for(record, sdir)
        return {"slurm": record}

    def wait_for(self, record: dict, sdir: Path, timeout_s: float = 3600) -> None:
        t0 = time.time()
        jobs = [j["job"] for j in record.get("chain", [])] or [j for j in (record["array"], record["merge"]) if j]
        while any(job_active(j) for j in jobs):
            if time.time() - t0 > timeout_s:
                raise TimeoutError(f"slurm jobs {jobs} still running after {timeout_s}s")
            time.sleep(self.poll_s)
        if not runfolder.is_finalized(sdir):
            st = runfolder.step_status(sdir)
            raise RuntimeError(f"slurm jobs {jobs} ended but {sdir.name} is not complete: "
                               f"failed {st['failed']}, stale {st['stale']}, pending {st['pending']}")
