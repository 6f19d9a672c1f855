"""Curation on one GPU: embed-images and assign against the model-only rate and the GEMM floor.

    python -m bench.bench_curation --gpu [--before DIR] [--json OUT.json]

* **GEMM probe**: bf16 and fp16 8192³ products (3 warm-ups, the mean of 10), the floor for assign.
* **embed-images**: each model (random weights: a timing needs none) alone, ``encode_image`` under bf16
  autocast on a ready batch; then through ``curation.embed.embed_rows`` on JPEGs made here (0.3–1 MP,
  smooth content plus sensor-like noise, quality 90: about the bytes per pixel of web photos), decoded in
  ``--decode-workers`` worker processes (each decoding ``--decode-unit`` rows at a time), and again with
  nvJPEG. Two rates: rows / wall time of the whole call (worker start-up and pipeline fill included), and
  the steady state (what a task embedding hundreds of thousands of rows sees): the rows after the fill
  over the time from the fill's last embeddings reaching the host to the end. The fill is the first
  ``ceil(workers × prefetch × unit / batch)`` batches (at least one; one for threads): those the workers
  may have prepared before the model started, which would flatter the rate. Each call also records when
  its first batch reached the host (``first_batch_s``), and ``startup_probe`` times the start-up's parts
  apart, before the calls and after them: one unit's decode in this process, and the start of the worker
  processes (the DataLoader forks all of them before any gets work; a fork copies the parent's page tables,
  so it costs more the more memory the parent holds; figures in ``bench/results/cpu.md``).
* **assign**: 1M × 500K × 1024, K = 10, fp16-exact unit vectors (what the ``.npy`` shards hold), through
  ``curation.assign_gpu.GpuTopK`` on the GPU, handed over as fp32 arrays and (``fp16 inputs``) as the
  fp16 arrays the shards hold, against the floor ``2·n·V·d / fp16 GEMM rate``; the ids are compared
  with the fp32 CPU path on the first ``--cpu-check`` queries.

``--before DIR`` times the previous ``embed_rows`` / ``topk_torch`` too, loaded from ``DIR/curation/``
(e.g. ``git show main:curation/embed.py``), in the same process on the same card. The previous
``embed_rows`` runs over this tree's ``curation.decode``, so it must take a ``DecodeConfig`` as this one does.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

RESULTS: dict = {}


def _save(path):
    if path:
        Path(path).write_text(json.dumps(RESULTS, indent=1, default=str))


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gemm_probe(device: str, n: int = 8192) -> dict:
    import torch

    out = {}
    for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        a = torch.randn(n, n, device=device, dtype=dt)
        b = torch.randn(n, n, device=device, dtype=dt)
        for _ in range(3):
            a @ b
        _sync()
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        _sync()
        out[name] = 2 * n ** 3 * 10 / (time.perf_counter() - t0) / 1e12
        del a, b
    return out


def _load_before(before: str | None, name: str):
    if not before:
        return None
    path = Path(before) / "curation" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"before_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod                 # (dataclasses look their module up there)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------- JPEGs

SIZES = [(640, 480), (800, 600), (1024, 768), (1200, 800), (720, 960), (900, 900), (1280, 720), (600, 800)]


def _jpeg(args):
    from PIL import Image

    i, folder = args
    rng = np.random.default_rng(i)
    w, h = SIZES[i % len(SIZES)]
    small = rng.integers(0, 255, (h // 24, w // 24, 3), dtype=np.uint8)
    im = np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC), dtype=np.float32)
    im += rng.normal(0, 6, im.shape).astype(np.float32)
    p = Path(folder) / f"{i:06d}.jpg"
    Image.fromarray(np.clip(im, 0, 255).astype(np.uint8)).save(p, "JPEG", quality=90)
    return str(p)


def make_jpegs(folder: Path, distinct: int, rows: int) -> tuple[list[dict], dict]:
    from multiprocessing import Pool

    folder.mkdir(parents=True, exist_ok=True)
    with Pool(os.cpu_count()) as pool:
        paths = pool.map(_jpeg, [(i, str(folder)) for i in range(distinct)])
    sizes = [os.path.getsize(p) for p in paths]
    mp = [SIZES[i % len(SIZES)][0] * SIZES[i % len(SIZES)][1] / 1e6 for i in range(distinct)]
    rows_ = [{"sample_id": f"{j:016x}", "status": "ok", "error": None,
              "images": [{"container": "file", "file": paths[j % distinct]}]} for j in range(rows)]
    return rows_, {"distinct": distinct, "rows": rows, "mean_megapixels": float(np.mean(mp)),
                   "mean_kb": float(np.mean(sizes) / 1e3), "kb_per_megapixel": float(np.sum(sizes) / np.sum(mp) / 1e3)}


# ------------------------------------------------------------------------------------- embed

def embed_variant(spec: str) -> dict:
    """``threads`` | ``processes`` | ``nvjpeg[:share]`` | ``step``, each ``+draft`` (libjpeg's reduced-scale
    decode) and ``+fast`` (torch's uint8 resize) optionally, then ``@unit`` optionally (a decode unit other
    than ``--decode-unit``): ``DecodeConfig`` fields, the ``embed-images`` step's of the same names
    (``step``: with ``"step": True``, for the step over a manifest of the rows), then ``/workers``
    optionally (decode workers other than ``--decode-workers``: ``step+draft+fast@256/7`` asks whether the
    rate follows the worker count)."""
    spec, _, workers = spec.partition("/")
    spec, _, unit = spec.partition("@")
    base, *flags = spec.split("+")
    if any(f not in ("draft", "fast") for f in flags):
        raise ValueError(f"unknown embed variant flag in {spec!r}")
    kw = {"decode": "threads" if base == "threads" else "processes", "jpeg_draft": "draft" in flags,
          "fast_resize": "fast" in flags, "jpeg_decode": "cpu"}
    if unit:
        kw["decode_unit"] = int(unit)
    if workers:
        kw["decode_workers"] = int(workers)
    if base.startswith("nvjpeg"):
        kw.update(jpeg_decode="nvjpeg", nvjpeg_share=float(base.partition(":")[2] or 1))
    elif base == "step":
        kw["step"] = True
    elif base not in ("threads", "processes"):
        raise ValueError(f"unknown embed variant {spec!r}")
    return kw


def ingested_run(rows: list[dict], work: Path) -> Path:
    """A run folder whose ``ingest`` step holds ``rows`` as a ``samples`` manifest: a LLaVA-558K-style JSON
    naming each row's JPEG, through the real ``ingest`` step (made once per bench; timed apart)."""
    import hashlib

    from ovpipe.cli import main as ovpipe

    records = [{"id": r["sample_id"], "image": r["images"][0]["file"],
                "conversations": [{"from": "human", "value": "<image>\nDescribe the image."},
                                  {"from": "gpt", "value": f"Photo {r['sample_id']}."}]} for r in rows]
    # (a caption per row: a sample's id hashes its image and its text, and rows sharing a JPEG must not
    # become duplicates)
    text = json.dumps(records)
    run = work / f"step-run-{hashlib.sha1(text.encode()).hexdigest()[:12]}"    # these rows' (a rerun: a no-op)
    src = work / "llava-json"
    src.mkdir(parents=True, exist_ok=True)
    (src / "rows.json").write_text(text)
    t0 = time.perf_counter()
    n = str(min(8, os.cpu_count() or 1))
    os.environ.setdefault("TQDM_DISABLE", "1")          # the tasks' row counters: not for a device log
    if ovpipe(["ingest", "--run-dir", str(run), "--set", f"inputs=[\"{src}/rows.json\"]", "--set", "format=llava-json",
               "--set", "source=bench", "--set", "category=caption", "--set", "verify=header", "--tasks", n,
               "--workers", n, "--quiet"]) != 0:
        raise RuntimeError(f"ingest of the bench rows into {run} failed")
    print(f"  ingested {len(rows):,} rows for the step runs in {time.perf_counter() - t0:.1f} s", flush=True)
    return run


