"""Slurm executor: one ``sbatch --array`` over the incomplete ranks, a follow-up merge job — and for
a step with a reduce (``Step.reduce``/``Step.apply``) a reduce job and an apply array before the merge.

What it does, in order (the phases the step has, ``Step.phases``):
1. writes ``RUN/<step>/launch_script.slurm`` (kept: it is what was submitted), whose
   ``--array`` lists only the map ranks without a completion marker, throttled with ``%workers``. Slurm refuses
   an array index at or above the cluster's ``MaxArraySize`` (1001 by default; ``scontrol show config``), so
   ranks that span more are submitted as several arrays (``array_chunks``): chunk ``i`` is
   ``launch_script.<i>.slurm``, its indices are ``rank - RANK_OFFSET``, and the task adds the offset back;
   the ``%workers`` throttle is shared among the chunks;
2. ``sbatch --parsable`` it, with ``#SBATCH --dependency=afterok:<merge job>`` on any step of the
   same run folder that produces one of this step's inputs and is still queued or running;
3. steps with a reduce: ``launch_reduce.slurm`` (one job, ``afterok`` on the map array — or, for a
   reduce-first step with no map array, on the input steps' merge jobs — → ``reduced/``), then
   ``launch_apply.slurm`` (an array, ``afterok`` on the reduce job);
4. submits the merge job ``launch_merge.slurm`` (``afterok`` on the array before it, every chunk of it): the
   step's ``finalize`` and merged stats;
5. records the job ids and their chain in ``RUN/<step>/slurm_jobs.json`` (``merge`` is what later
   steps chain on; ``ovpipe status`` prints the chain).

Every script carries its ``#SBATCH --dependency=afterok:…`` line, so the launch scripts themselves
show the chain ``map → reduce → apply → merge`` (``reduce → apply → merge`` for a reduce-first step).

Each array task runs the same task body as the local executor. ``--signal=B:USR1@grace`` asks
Slurm to warn the batch shell before the time limit; the trap stops the task and requeues
it (``scontrol requeue``). A requeued rank starts from scratch: its parts are rewritten and
its completion marker comes last, so a half-done rank is never mistaken for a done one.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ovpipe.runfolder import RunFolderError, markers
from ovpipe.runfolder.lock import step_lock
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
    # a distributed step's one job (``Step.distributed``): N nodes × T tasks, one process per task (per GPU)
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0


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


# Slurm's default MaxArraySize: an array index (not only the count) must be below it.
DEFAULT_MAX_ARRAY_SIZE = 1001


def max_array_size() -> int:
    """The cluster's ``MaxArraySize`` (``scontrol show config``): every array index must be below it. Slurm's
    default (1001) where scontrol does not answer; a ``RuntimeError`` where the cluster turns arrays off (0)."""
    try:
        res = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return DEFAULT_MAX_ARRAY_SIZE
    for line in res.stdout.splitlines() if res.returncode == 0 else []:
        key, _, value = line.partition("=")
        if key.strip() == "MaxArraySize":
            try:
                size = int(value.strip())
            except ValueError:
                break
            if size < 1:
                raise RuntimeError(f"this Slurm cluster has MaxArraySize={size} (job arrays off); the Slurm "
                                   f"executor submits each step's ranks as job arrays")
            return size
    return DEFAULT_MAX_ARRAY_SIZE


def array_chunks(ranks: list[int], max_size: int) -> list[tuple[int, list[int]]]:
    """``(offset, ranks)`` per array to submit: each chunk's ranks lie in ``[offset, offset + max_size)``, so its
    indices ``rank - offset`` stay below ``MaxArraySize``. The ranks below ``max_size`` keep offset 0 (an array
    task's index is its rank, as squeue and the ``.out`` names show it); past them each chunk starts at the lowest
    rank left, which gives the fewest chunks (a rerun of ranks 1200-1499 under 1001 is one array, indices 0-299)."""
    out: list[tuple[int, list[int]]] = []
    for r in sorted(ranks):
        if not out or r >= out[-1][0] + max_size:
            out.append((0 if r < max_size else r, []))
        out[-1][1].append(r)
    return out


def chunk_workers(workers: int, sizes: list[int]) -> list[int]:
    """The ``%throttle`` of each chunk's array: the step's ``workers`` shared in proportion to each chunk's
    ranks (at least one each), so the chunks together run about ``workers`` tasks at once, not one throttle each."""
    total = sum(sizes)
    if len(sizes) == 1 or workers >= total:        # no share binds: each array's throttle is the step's
        return [workers] * len(sizes)
    return [max(1, workers * n // total) for n in sizes]


def _dependency_lines(after: list[str] | None) -> list[str]:
    return [f"#SBATCH --dependency=afterok:{':'.join(after)}", "#SBATCH --kill-on-invalid-dep=yes"] if after else []


def _requeueable_lines(opts: SlurmOptions, output: str, after: list[str] | None) -> list[str]:
    """The ``#SBATCH`` lines of a job that requeues itself on the time-limit warning (an array or a distributed
    step's job): its log, limits, ``USR1`` lead, dependencies, partition, memory and the user's extra lines."""
    lines = [f"#SBATCH --output={output}",
             "#SBATCH --open-mode=append",
             f"#SBATCH --time={opts.time}",
             f"#SBATCH --cpus-per-task={opts.cpus_per_task}",
             f"#SBATCH --signal=B:USR1@{opts.requeue_grace_s}",
             "#SBATCH --requeue",
             *_dependency_lines(after)]
    if opts.partition:
        lines.append(f"#SBATCH --partition={opts.partition}")
    if opts.mem:
        lines.append(f"#SBATCH --mem={opts.mem}")
    return lines + [f"#SBATCH {x}" for x in opts.extra]


def render_launch_script(step_name: str, run_dir: Path, tasks: int, ranks: list[int], workers: int,
                         opts: SlurmOptions, python: str | None = None, name: str | None = None,
                         after: list[str] | None = None, phase: str = "map", offset: int = 0) -> str:
    """The array script of the ``map`` phase or the ``apply`` phase (steps with a reduce),
    ``afterok`` on the jobs in ``after``. Its array indices are ``rank - offset`` (``array_chunks``: an index
    must stay below the cluster's ``MaxArraySize``); the task adds ``offset`` back to get its rank."""
    if min(ranks) < offset:
        raise ValueError(f"rank {min(ranks)} is below the chunk's offset {offset}")
    python = python or sys.executable
    name = name or step_name
    sdir = (run_dir / name).resolve()
    run_dir = run_dir.resolve()
    job = name if phase == "map" else f"{name}-{phase}"
    out = "slurm-%A_%a.out" if phase == "map" else f"slurm-{phase}-%A_%a.out"
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=ovpipe-{job}",
        f"#SBATCH --array={compress_ranks([r - offset for r in ranks])}%{max(1, workers)}",
        *_requeueable_lines(opts, f"{sdir}/logs/{out}", after),
    ]
    what = "" if phase == "map" else f" ({phase} phase: after the reduce, per rank)"
    lines += [
        "",
        f"# ovpipe step {step_name!r}{what}: {tasks} tasks in all; this array holds {len(ranks)} incomplete one(s),",
        f"# ranks {compress_ranks(ranks)}: array index + RANK_OFFSET (an index stays below MaxArraySize).",
        "set -uo pipefail",
        f"RANK_OFFSET={offset}",
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
        f'--rank "$((SLURM_ARRAY_TASK_ID + RANK_OFFSET))" --world-size {tasks} --name {shlex.quote(name)}'
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
    """The one-job script of the ``reduce`` phase (steps with a reduce) or the ``merge`` (finalize + stats)."""
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
        + ("(→ reduced/, once, before the apply ranks)" if phase == "reduce" else "(finalize, merged stats)"),
        "set -uo pipefail",
        "export PYTHONUNBUFFERED=1",
    ]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(opts.env.items())]
    lines += [f"exec {shlex.quote(python)} -m ovpipe.cli _finalize {shlex.quote(step_name)} "
              f"--run-dir {shlex.quote(str(run_dir))} --name {shlex.quote(name)}{flag}", ""]
    return "\n".join(lines)


