"""The fuzz targets: one function per reader that feeds it one generated input in-process and checks the
properties, shared by the fuzz tests (``tests/fuzz/test_fuzz.py``, a fixed seed) and the bench
(``python -m bench fuzz``, many inputs).

Each target takes a drawn input and a scratch ``Workspace`` and returns the statuses its input came out as;
it raises ``AssertionError`` when a property fails (a row lost or doubled, a row without a status, a config
error not naming its field, a file read or written outside the run) and lets any other exception through:
that is a task that would have died. The properties:

- every input row comes out as exactly one row with a status (a file that cannot be read further is a
  file-level status, as ``ingest``'s ``shards`` manifest holds it);
- a wrong-typed config value fails naming its field, before any work (no step folder is made);
- a statement that writes, attaches or reads outside the run is refused or fails, and changes nothing;
- a long query or a huge result is stopped, with a message;
- every viewer answer is below 500 (503: a query it stopped), and a foreign Host header gets 400.

The step-level properties (a whole ``ingest`` or ``import-packs`` run twice: byte-identical, nothing
written outside the run folder) are in ``step_twice``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import tempfile
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

STATUS = re.compile(r"^[a-z][a-z0-9_]*$")
CANARY = "ovpipe-fuzz-canary-7c1f"          # the content of a file outside the run: never in an answer


class Workspace:
    """A scratch folder per process: ``inputs/`` (rewritten per example), a small ingested ``run/``, a
    ``secret.txt`` beside it holding ``CANARY``, a tiny tokenizer."""

    def __init__(self, root: str | Path | None = None, view_run: Path | None = None):
        self.root = Path(root or tempfile.mkdtemp(prefix="ovpipe-fuzz-"))
        self._view_run = view_run
        self.inputs = self.root / "inputs"
        self.secret = self.root / "secret.txt"
        self.secret.write_text(CANARY + "\n")
        self._run: Path | None = None
        self._tok = None
        self._apps: dict = {}
        self._n = 0

    def fresh(self) -> Path:
        """An empty folder for one example's input files, with ``img.jpg`` and a FIFO ``fifo.jpg`` in it."""
        from tests.fuzz.builders import jpeg

        self._n += 1
        d = self.inputs / f"{self._n:07d}"
        d.mkdir(parents=True)
        (d / "img.jpg").write_bytes(jpeg())
        os.mkfifo(d / "fifo.jpg")
        return d

    @property
    def run(self) -> Path:
        """A run folder with an ``ingest`` step over 3 samples (made once)."""
        if self._run is None:
            from ovpipe.cli import main
            from tests.fuzz.builders import jpeg, write_tar

            src = self.root / "wds" / "shard-0.tar"
            write_tar(src, [("a.jpg", jpeg()), ("a.txt", b"a cat."), ("b.jpg", jpeg(9, 9)), ("b.txt", b"a dog."),
                            ("c.jpg", b"broken"), ("c.txt", b"a cow.")])
            run = self.root / "run"
            with quiet():
                rc = main(["ingest", "--set", f'inputs=["{src}"]', "--run-dir", str(run), "--quiet"])
            assert rc == 0
            self._run = run
        return self._run

    @property
    def view_run(self) -> Path:
        """A run with every step the viewer shows (``tests/viewer/run_builder.py``: ingest, concepts, balance,
        lengths, packs with costs, pretrain metrics, RL, image vectors, dedup and the real ``index``), so every
        route renders its page rather than its "missing" one. Given (the test session's), or built once here."""
        if self._view_run is None:
            from demo.corpus import write_demo_corpus
            from ovpipe.cli import main
            from tests.viewer.run_builder import write_meaning_run, write_view_run

            demo = self.root / "demo"
            write_demo_corpus(demo, n_samples=60, seed=0, shards=2)
            ingested = self.root / "ingested"
            with quiet():
                assert main(["ingest", "--set", f'inputs=["{demo}/shards/*.tar"]', "--set", "source=demo",
                             "--run-dir", str(ingested), "--quiet"]) == 0
                view = write_view_run(ingested, self.root / "view" / "run")
                self._view_run = write_meaning_run(view, self.root / "meaning" / "run")["run"]
        return self._view_run

    @property
    def tokenizer(self):
        if self._tok is None:
            from packing.tokens import load_tokenizer
            from tests.fuzz.builders import tiny_tokenizer

            self._tok = load_tokenizer(tiny_tokenizer(str(self.root)))
        return self._tok

    def app_client(self, timeout: float = 0.5):
        if timeout not in self._apps:
            from starlette.testclient import TestClient

            from viewer.app import create_app

            self._apps[timeout] = TestClient(create_app(self.view_run, query_timeout=timeout),
                                             base_url="http://127.0.0.1",
                                             raise_server_exceptions=False)
        return self._apps[timeout]


