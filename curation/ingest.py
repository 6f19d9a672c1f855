"""``ingest``: the recipe's data layouts → the ``samples`` manifest, one conversation per row.

Inputs (``format``, default ``auto``; the adapters are in ``curation/formats*.py``): webdataset
tars and caption Parquet (caption pairs), LLaVA JSON/JSONL (LLaVA-558K, the instruct sets),
LLaVA-OneVision-style Parquet, FineVision Parquet, and the chat ``messages`` layout.

One row per source sample:

- ``sample_id``: xxh3-64 of the images' bytes in order + the conversation's canonical encoding
  (``manifests/conversation.py``). A caption pair from a tar or caption Parquet hashes the image
  bytes + the caption bytes exactly as stored — the id every earlier run gave it. A ``bad_row``
  (no conversation to hash) hashes its raw text.
- ``conversation`` (role, text with ``<image>`` placeholders), ``turns``, ``n_images`` and
  ``images``: every image's address (tar data offset/size, Parquet row + column + list index, or
  image file) with its format and width/height from the header (no full decode unless
  ``verify: full``). Images are read once, for the hash and the header.
- ``source`` / ``lang``: config ``source`` / ``lang``; else the file's path by ``source_from``
  (``"{source}/{lang}/*/*.parquet"``: the Mid-Training-85M layout ``coyo/EN/part00/x.parquet`` gives source
  ``coyo``, lang ``EN``, verbatim); else the row's (``data_source``; caption Parquet's ``source_column`` /
  ``lang_column``); else the file's folder name for ``source`` and null for ``lang``.
- ``category``: config ``category``, else the row's (``category`` / ``data_source`` / FineVision
  ``source``), else ``caption`` for a caption pair, else the source name.
- ``turn_ratings``: FineVision's per-turn ``*_ratings`` (null elsewhere).
- legacy columns: ``shard`` = the file the sample was read from (tar, Parquet, JSON), ``key`` = its
  key there, ``shard_format`` = ``tar`` | ``parquet`` | ``json``; ``offset``/``size``/
  ``image_format``/``width``/``height`` = the first image's (``-1``/0/""/0/0 without one);
  ``caption`` = the caption of a caption source, else the first assistant turn's text.
- ``status``/``error``, first problem found in this order:

    bad_row | unexpected_key | truncated_shard                      (parsing the record)
    missing_image | empty_image | corrupt_image | too_large | too_small   (each image, in order)
    missing_caption | empty_caption | bad_caption_encoding          (caption sources)
    unknown_role | no_assistant | bad_last_turn | empty_turn | image_mismatch   (check_conversation)
    duplicate                                                       (finalize)

A broken sample is a row with a status and an error message, never a crash and never a silent
drop; ``stats`` count ``status/<status>``. Duplicates (same ``sample_id``) are found over the whole
corpus by the apply ranks (every copy of an id lies in one rank's range, below): the first occurrence
in (source, shard, key) order keeps its status, later ones become ``duplicate`` with the first one
named in ``error`` — whatever the task split. The same key twice in one file: the earlier copy is the
first occurrence (rows are told apart by position).

Images: ``curation/image_header.py`` (``inspect_image``: size as displayed, ``too_large`` from the
header, ``verify``).

Files: every input file gets one row in the ``shards`` manifest (``shard``, ``source``,
``format``, ``shard_format``, ``samples``, ``status``, ``error``), written by the task owning its
first unit, ``samples`` counted in ``finalize``; ``stats`` count ``shard_status/<status>``:

    ok               read whole
    bad_shard        not its format at all (not a tar, not Parquet, empty): no samples rows
    truncated_shard  a tar cut short or damaged: the samples before the cut are rows (a sample
                     whose member is cut is a ``truncated_shard`` row), nothing after it is read
    missing_column   a Parquet file without the columns its layout needs (or, with ``format:
                     auto``, whose layout cannot be told from its columns)

Such a file never fails the task: the step completes, and ``SELECT * FROM shards WHERE status
<> 'ok'`` lists them (the report too) — unless no ok sample is left (every file bad, a wrong
``caption_column``): then the step fails in ``finalize`` with the reason (``empty_run_check``), after
writing its manifests, so the run stops instead of handing ``lengths`` an empty corpus. A link or
special file in a tar is a member whose data is not read: a ``missing_image`` (or ``missing_caption``) row naming it. Errors that are not about
the data (an I/O error, a config error such as ``format`` not fitting the file type) still fail.

Three phases (map → reduce → apply, ``docs/scale.md``) around the framework's external sort
(``ovpipe/shuffle.py``), so the ``samples`` parts come out as contiguous ``sample_id`` ranges —
canonical order as they lie, so no later task (``lengths``, ``embed-images``, an apply rank) sorts the
whole manifest to find its slice:

- **map**: work is split in units (a tar; a Parquet row group; ``JSON_CHUNK_ROWS`` JSON records): unit
  ``u`` of the ``i``-th input file (sorted) goes to rank ``(i + u) % world_size``. The rank's rows go to
  sorted spill runs under ``shuffle/`` (``SpillWriter``), counted per ``sample_id`` bucket; the partial
  is that bucket count. The file's ``shards`` row is written here. Memory: one run.
- **reduce**: sums the bucket counts and cuts the buckets into ``world_size`` ranges of ≈ equal rows
  (``bucket_cuts`` → ``reduced/ranges.npz``).
- **apply**: rank r merges its id range of every run into canonical order (ties by map rank and read
  order, as the merged manifest orders them) a sub-range at a time (``merge_runs``); it marks
  duplicates as the rows stream (``FirstOccurrence``) and writes its part batch by batch.
- **finalize**: the counts (``shards.samples``, ``status/*``), the report, and the spill runs removed
  (like a MapReduce job's map outputs: a rank of a finished ingest is redone by redoing the step).

The merged manifest is byte-identical for any task count, spill size or batch size
(``tests/curation/test_ingest_shuffle.py``).
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from curation.formats import FORMATS, RawSample, ShardError, default_source, detect_format
from curation.image_header import DEFAULT_MAX_PIXELS, inspect_image
from curation.readers import adapter
from ovpipe.step import Step, TaskContext


@dataclass
class IngestConfig:
    inputs: list[str] = field(default_factory=list)   # paths or globs: .tar / .parquet / .json / .jsonl
    source: str | None = None                          # source name; default: `source_from`'s {source}, else the
                                                       # row's (data_source, source_column), else the file's
                                                       # folder (the dataset's, above a hub `data/`)
    # a path pattern naming parts of each input's path: "{source}/{lang}/*/*.parquet" (the Mid-Training-85M
    # layout) gives source and lang from the folders; glob syntax otherwise (*, ?, **), matched at the path's end
    source_from: str | None = None
    lang: str | None = None                            # the whole step's language; default: `source_from`'s {lang},
                                                       # else the row's `lang_column`, else null
    source_column: str | None = None                   # caption Parquet: a column holding each row's source name
    lang_column: str | None = None                     # caption Parquet: a column holding each row's language
    format: str = "auto"                               # one of curation.formats.FORMATS
    category: str | None = None                        # the whole step's category; default: per row (see above)
    image_root: str | None = None                      # image paths are relative to it; default: the file's folder
    image_column: str = "image"                        # caption Parquet: binary, or struct with a `bytes` field
    caption_column: str = "caption"                    # caption Parquet
    image_columns: list[str] = field(default_factory=list)  # LLaVA-OV Parquet; default: every image-typed column
    extra_turn_keys: list[str] = field(default_factory=list)  # turn keys tolerated besides from/value, role/content
    verify: Literal["none", "header", "full"] = "header"  # header: size + end-of-image marker; full: decode
    min_side: int = 1                                  # an image whose shorter side is below it: a `too_small` row
    max_pixels: int = DEFAULT_MAX_PIXELS               # width*height above it: a `too_large` row (from the header)

    def __post_init__(self):
        if not self.inputs:
            raise ValueError("inputs: give at least one path or glob (e.g. ['data/shards/*.tar'])")
        if self.format not in FORMATS:
            raise ValueError(f"format: {self.format!r} is not one of {', '.join(FORMATS)}")
        if self.min_side < 1:
            raise ValueError(f"min_side must be >= 1, got {self.min_side}")
        if self.max_pixels < 1:
            raise ValueError(f"max_pixels must be >= 1, got {self.max_pixels}")
        if self.category is not None and not self.category.strip():
            raise ValueError("category: give a name or leave it out (null: per row)")
        if self.image_root is not None and not os.path.isdir(os.path.expanduser(self.image_root)):
            raise ValueError(f"image_root: {self.image_root!r} is not a folder")
        if self.source_from is not None:
            path_fields(self.source_from)      # its placeholders are checked here (ValueError naming the field)


PATH_FIELDS = ("source", "lang")


def path_fields(pattern: str):
    """``source_from`` as a compiled regex matching the end of a file's path: ``{source}`` / ``{lang}`` one
    folder or file-name part each, ``**`` any number of folders, ``*`` / ``?`` as in a glob."""
    import re

    names = re.findall(r"\{([^{}]*)\}", pattern)
    unknown = [n for n in names if n not in PATH_FIELDS]
    if unknown or not names:
        raise ValueError(f"source_from: {pattern!r} must name {{source}} and/or {{lang}}"
                         + (f", not {{{unknown[0]}}}" if unknown else ""))
    if len(set(names)) != len(names):
        raise ValueError(f"source_from: {pattern!r} names a field twice")
    out, i = "", 0
    for m in re.finditer(r"\{(source|lang)\}|\*\*/?|\*|\?", pattern):
        out += re.escape(pattern[i:m.start()])
        tok = m.group(0)
        out += (f"(?P<{m.group(1)}>[^/]+)" if m.group(1) else "(?:.*/)?" if tok.startswith("**") and tok.endswith("/")
                else ".*" if tok == "**" else "[^/]*" if tok == "*" else "[^/]")
        i = m.end()
    out += re.escape(pattern[i:])
    return re.compile(f"(?:^|/){out.lstrip('/')}$" if not pattern.startswith("/") else f"^{out}$")


def path_values(cfg: "IngestConfig", path: str) -> dict[str, str]:
    """{source, lang} of one input file from ``source_from`` (empty without one); ``ValueError`` when the
    pattern does not match the file (checked for every file before any work)."""
    if cfg.source_from is None:
        return {}
    m = path_fields(cfg.source_from).search(Path(path).as_posix())
    if m is None:
        raise ValueError(f"source_from: {cfg.source_from!r} does not match the input file {path}")
    return m.groupdict()


def expand_inputs(patterns: list[str]) -> list[str]:
    """Every file the input patterns match (``**`` matches any number of folders), each once, sorted."""
    files: list[str] = []
    for pat in patterns:
        hits = sorted(p for p in glob.glob(os.path.expanduser(pat), recursive=True) if os.path.isfile(p))
        if not hits:
            raise FileNotFoundError(f"ingest.inputs: {pat!r} matches no file")
        files.extend(hits)
    return sorted({str(Path(f).resolve()) for f in files})


def check_inputs(cfg: IngestConfig, run_dir: Path) -> None:
    """Before any work (``ovpipe ingest``): every input pattern matches a file, and ``source_from`` matches
    every file."""
    try:
        files = expand_inputs(cfg.inputs)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    for f in files:
        path_values(cfg, f)


def read_image_bytes(row: dict) -> bytes:
    """The bytes of a ``samples`` row's first image (what the curation steps embed), from its
    ``images`` address. A text-only sample has none: ``ValueError`` (callers skip ``n_images == 0``)."""
    from manifests.conversation import read_image

    if not row["images"]:
        raise ValueError(f"sample {row.get('sample_id')} has no image (a text-only sample)")
    return read_image(row["images"][0])


def sample_row(raw: RawSample, source: str, shard: str, shard_format: str, cfg: IngestConfig,
               from_path: dict | None = None) -> dict:
    """One ``samples`` row from an adapter's ``RawSample`` (status order: module docstring)."""
    from manifests.conversation import CAPTION_CATEGORY, check_conversation, is_caption_pair, sample_id

    problem = raw.format_status
    images = []
    for k, ref in enumerate(raw.images):
        if ref.data is None:
            st, w, h, fmt, err = "missing_image", 0, 0, "", ref.error or "image not found"
        else:
            st, w, h, fmt, err = inspect_image(ref.data, cfg.verify, cfg.max_pixels)
            if st == "ok" and min(w, h) < cfg.min_side:
                st, err = "too_small", f"{w}x{h} is below min_side={cfg.min_side}"
        if ref.addr is not None:
            images.append({**ref.addr, "size": len(ref.data or b""), "format": fmt, "width": w, "height": h})
        if problem is None and st != "ok":
            problem = st, (f"image {k}: {err}" if len(raw.images) > 1 else err)
    problem = problem or raw.text_status
    if problem is None:
        problem = check_conversation(raw.turns, len(images))
    image_bytes = [ref.data or b"" for ref in raw.images]
    sid = sample_id(image_bytes, raw.turns, encoded=raw.encoded)
    first = images[0] if images else None
    if raw.caption_source:
        caption = raw.caption
    else:
        caption = next((t for r, t in raw.turns if r == "assistant"), None)
    from_path = from_path or {}
    source = source if cfg.source or from_path.get("source") else (raw.source or source)
    lang = cfg.lang or from_path.get("lang") or raw.lang
    category = cfg.category or raw.category or (
        CAPTION_CATEGORY if raw.caption_source or is_caption_pair(raw.turns, len(images)) else source)
    return {"sample_id": sid, "source": source, "lang": lang, "shard": shard, "key": raw.key, "shard_format": shard_format,
            "offset": first["offset"] if first else -1, "size": first["size"] if first else 0,
            "image_format": first["format"] if first else "", "width": first["width"] if first else 0,
            "height": first["height"] if first else 0, "caption": caption, "category": category,
            "n_images": len(images), "images": images,
            "conversation": [{"role": r, "text": t} for r, t in raw.turns], "turns": len(raw.turns),
            "turn_ratings": raw.ratings, "status": problem[0] if problem else "ok",
            "error": problem[1] if problem else None}