def embed_step(run: Path, model: str, net, preprocess, device: str, batch: int, decode):
    """``ovpipe embed-images`` over ``run``'s ingest step, in this process (one task), with the model the
    bench holds in place of ``load_clip``'s (a timing needs no weights, and loading a checkpoint is a
    per-task cost outside the rate) and ``decode`` (a ``DecodeConfig``) as the step's fields of the same
    names: (embeddings in the manifest's order, per-row errors)."""
    import dataclasses
    import shutil
    from unittest import mock

    from manifests import read_manifest
    from ovpipe.cli import main as ovpipe

    shutil.rmtree(run / "embed-images", ignore_errors=True)     # completed tasks are never redone
    sets = {"model": model, "device": device, "batch_size": batch, **dataclasses.asdict(decode)}
    args = [a for k, v in sets.items() if v is not None
            for a in ("--set", f"{k}={json.dumps(v) if isinstance(v, bool) else v}")]
    with mock.patch("curation.clip.load_clip", lambda *a, **k: (net, preprocess, None, device)):
        if ovpipe(["embed-images", "--run-dir", str(run), "--tasks", "1", *args, "--quiet"]) != 0:
            raise RuntimeError("the embed-images step failed")
    out = read_manifest(run, "image_embeddings", "embed-images")
    shard = np.load(run / "embed-images" / "data" / "emb-00000.npy")
    return shard.astype(np.float32), [None if st == "ok" else (e or st) for st, e in
                                      zip(out["status"].to_pylist(), out["error"].to_pylist())]