@contextlib.contextmanager
def quiet():
    """stdout and stderr of an in-process command, captured: ``(out, err)`` StringIOs."""
    import logging

    out, err = io.StringIO(), io.StringIO()
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield out, err
    finally:
        logging.disable(logging.NOTSET)


def snapshot(folder: Path) -> dict:
    """Every file under ``folder`` with its size and mtime."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in Path(folder).rglob("*") if p.is_file()}


# ------------------------------------------------------------------------------------------- ingest readers

def ingest_rows(path: str, fmt: str = "auto") -> tuple[list[dict], str | None]:
    """The ``samples`` rows ``ingest`` makes of one file, read in-process as its map task reads it, and the
    file's status when it cannot be read further (``ShardError``)."""
    from curation.formats import ShardError, detect_format
    from curation.ingest import IngestConfig, sample_row, shard_format_of
    from curation.readers import adapter

    cfg = IngestConfig(inputs=[path], format=fmt)
    rows, shard_status = [], None
    try:
        fmt = detect_format(path, cfg.format, cfg.caption_column)
        for raw in adapter(fmt, path)(path, cfg, lambda unit: True):
            rows.append(sample_row(raw, "fuzz", path, shard_format_of(path, fmt), cfg))
    except ShardError as e:
        assert STATUS.match(e.status) and str(e), e
        shard_status = e.status
    return rows, shard_status


def _statuses(rows: list[dict], shard_status: str | None) -> list[str]:
    for r in rows:
        assert STATUS.match(r["status"] or ""), r
        assert (r["status"] == "ok") == (r["error"] is None), (r["status"], r["error"])
    return [r["status"] for r in rows] + ([f"shard:{shard_status}"] if shard_status else [])


def wds_groups(members: list[tuple[str, bytes]]) -> int:
    """Samples a webdataset tar holds: consecutive members of one key are one sample, and a repeated
    extension starts the next (the webdataset convention)."""
    from curation.formats import split_key

    n, key, exts = 0, None, set()
    for name, _ in members:
        k, ext = split_key(name)
        if key is None or k != key or ext in exts:
            n, exts = n + 1, set()
        key = k
        exts.add(ext)
    return n


def target_webdataset(drawn, ws: Workspace) -> list[str]:
    from tests.fuzz.builders import write_tar

    members, cut, tail = drawn
    path = write_tar(ws.fresh() / "shard.tar", members, cut)
    if tail:
        with open(path, "ab") as f:
            f.write(tail)
    rows, shard_status = ingest_rows(str(path))
    if shard_status is None:
        assert len(rows) == wds_groups(members), (len(rows), members)
    else:
        assert len(rows) <= wds_groups(members)
    return _statuses(rows, shard_status)


def json_records(text: bytes, ext: str) -> int:
    """Records a JSON(L) file holds: one per non-blank line of a .jsonl; the array's items of a .json (one
    bad record when it is not an array)."""
    if ext == ".jsonl":
        return sum(1 for line in text.splitlines() if line.strip())
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return 1
    return len(data) if isinstance(data, list) else 1