def render_distributed_job(step_name: str, run_dir: Path, opts: SlurmOptions, python: str | None = None,
                           name: str | None = None, after: list[str] | None = None) -> str:
    """The one job of a distributed step's task: ``opts.nodes`` × ``opts.tasks_per_node`` processes.

    ``srun`` starts every process itself (``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE`` from
    Slurm's ``SLURM_PROCID`` / ``SLURM_LOCALID`` / ``SLURM_NTASKS`` / ``SLURM_NTASKS_PER_NODE``; rendezvous at the first node), so a signal
    reaches them directly, with no launcher in between that would die of it. Each runs ``ovpipe _task``;
    process 0 keeps the task's markers. Pre-emption: ``--signal=B:USR1@<grace>`` warns the batch shell
    before the time limit; its trap forwards USR1 to ``srun``, which forwards it to every process; a step
    that saves and stops (``ovpipe.step.Stopped``) leaves no completion marker, and the script requeues
    the job (``scontrol requeue``), which resumes it. The merge job after it is ``afterok`` as for any step."""
    python = python or sys.executable
    name = name or step_name
    sdir = (run_dir / name).resolve()
    run_dir = run_dir.resolve()
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name=ovpipe-{name.replace('/', '-')}",
             f"#SBATCH --nodes={opts.nodes}",
             f"#SBATCH --ntasks-per-node={opts.tasks_per_node}"]
    if opts.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={opts.gpus_per_node}")
    # the rank-0 log name status and --wait look for
    lines += _requeueable_lines(opts, f"{sdir}/logs/slurm-%j_0.out", after)
    task = (f"exec {shlex.quote(python)} -m ovpipe.cli _task {shlex.quote(step_name)} --run-dir "
            f"{shlex.quote(str(run_dir))} --rank 0 --world-size 1 --name {shlex.quote(name)}")
    rank_env = ("export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS "
                "LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE; ")
    lines += ["",
              f"# ovpipe step {step_name!r}: one task as {opts.nodes} node(s) x {opts.tasks_per_node} process(es).",
              "set -uo pipefail",
              "export PYTHONUNBUFFERED=1"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(opts.env.items())]
    lines += ['FIRST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              # the first node's address as Slurm reaches it (NodeAddr; its name where none is set)
              'MASTER_ADDR=$(scontrol show node "$FIRST" | sed -n "s/.*NodeAddr=\\([^ ]*\\).*/\\1/p" | head -n 1)',
              'export MASTER_ADDR=${MASTER_ADDR:-$FIRST}',
              "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))   # a port per job: two jobs may share a node",
              "export CUDA_DEVICE_MAX_CONNECTIONS=1   # megatron-core: ordered TP comm/compute overlap",
              f"DONE={shlex.quote(str(sdir / 'completions' / '00000'))}",
              "preempted=0",
              "# USR1 (the time-limit warning): the processes save at the end of this step and stop; then requeue",
              'forward() { preempted=1; kill -USR1 "$child" 2>/dev/null; }',
              "trap forward USR1",
              f"srun --kill-on-bad-exit=1 bash -c {shlex.quote(rank_env + task)} &",
              "child=$!",
              'wait "$child"; rc=$?',
              'while kill -0 "$child" 2>/dev/null; do wait "$child"; rc=$?; done   # a trap interrupts wait',
              'if [ "$preempted" = 1 ] && [ ! -e "$DONE" ]; then',
              '  scontrol requeue "$SLURM_JOB_ID"',
              "  exit 0",
              "fi",
              'exit "$rc"',
              ""]
    return "\n".join(lines)


