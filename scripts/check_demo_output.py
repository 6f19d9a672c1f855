"""Check what `make demo` printed: no Python warnings or tracebacks reached the terminal, and every
step the demo ran printed its one summary line; and that `select` decided on a model that learned
something: some of the demo model's own prompts are solved sometimes but not always (pass@1 strictly
between 0 and 1) and some are kept. `python scripts/check_demo_output.py LOG RUN`.

The demo's terminal output is teed to LOG by the Makefile; this runs right after it, so a warning that
escapes a task's log (a new third-party notice, a print in a step) fails `make demo` with the lines.
"""
import re
import sys
from pathlib import Path

from ovpipe.summary import step_folders   # the step folders `ovpipe summary` lists

NOISE = [re.compile(p) for p in (
    r"\w*Warning\s*:",                # warnings.showwarning's "file:line: UserWarning: ..." and "Warning: ..."
    r"^\s*warnings\.warn\(",
    r"Traceback \(most recent call last\)",
    r"^[WE]\d{4} \d\d:\d\d:\d\d",    # torch / glog C++ log lines ("W1125 12:29:30.46 ...")
)]


def problems(text: str, run_dir: Path) -> list[str]:
    lines = [seg for ln in text.splitlines() for seg in ln.split("\r")]
    out = [f"noise: {ln.strip()[:200]}" for ln in lines if any(p.search(ln) for p in NOISE)]
    for folder, _ in step_folders(run_dir):
        # a nested step folder prints its path (pretrain/stage-1.5); a step run in a sub-run (gym/2048/rl-gym,
        # its own --run-dir) its folder name
        names = "|".join(re.escape(n) for n in (folder.relative_to(run_dir).as_posix(), folder.name))
        if not any(re.match(rf"(?:{names}): .* → ", ln) for ln in lines):
            out.append(f"no summary line for step {folder.relative_to(run_dir)}")
    return out + selection_problems(run_dir)


def selection_problems(run_dir: Path) -> list[str]:
    """A model at chance (every rollout wrong) leaves selection nothing to keep and GRPO no signal."""
    if not (run_dir / "select" / "stats.json").exists():
        return []
    from manifests.catalog import connect

    between, kept = connect(run_dir).sql("SELECT count(*) FILTER (pass_at_1 > 0 AND pass_at_1 < 1), "
                                         "count(*) FILTER (kept) FROM selection").fetchall()[0]
    if between and kept:
        return []
    return [f"select: {between} prompt(s) with 0 < pass@1 < 1 and {kept} kept — the demo model's rollouts do not "
            "spread (did stage 2 learn the answer-only skills? docs/rl_select.md)"]


def main(argv: list[str]) -> int:
    log, run_dir = Path(argv[0]), Path(argv[1])
    found = problems(log.read_text(errors="replace"), run_dir)
    if found:
        print(f"make demo printed {len(found)} problem line(s) (full output: {log}):", file=sys.stderr)
        for p in found[:40]:
            print(f"  {p}", file=sys.stderr)
        return 1
    print(f"demo output clean: no warnings or tracebacks, one summary line per step ({log})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