def bench_embed(model: str, rows: list[dict], device: str, batch: int, workers: int, before, json_path,
                reps_e: int = 1, variants=("processes", "nvjpeg"), unit: int = 256, work: Path | None = None,
                sustained_s: float = 0.0) -> None:
    import open_clip
    import torch

    from curation.clip import autocast
    from curation.decode import DecodeConfig
    from curation.embed import embed_rows

    torch.manual_seed(0)
    try:
        with torch.device(device):   # random init straight on the GPU (seconds, not a CPU minute)
            net, _, preprocess = open_clip.create_model_and_transforms(model, pretrained=None)
    except Exception:
        net, _, preprocess = open_clip.create_model_and_transforms(model, pretrained=None)
    net = net.to(device).eval()
    res = RESULTS.setdefault("embed", {}).setdefault(model, {})
    size = net.visual.image_size
    size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
    x = torch.randn(batch, 3, *size, device=device)
    with torch.inference_mode(), autocast(device):
        for _ in range(2):
            net.encode_image(x)
        _sync()
        reps = 8
        t0 = time.perf_counter()
        for _ in range(reps):
            net.encode_image(x)
        _sync()
    res["model_only"] = batch * reps / (time.perf_counter() - t0)
    print(f"{model}: model only {res['model_only']:,.0f} img/s (batch {batch})", flush=True)
    res["startup"] = startup_probe(rows, preprocess, device, workers, unit)
    print(f"  start-up parts: {res['startup']}", flush=True)
    _save(json_path)
    runs = []
    if before is not None:
        runs.append(("before: (main)", lambda: before.embed_rows(rows, net, preprocess, device, batch,
                                                                 DecodeConfig(decode_workers=workers)), 1))
    for spec in variants:
        kw = {"decode_unit": unit, "decode_workers": workers, **embed_variant(spec)}
        step = kw.pop("step", False)
        decode = DecodeConfig(**kw)
        w, procs = decode.decode_workers, decode.decode == "processes"
        fill = max(1, -(-w * decode.prefetch * decode.decode_unit // batch)) if procs else 1
        if step:          # the whole step: manifest in, .npy shard and manifest part out
            run = ingested_run(rows, work or Path("/tmp/bench-curation-gpu"))
            runs.append((f"step: {spec}, {w} workers, units of {decode.decode_unit}",
                         lambda decode=decode, run=run: embed_step(run, model, net, preprocess, device, batch,
                                                                   decode), fill))
            continue
        runs.append((f"after: {spec}, {w} workers" + (f", units of {decode.decode_unit}" if procs else ""),
                     lambda decode=decode: embed_rows(rows, net, preprocess, device, batch, decode), fill))
    ref = None
    for name, fn, fill in runs:
        try:
            embed_rows(rows[:2 * batch], net, preprocess, device, batch,
                       DecodeConfig(decode="threads", decode_workers=2))   # warm
            times, steady = [], []
            for _ in range(reps_e):       # best of reps_e: on a shared machine the least disturbed run
                first = {"rows": 0}

                def on_batch(b, n, first=first):     # batch b's embeddings are on the host
                    if b == 0:
                        first["first_batch_s"] = time.perf_counter() - t0
                    if b < fill:
                        first["t"], first["rows"] = time.perf_counter(), first["rows"] + n
                _sync()
                cpu0 = cpu_seconds()
                t0 = time.perf_counter()
                with host_waits() as waits, batches_reaching_the_host(on_batch):
                    emb, errors = fn()
                _sync()
                t1 = time.perf_counter()
                cpu1 = cpu_seconds()
                if not times or t1 - t0 < min(times):
                    d = {k: cpu1[k] - cpu0[k] for k in cpu0}
                    cpu = {k: d[k] * 1e3 / len(rows) for k in ("main", "workers")}
                    if "machine_busy" in d:    # the machine's CPUs over the run: a decode short of CPU has no idle
                        total = d["machine_busy"] + d["machine_idle"] + d["machine_steal"]
                        cpu.update(machine_busy_share=d["machine_busy"] / total,
                                   machine_steal_share=d["machine_steal"] / total)
                    if "throttled" in d:
                        cpu["throttled_s"] = d["throttled"]
                    cpu["host_wait_s"] = {k: round(v, 3) for k, v in waits.items()}
                times.append(t1 - t0)
                if "t" in first and len(rows) > first["rows"] and t1 > first["t"]:
                    steady.append(((len(rows) - first["rows"]) / (t1 - first["t"]), first["t"] - t0))
            dt = min(times)
            res[name] = {"img_s": len(rows) / dt, "all_s": times, "of_model": len(rows) / dt / res["model_only"],
                         "errors": sum(e is not None for e in errors), "first_batch_s": first.get("first_batch_s"),
                         "cpu_ms_per_image": cpu}
            if steady:      # (the first batch's forward overlaps the second's input: a bias of one batch in all)
                rate, fill_s = max(steady)
                res[name].update(steady_img_s=rate, steady_of_model=rate / res["model_only"], fill_batches=fill,
                                 fill_s=fill_s)
            if name.startswith("step"):      # the manifest's canonical order, not the rows': not compared
                res[name]["embedded"] = len(emb)
            elif ref is None:
                ref = emb
            else:
                res[name]["min_cos_vs_first"] = float((ref * emb).sum(1).min())
            print(f"  {name}: {res[name]}", flush=True)
        except Exception as e:       # one path failing must not lose the others' figures
            res[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"  {name}: FAILED {res[name]['error']}", flush=True)
        _save(json_path)
    if sustained_s > 0:     # the model alone for as long as a run, after the runs: the card's clocks under
        # sustained load (a burst of 8 batches may run at clocks that minutes of work do not keep)
        reps = max(8, round(sustained_s * res["model_only"] / batch))
        with torch.inference_mode(), autocast(device):
            _sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                net.encode_image(x)
            _sync()
        res["model_only_sustained"] = {"img_s": batch * reps / (time.perf_counter() - t0), "batches": reps}
        print(f"{model}: model only, sustained {res['model_only_sustained']}", flush=True)
        _save(json_path)
    # again, as the later calls found the process: pinned batches cached by torch, a fork copying more
    res["startup_after_runs"] = startup_probe(rows, preprocess, device, workers, unit)
    print(f"  start-up parts after the runs: {res['startup_after_runs']}", flush=True)
    _save(json_path)
    del net
    torch.cuda.empty_cache()


@contextlib.contextmanager
def batches_reaching_the_host(on_batch):
    """``on_batch(b, rows)`` as batch ``b``'s embeddings reach the host, in the embedding loop
    (``curation.decode.embed_batches``) that ``embed_rows`` and the step share, over the block."""
    from unittest import mock

    from curation import decode

    real = decode.embed_batches

    def counted(*a, **k):
        for b, item in enumerate(real(*a, **k)):
            on_batch(b, len(item[0]["rows"]))
            yield item

    with mock.patch.object(decode, "embed_batches", counted):
        yield


@contextlib.contextmanager
def host_waits():
    """The seconds the embedding loop (``curation.decode.embed_batches``, the step's and ``embed_rows``')
    waited for decoded input and for the device over the block: {"wait_input": s, "wait_device": s}."""
    from unittest import mock

    from curation import decode
    from ovpipe.step import Stats

    waits, real = {}, decode.embed_batches

    def timed(batches, net, pre, device, stats=None):
        stats = stats if stats is not None else Stats()
        before = {k: stats.timings.get(k, 0.0) for k in ("wait_input", "wait_device")}
        yield from real(batches, net, pre, device, stats)
        for k, v in before.items():
            waits[k] = waits.get(k, 0.0) + stats.timings[k] - v

    with mock.patch.object(decode, "embed_batches", timed):
        yield waits


def cpu_seconds() -> dict:
    """CPU seconds so far of this process (all its threads) and of its reaped children (the decode workers,
    joined when their loader ends), the machine's CPU time by state (``/proc/stat``: busy, idle, stolen by a
    hypervisor) and the time the CPU cgroup was throttled by its quota. Over a run, beside its wall time:
    whether the workers compute for as long as they take, or wait (on this process, on a quota, on a host)."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    out = {"main": me.ru_utime + me.ru_stime, "workers": kids.ru_utime + kids.ru_stime}
    try:    # cpu  user nice system idle iowait irq softirq steal ... (in USER_HZ ticks)
        f = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        tick = os.sysconf("SC_CLK_TCK")
        out.update(machine_busy=(f[0] + f[1] + f[2] + f[5] + f[6]) / tick, machine_idle=(f[3] + f[4]) / tick,
                   machine_steal=f[7] / tick)
    except (OSError, ValueError, IndexError):
        pass
    for path, key, scale in (("/sys/fs/cgroup/cpu.stat", "throttled_usec", 1e-6),            # cgroup v2
                             ("/sys/fs/cgroup/cpu/cpu.stat", "throttled_time", 1e-9)):       # v1
        try:
            stat = dict(line.split() for line in Path(path).read_text().splitlines())
            out["throttled"] = int(stat[key]) * scale
            break
        except (OSError, KeyError, ValueError):
            continue
    return out


def cpu_quota() -> float | None:
    """The CPU cgroup's quota in CPUs (None: no quota)."""
    try:
        q, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return None if q == "max" else int(q) / int(period)
    except (OSError, ValueError):
        pass
    try:
        q = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        return None if q < 0 else q / int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None


def cpu_topology() -> dict:
    """The CPUs this process may use, and how many distinct physical cores they are (hyper-threads share
    one core's execution units: 16 CPUs may be 8 cores)."""
    from curation.decode import usable_cpus

    cpus = usable_cpus()
    cores = set()
    for c in cpus:
        top = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            cores.add(((top / "physical_package_id").read_text().strip(), (top / "core_id").read_text().strip()))
        except OSError:
            cores.add(("?", str(c)))
    return {"cpus": len(cpus), "physical_cores": len(cores), "quota_cpus": cpu_quota()}


def _ping_dataset():
    import torch

    class Ping(torch.utils.data.IterableDataset):
        """One tiny tensor per DataLoader worker: what starting the workers costs, without any decoding."""

        def __iter__(self):
            yield torch.zeros(1)

    return Ping()


def startup_probe(rows: list[dict], preprocess, device: str, workers: int, unit: int) -> dict:
    """The parts of an ``embed_rows`` call's start-up, timed apart in this process as it stands (the model
    on the device): one ``unit``-row decode in this process (what a worker needs before its first unit is
    ready) and the start of ``workers`` DataLoader worker processes (fork, then one item from each)."""
    import torch

    from curation.decode import make_decoder, prepare_batch, split_preprocess

    pre = split_preprocess(preprocess)
    decoder = make_decoder(pre, device)           # the device's defaults, as the step decodes
    t0 = time.perf_counter()
    prepare_batch(rows[:unit], decoder)
    decode_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    it = iter(torch.utils.data.DataLoader(_ping_dataset(), batch_size=None, num_workers=workers))
    started = time.perf_counter() - t0
    for _ in range(workers):
        next(it)
    first = time.perf_counter() - t0
    del it
    return {"decode_unit_s": decode_s, "unit": min(unit, len(rows)), "workers": workers,
            "workers_started_s": started, "workers_first_item_s": first}


# ------------------------------------------------------------------------------------- assign

def _unit16(n, d, device, seed):
    """Unit vectors rounded to fp16, as the fp16 array the shards hold."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, d, device=device, generator=g)
    return torch.nn.functional.normalize(x, dim=1).half().cpu().numpy()


ASSIGN_TILES = ((16384, 65536), (32768, 131072), (32768, 262144))


def bench_assign(n: int, V: int, d: int, k: int, device: str, before, floor_tflops: float, cpu_check: int,
                 json_path, layouts=("strided",), tiles=ASSIGN_TILES, inputs=("fp32", "fp16")) -> None:
    from curation.assign import topk_torch
    from curation.assign_gpu import GpuTopK, topk_tiles

    X16, C16 = _unit16(n, d, device, 0), _unit16(V, d, device, 1)
    X, C = X16.astype(np.float32), C16.astype(np.float32)       # the same values, widened on the host
    floor = 2 * n * V * d / (floor_tflops * 1e12)
    res = RESULTS.setdefault("assign", {"n": n, "V": V, "d": d, "k": k, "floor_s": floor})
    print(f"assign {n:,} × {V:,} × {d}, K={k}: GEMM floor {floor:.2f} s at {floor_tflops:.0f} TFLOP/s (fp16)",
          flush=True)
    runs = []
    if before is not None:
        runs.append(("before: topk_torch (main), tiles 16384 × 65536",
                     lambda: before.topk_torch(X, C, k, 16384, 65536, device)))
    searches = {}

    def after(tq, tc, layout, dtype):
        keys, queries = (C16, X16) if dtype == "fp16" else (C, X)

        def go():
            t0 = time.perf_counter()
            s = searches[(tq, tc, layout, dtype)] = GpuTopK(keys, k, device, tc, layout)
            _sync()
            setup[(tq, tc, layout, dtype)] = time.perf_counter() - t0
            return topk_tiles(s, queries, tq)
        return go

    setup = {}
    for layout in layouts:
        for dtype in inputs:
            for tq, tc in tiles:
                label = ", fp16 inputs" if dtype == "fp16" else ""
                runs.append((f"after: GpuTopK, {layout} groups, tiles {tq} × {tc}{label}",
                             after(tq, tc, layout, dtype)))
    s_cpu, i_cpu = topk_torch(X[:cpu_check], C, k, 4096, 65536, "cpu")
    ref = None
    for name, fn in runs:
        try:
            _sync()
            t0 = time.perf_counter()
            s, i = fn()
            _sync()
            dt = time.perf_counter() - t0
            key = next(iter(setup)) if setup else None
            su = setup.pop(key) if key else 0.0       # the keys' upload, once per task: reported apart
            r = {"s": dt, "setup_s": su, "queries_s": n / dt, "of_floor": floor / dt,
                 "search_s": dt - su, "search_of_floor": floor / (dt - su),
                 "same_ids_as_cpu": float((i[:cpu_check] == i_cpu).mean()),
                 "max_score_diff_vs_cpu": float(np.abs(s[:cpu_check] - s_cpu).max())}
            if ref is not None:
                r["same_ids_as_first"] = float((i == ref).mean())
            ref = i if ref is None else ref
            res[name] = r
            print(f"  {name}: {r}", flush=True)
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"  {name}: FAILED {res[name]['error']}", flush=True)
        _save(json_path)
    res["recomputed_rows"] = {f"{a}x{b} {c} {t}": s.recomputed for (a, b, c, t), s in searches.items()}
    _save(json_path)


# ------------------------------------------------------------------------------------- table

def table() -> str:
    lines = []
    g = RESULTS.get("gemm_tflops", {})
    card = RESULTS.get("card", "?")
    lines.append(f"GPU curation bench on {card} — GEMM probe 8192³: bf16 {g.get('bf16', 0):.0f} TFLOP/s, "
                 f"fp16 {g.get('fp16', 0):.0f} TFLOP/s")
    if "jpegs" in RESULTS:
        j = RESULTS["jpegs"]
        lines.append(f"JPEGs: {j['distinct']:,} distinct, {j['rows']:,} rows, {j['mean_megapixels']:.2f} MP and "
                     f"{j['mean_kb']:.0f} kB on average")
    lines.append("\n| what | images or queries per second | share of the model / of the GEMM floor |\n"
                 "| --- | ---: | ---: |")
    for model, res in RESULTS.get("embed", {}).items():
        if "model_only" not in res:
            lines.append(f"| {model} | failed: {res.get('error')} | — |")
            continue
        lines.append(f"| {model} `encode_image`, bf16, model only | {res['model_only']:,.0f} | 100% |")
        if "model_only_sustained" in res:
            r = res["model_only_sustained"]
            lines.append(f"| {model} `encode_image`, model only, sustained ({r['batches']} batches, after the runs) | "
                         f"{r['img_s']:,.0f} | {r['img_s'] / res['model_only']:.0%} |")
        for name, r in res.items():
            if name.startswith("model_only") or name.startswith("startup"):    # printed apart
                continue
            cell = f"{r['img_s']:,.0f} | {r['of_model']:.0%}" if "img_s" in r else f"failed: {r['error']} | —"
            via = "the `embed-images` step" if name.startswith("step") else "`embed_rows`"
            c = r.get("cpu_ms_per_image")
            w = (c or {}).get("host_wait_s", {})
            cpu = (f" (CPU ms per image: main {c['main']:.2f}, workers {c['workers']:.2f}; machine busy "
                   f"{c.get('machine_busy_share', float('nan')):.0%}"
                   + (f"; host waited {w.get('wait_input', 0):.1f} s for input, {w.get('wait_device', 0):.1f} s "
                      f"for the device" if w else "") + ")" if c else "")
            lines.append(f"| {model} through {via}, {name}: whole call{cpu} | {cell} |")
            if "steady_img_s" in r:
                lines.append(f"| {model} through {via}, {name}: steady state (after the first "
                             f"{r['fill_batches']} batches, on the host at {r['fill_s']:.2f} s) | "
                             f"{r['steady_img_s']:,.0f} | {r['steady_of_model']:.0%} |")
    a = RESULTS.get("assign")
    if a:
        lines.append(f"| assign {a['n']:,} × {a['V']:,}, d = {a['d']}, K = {a['k']}: GEMM floor at fp16 | "
                     f"{a['n'] / a['floor_s']:,.0f} ({a['floor_s']:.2f} s) | 100% |")
        for name, r in a.items():
            if not isinstance(r, dict) or name == "recomputed_rows":
                continue
            if "s" not in r:
                cell = f"failed: {r['error']} | —"
            elif r.get("setup_s"):
                cell = (f"{r['queries_s']:,.0f} ({r['s']:.2f} s, of which {r['setup_s']:.2f} s uploading the keys; "
                        f"ids = CPU on {r['same_ids_as_cpu']:.5f}) | {r['of_floor']:.0%} "
                        f"({r['search_of_floor']:.0%} without the upload)")
            else:
                cell = (f"{r['queries_s']:,.0f} ({r['s']:.2f} s; ids = CPU on {r['same_ids_as_cpu']:.5f}) | "
                        f"{r['of_floor']:.0%}")
            lines.append(f"| assign, {name} | {cell} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_curation --gpu")
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--before", help="a folder holding the previous curation/embed.py and curation/assign.py")
    ap.add_argument("--models", nargs="+", default=["ViT-H-14-quickgelu", "ViT-L-14-quickgelu"])
    ap.add_argument("--images", type=int, default=16384, help="rows embedded per run")
    ap.add_argument("--distinct", type=int, default=2048, help="distinct JPEGs among them")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--decode-workers", type=int, help="default: the embed-images step's (curation.decode."
                    "DecodeConfig.resolve: the CPUs this process may use but one, at most 32)")
    ap.add_argument("--decode-unit", type=int, default=256, help="rows a decode worker prepares at a time")
    ap.add_argument("--embed", nargs="+", default=["processes", "nvjpeg", "processes+draft", "nvjpeg:0.5",
                                                    "nvjpeg:0.5+draft"],
                    help="decode paths to time: threads | processes | nvjpeg[:share], or step (the embed-images "
                         "step over an ingested manifest of the same rows), each +draft and +fast optionally, "
                         "then @unit optionally (a decode unit other than --decode-unit)")
    ap.add_argument("--layouts", nargs="+", default=["strided"], choices=["strided", "contiguous"],
                    help="assign group layouts to time")
    ap.add_argument("--tiles", nargs="+", default=[f"{a}x{b}" for a, b in ASSIGN_TILES],
                    help="assign tiles to time, queries x concepts")
    ap.add_argument("--assign-inputs", nargs="+", default=["fp32", "fp16"], choices=["fp32", "fp16"],
                    help="the dtype of the arrays handed to GpuTopK")
    ap.add_argument("--reps", type=int, default=1, help="embed runs per path (the best counts)")
    ap.add_argument("--sustained-s", type=float, default=0.0,
                    help="also time the model alone for about this many seconds, after the embed runs")
    ap.add_argument("--queries", type=int, default=1_000_000)
    ap.add_argument("--concepts", type=int, default=500_000)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--cpu-check", type=int, default=2048, help="queries compared with the fp32 CPU path")
    ap.add_argument("--skip", nargs="*", default=[], choices=["embed", "assign"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-curation-gpu"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--command", default="", help="the command line, recorded with the figures")
    a = ap.parse_args(argv or [])
    import torch

    from curation.clip import register_configs
    from curation.decode import DecodeConfig

    register_configs()
    RESULTS.update({"card": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
                    "torch": torch.__version__, "cpus": os.cpu_count(), "cpu_topology": cpu_topology(),
                    "command": a.command,
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
    RESULTS["gemm_tflops"] = gemm_probe(a.device, 8192 if a.device.startswith("cuda") else 512)
    print(RESULTS["gemm_tflops"], flush=True)
    _save(a.json)
    if "embed" not in a.skip:
        rows, RESULTS["jpegs"] = make_jpegs(a.work / "jpegs", a.distinct, a.images)
        print(RESULTS["jpegs"], flush=True)
        before = _load_before(a.before, "embed")
        workers = DecodeConfig(decode="processes", decode_workers=a.decode_workers).resolve(a.device).decode_workers
        for m in a.models:
            try:
                bench_embed(m, rows, a.device, a.batch_size, workers, before, a.json, a.reps, a.embed,
                            a.decode_unit, a.work, a.sustained_s)
            except Exception as e:
                RESULTS.setdefault("embed", {})[m + " (failed)"] = {"error": f"{type(e).__name__}: {e}"}
                print(f"{m}: FAILED {e}", flush=True)
    if "assign" not in a.skip:
        bench_assign(a.queries, a.concepts, a.dim, a.k, a.device, _load_before(a.before, "assign"),
                     RESULTS["gemm_tflops"]["fp16"], a.cpu_check, a.json, a.layouts,
                     [tuple(int(v) for v in t.split("x")) for t in a.tiles], a.assign_inputs)
    RESULTS["table"] = table()
    _save(a.json)
    print("\n" + RESULTS["table"])
    return 0