def sbatch(args: list[str]) -> str:
    """``sbatch --parsable ARGS``: the job id."""
    res = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"sbatch {' '.join(args)} failed: {res.stderr.strip() or res.stdout.strip()}")
    return res.stdout.strip().split(";")[0]


# ``--wait`` asks squeue every 0.5 s, and after 30 s less often, up to every 5 s (or what this variable says):
# a long step then costs the controller fewer queries. The test suite sets 0.5, since its steps are seconds long
# and a 5-s poll would be most of each one's wait.
POLL_MAX_ENV = "OVPIPE_SLURM_POLL_MAX_S"


def poll_max_s() -> float:
    raw = os.environ.get(POLL_MAX_ENV, "5")
    try:
        return max(0.1, float(raw))
    except ValueError:
        raise ValueError(f"{POLL_MAX_ENV} must be a number of seconds, got {raw!r}") from None


# squeue states: a job (or array task) still to run, running, or ended without success
_PENDING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "RESV_DEL_HOLD", "STOPPED"}
_RUNNING = {"RUNNING", "CONFIGURING", "COMPLETING", "RESIZING", "SIGNALING", "STAGE_OUT"}


def _squeue(jobs: list[str], all_states: bool = False) -> list[tuple[str, str, str, str]] | None:
    """``(array job id, array task id or "", state, reason)`` per job / array task of ``jobs`` (pending
    array tasks expanded); ``all_states`` adds those that ended within slurmctld's ``MinJobAge``. None
    when squeue cannot answer (not installed, no controller). Job ids slurmctld has forgotten have no row."""
    jobs = [str(j) for j in jobs if j]
    if not jobs:
        return []
    cmd = ["squeue", "-h", "-r", "-j", ",".join(jobs), "-o", "%F|%K|%T|%r"] + (["-t", "all"] if all_states else [])
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        # one id (of one) purged from slurmctld's memory: "Invalid job id specified"
        return [] if "Invalid job id" in res.stderr else None
    rows = []
    for line in res.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4:
            job, task, state, reason = parts
            rows.append((job, "" if task in ("N/A", "") else task, state.split()[0], reason))
    return rows


