"""``ovpipe`` command line: one subcommand per step, plus sql / report / status / demo-data.

    ovpipe <step> --config CONFIG.yaml --run-dir RUN [--executor local|slurm] [--tasks N] [--workers W] [--overwrite]
    ovpipe sql RUN "SELECT status, count(*) FROM samples GROUP BY 1"
    ovpipe report RUN
    ovpipe status RUN
    ovpipe demo-data --out DIR
    ovpipe pretrain --recipe tiny --stage 1 --run-dir RUN
    ovpipe export-model --run-dir RUN --stage 2 --out DIR
    ovpipe import-model --run-dir RUN --recipe R --llava-ov DIR --stage 1.5
    ovpipe plan --recipe R --stage 1.5 --samples N --gpus 128xA800
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ovpipe.registry import COMMANDS, DISTRIBUTED_STEPS, all_steps, command_help, step_help


# Commands with their own argument parser (the stage's layout and launch options, an export's, a plan's):
# ``main`` hands them their arguments whole; ``--help`` lists them with their one line.
OWN_PARSERS = ("pretrain", "export-model", "import-model", "plan", "view")


class UsageError(Exception):
    """A user error: printed as one line, exit code 2 (a traceback only with ``--debug``)."""


def _parse_set(items: list[str]) -> dict:
    import yaml

    from ovpipe.config import yaml_error_line, yaml_load

    out = {}
    for item in items or []:
        if "=" not in item:
            raise UsageError(f"--set expects FIELD=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k] = yaml_load(v)
        except yaml.YAMLError as e:
            raise UsageError(f"--set {k}: {v!r} is not a YAML value ({yaml_error_line(e)}); a text with "
                             f"{{ }}, [ ] or : in it is quoted: --set \"{k}='{v}'\"") from None
    return out


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _step_folder_name(text: str) -> str:
    from ovpipe.config import is_safe_component

    if not is_safe_component(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a step folder name (one path component: letters, digits, '.', '_', '-')")
    return text


def _run_dir(text: str) -> Path:
    run_dir = Path(text).expanduser().resolve()
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"--run-dir {text}: exists and is not a folder")
    return run_dir


def cmd_step(args) -> int:
    from ovpipe.config import ConfigError, load_config
    from ovpipe.console import set_verbose
    from ovpipe.registry import get_step

    step = get_step(args.command)
    set_verbose(args.verbose)
    try:
        cfg = load_config(step.config, args.config, _parse_set(args.set))
    except ConfigError as e:
        raise UsageError(f"invalid config: {e}") from e
    if step.distributed and hasattr(args, "nproc"):
        if args.tasks_per_node is None:
            args.tasks_per_node = args.gpus_per_node or 1
        world = args.nodes * args.tasks_per_node if args.executor == "slurm" else args.nproc
        if hasattr(cfg, "check_world"):        # the batch against the ranks, before any work
            try:
                cfg.check_world(world)
            except ValueError as e:
                raise UsageError(f"invalid config: {e}") from e
    return execute(step, cfg, args)


# A site's own #SBATCH flags, given on every step (and `ovpipe pretrain`): (flag, attribute, help). Each becomes
# one line of ``SlurmOptions.extra``, which every job of a step's chain carries — map, reduce, apply and merge
# alike — so a site that refuses a job without an account refuses none of them.
SITE_FLAGS = (
    ("--account", "account", "charge the jobs to this account (sbatch --account)"),
    ("--qos", "qos", "quality of service of the jobs (sbatch --qos)"),
    ("--gres", "gres", "generic resources per node, e.g. gpu:1 for a GPU step (embed-images, recaption, rollout)"),
    ("--gpus-per-task", "gpus_per_task", "GPUs per array task (sbatch --gpus-per-task)"),
    ("--constraint", "constraint", "node features the jobs need, e.g. a100 (sbatch --constraint)"),
)


def add_site_flags(group) -> None:
    """The site flags (``SITE_FLAGS``) and ``--sbatch-arg`` on an argument group."""
    for flag, dest, text in SITE_FLAGS:
        group.add_argument(flag, dest=dest, help=text)
    group.add_argument("--sbatch-arg", dest="sbatch_args", action="append", default=[], metavar="FLAG",
                       help="one more #SBATCH line for every job, e.g. --sbatch-arg=--exclusive (repeatable)")


def site_lines(args) -> list[str]:
    """``["--account=lab", "--gres=gpu:1", ...]``: the site flags given, then ``--sbatch-arg``'s, as given."""
    out = [f"{flag}={getattr(args, dest)}" for flag, dest, _ in SITE_FLAGS if getattr(args, dest, None)]
    for arg in getattr(args, "sbatch_args", None) or []:
        arg = arg.strip()
        if not arg.startswith("-") or "\n" in arg:
            raise UsageError(f"--sbatch-arg {arg!r}: give one sbatch flag, e.g. --sbatch-arg=--exclusive")
        out.append(arg)
    return out


