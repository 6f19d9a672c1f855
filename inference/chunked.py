"""Chunked, resumable generation: the one primitive behind ``recaption`` and ``rollout``.

A generating task runs for hours on a GPU and may be killed or pre-empted at any time, so it writes its
results a chunk at a time and a rerun keeps every chunk already written. Both steps hand over the same
things and keep only what is theirs (prompts, the item → request mapping, statuses)::

    chunks = ChunkedGeneration(task, "rollouts", ids, cfg.chunk_size, config_fingerprint(cfg))
    # ... load the backend (only if chunks.todo), for the file backend over chunks.todo_ids ...
    chunks.generate(lambda: stream_of_items(), lambda items: rows_of(items), id_field="prompt_id")
    n = chunks.write_part()                 # the rank's part: its chunks streamed in order
    ...
    remove_chunks(task)                     # in finalize, once every rank's part is written

* **Plan** (``ChunkedGeneration(...)``): the rank's work-item ids, in the order of its part, are cut into
  chunks of ``chunk_size``; chunk ``k`` lives at
  ``RUN/<step>/chunks/{rank:05d}/chunk-{k:06d}-{key}.parquet`` (``TaskContext.chunk_dir``), ``key`` a hash
  of the chunk's ids and of the step's config (``chunk_key``). Chunks already done are counted
  (``chunks/resumed``); the others are the to-do set (``todo``; their ids in ``todo_ids`` where a file
  backend must index them). Chunk files of this rank under any other name (an older plan) are removed.
* **Generate** (``generate``): the items are streamed (a callable, called only when something is to do),
  cut at the same positions; each to-do chunk's items — checked against the plan by the same key, so the
  two passes over the input cannot silently disagree — go through ``generate`` once and its rows are
  written atomically (``write_chunk``: validated against the manifest schema, sorted by its sort keys,
  ``manifests.io.atomic_write``) before the next chunk starts. A kill loses at most the chunk in flight;
  its temp file is removed when the rank restarts (``ovpipe.runfolder.cleanup.clean_temp_files``). The
  stream stops after the last to-do chunk.
* **Part** (``write_part``): the chunks, consecutive ranges of the slice and each sorted, streamed in order
  into the rank's part (``TaskContext.part_writer``) — the bytes of one ``write_part`` of all the rows,
  whatever the chunk size or the number of resumes.
* **Cleanup** (``remove_chunks``): after every rank's part is written (``finalize``), never by the rank
  itself — a rank killed between its part and its completion marker is redone, and with its chunks gone it
  would regenerate its whole slice.

Memory: one chunk of items and rows, plus one key per chunk (and, with ``want_ids``, the to-do ids) —
never the slice's rows.

**The done rule.** A chunk is done iff the file of its keyed name exists and its Parquet footer reads with
the manifest's schema. The two steps had two rules: ``rollout`` this one; ``recaption`` a fixed name
``chunk-{k}.parquet`` kept iff the whole file read back holds exactly the (sample_id, lang) pairs expected.
The keyed name is the stricter and the correct one: it holds the chunk's ids, which determine the keys
``recaption`` compared (every item gives its rows), *and* the config that generated them, so a chunk made
for the same items under another model, prompt, sampling or file is regenerated where ``recaption``'s rule
kept it. Whole-ness needs no full read: chunks appear only by an atomic rename, and a file cut short loses
its footer (the footer read also catches a schema from another version). And it costs a footer per chunk
at start-up, where ``recaption``'s re-read every finished chunk in full before captioning anything.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

ID_BATCH = 1 << 16           # ids of an Arrow array turned into Python strings at once


def config_fingerprint(cfg) -> str:
    """What generated a chunk: the step's whole config (a dataclass), as sorted JSON."""
    import dataclasses

    return json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)


def chunk_key(ids: Iterable[str], fingerprint: str) -> str:
    """A chunk's key: xxh64 of its ids (each ``\\0``-terminated) and of ``fingerprint``."""
    import xxhash

    h = xxhash.xxh64()
    for i in ids:
        h.update(i.encode() + b"\0")
    h.update(fingerprint.encode())
    return h.hexdigest()


def chunk_path(chunk_dir: Path, k: int, key: str) -> Path:
    return Path(chunk_dir) / f"chunk-{k:06d}-{key}.parquet"


def done_chunk(path: Path, kind: str) -> bool:
    """The done rule (module docstring): the file exists and its footer reads with ``kind``'s schema."""
    import pyarrow.parquet as pq

    from manifests.io import check_part_schema

    if not path.exists():
        return False
    try:
        check_part_schema(path, pq.read_schema(path), kind)
    except Exception:
        return False
    return True


def write_chunk(path: Path, rows: list[dict], kind: str) -> None:
    """One chunk's rows, validated and sorted, written atomically."""
    from manifests.io import write_part

    write_part(rows, path, kind, sort=True)


def remove_chunks(task) -> None:
    """Every rank's chunks (``finalize``: every part is written)."""
    import shutil

    shutil.rmtree(task.step_dir / "chunks", ignore_errors=True)


def iter_ids(ids) -> Iterator[str]:
    """The ids of a list, an iterator, or an Arrow (chunked) array — the latter a batch at a time."""
    import pyarrow as pa

    if isinstance(ids, (pa.Array, pa.ChunkedArray)):
        for at in range(0, len(ids), ID_BATCH):
            yield from ids.slice(at, ID_BATCH).to_pylist()
    else:
        yield from ids