def target_json(drawn, ws: Workspace, fmt: str = "auto") -> list[str]:
    text, ext, _ = drawn
    path = ws.fresh() / f"data{ext}"
    path.write_bytes(text)
    rows, shard_status = ingest_rows(str(path), fmt)
    assert shard_status is None, shard_status          # a JSON file is read whole: its problems are rows
    assert len(rows) == json_records(text, ext), (len(rows), text[:300])
    return _statuses(rows, None)


def target_parquet(drawn, ws: Workspace) -> list[str]:
    import pyarrow.parquet as pq

    flavour, table = drawn
    path = ws.fresh() / "data.parquet"
    pq.write_table(table, path, row_group_size=4)
    fmt = "messages" if flavour == "messages" else "auto"
    rows, shard_status = ingest_rows(str(path), fmt)
    if shard_status is None:
        assert len(rows) == table.num_rows, (len(rows), table.num_rows, table.schema)
    else:
        assert len(rows) <= table.num_rows
    return _statuses(rows, shard_status)


# ------------------------------------------------------------------------------------------- import-packs

IMPORT_STATUSES = {"bad_json", "bad_text", "empty", "misaligned", "missing_image", "bad_image", "image_mismatch"}


def target_official_entry(members: dict, ws: Workspace) -> list[str]:
    """One official entry through ``import-packs``' encoder: an ovpipe pack entry, or a ``status: why``."""
    from packing.import_packs import ImportPacksConfig, encode_entry

    cfg = ImportPacksConfig(source="x", tokenizer="x", seq_len=4096)
    try:
        e = encode_entry(ws.tokenizer, cfg, cfg.image_cfg(), members, 0)
    except ValueError as err:
        status, _, why = str(err).partition(": ")
        assert status in IMPORT_STATUSES and why, str(err)
        return [status]
    assert e["sample_ids"] and len(e["ids"]) > 0 and len(e["images"]) == len(e["sample_ids"])
    return ["ok"]


def target_official_folder(drawn, ws: Workspace) -> list[str]:
    """An official folder's index and tars: ``shards`` either names tars inside the folder or refuses with a
    ``ValueError``; each indexed entry comes out of ``official_entries`` exactly once (read, or unreadable)."""
    from packing.import_packs import Unreadable, official_entries
    from packing.official import shards
    from tests.fuzz.builders import official_folder

    tars, info, cut = drawn
    root = official_folder(ws.fresh() / "src", tars, cut=cut, info=info)
    try:
        index = shards(root)
    except ValueError as e:
        assert str(e)
        return ["refused"]
    out = []
    for rel, n in index:
        assert not Path(rel).is_absolute() and ".." not in Path(rel).parts
        if not (root / rel).is_file():
            out.append("missing_tar")          # `check` refuses this folder before any work
            continue
        got = []
        try:
            got = list(official_entries(root, rel, n))
        except RuntimeError as e:
            assert "more entries" in str(e)
            out.append("more_entries")
            continue
        assert len(got) == n, (len(got), n)
        out += ["unreadable" if isinstance(m, Unreadable) else "entry" for _, m in got]
    return out


# ------------------------------------------------------------------------------------------- config loader

def config_fields() -> list[tuple[str, str, Any]]:
    """(step, field, type) of every plain-typed field of every step's config."""
    from ovpipe.registry import STEPS, get_step

    out = []
    for name in sorted(STEPS):
        cls = get_step(name).config
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.init and _plain(hints[f.name]) is not None:
                out.append((name, f.name, hints[f.name]))
    return out


def _plain(tp):
    """The field's type without Optional, when it is one the fuzz knows the wrong values of."""
    if get_origin(tp) in (Union, getattr(__import__("types"), "UnionType")):
        args = [a for a in get_args(tp) if a is not type(None)]
        return _plain(args[0]) if len(args) == 1 else None
    if tp in (int, float, str, bool) or get_origin(tp) in (list, tuple, dict, Literal):
        return tp
    return None