def slurm_options(args):
    """The ``SlurmOptions`` of a command's arguments (a distributed step's also ``nodes``, ``tasks_per_node``,
    ``gpus_per_node``); the site flags go to ``extra``."""
    from ovpipe.executors import SlurmOptions

    return SlurmOptions(partition=args.partition, time=args.slurm_time, cpus_per_task=args.cpus_per_task,
                        mem=args.mem, nodes=getattr(args, "nodes", 1), tasks_per_node=getattr(args, "tasks_per_node", 1),
                        gpus_per_node=getattr(args, "gpus_per_node", 0), extra=site_lines(args))


def execute(step, cfg, args, summary=None) -> int:
    """Run ``step`` under ``cfg`` with the executor options in ``args`` (``run_dir``, ``name``, ``executor``,
    ``tasks``, ``workers``, ``overwrite``, ``quiet``, ``wait_lock``, the Slurm options; a distributed step
    also ``nproc`` locally and ``nodes`` / ``tasks_per_node`` / ``gpus_per_node`` on Slurm): the up-to-date
    check, the pre-start check, the step folder under its lock, then the executor — the one lifecycle
    every step goes through, ``ovpipe pretrain``'s stages included. ``summary(seconds, where)``: the step's
    own last line once it ran (``where``: "" or " on Slurm"), instead of the counters' ``step_line``."""
    from ovpipe.runfolder import RunFolderError
    from ovpipe.runfolder.prepare import prepare, up_to_date
    from ovpipe.executors import LocalExecutor, SlurmExecutor
    from ovpipe.step import StepFailed, Stopped, preflight

    tasks = args.tasks
    if step.max_tasks is not None and tasks > step.max_tasks:
        raise UsageError(f"--tasks {tasks} > {step.max_tasks} (this step needs its whole input at once)")
    run_dir = _run_dir(args.run_dir)
    name = args.name or step.name
    done = None if args.overwrite else up_to_date(run_dir, step, cfg, tasks, name)
    if done is not None:
        if not args.quiet:
            from ovpipe.summary import key_figures

            print(f"{name}: already done ({tasks} task(s), same config): "
                  f"{key_figures(step.name, done.get('counters', {}))} → {run_dir / name}")
        return 0
    try:
        preflight(step, cfg, run_dir, name)
    except ValueError as e:
        raise UsageError(f"cannot start: {e}") from e
    try:
        prepare(run_dir, step, cfg, tasks, overwrite=args.overwrite, name=args.name, wait_lock=args.wait_lock)
    except RunFolderError as e:
        raise UsageError(str(e)) from e
    except OSError as e:  # a read-only run folder, a file where a folder should be, a full disk
        raise UsageError(f"cannot write the step folder {run_dir / name}: "
                         f"{e.strerror or e}{f' ({e.filename})' if e.filename else ''}") from e
    if args.executor == "slurm":
        from ovpipe.executors.slurm import SlurmChainFailed, describe_jobs

        ex = SlurmExecutor(workers=args.workers, options=slurm_options(args), dependency=args.dependency,
                           wait_lock=args.wait_lock, progress=not args.quiet)
        t0 = time.perf_counter()
        result = ex.run(step, run_dir, tasks, name=args.name)
        rec = result["slurm"]
        if not args.quiet:
            what = "nothing to do" if result.get("nothing_to_do") else f"submitted {describe_jobs(rec)}"
            print(f"{name}: {what} ({tasks} task(s), {run_dir / name}/slurm_jobs.json)", flush=True)
        if args.wait and not result.get("nothing_to_do"):
            try:
                ex.wait_for(rec, run_dir / name, timeout_s=args.wait_timeout)
            except SlurmChainFailed as e:
                print(f"ovpipe {step.name}: {e}", file=sys.stderr)
                return 1
            if not args.quiet and summary is not None:
                print(summary(time.perf_counter() - t0, " on Slurm"))
            elif not args.quiet:
                from ovpipe.summary import step_line

                merged = json.loads((run_dir / name / "stats.json").read_text())
                print(step_line(name, step.name, merged.get("counters", {}), tasks, time.perf_counter() - t0,
                                run_dir / name).replace(" task(s)", " task(s) on Slurm", 1))
        return 0
    from ovpipe.executors.task import TaskFailed

    t0 = time.perf_counter()
    try:
        merged = LocalExecutor(workers=args.workers, progress=not args.quiet, wait_lock=args.wait_lock,
                               nproc=getattr(args, "nproc", 1)).run(step, run_dir, tasks, name=args.name)
    except (TaskFailed, StepFailed) as e:
        print(f"ovpipe {step.name}: {e}", file=sys.stderr)
        return 1
    except Stopped as e:
        print(f"ovpipe {step.name}: {name}: {e}", file=sys.stderr)
        return 128 + e.signum
    if not args.quiet and summary is not None:
        print(summary(time.perf_counter() - t0, ""))
    elif not args.quiet:
        from ovpipe.summary import step_line

        print(step_line(name, step.name, merged["counters"], tasks, time.perf_counter() - t0, run_dir / name))
    return 0