SHARD_FORMAT = {"webdataset": "tar", "json-auto": "json", "llava-json": "json"}


def shard_format_of(path: str, fmt: str | None) -> str:
    if fmt in SHARD_FORMAT:
        return SHARD_FORMAT[fmt]
    return "tar" if path.endswith(".tar") else "parquet" if path.endswith(".parquet") else "json"


def shuffle_dir(task: TaskContext) -> Path:
    return task.step_dir / "shuffle"


def run(cfg: IngestConfig, task: TaskContext) -> None:
    """Map: read this rank's units (files, row groups, JSON chunks) into ``samples`` rows, spilled as
    sorted runs under ``shuffle/`` with a per-bucket count (the partial), and write this rank's
    ``shards`` rows."""
    import numpy as np

    from ovpipe.shuffle import SpillWriter

    files = expand_inputs(cfg.inputs)
    spill = SpillWriter(shuffle_dir(task), task.rank, "samples")
    shards: list[dict] = []
    n = 0
    with task.progress(None, unit="sample") as bar:
        for i, path in enumerate(files):
            owner = i % task.world_size == task.rank  # owns the file's first unit: counts it, writes its `shards` row
            from_path = path_values(cfg, path)
            source = cfg.source or from_path.get("source") or default_source(path)
            fmt, problem = None, None
            n0 = n

            def take(unit: int, i=i) -> bool:
                return (i + unit) % task.world_size == task.rank

            try:
                fmt = detect_format(path, cfg.format, cfg.caption_column)
                shard_format = shard_format_of(path, fmt)
                with task.stats.timer("read"):
                    for raw in adapter(fmt, path)(path, cfg, take):
                        row = sample_row(raw, source, path, shard_format, cfg, from_path)
                        task.stats.inc(f"status/{row['status']}")
                        task.stats.inc("images", row["n_images"])
                        spill.add(row)
                        n += 1
                        if n % 256 == 0:
                            bar.update(256, file=i)
            except ShardError as e:  # the samples read before it stay; the file gets a status
                problem = e
                if owner:
                    task.log.warning("ingest: %s: %s", e.status, e)
            task.stats.inc("samples", n - n0)
            if owner:  # each file counted once, whatever the split
                status = problem.status if problem else "ok"
                task.stats.inc("files")
                task.stats.inc(f"format/{fmt or 'unknown'}")
                task.stats.inc(f"shard_status/{status}")
                shards.append({"shard": path, "source": source, "format": fmt or "",
                               "shard_format": shard_format_of(path, fmt), "samples": 0, "status": status,
                               "error": str(problem)[:500] if problem else None})
    with task.stats.timer("spill"):
        spill.flush()
    task.write_partial("buckets", counts=spill.buckets, runs=np.array([spill.runs]))
    task.write_part("shards", shards)


