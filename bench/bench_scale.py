"""Scale dry run: ``balance`` → ``lengths`` → ``pack`` at corpus scale, through the real CLI and the
local executor, with per-task peak memory; then what the cluster run costs.

    python -m bench.bench_scale                          # 500K samples, the chain (``make bench``); --quick: 100K
    python -m bench.bench_scale --samples 10M 40M 85M --steps balance pack   # lengths counted from the draws
    make bench-scale                                     # the chain at 1M, then balance → pack at 10M 40M 85M
    python -m bench.bench_scale --report bench/results/bench_scale.json      # the recorded tables again

**Inputs** (synthesised under ``--work``, default ``runs/bench-scale``, as external step folders —
no ``executor.json``, so the steps accept them as given):

* ``assign/assignments``: ``N`` rows, K=10 concept ids per sample drawn from a Zipf(1.1) law
  truncated to a 500K vocabulary, scores descending; 8 parts in canonical order, as an
  8-task ``assign`` writes them; ``embed-concepts/concepts``: the 500K concept rows.
* ``ingest/samples``: ``N`` caption pairs ``[user "<image>", assistant caption]`` with one image
  each, in parts of 1M rows that are contiguous id ranges, as ``ingest``'s shuffle writes them
  (``--samples-layout interleaved``: parts whose ids interleave, each sorted — ingest's layout before
  its shuffle, where a canonical slice is a DuckDB sort of every part in every task). Image
  sizes lognormal around 640 px (aspect ratio lognormal, σ 0.3) → 120–1280 image tokens after
  ``smart_resize``; captions drawn from a pool of 4,096 texts over a 30K-word Zipf vocabulary,
  60 % alt-text-like (8–40 words) and 40 % dense recaptions (60–200 words). So ``lengths`` runs as it
  does on real data — tokenising every caption with a 32K byte-level BPE (``bench_lengths``'s) and
  ``smart_resize`` on every image size — only the texts repeat (its word cache is warm: the
  "words all known" regime a task reaches deep into a slice of millions).

**Measured**, per step: per-task peak RSS as every task records it (``ovpipe.executors.task.
recorded_peaks``: VmHWM of the process running the task, reset as the task starts, so a pool worker's
earlier tasks do not count; the finalize's too) and, by polling (``--poll`` s) the step's ``running/``
markers (the pid of the process running each map / reduce / apply task), wall time and CPU time
(``utime + stime`` of that process over the task); the step's wall time. A memory guard kills the
step's process group when the whole tree's RSS passes ``--guard-gib`` (the machine is shared) and
reports it (a killed task records no peak).

**Projection**: CPU core-seconds per sample of each step, measured here, × 85M and 500M samples
(linear: every map task's cost is linear in its share; a reduce that sorts is n log n, so its
line is a lower bound). GPU-hours for ``embed-images`` and ``assign`` at MetaCLIP ViT-H-14 from
its FLOPs per image, counted here by ``torch.utils.flop_counter`` on a randomly initialised
``open_clip`` ViT-H-14 (no weights needed for a count or a timing), and the GPU rates: measured
(``--gpu-json bench/results/h100/embed_vith_102400.json``, written by ``python -m bench.bench_curation
--gpu``: ViT-H-14 images/s end to end through the ``embed-images`` step (else ``embed_rows``) and assign's effective FLOP/s, with the
card and command) or, without it, assumed (``--gpu-tflops``, ``--gpu-mfu``, ``--assign-eff``: stated
in the table; ``--gpu-measured`` gives the ViT's images/s alone). The CPU forward of the image tower at
224 px is timed here too (``--vit``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

GIB = 1024 ** 3
STEPS = ("balance", "lengths", "pack")
POOL = 4096


# --------------------------------------------------------------------------------- synthesis

def _hex_ids(u: np.ndarray):
    """16-char lowercase hex strings of uint64s, vectorised (an Arrow string array)."""
    import pyarrow as pa

    digits = np.frombuffer(b"0123456789abcdef", np.uint8)
    b = u.astype(">u8").view(np.uint8).reshape(-1, 8)
    out = np.empty((len(u), 16), np.uint8)
    out[:, 0::2], out[:, 1::2] = digits[b >> 4], digits[b & 15]
    return pa.array(out.view("S16").ravel(), pa.binary(16)).cast(pa.binary()).cast(pa.string())


def _ids(n: int, seed: int) -> np.ndarray:
    from manifests.ids import splitmix64

    with np.errstate(over="ignore"):
        return splitmix64(np.arange(n, dtype=np.uint64) + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15))


def _caption_pool(seed: int) -> list[str]:
    from bench.bench_lengths import Text

    t = Text(seed)
    rng = np.random.default_rng(seed)
    return [t.sentence(8, 40) if rng.random() < 0.6 else t.sentence(60, 200) for _ in range(POOL)]


def _draws(rng, n: int, pool_size: int):
    """Per sample: image height, width (lognormal around 640 px, aspect σ 0.3) and caption index."""
    side = np.exp(rng.normal(np.log(640), 0.5, n)) + 28
    aspect = np.exp(rng.normal(0, 0.3, n))
    h = np.clip(side / np.sqrt(aspect), 28, 4000).astype(np.int32)
    w = np.clip(side * np.sqrt(aspect), 28, 4000).astype(np.int32)
    return h, w, rng.integers(0, pool_size, n)


def _samples_chunk(ids, pool, draws, rng, part: int):
    import pyarrow as pa

    from manifests.conversation import IMAGE_ADDRESS, TURN
    from manifests.schemas import schema_for

    n = len(ids)
    h, w, cap = draws
    texts = pa.array(["<image>"] + pool)
    turn_idx = np.empty(2 * n, np.int64)
    turn_idx[0::2], turn_idx[1::2] = 0, cap + 1
    roles = pa.DictionaryArray.from_arrays(pa.array(np.tile([0, 1], n).astype(np.int8)),
                                           pa.array(["user", "assistant"])).cast(pa.string())
    two = pa.array(np.arange(0, 2 * n + 1, 2, dtype=np.int32))
    one = pa.array(np.arange(n + 1, dtype=np.int32))
    shard = f"shard-{part:06d}.tar"
    size = rng.integers(20_000, 400_000, n)
    offset = np.cumsum(size + 1024) - size
    str_n = lambda s: pa.array([s], pa.string()).take(pa.array(np.zeros(n, np.int64)))  # noqa: E731
    images = pa.StructArray.from_arrays(
        [str_n(shard), str_n("tar"), pa.array(offset), pa.array(size), pa.nulls(n, pa.string()),
         pa.array(np.full(n, -1, np.int32)), str_n("jpeg"), pa.array(w), pa.array(h)],
        fields=list(IMAGE_ADDRESS))
    conv = pa.StructArray.from_arrays([roles, texts.take(pa.array(turn_idx))], fields=list(TURN))
    schema = schema_for("samples")
    cols = {
        "sample_id": ids, "source": str_n("web"), "shard": str_n(shard),
        "key": _hex_ids(np.arange(n, dtype=np.uint64) + np.uint64(part << 32)),
        "shard_format": str_n("tar"), "offset": pa.array(offset), "size": pa.array(size),
        "image_format": str_n("jpeg"), "width": pa.array(w), "height": pa.array(h),
        "caption": texts.take(pa.array(cap + 1)), "category": str_n("caption"),
        "n_images": pa.array(np.ones(n, np.int32)),
        "images": pa.ListArray.from_arrays(one, images),
        "conversation": pa.ListArray.from_arrays(two, conv),
        "turns": pa.array(np.full(n, 2, np.int32)),
        "turn_ratings": pa.nulls(n, schema.field("turn_ratings").type),
        "status": str_n("ok"), "error": pa.nulls(n, pa.string()),
    }
    return pa.table([cols[f.name] for f in schema], schema=schema)


def pool_token_counts(pool: list[str], tokenizer: str) -> tuple[np.ndarray, np.ndarray]:
    """(text_tokens, target_tokens) of each pool caption as a caption pair, counted by the lengths
    step's own code (``compute_lengths``) — image tokens are added per sample from its size."""
    import pyarrow as pa

    from manifests.conversation import IMAGE_ADDRESS, TURN
    from packing.lengths import LengthsConfig, compute_lengths
    from packing.tokens import load_tokenizer

    n = len(pool)
    img = {"file": "x", "container": "file", "offset": 0, "size": 0, "column": None, "index": -1, "format": "jpeg",
           "width": 224, "height": 224}
    t = pa.table({"sample_id": [f"{i:016x}" for i in range(n)], "source": ["web"] * n, "status": ["ok"] * n,
                  "error": pa.nulls(n, pa.string()),
                  "conversation": pa.array([[{"role": "user", "text": "<image>"}, {"role": "assistant", "text": c}]
                                            for c in pool], pa.list_(TURN)),
                  "images": pa.array([[img]] * n, pa.list_(IMAGE_ADDRESS))})
    cols = compute_lengths(t, LengthsConfig(tokenizer=tokenizer, seq_len=1 << 20), load_tokenizer(tokenizer))
    return np.asarray(cols["text_tokens"], np.int32), np.asarray(cols["target_tokens"], np.int32)