def cmd_task(args) -> int:
    from ovpipe.executors.task import run_task
    from ovpipe.step import Stopped

    try:
        run_task(args.step, args.run_dir, args.rank, args.world_size, name=args.name, phase=args.phase)
    except Stopped as e:      # saved and stopped: the Slurm script requeues, a local rerun resumes
        print(f"ovpipe {args.step}: {e}", file=sys.stderr)
        return 128 + e.signum
    return 0


def cmd_finalize(args) -> int:
    from ovpipe.executors.task import finalize_step, reduce_step

    if args.phase == "reduce":  # the reduce job of a three-phase step (map array → reduce → apply array)
        print(reduce_step(args.step, args.run_dir, name=args.name))
        return 0
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


def cmd_summary(args) -> int:
    from ovpipe.summary import run_summary

    if _sql_run_dir("summary", args.run_dir) is None:     # a mistyped folder is an error, not an empty summary
        return 2
    print(run_summary(_run_dir(args.run_dir)))
    return 0


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
    """Per step: done / running / failed / stale / pending ranks (``runfolder.status.print_status``);
    exit 1 only for failed or stale ranks or a failed Slurm job, never for ranks still running or queued.
    Each step submitted to Slurm shows its chain with each job's state (``executors.slurm.status_lines``)."""
    from ovpipe.executors.slurm import status_lines
    from ovpipe.runfolder.status import print_status

    run_dir = _sql_run_dir("status", args.run_dir)     # a typo in the path is an error, not "no steps run yet"
    if run_dir is None:
        return 2
    return print_status(run_dir, slurm_lines=status_lines)


