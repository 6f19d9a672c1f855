"""The long fuzz run: every reader fed generated bad inputs by hypothesis (the strategies and properties of
``tests/fuzz/``), counted rather than stopped at the first failure.

    .venv/bin/python -m bench fuzz --examples 8000 --bulk 40 --jobs 2 --out bench/results/bench_fuzz.md

``--examples`` is the number of generated inputs (hypothesis examples) over every reader, shared out by
``SHARE`` (a reader whose input costs more, a whole step run twice, gets fewer). A file input (a tar, a JSON
file, a Parquet file) holds its drawn rows plus ``--bulk`` more made from them (re-keyed, recombined,
mutated: cheap to make, so a run reaches many rows). Per reader the table gives the inputs, the input rows
they held (samples, records, table rows, official entries; one for a statement, a request, a config value),
the distinct statuses they came out as, the crashes (an exception escaping the reader: a task that would
have died — must be 0) and the property failures (a row lost or doubled, a row without a status, a config
error not naming its field, a file read or written outside the run, a step's second run not byte-identical
— must be 0), with the first failing input of each. Random seeds (``--seed`` fixes them); no shrinking, so
every input counts once.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed

# reader: its share of --examples (the weights sum to 1)
SHARE = {"webdataset": 0.18, "llava/messages JSON": 0.18, "caption-parquet": 0.06, "llava-ov-parquet": 0.06,
         "finevision": 0.06, "messages parquet": 0.06, "import-packs entry": 0.10, "official layout": 0.08,
         "config --set": 0.06, "viewer SQL box": 0.07, "ovpipe sql": 0.03, "viewer routes": 0.058,
         "ingest twice": 0.001, "import-packs twice": 0.001}


def _case(name: str, bulk: int = 0):
    """(strategy, target) of one reader: the target takes (drawn, workspace) and returns its statuses."""
    from hypothesis import strategies as st

    from tests.fuzz import strategies as S
    from tests.fuzz import targets as T

    parquet = {"caption-parquet": "caption-parquet", "llava-ov-parquet": "llava-ov-parquet",
               "finevision": "finevision", "messages parquet": "messages"}
    if name in parquet:
        f = parquet[name]
        return st.tuples(st.just(f), S.parquet_table(f, bulk=bulk)), T.target_parquet
    if name == "config --set":
        return S.config_value(T.config_fields()), T.target_config
    return {
        "webdataset": (S.wds_tar(bulk=bulk), T.target_webdataset),
        "llava/messages JSON": (S.json_file(bulk=bulk), T.target_json),
        "import-packs entry": (S.official_members(), T.target_official_entry),
        "official layout": (S.official_layout(), T.target_official_folder),
        "viewer SQL box": (S.sql_statement(), T.target_sql),
        "ovpipe sql": (S.sql_statement(long=False), lambda q, ws: T.target_sql(q, ws, cli=True)),
        "viewer routes": (S.route_request(), T.target_route),
        "ingest twice": (st.tuples(S.wds_tar(), S.json_file(), st.tuples(st.just("caption-parquet"),
                                                                          S.parquet_table("caption-parquet"))),
                         lambda d, ws: T.step_twice("ingest", d, ws)),
        "import-packs twice": (S.official_tars(), lambda d, ws: T.step_twice("import-packs", d, ws)),
    }[name]


def fuzz_one(name: str, examples: int, seed: int, bulk: int = 0) -> dict:
    """Run one reader on ``examples`` generated inputs in this process; the counts."""
    os.environ.setdefault("HYPOTHESIS_PROFILE", "long")
    os.environ["TQDM_DISABLE"] = "1"
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    from tests.fuzz.targets import Workspace

    strategy, target = _case(name, bulk)
    ws = Workspace()
    out = {"reader": name, "tried": 0, "rows": 0, "statuses": Counter(), "crashes": 0, "failures": 0,
           "first_crash": None, "first_failure": None}
    t0 = time.perf_counter()

    @hseed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(drawn=strategy)
    def run(drawn):
        out["tried"] += 1
        try:
            got = target(drawn, ws)
            out["statuses"].update(got)
            out["rows"] += sum(1 for s in got if not s.startswith("shard:"))
        except AssertionError as e:
            out["failures"] += 1
            out["first_failure"] = out["first_failure"] or f"{e!s:.300} ← {drawn!r:.300}"
        except Exception as e:               # a crash: the reader let an exception escape
            out["crashes"] += 1
            out["first_crash"] = out["first_crash"] or \
                f"{''.join(traceback.format_exception_only(e)).strip():.300} ← {drawn!r:.300}"
        finally:
            shutil.rmtree(ws.inputs, ignore_errors=True)

    try:
        run()
    finally:
        shutil.rmtree(ws.root, ignore_errors=True)
    out["seconds"] = time.perf_counter() - t0
    return out


def table(results: list[dict]) -> str:
    lines = ["| reader | inputs | input rows | distinct statuses | most frequent statuses | crashes | property "
             "failures (rows lost) | seconds |", "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in results:
        top = ", ".join(f"{s} {n:,}" for s, n in Counter(r["statuses"]).most_common(6))
        lines.append(f"| {r['reader']} | {r['tried']:,} | {r['rows']:,} | {len(r['statuses'])} | {top} | "
                     f"{r['crashes']} | {r['failures']} | {r['seconds']:.0f} |")
    tot = {k: sum(r[k] for r in results) for k in ("tried", "rows", "crashes", "failures")}
    lines.append(f"| **all** | **{tot['tried']:,}** | **{tot['rows']:,}** | | | **{tot['crashes']}** | "
                 f"**{tot['failures']}** | |")
    for r in results:
        for k in ("first_crash", "first_failure"):
            if r[k]:
                lines.append(f"\n{r['reader']}, {k.replace('_', ' ')}: `{r[k]}`")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=2000, help="generated inputs in all, over every reader")
    p.add_argument("--bulk", type=int, default=0, help="rows added to each generated file from its drawn ones")
    p.add_argument("--jobs", type=int, default=1, help="readers fuzzed at once, one process each")
    p.add_argument("--seed", type=int, default=51)
    p.add_argument("--only", nargs="*", default=None, help="these readers only")
    p.add_argument("--out", help="write the table (with machine, commit and command) to this file")
    p.add_argument("--quick", action="store_true", help="200 inputs in all")
    a = p.parse_args(argv)
    total = 200 if a.quick else a.examples
    names = [n for n in SHARE if a.only is None or n in a.only]
    share = {n: max(1, round(total * SHARE[n] / sum(SHARE[m] for m in names))) for n in names}
    t0 = time.perf_counter()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    results = []
    with ProcessPoolExecutor(max_workers=a.jobs) as pool:
        futures = {pool.submit(fuzz_one, n, share[n], a.seed + i, a.bulk): n for i, n in enumerate(names)}
        for f in as_completed(futures):
            r = f.result()
            results.append(r)
            print(f"{r['reader']}: {r['tried']:,} inputs, {r['rows']:,} rows, {len(r['statuses'])} statuses, "
                  f"{r['crashes']} crashes, "
                  f"{r['failures']} failures, {r['seconds']:.0f} s", flush=True)
    results.sort(key=lambda r: names.index(r["reader"]))
    text = table(results)
    print(text)
    if a.out:
        head = (f"# Fuzz run: every reader, generated bad inputs\n\nMachine: {platform.machine()}, {os.cpu_count()} "
                f"cores (shared with other work), Python {platform.python_version()}; commit `{commit}`; "
                f"{time.perf_counter() - t0:.0f} s wall.\n\nCommand: `.venv/bin/python -m bench fuzz "
                f"{' '.join(argv or sys.argv[1:])}`\n\n")
        with open(a.out, "w") as f:
            f.write(head + text + "\n")
    return 1 if any(r["crashes"] or r["failures"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