def is_wrong(value, tp) -> bool:
    """``value`` is not of the field's type (independently of the loader: Python's own notion)."""
    if value is None:
        return not _optional(tp)
    tp = _plain(tp)
    if tp is bool:
        return not isinstance(value, bool)
    if tp is int:
        return isinstance(value, bool) or not isinstance(value, int)
    if tp is float:
        return isinstance(value, bool) or not isinstance(value, (int, float))
    if tp is str:
        return not isinstance(value, str)
    if get_origin(tp) is Literal:
        return value not in get_args(tp) and str(value) not in get_args(tp)
    if get_origin(tp) in (list, tuple):
        return not isinstance(value, list)
    if get_origin(tp) is dict:
        return not isinstance(value, dict)
    return False


def _optional(tp) -> bool:
    return get_origin(tp) in (Union, getattr(__import__("types"), "UnionType")) and type(None) in get_args(tp)


def target_config(drawn, ws: Workspace) -> list[str]:
    """A wrong-typed value for one field, through ``--set``: exit 2 naming the field, no step folder made."""
    from ovpipe.cli import main
    from ovpipe.config import ConfigError, load_config
    from ovpipe.registry import get_step

    step, field, tp, value = drawn
    if not is_wrong(value, tp):
        return ["not_wrong"]
    try:
        load_config(get_step(step).config, None, {field: value})
    except ConfigError as e:
        assert field in str(e), (step, field, value, str(e))
    else:
        raise AssertionError(f"{step}.{field} = {value!r} ({tp}) was accepted")
    from ovpipe.registry import COMMANDS

    if step in COMMANDS:                   # a command with its own parser (pretrain, export-model): loaded above
        return ["refused"]
    run = ws.fresh() / "run"
    with quiet() as (_, err):
        rc = main([step, "--set", f"{field}={json.dumps(value)}", "--run-dir", str(run), "--quiet"])
    assert rc == 2 and field in err.getvalue(), (step, field, value, rc, err.getvalue())
    assert not run.exists(), f"{step}: the run folder was made before the config was refused"
    return ["refused"]


# ------------------------------------------------------------------------------------------- SQL

def target_sql(q: str, ws: Workspace, cli: bool = False) -> list[str]:
    """One statement through the viewer's SQL route (``RunCatalog.rows`` with its time limit and cap) or
    ``ovpipe sql``: refused, an error, stopped, or rows — never the secret's content, never a change to the
    run folder or a new file beside it."""
    import duckdb

    from manifests.catalog import ReadOnlyError

    q = q.replace("{run}", str(ws.run)).replace("{secret}", str(ws.secret)).replace("{outside}", str(ws.root))
    before, around = snapshot(ws.run), sorted(p.name for p in ws.root.iterdir())
    if cli:
        from ovpipe.cli import main

        with quiet() as (out, err):
            rc = main(["sql", str(ws.run), q])
        assert rc in (0, 2), rc
        got = "refused" if "only SELECT" in err.getvalue() else "error" if rc else "rows"
        text = out.getvalue() + err.getvalue()
    else:
        from viewer.catalog import QueryStopped, RunCatalog

        cat = ws._apps.get("cat") or ws._apps.setdefault("cat", RunCatalog(ws.run, query_timeout=0.5))
        try:
            text, got = repr(cat.rows(q, steps=True, max_bytes=2**20)), "rows"
        except ReadOnlyError as e:
            text, got = str(e), "refused"
        except QueryStopped as e:
            text, got = str(e), "stopped"
        except duckdb.Error as e:
            text, got = str(e), "error"
    assert CANARY not in text, q
    assert snapshot(ws.run) == before, f"{q!r} changed the run folder"
    assert sorted(p.name for p in ws.root.iterdir()) == around, f"{q!r} wrote beside the run"
    return [got]