def _phase_ranks(record: dict, phase: str) -> list[int]:
    if phase == "map":
        return list(record.get("ranks") or [])
    if phase == "apply":
        return list(record.get("apply_ranks") or [])
    return [0]


def _slurm_log(sdir: Path, phase: str, job: str, rank: int, offset: int = 0) -> Path:
    # Slurm names an array task's .out by its index (``%a``): the rank less the chunk's offset
    if phase == "map":          # a distributed step's one job writes the same name (rank 0)
        return sdir / "logs" / f"slurm-{job}_{rank - offset}.out"
    if phase == "apply":
        return sdir / "logs" / f"slurm-apply-{job}_{rank - offset}.out"
    return sdir / "logs" / f"slurm-{phase}-{job}.out"


def chain_status(sdir: Path, record: dict | None = None, rows=...) -> list[dict] | None:
    """The state of each job of the step's last Slurm submit, from the completion markers and squeue.

    Per job of the chain (``map``, ``reduce``, ``apply``, ``merge``): ``state`` — ``done`` (every rank's
    completion marker, the reduce's digest, the ``finalized`` marker), ``running``, ``pending``,
    ``failed`` (a rank ended without its marker: failed, cancelled, timed out, or cancelled because a
    job it was ``afterok`` on failed) or ``unknown`` (squeue cannot answer and the markers are not all
    there); ``done``/``running``/``pending``/``failed`` rank lists; ``reason`` (squeue's, for a pending
    or failed job); ``logs`` per failed rank (the task log and Slurm's ``.out``, those that exist)."""
    sdir = Path(sdir)
    if record is None:
        try:
            record = json.loads((sdir / "slurm_jobs.json").read_text())
        except (OSError, ValueError):
            return None
    chain = record.get("chain") or []
    if rows is ...:
        rows = _squeue([j["job"] for j in chain], all_states=True)
    by_job: dict[str, dict[str, tuple[str, str]]] = {}
    for job, task, state, reason in rows or []:
        by_job.setdefault(job, {})[task] = (state, reason)
    out = []
    for link in chain:
        phase, job = link["phase"], link["job"]
        # a chunk of an array phase (``array_chunks``) lists its own ranks; squeue's task id is rank - offset
        ranks = list(link["ranks"]) if "ranks" in link else _phase_ranks(record, phase)
        offset = int(link.get("offset") or 0)
        if phase in ("map", "apply"):
            have = markers.done_ranks(sdir, phase)
        elif phase == "reduce":
            have = {0} if markers.is_reduced(sdir) else set()
        else:
            have = {0} if markers.is_finalized(sdir) else set()
        jrows = by_job.get(job, {})
        st = {"phase": phase, "job": job, "after": link.get("after") or [], "ranks": len(ranks),
              "rank_list": ranks, "chunks": sum(1 for x in chain if x["phase"] == phase),
              "done": [], "running": [], "pending": [], "failed": [], "reason": "", "logs": {}}
        for r in ranks:
            if r in have:
                st["done"].append(r)
                continue
            # an array task's own row; else the job's row (a pending array squeue did not expand)
            state, reason = jrows.get(str(r - offset) if phase in ("map", "apply") else "", jrows.get("", ("", "")))
            if state in _RUNNING:
                st["running"].append(r)
            elif state in _PENDING:
                st["pending"].append(r)
                st["reason"] = st["reason"] or reason
            elif rows is None:       # squeue cannot say: neither done nor known to have failed
                pass
            else:                    # ended without its marker, or purged from squeue's memory
                st["failed"].append(r)
                if reason and reason != "None":
                    st["reason"] = st["reason"] or f"{state} {reason}"
                elif state:
                    st["reason"] = st["reason"] or state
                task_log = markers.log_path(sdir, r, phase)
                st["logs"][r] = [str(p) for p in (task_log, _slurm_log(sdir, phase, job, r, offset)) if p.exists()]
        if st["failed"]:
            st["state"] = "failed"
        elif len(st["done"]) == len(ranks):
            st["state"] = "done"
        elif st["running"] or (st["done"] and st["pending"]):
            st["state"] = "running"
        elif st["pending"]:
            st["state"] = "pending"
        else:
            st["state"] = "unknown"
        out.append(st)
    return out