def _write_lengths(run: Path, u_sorted: np.ndarray, text, target, image, parts: int, chunk: int) -> None:
    """The ``lengths`` manifest an ``parts``-task lengths step writes (canonical order), from counts."""
    import pyarrow as pa

    def rows(a: int, b: int):
        m = b - a
        ids = _hex_ids(u_sorted[a:b])
        const = lambda v, t: pa.array([v], t).take(pa.array(np.zeros(m, np.int64)))  # noqa: E731
        return pa.table({"sample_id": ids, "source": const("web", pa.string()),
                         "text_tokens": text[a:b], "image_tokens": image[a:b],
                         "total_tokens": text[a:b] + image[a:b], "target_tokens": target[a:b],
                         "turns_kept": np.full(m, 2, np.int32), "images": np.ones(m, np.int32),
                         "vit_sq": ((image[a:b].astype(np.int64) - 2) * 4 + 1) ** 2, "status": const("ok", pa.string()),
                         "error": pa.nulls(m, pa.string()), "source_sample_id": ids})

    _write_parts(run / "lengths" / "lengths", "lengths", len(u_sorted), parts, chunk, rows)


def _write_parts(folder: Path, kind: str, n: int, parts: int, chunk: int, rows, done=None) -> None:
    """``n`` rows in ``parts`` canonical parts (as a ``parts``-task step writes them), each streamed
    ``chunk`` rows at a time: ``rows(a, b)`` gives rows [a, b), called in order; ``done(r, end)``
    after part ``r``."""
    from manifests.io import PartWriter

    bounds = np.linspace(0, n, parts + 1).astype(np.int64)
    for r in range(parts):
        with PartWriter(folder / f"part-{r:05d}.parquet", kind) as w:
            for a in range(bounds[r], bounds[r + 1], chunk):
                w.write(rows(a, min(a + chunk, bounds[r + 1])))
        if done is not None:
            done(r, int(bounds[r + 1]))