def cut_ranges(cfg: IngestConfig, task: TaskContext) -> None:
    """Reduce: sum the map ranks' bucket counts and cut the buckets into ``world_size`` contiguous
    ranges balanced by rows (``ovpipe.shuffle.bucket_cuts``) — apply rank r owns ids ``[cuts[r],
    cuts[r+1])``. Writes ``reduced/ranges.npz`` (cuts, each map rank's run count, the bucket counts)."""
    import numpy as np

    from ovpipe.shuffle import N_BUCKETS, bucket_cuts, spill_files

    total = np.zeros(N_BUCKETS, np.int64)
    runs = []
    for part in task.iter_partials("buckets"):
        total += part["counts"]
        runs.append(int(part["runs"][0]))
    spill_files(shuffle_dir(task), runs)
    cuts = bucket_cuts(total, task.world_size)
    task.stats.inc("shuffled_rows", int(total.sum()))
    task.write_reduced("ranges", cuts=np.array(cuts, np.int64), runs=np.array(runs, np.int64), buckets=total)


def write_samples(cfg: IngestConfig, task: TaskContext) -> None:
    """Apply: this rank's id range of every spill run, merged into canonical order a sub-range at a
    time (``merge_runs``), duplicates marked as the rows stream, written batch by batch. Every copy of
    an id lies in one range, so the first occurrence in (source, shard, key) order — ties by map rank
    and read order, as the merged manifest orders them — keeps its status and the later ones become
    ``duplicate``, whatever the task split."""
    from ovpipe.mapreduce import BATCH_ROWS
    from ovpipe.shuffle import merge_runs, spill_files

    r = task.read_reduced("ranges")
    cuts, runs = r["cuts"], r["runs"]
    lo_b, hi_b = int(cuts[task.rank]), int(cuts[task.rank + 1])
    files = spill_files(shuffle_dir(task), runs)
    marker = _DuplicateMarker()
    with task.part_writer("samples", row_group_rows=BATCH_ROWS) as w, \
            task.progress(int(r["buckets"][lo_b:hi_b].sum()), unit="sample", desc=f"ingest[apply {task.rank}]") as bar:
        for batch in merge_runs(files, "samples", r["buckets"], lo_b, hi_b, task.stats, BATCH_ROWS,
                                tag=f"{task.rank:05d}"):
            batch = marker.mark(batch)
            w.write(batch)
            bar.update(batch.num_rows)
    task.stats.inc("duplicates", marker.marked)