def describe_jobs(record: dict) -> str:
    """``map 12 → reduce 13 (afterok:12) → apply 14 (afterok:13) → merge 15 (afterok:14)``: the jobs of
    one submit, as ``slurm_jobs.json`` records them; the chunks of one array phase side by side
    (``map 12 [ranks 0-1000], map 13 [ranks 1001-1499] → merge 14 (afterok:12:13)``)."""
    return _join_phases([(j["phase"], f"{j['phase']} {j['job']}"
                          + (f" [ranks {compress_ranks(j['ranks'])}]" if "offset" in j and _chunked(record, j) else "")
                          + (f" (afterok:{':'.join(j['after'])})" if j.get("after") else ""))
                         for j in record.get("chain") or []])


def _chunked(record: dict, link: dict) -> bool:
    return sum(1 for x in record.get("chain") or [] if x["phase"] == link["phase"]) > 1


def _join_phases(parts: list[tuple[str, str]]) -> str:
    """``a → b``: one phase after another; the chunks of one phase (consecutive, the same phase) with ``, ``."""
    out: list[str] = []
    prev = None
    for phase, text in parts:
        if out and phase == prev and phase in ("map", "apply"):
            out[-1] += f", {text}"
        else:
            out.append(text)
        prev = phase
    return " → ".join(out)


def describe_chain(states: list[dict]) -> str:
    """``map 12 done 4/4 → reduce 13 running (afterok:12) → apply 14 pending 0/4 (afterok:13) → merge 15
    pending (afterok:14)``: one line of the whole chain. A phase submitted in chunks (``array_chunks``) shows
    each chunk with its ranks, side by side: ``map 12 [ranks 0-2] done 3/3, map 16 [ranks 3-4] running 1/2 → …``."""
    parts: list[tuple[str, str]] = []
    for st in states:
        counts = f" {len(st['done'])}/{st['ranks']}" if st["phase"] in ("map", "apply") else ""
        extra = ""
        if st["state"] == "running" and st["phase"] in ("map", "apply"):
            extra = f" ({len(st['running'])} running, {len(st['pending'])} pending)"
        after = f" (afterok:{':'.join(st['after'])})" if st["after"] else ""
        chunk = f" [ranks {compress_ranks(st['rank_list'])}]" if st.get("chunks", 1) > 1 else ""
        parts.append((st["phase"], f"{st['phase']} {st['job']}{chunk} {st['state']}{counts}{extra}{after}"))
    return _join_phases(parts)        # the chunks of one phase run side by side, not one after another