def synthesise(run: Path, n: int, vocab: int, k: int, seed: int = 0, chunk: int = 1 << 20,
               assign_parts: int = 8, samples: bool = True, lengths_tokenizer: str | None = None,
               samples_layout: str = "id-range") -> dict:
    """The external inputs of the dry run (see the module docstring): ``samples`` (for the lengths
    step) and/or — given ``lengths_tokenizer`` — the ``lengths`` manifest itself, counted from the same
    draws (pool captions' tokens + each image's tokens); returns seconds and sizes on disk."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from manifests.io import PARQUET_OPTS, write_part

    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    u = _ids(n, seed)
    if samples_layout == "id-range":     # parts are contiguous id ranges: canonical as they lie
        u.sort()
    # concepts: 500K rows (text only matters to balance; no vectors are read downstream)
    write_part({"concept_id": np.arange(vocab, dtype=np.int32), "text": [f"concept {i}" for i in range(vocab)],
                "file": pa.nulls(vocab, pa.string()), "row": np.full(vocab, -1, np.int32)},
               run / "embed-concepts" / "concepts" / "part-00000.parquet", "concepts")
    # samples: parts of `chunk` rows, contiguous id ranges as ingest's shuffle writes them (samples_layout
    # "interleaved": ids interleaved across parts, each part sorted — ingest's parts before the shuffle)
    pool = _caption_pool(seed)
    opts = dict(PARQUET_OPTS, dictionary_pagesize_limit=64 << 20)   # the caption pool stays dictionary-coded
    if lengths_tokenizer:
        from packing.image_tokens import image_tokens

        pool_text, pool_target = pool_token_counts(pool, lengths_tokenizer)
        order_u = np.empty(n, np.uint64)
        text, target, image = (np.empty(n, np.int32) for _ in range(3))
    for part, a in enumerate(range(0, n, chunk)):
        ids_u = np.sort(u[a:a + chunk])
        h, w, cap = draws = _draws(rng, len(ids_u), len(pool))
        if samples:
            t = _samples_chunk(_hex_ids(ids_u), pool, draws, rng, part)
            path = run / "ingest" / "samples" / f"part-{part:05d}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(t, path, **opts)
        if lengths_tokenizer:
            sl = slice(a, a + len(ids_u))
            order_u[sl], text[sl], target[sl] = ids_u, pool_text[cap], pool_target[cap]
            image[sl] = image_tokens(h, w)
        print(f"  samples part {part}: {a + len(ids_u):,}/{n:,} ({time.perf_counter() - t0:.0f} s)", flush=True)
    if lengths_tokenizer:
        o = np.argsort(order_u, kind="stable")
        _write_lengths(run, order_u[o], text[o], target[o], image[o], assign_parts, chunk)
        del o, order_u, text, target, image
        print(f"  lengths (counted from the draws): {n:,} rows ({time.perf_counter() - t0:.0f} s)", flush=True)
    # assignments: canonical order over all parts (an 8-task assign over canonical slices)
    order = np.sort(u)
    del u
    def assignments(a: int, b: int):
        m = b - a
        # Zipf(1.1) truncated to the vocabulary, by the inverse CDF of its continuous (Pareto) form
        x = (1.0 - rng.random((m, k)) * (1.0 - (vocab + 1.0) ** -0.1)) ** -10.0
        c = np.minimum(x.astype(np.int64) - 1, vocab - 1).astype(np.int32)
        s = (rng.uniform(0.2, 0.4, (m, 1)) - 0.01 * np.arange(k)).astype(np.float32)   # descending
        off = pa.array(np.arange(0, (m + 1) * k, k, dtype=np.int32))
        return pa.table({"sample_id": _hex_ids(order[a:b]),
                         "concept_ids": pa.ListArray.from_arrays(off, pa.array(c.ravel())),
                         "scores": pa.ListArray.from_arrays(off, pa.array(s.ravel()))})

    _write_parts(run / "assign" / "assignments", "assignments", n, assign_parts, chunk, assignments,
                 done=lambda r, end: print(f"  assignments part {r}: {end:,}/{n:,} "
                                           f"({time.perf_counter() - t0:.0f} s)", flush=True))
    del order
    sizes = {d: sum(f.stat().st_size for f in (run / d).rglob("*.parquet"))
             for d in ("ingest", "assign", "embed-concepts", "lengths") if (run / d).exists()}
    print(f"  synthesised {n:,} samples in {time.perf_counter() - t0:.0f} s: "
          + ", ".join(f"{d} {b / GIB:.2f} GiB" for d, b in sizes.items()), flush=True)
    return {"seconds": time.perf_counter() - t0, "bytes": sizes}


# ------------------------------------------------------------------------------- measurement

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _rss(pid: int) -> int:
    """The resident bytes of ``pid`` now (0 if it is gone): for the memory guard."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _cpu_s(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK     # utime, stime
    except (OSError, ValueError, IndexError):
        return None


def _tree(root: int) -> list[int]:
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


class _Task:
    """One task seen running: its wall and CPU time, polled; its peak memory, what it recorded."""

    def __init__(self, name: str, pid: int, now: float):
        self.name, self.pid, self.start, self.end = name, pid, now, now
        self.cpu0 = _cpu_s(pid) or 0.0
        self.cpu1 = self.cpu0
        self.peak = None

    def poll(self, now: float) -> None:
        c = _cpu_s(self.pid)
        self.cpu1 = c if c is not None else self.cpu1
        self.end = now

    def as_dict(self) -> dict:
        return {"task": self.name, "phase": _phase_of(self.name), "pid": self.pid, "peak_bytes": self.peak,
                "wall_s": round(self.end - self.start, 3), "cpu_s": round(self.cpu1 - self.cpu0, 3)}


def _phase_of(task: str) -> str:
    """``00003`` → map, ``apply-00003`` → apply, ``reduce`` → reduce (the ``running/`` marker names)."""
    return "reduce" if task == "reduce" else task.split("-")[0] if "-" in task else "map"