def cmd_demo_data(args) -> int:
    from ovpipe.registry import get_command

    info = get_command("demo-data")(Path(args.out), n_samples=args.samples, seed=args.seed, shards=args.shards,
                                    conversations=not args.no_conversations)
    (Path(args.out) / "demo-data.json").write_text(json.dumps({k: v for k, v in info.items() if k != "out"},
                                                              indent=2) + "\n")   # no path: byte-identical per seed
    conv = info.get("conversations", {})
    extra = (f", {conv['llava_558k']['samples']} LLaVA-558K-style, "
             f"{conv['instruct']['llava'] + conv['instruct']['finevision']} instruction conversations, "
             f"{conv['short_answer']['samples']} answer-only" if conv else "")
    print(f"demo-data: {info['samples']} caption samples in {info['shards']} shards ({info['concepts']} concepts, "
          f"top 1% of concepts in {info['top1pct_share']:.0%} of samples){extra}; broken on purpose: "
          f"{', '.join(info['broken'])} → {args.out} (details: demo-data.json)")
    return 0


def _forward(command: str):
    def run(args) -> int:
        from ovpipe.registry import get_command

        return get_command(command)(args.rest)
    return run


def _fields_epilog(name: str) -> str | None:
    """The config fields of step ``name`` (``ovpipe.config_help``), for its ``--help``: the step's module is
    imported for this, so only the step asked about pays for it."""
    from ovpipe.config_help import fields_text
    from ovpipe.registry import get_step

    try:
        return fields_text(get_step(name).config)
    except Exception as e:  # an extra step whose module does not import: --help still answers
        return f"(config fields unavailable: {type(e).__name__}: {e})"


