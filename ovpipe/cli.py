"""``ovpipe`` command line: one subcommand per step, plus sql / report / status / demo-data.

    ovpipe <step> --config CONFIG.yaml --run-dir RUN [--executor local|slurm] [--tasks N] [--workers W] [--overwrite]
    ovpipe sql RUN "SELECT status, count(*) FROM samples GROUP BY 1"
    ovpipe report RUN
    ovpipe status RUN
    ovpipe demo-data --out DIR
    ovpipe pretrain --recipe tiny --stage 1 --run-dir RUN
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ovpipe.registry import all_steps


def _parse_set(items: list[str]) -> dict:
    import yaml

    out = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"--set expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        out[k] = yaml.safe_load(v)
    return out


def cmd_step(args) -> int:
    from ovpipe import runfolder
    from ovpipe.config import ConfigError, load_config
    from ovpipe.executors import LocalExecutor, SlurmExecutor, SlurmOptions
    from ovpipe.registry import get_step

    step = get_step(args.command)
    try:
        cfg = load_config(step.config, args.config, _parse_set(args.set))
    except ConfigError as e:
        print(f"ovpipe {step.name}: invalid config: {e}", file=sys.stderr)
        return 2
    tasks = args.tasks
    if step.max_tasks is not None and tasks > step.max_tasks:
        print(f"ovpipe {step.name}: --tasks {tasks} > {step.max_tasks} (this step needs its whole input at once)",
              file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir).resolve()
    try:
        runfolder.prepare(run_dir, step, cfg, tasks, overwrite=args.overwrite, name=args.name)
    except runfolder.RunFolderError as e:
        print(f"ovpipe {step.name}: {e}", file=sys.stderr)
        return 2
    if args.executor == "slurm":
        opts = SlurmOptions(partition=args.partition, time=args.slurm_time, cpus_per_task=args.cpus_per_task,
                            mem=args.mem)
        ex = SlurmExecutor(workers=args.workers, options=opts, wait=args.wait, dependency=args.dependency)
        result = ex.run(step, run_dir, tasks, name=args.name)
        print(json.dumps(result, indent=2))
        return 0
    from ovpipe.executors.task import TaskFailed

    try:
        merged = LocalExecutor(workers=args.workers, progress=not args.quiet).run(step, run_dir, tasks, name=args.name)
    except TaskFailed as e:
        print(f"ovpipe {step.name}: {e}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"{args.name or step.name}: {tasks} task(s) done → {run_dir / (args.name or step.name)}")
        print(json.dumps(merged["counters"], indent=None))
    return 0


def cmd_task(args) -> int:
    from ovpipe.executors.task import run_task

    run_task(args.step, args.run_dir, args.rank, args.world_size, name=args.name)
    return 0


def cmd_finalize(args) -> int:
    from ovpipe.executors.task import finalize_step

    merged = finalize_step(args.step, args.run_dir, name=args.name)
    print(json.dumps(merged["counters"]))
    return 0


def _sql_run_dir(cmd: str, run_dir: str) -> Path | None:
    path = Path(run_dir)
    if not path.is_dir():
        print(f"ovpipe {cmd}: run folder {run_dir} does not exist or is not a folder", file=sys.stderr)
        return None
    return path


def cmd_sql(args) -> int:
    """Read-only SQL over the run folder (see manifests.catalog.run_sql); any SQL error is one line, exit 2."""
    import duckdb

    from manifests.catalog import ReadOnlyError, run_sql

    run_dir = _sql_run_dir("sql", args.run_dir)
    if run_dir is None:
        return 2
    try:
        rel = run_sql(run_dir, args.query)
        if rel is None:
            return 0
        if args.format == "csv":
            import csv

            rows = rel.fetchall()     # fetch first, so an error prints no half-written table
            w = csv.writer(sys.stdout, lineterminator="\n")
            w.writerow(rel.columns)
            w.writerows(rows)
        elif args.format == "json":
            cols = rel.columns
            for row in rel.fetchall():
                print(json.dumps(dict(zip(cols, row)), default=str))
        else:
            rel.show(max_rows=args.max_rows, max_width=200)
    except (ReadOnlyError, duckdb.Error) as e:
        print(f"ovpipe sql: {_sql_error_line(e)}", file=sys.stderr)
        return 2
    return 0


def _sql_error_line(e: Exception) -> str:
    """DuckDB messages run over several lines (a LINE 1: ... ^ caret); the first says what went wrong."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def cmd_report(args) -> int:
    import duckdb

    from manifests.catalog import run_report

    run_dir = _sql_run_dir("report", args.run_dir)
    if run_dir is None:
        return 2
    print(f"# ovpipe report: {run_dir}")
    try:
        for title, rel in run_report(run_dir):
            print(f"\n## {title}")
            rel.show(max_rows=40, max_width=200)
    except duckdb.Error as e:
        print(f"ovpipe report: {_sql_error_line(e)}", file=sys.stderr)
        return 2
    for rep in sorted(run_dir.glob("*/report.md")):
        print(f"\n## {rep.parent.name}\n")
        print(rep.read_text().rstrip())
    return 0


