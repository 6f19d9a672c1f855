"""The anatomy of a step: a validated config dataclass and one task body.

A step module defines, with light imports at module level::

    @dataclass
    class LengthsConfig: ...

    def run(cfg: LengthsConfig, task: TaskContext) -> None:
        samples = task.read_input_slice("samples")    # this rank's share of the input
        ...
        task.stats.inc("too_long", n)
        task.write_part("lengths", table)             # RUN/lengths/lengths/part-{rank:05d}.parquet

    STEP = Step("lengths", LengthsConfig, run, inputs={"samples": "samples_steps"}, outputs=("lengths",))

``inputs`` declares every manifest the step reads against the config field naming its folder
(``ovpipe/inputs.py``: optional ones marked ``Input(field, when=...)``); the task's reads go through
that one resolver, and so do the pre-start check, the upstream hashes and ``ovpipe status``.

``ovpipe/registry.py`` names the module of every step, so the CLI imports only the one it
runs. ``finalize(cfg, ctx)`` (optional) runs once after every rank completed — locally
right after the pool, on Slurm in the follow-up job — for reports and small global fix-ups.

Three shapes, told apart by which bodies the ``Step`` holds (``Step.phases``; ``docs/scale.md``):

* **map** — ``Step(name, Config, run)``: rank r of N runs ``run`` over its share of the input;
* **map → reduce → apply** — ``Step(name, Config, run, reduce=..., apply=...)``, for a step that needs the
  whole corpus (``balance``, ``ingest``): ``run`` is the map body (rank r streams its share,
  ``task.write_partial``), ``reduce(cfg, ctx)`` runs once after every map rank (``ctx.iter_partials`` →
  ``ctx.write_reduced``: a small artifact), ``apply(cfg, ctx)`` per rank after it (``ctx.read_reduced`` +
  its share → manifest parts);
* **reduce → apply** — ``Step(name, Config, reduce=..., apply=...)`` with no ``run``, for a step whose
  global pass reads its inputs directly (``pack`` solves the packing over every length, ``select``
  cuts the sorted prompt list), so there is no per-rank partial to make first.

``finalize`` comes last in every shape. Locally: [pool →] reduce → pool → finalize; on Slurm:
[map array →] reduce job → apply array → merge job, each ``afterok`` on the one before.
"""
from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ovpipe.mapreduce import slice_bounds  # noqa: F401  (steps import it from here)

log = logging.getLogger("ovpipe")


@dataclass(frozen=True)
class Step:
    name: str
    config: type
    run: Callable[[Any, "TaskContext"], Any] | None = None   # the map body; None: a reduce-first step
    # {kind: config field naming its step folder(s) | Input(...) | None}: every manifest read from the
    # run folder (ovpipe/inputs.py); the older tuple of kinds is accepted too
    inputs: Any = ()
    outputs: tuple[str, ...] = ()        # manifest kinds written under RUN/<step>/<kind>/
    finalize: Callable[[Any, "TaskContext"], Any] | None = None
    max_tasks: int | None = None         # e.g. 1 for a step that needs the whole input at once
    description: str = ""
    # check(cfg, run_dir) -> None: raise ValueError naming what is missing (an upstream step folder,
    # a tokenizer path) — run by the CLI before any work, so it fails in a second, not at task time.
    check: Callable[[Any, Path], None] | None = None
    # reduce(cfg, ctx) once (after every map rank, if the step has ``run``), apply(cfg, ctx) per rank after it.
    reduce: Callable[[Any, "TaskContext"], Any] | None = None
    apply: Callable[[Any, "TaskContext"], Any] | None = None
    # A step whose one task is a group of processes (a training stage): the executor starts its ranks —
    # ``torchrun`` on this machine (``--nproc``), one Slurm job of N nodes × G tasks with ``srun`` starting
    # each rank (``--nodes``) — and process rank 0 (``RANK``) keeps the task's markers, stats and log;
    # the lock, upstream check, status and ``afterok`` chaining are every step's.
    distributed: bool = False

    def __post_init__(self):
        from ovpipe.inputs import normalise

        object.__setattr__(self, "inputs", normalise(self.inputs))
        if (self.reduce is None) != (self.apply is None):
            raise ValueError(f"step {self.name!r}: reduce and apply come together (map → reduce → apply, "
                             f"or reduce → apply without run)")
        if self.run is None and self.apply is None:
            raise ValueError(f"step {self.name!r}: give run (a map step), or reduce and apply (a reduce-first step)")

        if self.distributed and (self.apply is not None or self.max_tasks != 1):
            raise ValueError(f"step {self.name!r}: a distributed step is one map task (max_tasks=1, no reduce)")

    @property
    def phases(self) -> tuple[str, ...]:
        """The phases in the order they run: ("map",), ("map", "reduce", "apply") or ("reduce", "apply")."""
        return ("map",) * (self.run is not None) + ("reduce", "apply") * (self.apply is not None)