def describe_failure(sdir: Path, states: list[dict]) -> str:
    """Which ranks failed (or were cancelled) in which job, why, and their log files."""
    lines = []
    for st in states:
        if st["state"] != "failed":
            continue
        what = f"{st['phase']} job {st['job']}"
        if st["phase"] in ("map", "apply"):
            what += f": rank{'s' if len(st['failed']) > 1 else ''} {', '.join(map(str, st['failed']))} failed"
        else:
            what += " failed"
        if st["reason"]:
            what += f" ({st['reason']})"
        lines.append(what)
        for r in st["failed"]:
            reason = ""
            fp = markers.failure_path(sdir, r, st["phase"])
            if fp.exists():
                last = [ln for ln in fp.read_text(errors="replace").splitlines() if ln.strip()]
                reason = f" {last[-1].strip()}" if last else ""
            logs = st["logs"].get(r) or []
            who = f"rank {r}" if st["phase"] in ("map", "apply") else st["phase"]
            lines.append(f"  {who}:{reason}" + (f" — logs: {', '.join(logs)}" if logs else " (no log: never started)"))
    return "\n".join(lines)


def status_lines(sdir: Path) -> tuple[list[str], bool]:
    """``ovpipe status``'s lines for a step's Slurm chain: ``slurm: <describe_chain>``, then the failed ranks
    with their logs; and whether a job of the chain failed. No lines for a step never submitted to Slurm."""
    states = chain_status(Path(sdir))
    if not states:
        return [], False
    failed = describe_failure(Path(sdir), states)
    return ([f"    slurm: {describe_chain(states)}"] + [f"    {ln}" for ln in failed.splitlines()]), bool(failed)


class SlurmChainFailed(RuntimeError):
    """A ``--wait`` ended with a job of the step's chain failed or cancelled."""