class _DuplicateMarker:
    """Marks every row whose ``sample_id`` equals an earlier row's, over a stream in canonical order
    (``ovpipe.shuffle.FirstOccurrence``): ``duplicate`` with the first occurrence named in ``error``."""

    def __init__(self):
        from ovpipe.shuffle import FirstOccurrence

        self.first, self.marked = FirstOccurrence("sample_id", origin=("shard", "key")), 0

    def mark(self, batch):
        import pyarrow as pa

        repeats = self.first.repeats(batch)
        if repeats is None:
            return batch
        shard, key = batch.column("shard").to_pylist(), batch.column("key").to_pylist()
        status, error = batch.column("status").to_pylist(), batch.column("error").to_pylist()
        for i, first in enumerate(repeats):
            if first is None:
                continue
            text = f"{Path(first[0]).name}/{first[1]}"
            if (shard[i], key[i]) == first:
                text += " (an earlier copy with the same key)"
            status[i], error[i] = "duplicate", f"duplicate of {text}"
            self.marked += 1
        names = batch.schema.names
        cols = [pa.array(status, pa.string()) if c == "status" else pa.array(error, pa.string()) if c == "error"
                else batch.column(c) for c in names]
        return pa.RecordBatch.from_arrays(cols, schema=batch.schema)