def cmd_status(args) -> int:
    from ovpipe import runfolder

    run_dir = Path(args.run_dir)
    steps = sorted(p.parent for p in run_dir.glob("*/executor.json"))
    if not steps:
        print(f"{run_dir}: no steps run yet")
        return 0
    rc = 0
    print(f"{'step':<16} {'done':>6} {'failed':>6} {'pending':>7}  final")
    for sdir in steps:
        st = runfolder.step_status(sdir)
        print(f"{st['step']:<16} {st['done']:>3}/{st['tasks']:<2} {len(st['failed']):>6} {len(st['pending']):>7}  "
              f"{'yes' if st['finalized'] else 'no'}")
        for rank, log in st["failed"]:
            print(f"    rank {rank} failed: {log}")
            rc = 1
    return rc


def cmd_demo_data(args) -> int:
    from ovpipe.demo import write_demo_corpus
    from ovpipe.demo_conversations import write_demo_conversations

    info = write_demo_corpus(Path(args.out), n_samples=args.samples, seed=args.seed, shards=args.shards)
    if not args.no_conversations:
        info["conversations"] = write_demo_conversations(Path(args.out), seed=args.seed)
    print(json.dumps(info, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ovpipe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in all_steps().items():
        sp = sub.add_parser(name, help=f"step ({module})")
        sp.add_argument("--config", help="YAML file of the step's config (defaults if omitted)")
        sp.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override one config field (YAML value), repeatable")
        sp.add_argument("--run-dir", required=True)
        sp.add_argument("--name", help="step folder name (default: the step's name), to run a step twice in one run")
        sp.add_argument("--executor", choices=["local", "slurm"], default="local")
        sp.add_argument("--tasks", type=int, default=1)
        sp.add_argument("--workers", type=int, default=1)
        sp.add_argument("--overwrite", action="store_true", help="discard outputs made with another config/task count")
        sp.add_argument("--quiet", action="store_true")
        g = sp.add_argument_group("slurm")
        g.add_argument("--partition")
        g.add_argument("--slurm-time", default="04:00:00")
        g.add_argument("--cpus-per-task", type=int, default=1)
        g.add_argument("--mem")
        g.add_argument("--dependency", help="extra job id this step must wait for (afterok)")
        g.add_argument("--wait", action="store_true", help="block until the array and merge jobs end")
        sp.set_defaults(func=cmd_step)

    sp = sub.add_parser("sql", help="run SQL over the run folder's manifests (DuckDB, one view per manifest)")
    sp.add_argument("run_dir")
    sp.add_argument("query")
    sp.add_argument("--format", choices=["table", "csv", "json"], default="table")
    sp.add_argument("--max-rows", type=int, default=100)
    sp.set_defaults(func=cmd_sql)

    sp = sub.add_parser("report", help="canned reports over a run folder")
    sp.add_argument("run_dir")
    sp.set_defaults(func=cmd_report)

    sp = sub.add_parser("status", help="per step: ranks done / failed / pending")
    sp.add_argument("run_dir")
    sp.set_defaults(func=cmd_status)

    sp = sub.add_parser("demo-data", help="write the synthetic demo corpus (caption shards + concept vocabulary, "
                                          "LLaVA-558K-style JSON, LLaVA JSON + FineVision instruction sets)")
    sp.add_argument("--out", required=True)
    sp.add_argument("--samples", type=int, default=2000)
    sp.add_argument("--shards", type=int, default=4)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--no-conversations", action="store_true",
                    help="only the caption shards (skip the LLaVA-558K-style and instruction sets)")
    sp.set_defaults(func=cmd_demo_data)

    sp = sub.add_parser("pretrain", help="three-stage megatron-core training (see `ovpipe pretrain --help`)",
                        add_help=False)
    sp.add_argument("rest", nargs=argparse.REMAINDER)
    sp.set_defaults(func=lambda a: __import__("pretrain.launch", fromlist=["main"]).main(a.rest))

    sp = sub.add_parser("_task", help=argparse.SUPPRESS)
    sp.add_argument("step")
    sp.add_argument("--run-dir", required=True)
    sp.add_argument("--rank", type=int, required=True)
    sp.add_argument("--world-size", type=int, required=True)
    sp.add_argument("--name")
    sp.set_defaults(func=cmd_task)

    sp = sub.add_parser("_finalize", help=argparse.SUPPRESS)
    sp.add_argument("step")
    sp.add_argument("--run-dir", required=True)
    sp.add_argument("--name")
    sp.set_defaults(func=cmd_finalize)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["pretrain"]:  # its own argument parser (torchrun / srun launch options)
        from pretrain.launch import main as pretrain_main

        return int(pretrain_main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    rc = args.func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