class ChunkedGeneration:
    """One rank's chunked, resumable generation of manifest ``kind`` (see the module docstring).

    ``ids``: the rank's work-item ids in the order of its part (list, iterator or Arrow array; read once).
    ``fingerprint``: what generates the rows (``config_fingerprint(cfg)``). ``want_ids``: keep the to-do
    chunks' ids in ``todo_ids`` (a ``file`` backend indexes only those rows)."""

    def __init__(self, task, kind: str, ids, chunk_size: int, fingerprint: str, want_ids: bool = False):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.task, self.kind, self.chunk_size, self.fingerprint = task, kind, chunk_size, fingerprint
        self.dir = task.chunk_dir()
        self.keys: list[str] = []
        self.sizes: list[int] = []
        self.todo: set[int] = set()
        self.todo_ids: set[str] | None = set() if want_ids else None
        chunk: list[str] = []
        for i in iter_ids(ids):
            chunk.append(i)
            if len(chunk) == chunk_size:
                self._plan(chunk)
                chunk = []
        if chunk:
            self._plan(chunk)
        planned = set(self.paths)
        stale = [p for p in self.dir.glob("chunk-*.parquet") if p not in planned]
        for p in stale:                      # an older plan's chunks: this rank's folder holds this plan's only
            p.unlink(missing_ok=True)
        if stale:
            task.stats.inc("chunks/stale_removed", len(stale))
        task.stats.inc("chunks/resumed", self.n_chunks - len(self.todo))

    def _plan(self, chunk: list[str]) -> None:
        k, key = len(self.keys), chunk_key(chunk, self.fingerprint)
        self.keys.append(key)
        self.sizes.append(len(chunk))
        if not done_chunk(chunk_path(self.dir, k, key), self.kind):
            self.todo.add(k)
            if self.todo_ids is not None:
                self.todo_ids.update(chunk)

    @property
    def n_chunks(self) -> int:
        return len(self.keys)

    @property
    def n_items(self) -> int:
        return sum(self.sizes)

    @property
    def paths(self) -> list[Path]:
        return [chunk_path(self.dir, k, key) for k, key in enumerate(self.keys)]

    def todo_chunks(self, items: Callable[[], Iterable[Any]] | Iterable[Any], id_of: Callable[[Any], str]
                    ) -> Iterator[tuple[int, list]]:
        """``(k, items)`` of each to-do chunk, in order, from the stream of every item of the slice (in the
        order of ``ids``); raises where the stream's ids are not the planned ones."""
        if not self.todo:
            return
        last, k, chunk = max(self.todo), 0, []
        for i, item in enumerate(items() if callable(items) else items):
            k = i // self.chunk_size
            if k not in self.todo:
                continue
            chunk.append(item)
            if len(chunk) == self.sizes[k]:
                if chunk_key((id_of(x) for x in chunk), self.fingerprint) != self.keys[k]:
                    raise RuntimeError(f"{self.task.step}[{self.task.rank}]: chunk {k}'s items are not the ones "
                                       f"planned (the input changed under the task)")
                yield k, chunk
                chunk = []
                if k == last:
                    return
        raise RuntimeError(f"{self.task.step}[{self.task.rank}]: the item stream ended in chunk {k}, before the "
                           f"{self.n_items} items planned (the input changed under the task)")

    def generate(self, items: Callable[[], Iterable[Any]] | Iterable[Any], generate: Callable[[list], list[dict]],
                 id_field: str | None = None, id_of: Callable[[Any], str] | None = None, unit: str = "items") -> int:
        """Generate and write every to-do chunk: ``generate(chunk's items) -> rows`` of the manifest. ``items``
        (or a callable giving them, called only when a chunk is to do) streams the slice's items in the order
        of ``ids``; ``id_field`` / ``id_of`` gives an item's id. Returns the chunks written."""
        if id_of is None:
            if id_field is None:
                raise ValueError("give id_field or id_of")
            id_of = lambda item: item[id_field]  # noqa: E731
        written = 0
        with self.task.progress(self.n_items, unit=unit) as bar:
            bar.update(self.n_items - sum(self.sizes[k] for k in self.todo))
            for k, chunk in self.todo_chunks(items, id_of):
                write_chunk(chunk_path(self.dir, k, self.keys[k]), generate(chunk), self.kind)
                self.todo.discard(k)
                written += 1
                self.task.stats.inc("chunks/written")
                bar.update(len(chunk))
        return written

    def iter_tables(self) -> Iterator:
        """Every chunk, read back in order (after ``generate``)."""
        from manifests.io import read_part

        if self.todo:
            raise RuntimeError(f"{self.task.step}[{self.task.rank}]: chunks {sorted(self.todo)[:5]} not generated")
        for path in self.paths:
            yield read_part(path, self.kind)

    def write_part(self, each: Callable[[Any], None] | None = None) -> int:
        """The rank's part of ``kind``: its chunks streamed in order (``each(table)`` sees every chunk on the
        way, for the step's counters). Returns its rows."""
        n = 0
        with self.task.part_writer(self.kind) as out:
            for t in self.iter_tables():
                if each is not None:
                    each(t)
                n += t.num_rows
                out.write(t)
        return n