def _sql_list(paths: list[str]) -> str:
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"


def _counts(task: TaskContext, files: list[Path], column: str) -> list[tuple]:
    """``[(value, rows)]`` of one ``samples`` column over every part (DuckDB ``GROUP BY``)."""
    with task.duckdb() as con:
        paths = [str(Path(f).resolve()) for f in files]
        return con.execute(f'SELECT "{column}", count(*) FROM read_parquet({_sql_list(paths)}) GROUP BY 1').fetchall()


def finalize(cfg: IngestConfig, task: TaskContext) -> None:
    """Count each file's samples into ``shards``, make the ``status/*`` stats equal the manifest's
    counts, write the report, and remove the shuffle's spill runs. The whole-corpus counts are DuckDB
    ``GROUP BY``s of one column under a memory limit (``_counts``)."""
    import shutil

    import pyarrow as pa

    from manifests.io import read_part, write_part

    files = task.output_files("samples")
    by_status = _counts(task, files, "status")
    # stats.json sums the ranks' stats and this one's: make its status/<x> equal the manifest's
    # counts (computed, not counted per change, so a finalize rerun after a kill stays exact).
    ranks: dict[str, float] = {}
    for r in range(task.world_size):
        f = task.step_dir / "stats" / f"{r:05d}.json"
        for k, v in (json.loads(f.read_text()).get("counters", {}) if f.exists() else {}).items():
            if k.startswith("status/"):
                ranks[k] = ranks.get(k, 0) + v
    final = {f"status/{v}": n for v, n in by_status}
    for k in sorted(set(ranks) | set(final)):
        if final.get(k, 0) != ranks.get(k, 0):
            task.stats.inc(k, final.get(k, 0) - ranks.get(k, 0))
    # shards: every file's sample count over all tasks (its row was written by one task)
    counts = dict(_counts(task, files, "shard"))
    shard_parts = sorted((task.step_dir / "shards").glob("part-*.parquet"))
    bad: list[dict] = []
    for f in shard_parts:
        t = read_part(f, "shards")
        n = pa.array([counts.get(s, 0) for s in t.column("shard").to_pylist()], pa.int64())
        t = t.set_column(t.schema.get_field_index("samples"), "samples", n)
        write_part(t, f, "shards", sort=True)
        bad += [r for r in t.to_pylist() if r["status"] != "ok"]
    tables = [_count_table(by_status, "status"), _count_table(_counts(task, files, "category"), "category")]
    n_dups = dict(by_status).get("duplicate", 0)
    if bad:
        lines = ["| shard | status | samples | error |", "| --- | --- | ---: | --- |"]
        for r in sorted(bad, key=lambda r: r["shard"]):
            err = (r["error"] or "").replace("|", "\\|")
            lines.append(f"| {Path(r['shard']).name} | {r['status']} | {r['samples']} | {err} |")
        tables.append("\n".join(lines))
    (task.step_dir / "report.md").write_text(
        f"{sum(n for _, n in by_status)} samples ingested from {len(expand_inputs(cfg.inputs))} files"
        + (f" ({len(bad)} with a problem: see the `shards` manifest)" if bad else "")
        + f"; {n_dups} duplicate(s) marked.\n\n"
        + "\n\n".join(tables) + "\n")
    # every apply rank is done (finalize runs last): the spill runs are a second copy of the corpus
    shutil.rmtree(shuffle_dir(task), ignore_errors=True)
    empty_run_check(task.step, dict(by_status), n_files=sum(len(read_part(f, "shards", ["shard"])) for f in shard_parts),
                    bad=bad)