def run_step(argv: list[str], sdir: Path, log: Path, guard_bytes: int, poll_s: float) -> dict:
    """Run ``python -m ovpipe *argv`` in its own process group, polling the step's ``running/``
    markers; returns per-task figures (peaks: what each task recorded), the finalize's, wall, rc."""
    from ovpipe.executors.task import recorded_peaks

    t0 = time.perf_counter()
    with open(log, "w") as lf:
        proc = subprocess.Popen([sys.executable, "-m", "ovpipe", *argv], stdout=lf, stderr=subprocess.STDOUT,
                                start_new_session=True)
    active: dict[str, _Task] = {}
    done: list[_Task] = []
    tree_peak, killed, tail = 0, None, None
    cli_cpu0 = 0.0
    while True:
        now = time.perf_counter() - t0
        rc = proc.poll()
        markers = {}
        try:
            for m in (sdir / "running").iterdir():
                try:
                    markers[m.name] = json.loads(m.read_text())["pid"]
                except (OSError, ValueError, KeyError):
                    pass
        except OSError:
            pass
        for name in list(active):
            if markers.get(name) != active[name].pid:
                done.append(active.pop(name))
        for name, pid in markers.items():
            if name not in active:
                active[name] = _Task(name, pid, now)
        for t in active.values():
            t.poll(now)
        if done and not active and not markers and tail is None and rc is None:
            tail = {"start": now}                                    # the tasks are over: finalize
            cli_cpu0 = _cpu_s(proc.pid) or 0.0
        elif markers and tail is not None:
            tail = None                                              # a later phase started
        if tail is not None and rc is None:
            c = _cpu_s(proc.pid)
            tail["cpu_s"] = max(tail.get("cpu_s", 0.0), (c - cli_cpu0) if c is not None else 0.0)
            tail["end"] = now
        if rc is not None:
            break
        rss = sum(_rss(p) for p in _tree(proc.pid))
        tree_peak = max(tree_peak, rss)
        if rss > guard_bytes:
            killed = f"memory guard: the step's processes held {rss / GIB:.1f} GiB > {guard_bytes / GIB:.1f} GiB"
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = proc.returncode
            break
        time.sleep(poll_s)
    wall = time.perf_counter() - t0
    done.extend(active.values())
    peaks = recorded_peaks(sdir)
    for t in done:
        t.peak = peaks.get(t.name)
    seen = {t.name for t in done}
    unseen = [{"task": name, "phase": _phase_of(name), "pid": None, "peak_bytes": peak, "wall_s": None,
               "cpu_s": None} for name, peak in peaks.items() if name != "finalize" and name not in seen]
    return {"argv": argv, "rc": rc, "killed": killed, "wall_s": round(wall, 2), "tree_peak_bytes": tree_peak,
            "started_utc": time.strftime("%H:%M", time.gmtime(time.time() - wall)), "load_end": os.getloadavg()[0],
            "tasks": [t.as_dict() for t in sorted(done, key=lambda t: (t.start, t.name))] + unseen,
            "finalize": None if tail is None else {"wall_s": round(tail.get("end", tail["start"]) - tail["start"], 2),
                                                   "peak_bytes": peaks.get("finalize"),
                                                   "cpu_s": tail.get("cpu_s", 0.0)},
            "log_tail": log.read_text()[-1500:] if rc else ""}


def step_argv(step: str, run: Path, tokenizer: str, tasks: int, workers: int, balanced: bool = True) -> list[str]:
    base = [step, "--run-dir", str(run), "--executor", "local", "--tasks", str(tasks), "--workers", str(workers)]
    if step == "lengths":
        return base + ["--set", f"tokenizer={tokenizer}", "--set", "seq_len=8192"]
    if step == "pack":
        return base + ["--set", f"copies_from={'balanced' if balanced else 'none'}", "--set", "write_shards=false",
                       "--set", "seq_len=8192"]
    return base


def dry_run(n: int, work: Path, tokenizer: str, a) -> dict:
    run = work / f"run-{n}"
    if run.exists():
        shutil.rmtree(run)
    print(f"\n## {n:,} samples: synthesising under {run}", flush=True)
    run_lengths = "lengths" in a.steps
    syn = synthesise(run, n, a.vocab, a.k, seed=a.seed, samples=run_lengths, samples_layout=a.samples_layout,
                     lengths_tokenizer=None if run_lengths or "pack" not in a.steps else tokenizer)
    steps = {}
    for step in a.steps:
        print(f"  running {step} ({a.tasks} tasks, {a.workers} workers)...", flush=True)
        r = run_step(step_argv(step, run, tokenizer, a.tasks, a.workers, "balance" in a.steps), run / step,
                     work / f"{step}-{n}.log",
                     int(a.guard_gib * GIB), a.poll)
        steps[step] = r
        print("  " + _step_line(step, r), flush=True)
        if r["rc"] != 0:
            print(f"  {step} failed (rc {r['rc']}{'; ' + r['killed'] if r['killed'] else ''}); later steps skipped\n"
                  + "\n".join("    " + x for x in r["log_tail"].splitlines()[-12:]), flush=True)
            break
    disk = sum(f.stat().st_size for f in run.rglob("*") if f.is_file())
    if not a.keep:
        shutil.rmtree(run)
    return {"samples": n, "samples_layout": a.samples_layout, "synth": syn, "steps": steps, "run_bytes": disk}


# ---------------------------------------------------------------------------------- reporting

def _phase(r: dict, phase: str) -> list[dict]:
    return [t for t in r["tasks"] if t["phase"] == phase]


def _gib(b) -> str:
    return "—" if b is None else f"{b / GIB:.2f}"


def _step_line(step: str, r: dict) -> str:
    m = _phase(r, "map")
    red = _phase(r, "reduce")
    ap = _phase(r, "apply")
    parts = [f"{step}: {r['wall_s']:.1f} s, rc {r['rc']}"]
    if m:
        parts.append(f"map max peak {_gib(_most(m, 'peak_bytes'))} GiB")
    if red:
        parts.append(f"reduce {_s(red[0]['wall_s'])} s / {_gib(red[0]['peak_bytes'])} GiB")
    if ap:
        parts.append(f"apply max peak {_gib(_most(ap, 'peak_bytes'))} GiB")
    return ", ".join(parts)


def _most(tasks: list[dict], key: str):
    """The largest ``key`` among ``tasks`` that have it (None: none has; a task the poller did not see
    running has a recorded peak but no wall or CPU time, a killed one no peak)."""
    return max((t[key] for t in tasks if t.get(key) is not None), default=None)