# ------------------------------------------------------------------------------------------- viewer routes

def target_route(drawn, ws: Workspace) -> list[str]:
    from viewer.app import LOOPBACK_HOSTS

    path, params, host, headers = drawn
    client = ws.app_client()
    r = client.get(path, params=params, headers={**headers, "Host": host})
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0] + "]"
    if name.lower() not in LOOPBACK_HOSTS:
        assert r.status_code == 400, (path, host, r.status_code)
    else:
        assert r.status_code < 500 or r.status_code == 503, (path, params, r.status_code, r.text[:400])
    assert CANARY not in r.text
    return [str(r.status_code)]


# ------------------------------------------------------------------------------------------- whole steps

def _first_difference(a: Path, b: Path) -> str:
    import pyarrow.parquet as pq

    ta, tb = pq.read_table(a), pq.read_table(b)
    if ta.schema != tb.schema or ta.num_rows != tb.num_rows:
        return f"schema or rows: {ta.schema} {ta.num_rows} / {tb.schema} {tb.num_rows}"
    for name in ta.column_names:
        for i, (x, y) in enumerate(zip(ta.column(name).to_pylist(), tb.column(name).to_pylist())):
            if x != y:
                return f"row {i} {name}: {x!r:.200} / {y!r:.200}"
    return f"same values, other bytes (metadata {pq.read_metadata(a).metadata} / {pq.read_metadata(b).metadata})"


def step_twice(kind: str, drawn, ws: Workspace) -> list[str]:
    """``ingest`` (a webdataset tar, a JSON file and a Parquet file) or ``import-packs`` run twice over the same
    inputs, in two run folders: both succeed (or, for an ingest that read no ok sample, both exit 1 saying so,
    its manifests written for the reason), their manifest parts are byte-identical, and nothing is written beside
    the inputs."""
    from ovpipe.cli import main

    d = ws.fresh()
    if kind == "ingest":
        from tests.fuzz.builders import write_tar

        import pyarrow.parquet as pq

        (members, cut, tail), (text, ext, _), (_, table) = drawn
        write_tar(d / "shard.tar", members, cut)
        (d / f"data{ext}").write_bytes(text)
        pq.write_table(table, d / "data.parquet", row_group_size=4)
        argv = ["ingest", "--set", f'inputs=["{d}/shard.tar", "{d}/data{ext}", "{d}/data.parquet"]']
    else:
        from tests.fuzz.builders import official_folder, tiny_tokenizer

        official_folder(d / "src", drawn)
        argv = ["import-packs", "--set", f"source={d / 'src'}", "--set", f"tokenizer={tiny_tokenizer(str(ws.root))}",
                "--set", "seq_len=4096"]
    before = snapshot(d)
    runs = [ws.root / f"twice-{ws._n}-{i}" for i in range(2)]
    rcs = []
    for run in runs:
        with quiet() as (_, err):
            rc = main([*argv, "--run-dir", str(run), "--quiet"])
        assert rc == 0 or (kind == "ingest" and rc == 1 and "no ok sample" in err.getvalue()), err.getvalue()
        rcs.append(rc)
    assert rcs[0] == rcs[1], rcs
    assert snapshot(d) == before, "the step wrote beside its inputs"
    parts = [sorted(p.relative_to(run) for p in run.rglob("part-*.parquet")) for run in runs]
    assert parts[0] == parts[1] and parts[0]
    for rel in parts[0]:
        assert (runs[0] / rel).read_bytes() == (runs[1] / rel).read_bytes(), \
            f"{rel} differs in the second run: {_first_difference(runs[0] / rel, runs[1] / rel)}"
    from manifests import read_manifest

    table = read_manifest(runs[0], "samples" if kind == "ingest" else "imported_packs")
    return sorted(set(table.column("status").to_pylist()))