class Stopped(Exception):
    """A task that saved its state and stopped on a signal (SIGTERM / SIGUSR1 before a time limit or a
    pre-emption): neither done nor failed. No failure is recorded; rerunning the command (or a Slurm
    requeue) resumes it. ``signum`` becomes the exit code 128 + signum."""

    def __init__(self, signum: int, message: str = ""):
        super().__init__(message or f"stopped on signal {signum}; rerun the same command to resume")
        self.signum = int(signum)


class StepFailed(Exception):
    """A step whose tasks ran but whose result cannot be used (an ingest with no ok sample): raised by its
    ``finalize`` with the reason, after its manifests and report are written, so ``ovpipe sql`` shows the
    detail. The step is left unfinalized: the command exits 1 (a Slurm chain fails, and ``afterok``
    dependents never start), and a later step refuses to read it."""


def preflight(step: Step, cfg, run_dir: Path, name: str | None = None) -> None:
    """Everything a step needs before its first task: its own ``check`` (paths, tokenizers), then every
    input it declares (``inputs.check_inputs``)."""
    from ovpipe.inputs import check_inputs

    if step.check is not None:
        step.check(cfg, Path(run_dir))
    check_inputs(step, cfg, Path(run_dir), name)


class Stats:
    """Per-task counters and timings, saved as ``stats/{rank:05d}.json`` and merged by sum."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = defaultdict(float)
        self.timings: dict[str, float] = defaultdict(float)
        self.info: dict[str, Any] = {}

    def inc(self, key: str, n: float = 1) -> None:
        self.counters[key] += n

    def timer(self, key: str):
        stats = self

        class _T:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                stats.timings[key] += time.perf_counter() - self.t0

        return _T()

    def to_dict(self) -> dict:
        def norm(d):
            return {k: (int(v) if float(v).is_integer() else v) for k, v in sorted(d.items())}

        return {"counters": norm(self.counters), "timings_s": {k: round(v, 4) for k, v in sorted(self.timings.items())},
                "info": self.info}

    @staticmethod
    def merge(dicts: list[dict]) -> dict:
        counters: dict[str, float] = defaultdict(float)
        timings: dict[str, float] = defaultdict(float)
        info: dict[str, Any] = {}
        for d in dicts:
            for k, v in d.get("counters", {}).items():
                counters[k] += v
            for k, v in d.get("timings_s", {}).items():
                timings[k] += v
            info.update(d.get("info", {}))
        counters = {k: (int(v) if float(v).is_integer() else v) for k, v in counters.items()}
        return {"tasks": len(dicts), "counters": dict(sorted(counters.items())),
                "timings_s": {k: round(v, 4) for k, v in sorted(timings.items())}, "info": info}


@dataclass
class TaskContext:
    """What one task (``rank`` of ``world_size``) of a step sees."""

    step: str
    rank: int
    world_size: int
    run_dir: Path
    workers: int = 1
    stats: Stats = field(default_factory=Stats)
    phase: str = "map"                   # map | reduce | apply | finalize
    # {kind: [step folder, ...]}: the step's declared inputs resolved (``ovpipe/inputs.py``); every read
    # goes to these folders and a kind not in it is refused. None: a context made by hand (tests), which
    # reads the folder it is given or every folder holding the kind.
    inputs: dict[str, list[str]] | None = None

    @classmethod
    def for_step(cls, step: "Step", cfg, run_dir: Path, rank: int = 0, world_size: int = 1,
                 name: str | None = None, **kw) -> "TaskContext":
        """The context a task of ``step`` under ``cfg`` gets, its inputs resolved."""
        from ovpipe.inputs import resolve

        run_dir = Path(run_dir)
        return cls(step=name or step.name, rank=rank, world_size=world_size, run_dir=run_dir,
                   inputs=resolve(step, cfg, run_dir, name), **kw)

    @property
    def step_dir(self) -> Path:
        return self.run_dir / self.step

    def input_steps(self, kind: str) -> list[str]:
        """The step folders this step reads ``kind`` from, in the order its config names them."""
        if self.inputs is None:
            from ovpipe.inputs import holding_folders

            return holding_folders(self.run_dir, kind, self.step)
        if kind not in self.inputs:
            raise ValueError(f"step {self.step!r} reads {kind!r} but its Step.inputs does not declare it "
                             f"(declared and active: {sorted(self.inputs)})")
        return list(self.inputs[kind])

    def _folders(self, kind: str, step: str | None):
        """What the reads of ``kind`` open: ``step`` (one of the resolved folders) or all of them."""
        if self.inputs is None:
            return step
        folders = self.input_steps(kind)
        if step is None:
            return folders
        if step not in folders:
            raise ValueError(f"step {self.step!r} reads {kind!r} from {step!r}, which its inputs do not resolve "
                             f"to (resolved: {folders})")
        return step

    @property
    def log(self) -> logging.Logger:
        return log

    def progress(self, total: int | None, unit: str = "it", desc: str | None = None,
                 log_every_s: float = 10.0) -> "Progress":
        """Progress *inside* the task (steps, loss, items/s), not only the executor's per-task bar:
        a tqdm bar on stderr plus a line in the task log every ``log_every_s`` seconds, so a
        Slurm task's log shows it too."""
        return Progress(total, unit, desc or f"{self.step}[{self.rank}]", log_every_s)

    def duckdb(self):
        """``with task.duckdb() as con:`` a DuckDB connection under ``OVPIPE_REDUCE_MEMORY`` (default 1GB),
        spilling to a folder of this task's own in the step folder, removed afterwards
        (``manifests.io.duckdb_session``)."""
        from manifests.io import duckdb_session

        return duckdb_session(self.step_dir, prefix=f".duckdb-{self.phase}-{self.rank}-")

    def part_path(self, kind: str, suffix: str = ".parquet") -> Path:
        return self.step_dir / kind / f"part-{self.rank:05d}{suffix}"

    def data_path(self, name: str) -> Path:
        """A data file of this rank (``.npy`` shard, packed ``.tar``) under ``RUN/<step>/data/``."""
        p = self.step_dir / "data" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def write_npy(self, name: str, array) -> str:
        """Save a data array atomically under ``RUN/<step>/data/``; returns its path relative to the run."""
        import numpy as np

        from manifests.io import atomic_write

        with atomic_write(self.data_path(name)) as tmp, open(tmp, "wb") as f:
            np.save(f, array)
        return f"{self.step}/data/{name}"

    def write_part(self, kind: str, data, sort: bool = True) -> Path:
        from manifests.io import write_part

        path = write_part(data, self.part_path(kind), kind, sort=sort)
        return path

    def read_input(self, kind: str, step: str | None = None, columns: list[str] | None = None):
        """The whole manifest ``kind`` of this run folder, in canonical order."""
        from manifests.io import read_manifest

        return read_manifest(self.run_dir, kind, step=self._folders(kind, step), columns=columns)

    def read_input_slice(self, kind: str, step: str | None = None, columns: list[str] | None = None):
        """This rank's contiguous share of ``kind`` in canonical order (independent of how the
        input itself was split into parts), read from the row groups that overlap it: a task holds its
        share, never the whole manifest (``iter_input_slice`` streams it)."""
        import pyarrow as pa

        from manifests.schemas import schema_for

        batches = list(self.iter_input_slice(kind, columns, step))
        if batches:
            return pa.Table.from_batches(batches)
        schema = schema_for(kind)
        return schema.empty_table().select(columns) if columns else schema.empty_table()

    def chunk_dir(self) -> Path:
        """This rank's resumable chunks (``recaption``, ``rollout``): a long GPU task writes each chunk of its
        slice here, atomically, as it is done, so a rerun after a kill or pre-emption keeps them (the
        temp files of a killed try are removed as the rank starts: ``clean_temp_files``)."""
        return self.step_dir / "chunks" / f"{self.rank:05d}"

    def read_output(self, kind: str):
        """Every part this step wrote for ``kind`` (for ``finalize``)."""
        from manifests.io import read_manifest

        return read_manifest(self.run_dir, kind, step=self.step)

    def output_files(self, kind: str) -> list[Path]:
        """The parts this step wrote for ``kind``, in path order."""
        from manifests.io import manifest_files

        return manifest_files(self.run_dir, kind, step=self.step)

    # -- three-phase steps (ovpipe/mapreduce.py) ---------------------------------------------

    def input_files(self, kind: str, step: str | None = None, order: str = "canonical") -> list[Path]:
        """The parts of input ``kind`` (of ``step``, or of every folder it resolves to): in path order, or
        with ``order="folders"`` folder by folder in the order the config names them."""
        from manifests.io import manifest_files

        folders = self._folders(kind, step)
        if order == "folders" and not isinstance(folders, (str, type(None))):
            return [f for s in folders for f in manifest_files(self.run_dir, kind, step=s)]
        return manifest_files(self.run_dir, kind, step=folders)

    def input_num_rows(self, kind: str, step: str | None = None) -> int:
        """Rows of input ``kind`` (of ``step``, or of every folder it resolves to), from the footers."""
        from manifests.io import manifest_num_rows

        return manifest_num_rows(self.run_dir, kind, self._folders(kind, step))

    def iter_input(self, kind: str, columns: list[str] | None = None, step: str | None = None, lo: int = 0,
                   hi: int | None = None, batch_rows: int | None = None, order: str = "canonical"):
        """Rows ``[lo, hi)`` of input ``kind`` (of ``step``, or of every folder it resolves to), streamed by
        ``manifests.io.iter_parts`` (``order``: ``canonical``, ``folders`` in config order, or ``files``
        as they lie); a DuckDB sort spills under this step's folder."""
        from manifests.io import BATCH_ROWS, iter_parts

        return iter_parts(self.input_files(kind, step, order), kind, columns, lo, hi, order=order,
                          batch_rows=batch_rows or BATCH_ROWS, spill_dir=self.step_dir)

    def _share(self, kind: str, step: str | None) -> tuple[int, int]:
        return slice_bounds(self.input_num_rows(kind, step), self.rank, self.world_size)

    def iter_input_share(self, kind: str, columns: list[str], step: str | None = None, batch_rows: int | None = None):
        """This rank's share of ``kind`` as record batches: a row range of the parts in file order (a map
        whose partials are sums), one row group at a time — memory one batch, whatever the corpus size."""
        return self.iter_input(kind, columns, step, *self._share(kind, step), batch_rows, order="files")

    def iter_input_canonical(self, kind: str, columns: list[str], step: str | None = None):
        """The whole of ``kind``'s ``columns`` in canonical order, streamed — for a reduce that truly needs
        every row in order — decoded a batch ahead in a background thread (``mapreduce.prefetch``: the one
        process of a reduce uses a second core)."""
        from ovpipe.mapreduce import prefetch

        return prefetch(self.iter_input(kind, columns, step))

    def iter_input_slice(self, kind: str, columns: list[str] | None, step: str | None = None,
                         batch_rows: int | None = None):
        """This rank's canonical slice of ``kind`` (what ``read_input_slice`` returns), streamed: for an
        apply phase whose part must come out sorted, in bounded memory."""
        return self.iter_input(kind, columns, step, *self._share(kind, step), batch_rows)

    def part_writer(self, kind: str, row_group_rows: int | None = None):
        """A streaming writer of this rank's part of ``kind`` (``with task.part_writer(k) as w: w.write(t)``);
        rows must come in canonical order. ``manifests.io.PartWriter``: ``write_part``'s bytes with its
        1M-row row groups, or ``row_group_rows`` (an apply phase whose memory must stay flat)."""
        from manifests.io import PartWriter

        return PartWriter(self.part_path(kind), kind, row_group_rows)

    def partial_path(self, name: str, rank: int | None = None) -> Path:
        return self.step_dir / "partials" / f"{name}-{self.rank if rank is None else rank:05d}.npz"

    def write_partial(self, name: str, **arrays) -> Path:
        """A map rank's partial result (arrays), reduced once by the step's ``reduce``."""
        from ovpipe.mapreduce import save_arrays

        return save_arrays(self.partial_path(name), **arrays)

    def iter_partials(self, name: str):
        """Every map rank's partial ``name``, in rank order (for ``reduce``)."""
        from ovpipe.mapreduce import load_arrays

        for r in range(self.world_size):
            path = self.partial_path(name, r)
            if not path.exists():
                raise FileNotFoundError(f"{path}: map rank {r} left no partial {name!r} — rerun the step")
            yield load_arrays(path)

    def reduced_path(self, name: str) -> Path:
        return self.step_dir / "reduced" / name

    def write_reduced(self, name: str, **arrays) -> Path:
        """The reduce's global artifact ``RUN/<step>/reduced/<name>.npz`` (small: no per-sample rows)."""
        from ovpipe.mapreduce import save_arrays

        return save_arrays(self.reduced_path(f"{name}.npz"), **arrays)

    def read_reduced(self, name: str) -> dict:
        from ovpipe.mapreduce import load_arrays

        return load_arrays(self.reduced_path(f"{name}.npz"))


class Progress:
    """``p.update(n, loss=0.12)``: advance by ``n`` items and show the latest figures."""

    def __init__(self, total: int | None, unit: str, desc: str, log_every_s: float):
        from tqdm import tqdm

        from ovpipe import console

        self.bar = tqdm(total=total, unit=unit, desc=desc, file=console.terminal(), mininterval=1.0, leave=False,
                        dynamic_ncols=True)
        self.unit, self.desc, self.every = unit, desc, log_every_s
        self.t0 = self.last = time.perf_counter()
        self.done = 0

    def update(self, n: int = 1, **figures) -> None:
        self.done += n
        self.bar.update(n)
        if figures:
            self.bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in figures.items()},
                                 refresh=False)
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            extra = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())
            total = f"/{self.bar.total}" if self.bar.total else ""
            log.info("%s: %d%s %s (%.1f %s/s) %s", self.desc, self.done, total, self.unit, rate, self.unit, extra)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def save_json(path: Path, obj) -> None:
    from manifests.io import atomic_write

    with atomic_write(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