def step_figures(r: dict) -> dict:
    """The table's figures of one step run (None where a phase did not happen)."""
    m, red, ap = _phase(r, "map"), _phase(r, "reduce"), _phase(r, "apply")
    fin = r.get("finalize") or {}
    cpu = sum(t["cpu_s"] or 0.0 for t in r["tasks"]) + fin.get("cpu_s", 0.0)
    return {
        "map_peak": _most(m, "peak_bytes"), "map_wall_max": _most(m, "wall_s"),
        "reduce_peak": red[0]["peak_bytes"] if red else None, "reduce_wall": red[0]["wall_s"] if red else None,
        "apply_peak": _most(ap, "peak_bytes"), "apply_wall_max": _most(ap, "wall_s"),
        "finalize_peak": fin.get("peak_bytes"), "finalize_wall": fin.get("wall_s"),
        "wall": r["wall_s"], "cpu_s": cpu, "rc": r["rc"], "killed": r["killed"],
        "when": f"{r.get('started_utc', '?')} UTC, load {r['load_end']:.1f}" if "load_end" in r else "",
    }


def _s(x) -> str:
    return "—" if x is None else f"{x:.1f}"


def print_tables(results: list[dict], a) -> None:
    print(f"\n### dry run: {', '.join(f'{r['samples']:,}' for r in results)} samples — local executor, "
          f"{a.tasks} tasks, {a.workers} workers, K={a.k} over {a.vocab:,} concepts\n")
    print("| samples | step | map task peak GiB (max) | map task s (max) | reduce peak GiB | reduce s | "
          "apply task peak GiB (max) | apply task s (max) | finalize peak GiB | finalize s | step wall s | CPU s | rc | "
          "run at |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for res in results:
        chain = 0.0
        if "pack" in res["steps"] and "lengths" not in res["steps"]:
            print(f"| {res['samples']:,} | lengths | *not run: its manifest synthesised from the draws* "
                  f"| | | | | | | | | | | |")
        for step, r in res["steps"].items():
            f = step_figures(r)
            chain += f["wall"]
            rc = f"{f['rc']}" + (f" ({f['killed']})" if f["killed"] else "")
            print(f"| {res['samples']:,} | {step} | {_gib(f['map_peak'])} | {_s(f['map_wall_max'])} | "
                  f"{_gib(f['reduce_peak'])} | {_s(f['reduce_wall'])} | {_gib(f['apply_peak'])} | "
                  f"{_s(f['apply_wall_max'])} | {_gib(f['finalize_peak'])} | {_s(f['finalize_wall'])} | "
                  f"{f['wall']:.1f} | {f['cpu_s']:.1f} | {rc} | {f['when']} |")
        if len(res["steps"]) > 1:
            print(f"| {res['samples']:,} | **{' + '.join(res['steps'])}** | | | | | | | | | **{chain:.1f}** | | | |")
    if any("pack" in r["steps"] and "lengths" not in r["steps"] for r in results):
        print("\n*lengths not run*: its manifest was synthesised from the same draws (each pool caption's text "
              "and target tokens counted once by `compute_lengths`, + each image's tokens from its size).")
    goals = "goals: every map task ≤ 2 GiB at any size; reduce ≤ 8 GiB at 85M; chain ≤ 15 min on 2 cores"
    print(f"\n{goals}. Peaks are what each task recorded in its stats (`peak_rss_bytes/*`: VmHWM of the process "
          "running it, reset at task start); 'finalize' is the step's finalize in the CLI process (pack's report), "
          "its time the CLI's after the last task (merged stats too). Wall times are on "
          "this shared 2-core machine at the load average shown (other jobs ran beside it): CPU s is the "
          "steadier figure. A phase faster than the polling interval shows '—' for its times.")
    if len(results) > 1:
        print("\nflatness — largest map / apply task peak (GiB) per corpus size:\n")
        print("| step | " + " | ".join(f"{r['samples']:,}" for r in results) + " |")
        print("| --- |" + " ---: |" * len(results))
        for step in a.steps:
            cells = []
            for res in results:
                r = res["steps"].get(step)
                if r is None:
                    cells.append("—")
                    continue
                f = step_figures(r)
                peaks = [p for p in (f["map_peak"], f["apply_peak"]) if p is not None]
                if f["rc"] != 0:
                    cells.append("killed" if f["killed"] else f"rc {f['rc']}")
                else:
                    cells.append(_gib(max(peaks)) if peaks else "—")
            print(f"| {step} | " + " | ".join(cells) + " |")


# ------------------------------------------------------------------------------- projection

def vit_h14_figures(batches=(1, 2, 4), reps: int = 2, threads: int = 2) -> dict:
    """FLOPs per image of MetaCLIP's image tower (open_clip ViT-H-14, 224 px, randomly initialised)
    counted by torch's FlopCounterMode, and the CPU forward time per image at a few batch sizes."""
    import open_clip
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = open_clip.create_model("ViT-H-14", pretrained=None).visual.eval()
    params = sum(p.numel() for p in model.parameters())
    out = {"model": "open_clip ViT-H-14 image tower (random init), 224 px, fp32", "params": params,
           "threads": threads, "cpu_s_per_image": {}}
    # Counted with autograd on: under no_grad/inference_mode nn.MultiheadAttention takes its fused fast
    # path (aten._native_multi_head_attention), which the counter does not see (it would miss ~1/3).
    fc = FlopCounterMode(display=False)
    with fc:
        model(torch.randn(1, 3, 224, 224))
    out["flops_per_image"] = int(fc.get_total_flops())
    out["preprocess_s_per_image"], out["preprocess_image"] = _preprocess_s(), "640×480"
    load0 = os.getloadavg()[0]
    with torch.inference_mode():
        for b in batches:
            x = torch.randn(b, 3, 224, 224)
            model(x)                                               # warm-up
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                model(x)
                ts.append((time.perf_counter() - t0) / b)
            out["cpu_s_per_image"][b] = {"best": min(ts), "all": ts}
    out["load"] = [load0, os.getloadavg()[0]]
    return out


def _preprocess_s(n: int = 64) -> float:
    """Seconds per image, one core: PIL decode of a 640×480 JPEG + open_clip's ViT-H-14 224-px transform."""
    import io

    import open_clip
    import torch
    from PIL import Image

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    # a smooth random image (a noise image would be an unrealistically large JPEG)
    small = rng.integers(0, 255, (30, 40, 3), dtype=np.uint8)
    Image.fromarray(small).resize((640, 480), Image.BICUBIC).save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    transform = open_clip.image_transform(224, is_train=False)
    transform(Image.open(io.BytesIO(data)).convert("RGB"))
    t0 = time.perf_counter()
    for _ in range(n):
        transform(Image.open(io.BytesIO(data)).convert("RGB"))
    dt = (time.perf_counter() - t0) / n
    torch.set_num_threads(threads)
    return dt


def _vit_child(path: str) -> None:
    Path(path).write_text(json.dumps(vit_h14_figures()))


def projection(results: list[dict], a, vit: dict | None) -> None:
    """Core-hours per step from the largest run where the step completed; GPU-hours for the embed and
    assign jobs at ViT-H-14 from its counted FLOPs and the stated throughput assumptions."""
    print("\n### what the cluster run costs (projection)\n")
    if getattr(a, "dedup_json", None):
        dedup_projection(json.loads(Path(a.dedup_json).read_text()), a)
        print()
    print("CPU: CPU time (utime + stime) of every task process and of the CLI after its tasks, per sample, "
          "from the largest run where the step completed; × samples (linear: a streaming map / apply task "
          "costs its share; a step whose every task reads the whole input — rc 0 but map peak growing with "
          "the corpus in the table above — grows faster, so its line is a lower bound).\n")
    print("| step | from the run of | CPU µs / sample | core-hours at 85M | core-hours at 500M |\n"
          "| --- | ---: | ---: | ---: | ---: |")
    for step in STEPS:
        done = [r for r in results if step in r["steps"] and r["steps"][step]["rc"] == 0]
        if not done:
            continue
        big = max(done, key=lambda r: r["samples"])
        per = step_figures(big["steps"][step])["cpu_s"] / big["samples"]
        print(f"| {step} | {big['samples']:,} | {per * 1e6:.1f} | {per * 85e6 / 3600:,.2f} | "
              f"{per * 500e6 / 3600:,.2f} |")
    if vit is None:
        return
    fl = vit["flops_per_image"]
    d, V = 1024, a.vocab
    cpu = vit["cpu_s_per_image"]
    best_cpu = min(v["best"] for v in cpu.values())
    load = vit.get("load")
    print(f"\nMetaCLIP ViT-H-14 image tower (open_clip `ViT-H-14`, random init): {vit['params'] / 1e6:.0f}M "
          f"parameters, **{fl / 1e9:.1f} GFLOPs per 224-px image** (torch FlopCounterMode, a multiply-add = 2 "
          f"FLOPs). CPU forward here, {vit['threads']} threads, fp32, inference mode: "
          + ", ".join(f"batch {b}: {v['best']:.2f} s/image" for b, v in cpu.items())
          + (f" (load average {load[0]:.1f} → {load[1]:.1f} on this 2-core machine while it ran)" if load else "")
          + f" — {fl / (best_cpu * vit['threads']) / 1e9:.0f} GFLOP/s per core.")
    if vit.get("preprocess_s_per_image"):
        print(f"Decode + preprocess (PIL JPEG decode of a {vit['preprocess_image']} image + open_clip's 224-px "
              f"transform), one core: {vit['preprocess_s_per_image'] * 1e3:.1f} ms/image.")
    measured = gpu_measured_rates(a.gpu_json) if a.gpu_json else None
    if a.gpu_measured:
        img_s = a.gpu_measured
        basis = f"{img_s:,.0f} images/s measured ({a.gpu_measured_note})"
    elif measured and measured.get("img_s"):
        img_s = measured["img_s"]
        basis = (f"measured: {img_s:,.0f} images/s end to end through {measured['embed_via']} ({measured['embed_path']}) on "
                 f"{measured['card']}, `{measured['command']}` ({measured['date']})")
    else:
        img_s = a.gpu_tflops * 1e12 * a.gpu_mfu / fl
        basis = (f"assumed: {a.gpu_tflops:g} TFLOP/s dense bf16 (H100 SXM spec) × {a.gpu_mfu:.0%} model FLOPs "
                 f"utilisation = {img_s:,.0f} images/s per GPU")
    assign_flops = 2 * V * d                  # per image: one row of the image × concept product
    assign_rate = a.gpu_tflops * 1e12 * a.assign_eff
    assign_basis = f"assumed {a.gpu_tflops:g} TFLOP/s × {a.assign_eff:.0%} (fp16 GEMM + top-k merge)"
    if measured and measured.get("assign_flops_s"):
        assign_rate = measured["assign_flops_s"]
        assign_basis = (f"measured {assign_rate / 1e12:,.0f} TFLOP/s effective ({measured['assign_shape']}, "
                        f"{measured['assign_path']}, the keys' upload included) on {measured['assign_card']}, "
                        f"`{measured['assign_command']}`")
    pre = vit.get("preprocess_s_per_image")
    print(f"\n| job | basis | GPU-hours at 85M | GPU-hours at 500M | CPU core-hours at 85M | at 500M |\n"
          f"| --- | --- | ---: | ---: | ---: | ---: |")
    core_s = best_cpu * vit["threads"]
    cpu_gflops = a.cpu_gflops or fl / core_s / 1e9      # default: the ViT forward's measured rate per core
    print(f"| embed-images: ViT-H-14 forward | {basis} | {85e6 / img_s / 3600:,.1f} | {500e6 / img_s / 3600:,.1f} | "
          f"{85e6 * core_s / 3600:,.0f} | {500e6 * core_s / 3600:,.0f} |")
    if pre:
        print(f"| embed-images: decode + preprocess | CPU, overlapped with the GPU by the decode pool (measured "
              f"above) | — | — | {85e6 * pre / 3600:,.0f} | {500e6 * pre / 3600:,.0f} |")
    print(f"| assign: exact top-{a.k}, V={V:,}, d={d} | 2·V·d = {assign_flops / 1e9:.2f} GFLOP per image; "
          f"{assign_basis}; reading the "
          f"fp16 vectors ({85e6 * d * 2 / 1e9:,.0f} GB at 85M) not counted | "
          f"{85e6 * assign_flops / assign_rate / 3600:,.2f} | {500e6 * assign_flops / assign_rate / 3600:,.2f} | "
          f"{85e6 * assign_flops / (cpu_gflops * 1e9) / 3600:,.0f} | "
          f"{500e6 * assign_flops / (cpu_gflops * 1e9) / 3600:,.0f} |")
    print(f"\nCPU columns: the ViT forward at its measured best s/image × {vit['threads']} cores; assign at "
          f"{cpu_gflops:.0f} GFLOP/s per core (`--cpu-gflops`; default: the ViT forward's measured rate). "
          f"GPU columns: FLOPs ÷ the rate named in the row: measured (`--gpu-json`, a `bench_curation --gpu` "
          f"result; `--gpu-measured` for the ViT alone) or assumed (`--gpu-tflops`, `--gpu-mfu`, `--assign-eff`).")


def dedup_projection(d: dict, a) -> None:
    """``dedup`` and ``align`` at 85M / 500M from ``bench_dedup``'s measured rates (``--dedup-json``).

    dedup's reduce has three parts that scale differently with N at a fixed ``cluster_rows`` (k = N /
    cluster_rows): the pairwise inside clusters is linear in N (each row meets ~cluster_rows others); every
    row's nearest centroid costs 2·d·k, so N·k: quadratic; k-means training is k × its training rows (capped
    at ``max_train_rows``) × iterations. Each is scaled from its own measured time; map and apply (streaming,
    linear) from their CPU time per row. The GPU column is FLOPs ÷ ``--gpu-tflops`` × ``--assign-eff``."""
    import math

    n, dim, m = d["rows"], d["dim"], d["cluster_rows"]
    t = d["step"]["timings_s"]
    threads = d.get("cpus", 2)

    def k_of(rows):
        return math.ceil(rows / m)

    def train_of(rows):
        return min(k_of(rows) * d.get("train_per_cluster", 256), d.get("max_train_rows", 1_000_000))

    def cpu_h(rows):        # the reduce's parts (wall × the cores BLAS used) + the streaming phases' CPU
        pair = t.get("pairwise", 0) * rows / n
        near = d.get("nearest", {}).get("s_per_row_centroid")
        if near:          # the pass's nearest-centroid search × N·k, the rest of it (reads, spills) × N
            assign = (t.get("assign", 0) - near * n * k_of(n)) * rows / n + near * rows * k_of(rows)
        else:             # without the rate: the whole pass × N·k, an upper bound
            assign = t.get("assign", 0) * (rows / n) * (k_of(rows) / k_of(n))
        km = t.get("kmeans", 0) * (k_of(rows) / k_of(n)) * (train_of(rows) / train_of(n))
        stream = (t.get("total", 0) + t.get("apply", 0)) * rows / n     # map + apply tasks' time, one core each
        return ((pair + assign + km) * threads + stream) / 3600

    def gpu_h(rows):
        fl = 2 * dim * (rows * m + rows * k_of(rows) + train_of(rows) * k_of(rows) * 20)
        return fl / (a.gpu_fp32_tflops * 1e12 * a.assign_eff) / 3600

    print(f"\n| job | basis | GPU-hours at 85M | GPU-hours at 500M | CPU core-hours at 85M | at 500M |\n"
          f"| --- | --- | ---: | ---: | ---: | ---: |")
    print(f"| dedup: k-means + cosine inside clusters, d={dim}, {m:,} rows a cluster | measured at {n:,} rows "
          f"(`python -m bench.bench_dedup`, {d['step']['wall_s']:.0f} s on {threads} cores): pairwise "
          f"{t.get('pairwise', 0):.0f} s (× N), nearest centroid {t.get('assign', 0):.0f} s (× N·k), k-means "
          f"{t.get('kmeans', 0):.0f} s (× k · training rows)"
          + (f", the nearest-centroid search {d['nearest']['s_per_row_centroid'] * 1e9:.2f} ns per row × centroid"
             if d.get("nearest") else "") +
          f"; GPU: 2·d·(N·{m:,} + N·k + 20·training rows·k) fp32 FLOPs at {a.gpu_fp32_tflops:g} TFLOP/s × "
          f"{a.assign_eff:.0%} | {gpu_h(85e6):,.2f} | {gpu_h(500e6):,.2f} | "
          f"{cpu_h(85e6):,.0f} | {cpu_h(500e6):,.0f} |")
    tt = d.get("text_tower")
    if tt:
        fl = tt["flops_per_caption"]
        rate = a.gpu_tflops * 1e12 * a.gpu_mfu
        core_s = tt["cpu_s_per_caption"] * tt["threads"]
        print(f"| align: ViT-H-14 text tower, 77 tokens | {fl / 1e9:.1f} GFLOPs per caption (FlopCounterMode); CPU "
              f"measured {tt['cpu_s_per_caption'] * 1e3:.0f} ms per caption on {tt['threads']} threads; GPU assumed "
              f"{a.gpu_tflops:g} TFLOP/s × {a.gpu_mfu:.0%} | {85e6 * fl / rate / 3600:,.2f} | "
              f"{500e6 * fl / rate / 3600:,.2f} | {85e6 * core_s / 3600:,.0f} | {500e6 * core_s / 3600:,.0f} |")


def gpu_measured_rates(paths: list[Path]) -> dict:
    """The rates ``python -m bench.bench_curation --gpu`` JSONs measured: ViT-H-14 images/s end to end
    through the ``embed-images`` step where a file has that figure, else through ``embed_rows`` (the fastest of
    any file), assign's effective FLOP/s (2·n·V·d ÷ seconds,
    key upload included, fastest path), each with the card, command and date it was measured with."""
    out = {}
    for path in paths:
        r = json.loads(Path(path).read_text())
        src = {"card": r.get("card", "?"), "command": r.get("command", "?").strip(), "date": r.get("date", "?")}
        vit = next((v for k, v in r.get("embed", {}).items() if k.startswith("ViT-H-14")), {})
        for k, v in vit.items():     # the step's own figure first (what a cluster runs), then embed_rows'
            if not (k.startswith(("step", "after")) and isinstance(v, dict) and "img_s" in v):
                continue
            rank = (k.startswith("step"), v["img_s"])
            if rank > out.get("embed_rank", (False, 0.0)):
                out.update(src, img_s=v["img_s"], embed_path=k.split(": ", 1)[1], embed_rank=rank,
                           embed_via=(f"the `embed-images` step over {r.get('jpegs', {}).get('rows', 0):,} rows"
                                      if k.startswith("step") else "`embed_rows`"))
        asg = r.get("assign", {})
        for k, v in asg.items():
            if k.startswith("after") and isinstance(v, dict) and "s" in v:
                flops = 2 * asg["n"] * asg["V"] * asg["d"] / v["s"]
                if flops > out.get("assign_flops_s", 0):
                    out.update(assign_flops_s=flops, assign_path=k.removeprefix("after: "),
                               assign_card=src["card"], assign_command=src["command"],
                               assign_shape=f"{asg['n']:,} × {asg['V']:,} × {asg['d']}, K = {asg['k']}")
    return out


# ------------------------------------------------------------------------------------- main

def _size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100K samples, no ViT timing")
    ap.add_argument("--samples", nargs="+", type=_size, help="corpus sizes, e.g. 10M 20M 40M (default 500K)")
    ap.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    ap.add_argument("--samples-layout", choices=("id-range", "interleaved"), default="id-range",
                    help="id-range: parts are contiguous id ranges (as ingest's shuffle writes them); interleaved: "
                         "ids interleaved across parts, each sorted (ingest before its shuffle: a canonical slice "
                         "is then a DuckDB sort of all parts in every task)")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=500_000)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=Path("runs/bench-scale"))
    ap.add_argument("--keep", action="store_true", help="keep each synthesised run folder")
    ap.add_argument("--guard-gib", type=float, default=14.0, help="kill a step whose processes pass this RSS")
    ap.add_argument("--poll", type=float, default=0.05)
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--vit", action=argparse.BooleanOptionalAction, default=None,
                    help="time the ViT-H-14 image tower on the CPU (default: on unless --quick)")
    ap.add_argument("--report", type=Path, nargs="+", help="print the tables and projection of saved --json files "
                    "(their runs merged, in order of size), run nothing")
    ap.add_argument("--vit-json", type=Path, help="reuse ViT-H-14 figures saved by an earlier run (its --json's 'vit')")
    ap.add_argument("--gpu-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H100 SXM: 989)")
    ap.add_argument("--gpu-mfu", type=float, default=0.4, help="assumed utilisation of the image tower's forward")
    ap.add_argument("--assign-eff", type=float, default=0.5, help="assumed fraction of peak for assign's fp16 GEMM")
    ap.add_argument("--gpu-measured", type=float, help="measured ViT-H-14 images/s per GPU (replaces the assumption)")
    ap.add_argument("--gpu-measured-note", default="", help="where --gpu-measured comes from")
    ap.add_argument("--gpu-json", type=Path, nargs="+", help="rates measured by `python -m bench.bench_curation --gpu --json F` "
                    "(ViT-H-14 through embed_rows, assign): replace the assumed GPU rates")
    ap.add_argument("--gpu-fp32-tflops", type=float, default=67.0, help="dense fp32 peak of the GPU (H100 SXM: 67): "
                    "dedup's cosines and k-means run in fp32")
    ap.add_argument("--dedup-json", type=Path, help="rates measured by `python -m bench.bench_dedup --json F`: the "
                    "projection's dedup and align rows")
    ap.add_argument("--cpu-gflops", type=float,
                    help="fp32 GFLOP/s per core for assign on CPU (default: the ViT forward's measured rate)")
    a = ap.parse_args(argv or [])
    sizes = a.samples or ([100_000] if a.quick else [500_000])
    if a.vit is None:
        a.vit = not a.quick
    if a.report:
        saved = [json.loads(p.read_text()) for p in a.report]
        results = sorted((r for s_ in saved for r in s_["results"]), key=lambda r: r["samples"])
        a.steps = [s for s in STEPS if any(s in r["steps"] for r in results)]
        print_tables(results, a)
        vit = next((s_["vit"] for s_ in saved if s_.get("vit")), None)
        if a.vit_json:
            vit = json.loads(a.vit_json.read_text()).get("vit") or json.loads(a.vit_json.read_text())
        projection(results, a, vit)
        return 0
    work = a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work).free
    print(f"bench_scale: sizes {sizes}, steps {a.steps}, work {work} ({free / GIB:.0f} GiB free), "
          f"guard {a.guard_gib} GiB, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
    tok = work / "tokenizer"
    if ("lengths" in a.steps or "pack" in a.steps) and not (tok / "tokenizer.json").exists():
        from bench.bench_lengths import build_tokenizer

        print("building the 32K BPE tokenizer...", flush=True)
        build_tokenizer(tok)
    results = []
    for n in sizes:
        results.append(dry_run(n, work, str(tok), a))
        if a.json:
            a.json.write_text(json.dumps({"results": results}, indent=1, default=str))
    print_tables(results, a)
    vit = None
    if a.vit_json:
        saved = json.loads(a.vit_json.read_text())
        vit = saved.get("vit", saved)
    elif a.vit:
        import multiprocessing as mp

        out = work / "vit.json"
        p = mp.get_context("spawn").Process(target=_vit_child, args=(str(out),))
        p.start()
        p.join()
        vit = json.loads(out.read_text()) if out.exists() else None
    projection(results, a, vit)
    if a.json:
        a.json.write_text(json.dumps({"results": results, "vit": vit}, indent=1, default=str))
    return 0 if all(s["rc"] == 0 for r in results for s in r["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