def empty_run_check(name: str, by_status: dict, n_files: int, bad: list[dict]) -> None:
    """An ingest with no ok sample fails (``StepFailed``: exit 1, the Slurm chain stops) — so does one whose
    every file is unusable, which has no sample at all: a wrong ``caption_column`` must not become an empty
    run that ``lengths`` and ``pack`` then process "successfully". The reason is the first bad file's error
    (a cut tar that kept its ok samples is not a reason to stop), or the samples' statuses."""
    from ovpipe.step import StepFailed

    if by_status.get("ok", 0):
        return
    total = sum(by_status.values())
    statuses = ", ".join(f"{n} {s}" for s, n in sorted(by_status.items(), key=lambda d: -d[1])) or "none"
    why = (f"{len(bad)} of {n_files} file(s) bad, first: {Path(bad[0]['shard']).name}: {bad[0]['status']}: "
           f"{bad[0]['error']}" if bad else f"statuses: {statuses}")
    raise StepFailed(f"{name}: no ok sample ({total} samples read from {n_files} file(s); {why}) — fix the config "
                     f"(caption_column, image_column, format, inputs) and rerun; `SELECT * FROM shards` and "
                     f"{name}/report.md have the detail")


def _count_table(counts: list[tuple], name: str) -> str:
    lines = [f"| {name} | samples |", "| --- | ---: |"]
    for value, n in sorted(counts, key=lambda d: (-d[1], str(d[0]))):
        lines.append(f"| {value} | {n} |")
    return "\n".join(lines)


STEP = Step("ingest", IngestConfig, run, inputs=(), outputs=("samples", "shards"), finalize=finalize, check=check_inputs,
            reduce=cut_ranges, apply=write_samples,
            description="webdataset / caption Parquet / LLaVA JSON / LLaVA-OV Parquet / FineVision / messages "
                        "→ samples manifest")