class SlurmExecutor:
    def __init__(self, workers: int = 1, options: SlurmOptions | None = None, wait: bool = False,
                 dependency: str | None = None, poll_s: float = 0.5, progress: bool = True,
                 wait_lock: bool = False):
        self.wait_lock = wait_lock
        self.progress = progress
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
        """Submit under the step lock (``runfolder.lock.step_lock``); refuses while the jobs of an
        earlier submit of this step folder are still queued or running."""
        run_dir = run_dir.resolve()
        name = self._name = name or step.name
        sdir = run_dir / name
        with step_lock(sdir, wait=self.wait_lock):
            prev = sdir / "slurm_jobs.json"
            if prev.exists():
                rec = json.loads(prev.read_text())
                jobs = [j["job"] for j in rec.get("chain") or []] or [
                    rec.get("array"), rec.get("reduce"), rec.get("apply"), rec.get("merge")]
                live = [j for j in jobs if j and job_active(j)]
                if live:
                    raise RunFolderError(
                        f"{sdir}: slurm jobs {live} of an earlier submit are still queued or running; "
                        f"wait for them (or scancel them) first")
            return self._submit(step, run_dir, tasks, name, sdir)

    def _submit(self, step, run_dir: Path, tasks: int, name: str, sdir: Path) -> dict:
        pending = markers.pending_ranks(sdir, tasks) if "map" in step.phases else []   # a reduce-first step: none
        deps = self.upstream_jobs(step, run_dir)
        if self.dependency:
            deps.append(self.dependency)
        python = sys.executable
        record = {"outputs": list(step.outputs), "ranks": pending, "array": None, "merge": None,
                  "submitted_at": time.time(), "chain": []}
        after = deps or None
        max_size = None

        def submit(phase: str, script: str, path: Path) -> str:
            nonlocal after
            path.write_text(script)
            job = sbatch([str(path)])
            record["chain"].append({"phase": phase, "job": job, "after": list(after or [])})
            after = [job]
            return job

        def submit_array(phase: str, ranks: list[int], stem: str) -> str:
            """The ranks as one array per chunk (``array_chunks``: every index below ``MaxArraySize``), each
            ``afterok`` on what came before; what comes next is ``afterok`` on every chunk. The first chunk's job."""
            nonlocal after, max_size
            if max_size is None:
                max_size = max_array_size()
            before, jobs = after, []
            chunks = array_chunks(ranks, max_size)
            for old in sdir.glob(f"{stem}.*.slurm"):     # an earlier submit's chunks: not what is submitted now
                old.unlink()
            for i, ((offset, part), workers) in enumerate(zip(chunks, chunk_workers(self.workers,
                                                                                    [len(c) for _, c in chunks]))):
                path = sdir / (f"{stem}.slurm" if i == 0 else f"{stem}.{i}.slurm")
                path.write_text(render_launch_script(step.name, run_dir, tasks, part, workers, self.options, python,
                                                     name, before, phase=phase, offset=offset))
                job = sbatch([str(path)])
                jobs.append(job)
                record["chain"].append({"phase": phase, "job": job, "after": list(before or []),
                                        "offset": offset, "ranks": part})
            record[f"{'' if phase == 'map' else 'apply_'}arrays"] = jobs
            after = jobs
            return jobs[0]

        try:
            if pending and step.distributed:
                record["array"] = submit("map", render_distributed_job(step.name, run_dir, self.options, python,
                                                                       name, after),
                                         sdir / "launch_script.slurm")
            elif pending:
                record["array"] = submit_array("map", pending, "launch_script")
            if "apply" in step.phases:
                # The reduce (unless done and no map rank reruns), then the apply ranks: all of them after a new
                # reduce (a rank whose marker holds the same digest returns at once), else the pending ones.
                if pending or not markers.is_reduced(sdir):
                    record["reduce"] = submit("reduce", render_single_job(step.name, run_dir, "reduce",
                                                                          self.options, python, name, after),
                                              sdir / "launch_reduce.slurm")
                    apply_ranks = list(range(tasks))
                else:
                    apply_ranks = markers.pending_ranks(sdir, tasks, "apply")
                record["apply_ranks"] = apply_ranks
                if apply_ranks:
                    record["apply"] = submit_array("apply", apply_ranks, "launch_apply")
            if not record["chain"] and markers.is_finalized(sdir):
                return {"slurm": record, "nothing_to_do": True}
            record["merge"] = submit("merge", render_single_job(step.name, run_dir, "merge", self.options, python,
                                                                name, after),
                                     sdir / "launch_merge.slurm")
        except BaseException:
            # a chunk refused part-way: cancel what this submit queued, so no half of a step runs unrecorded
            submitted = [j["job"] for j in record["chain"]]
            if submitted:
                subprocess.run(["scancel", *submitted], capture_output=True)
            raise
        save_json(sdir / "slurm_jobs.json", record)
        if self.wait:
            self.wait_for(record, sdir)
        return {"slurm": record}

    def wait_for(self, record: dict, sdir: Path, timeout_s: float | None = None, out=None) -> None:
        """Block until no job of the chain is queued or running (``sbatch --wait``'s meaning, for the whole
        chain), printing a line each time the progress changes: per job, ranks done / running / pending.
        Raises ``SlurmChainFailed`` naming the failed ranks and their logs if the step did not finish."""
        out = out or sys.stderr
        t0 = time.time()
        jobs = [j["job"] for j in record.get("chain", [])]
        name = sdir.name
        last = None
        poll, poll_max = self.poll_s, poll_max_s()
        try:
            while True:
                live = _squeue(jobs)
                states = chain_status(sdir, record)
                line = describe_chain(states or [])
                if line != last and self.progress:
                    print(f"{name} [{time.time() - t0:6.0f} s] {line}", file=out, flush=True)
                    last = line
                if live == [] or (live is None and markers.is_finalized(sdir)):
                    break
                if timeout_s is not None and time.time() - t0 > timeout_s:
                    raise TimeoutError(f"{name}: slurm jobs {jobs} still queued or running after {timeout_s:.0f} s")
                time.sleep(poll)
                # a short step ends within a poll or two; a long one is asked less often
                poll = min(max(poll_max, self.poll_s), poll * 1.1) if time.time() - t0 > 30 else poll
        except KeyboardInterrupt:
            print(f"\n{name}: stopped waiting; the jobs {jobs} keep running (ovpipe status {sdir.parent}; "
                  f"scancel {' '.join(jobs)} to stop them)", file=out, flush=True)
            raise
        if not markers.is_finalized(sdir):
            states = chain_status(sdir, record) or []
            detail = describe_failure(sdir, states) or describe_chain(states)
            raise SlurmChainFailed(f"{name}: its Slurm chain ended without finishing the step\n{detail}")