def build_parser(fields_of: str | None = None) -> argparse.ArgumentParser:
    """``fields_of``: the step whose ``--help`` is asked for, which lists its config fields."""
    p = argparse.ArgumentParser(prog="ovpipe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in all_steps():
        if name in COMMANDS:      # a step with its own command line (`ovpipe pretrain --stage S`), added below
            continue
        sp = sub.add_parser(name, help=step_help(name), description=step_help(name),
                            epilog=_fields_epilog(name) if name == fields_of else None,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.add_argument("--config", help="YAML file of the step's config (defaults if omitted)")
        sp.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override one config field (YAML value), repeatable")
        sp.add_argument("--run-dir", required=True)
        sp.add_argument("--name", type=_step_folder_name,
                        help="step folder name (default: the step's name), to run a step twice in one run")
        sp.add_argument("--executor", choices=["local", "slurm"], default="local")
        sp.add_argument("--tasks", type=_positive_int, default=1)
        sp.add_argument("--workers", type=_positive_int, default=1)
        sp.add_argument("--overwrite", action="store_true", help="discard outputs made with another config/task count")
        sp.add_argument("--quiet", action="store_true", help="no progress bars and no summary line")
        sp.add_argument("--verbose", action="store_true",
                        help="show the tasks' own output (third-party warnings included) instead of sending it "
                             "to their logs")
        sp.add_argument("--wait-lock", action="store_true",
                        help="wait for another command running this step to finish, instead of refusing")
        g = sp.add_argument_group("slurm")
        g.add_argument("--partition")
        g.add_argument("--slurm-time", default="04:00:00")
        g.add_argument("--cpus-per-task", type=_positive_int, default=1)
        g.add_argument("--mem")
        add_site_flags(g)
        g.add_argument("--dependency", help="extra job id this step must wait for (afterok)")
        g.add_argument("--wait", action="store_true",
                       help="block until the step's Slurm chain ends, showing ranks done / running / pending; "
                            "exit 1 naming the failed ranks and their logs if it did not finish")
        g.add_argument("--wait-timeout", type=float, metavar="SECONDS",
                       help="with --wait: give up waiting (the jobs keep running) after this long")
        if name in DISTRIBUTED_STEPS:
            d = sp.add_argument_group("ranks (the task is a group of processes)")
            d.add_argument("--nproc", type=_positive_int, default=1, help="local: processes under torchrun")
            d.add_argument("--nodes", type=_positive_int, default=1, help="slurm: nodes, srun starting each rank")
            d.add_argument("--gpus-per-node", type=int, default=0, help="slurm: GPUs per node (0: CPU processes)")
            d.add_argument("--tasks-per-node", type=_positive_int,
                           help="slurm: processes per node (default --gpus-per-node, or 1 on a CPU node)")
        sp.set_defaults(func=cmd_step)

    sp = sub.add_parser("sql", help="SQL over a run folder's manifests (DuckDB)")
    sp.add_argument("run_dir")
    sp.add_argument("query")
    sp.add_argument("--format", choices=["table", "csv", "json"], default="table")
    sp.add_argument("--max-rows", type=_positive_int, default=100)
    sp.set_defaults(func=cmd_sql)

    sp = sub.add_parser("report", help="the canned reports over a run folder")
    sp.add_argument("run_dir")
    sp.set_defaults(func=cmd_report)

    sp = sub.add_parser("summary", help="per stage: the steps that ran and their key figures")
    sp.add_argument("run_dir")
    sp.set_defaults(func=cmd_summary)

    sp = sub.add_parser("status", help="per step, in pipeline order: ranks done / failed / …")
    sp.add_argument("run_dir")
    sp.set_defaults(func=cmd_status)

    sp = sub.add_parser("demo-data", help=command_help("demo-data"))
    sp.add_argument("--out", required=True)
    sp.add_argument("--samples", type=_positive_int, default=2000)
    sp.add_argument("--shards", type=_positive_int, default=4)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--no-conversations", action="store_true",
                    help="only the caption shards (skip the LLaVA-558K-style and instruction sets)")
    sp.set_defaults(func=cmd_demo_data)

    for command in OWN_PARSERS:
        sp = sub.add_parser(command, help=command_help(command), add_help=False)
        sp.add_argument("rest", nargs=argparse.REMAINDER)
        sp.set_defaults(func=_forward(command))

    sp = sub.add_parser("_task")          # internal: no help, not listed
    sp.add_argument("step")
    sp.add_argument("--run-dir", required=True)
    sp.add_argument("--rank", type=int, required=True)
    sp.add_argument("--world-size", type=int, required=True)
    sp.add_argument("--name")
    sp.add_argument("--phase", choices=["map", "apply"], default="map")
    sp.set_defaults(func=cmd_task)

    sp = sub.add_parser("_finalize")      # internal: no help, not listed
    sp.add_argument("step")
    sp.add_argument("--run-dir", required=True)
    sp.add_argument("--name")
    sp.add_argument("--phase", choices=["reduce", "finalize"], default="finalize")
    sp.set_defaults(func=cmd_finalize)
    return p


def _add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """``--debug`` after the subcommand too; SUPPRESS keeps a subcommand from resetting the global one."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in action.choices.values():
                if sp.add_help:  # not `pretrain`, which forwards its arguments
                    sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                    help="show the traceback of an error")


def _user_error_types() -> tuple[type, ...]:
    from ovpipe.config import ConfigError
    from ovpipe.runfolder import RunFolderError

    return (UsageError, ConfigError, RunFolderError)


def main(argv: list[str] | None = None) -> int:
    """Run one command. A user error is one line on stderr and exit code 2; anything else
    unexpected is one line and exit code 1. ``--debug`` re-raises, with the traceback."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in OWN_PARSERS:
        from ovpipe.registry import get_command

        return int(get_command(argv[0])(argv[1:]) or 0)
    asks_help = argv[:1] and argv[0] in all_steps() and any(a in ("-h", "--help") for a in argv[1:])
    parser = build_parser(fields_of=argv[0] if asks_help else None)
    _add_debug_flag(parser)
    args = parser.parse_args(argv)
    prog = f"ovpipe {args.command}"
    try:
        rc = args.func(args)
    except _user_error_types() as e:
        if args.debug:
            raise
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        if args.debug:
            raise
        print(f"{prog}: {type(e).__name__}: {_one_line(e)} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1
    return int(rc or 0)


def _one_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return " / ".join(lines[:3]) if lines else ""


if __name__ == "__main__":
    sys.exit(main())
