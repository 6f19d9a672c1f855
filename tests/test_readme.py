"""The README's front door says what is true: its CLI section has a row for every command ``ovpipe --help``
lists (every step of ``ovpipe.registry`` included) and none for a command that is gone, and its layout block
names every top-level package. A failure says which line to add or remove, and where."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
ROW = re.compile(r"^\| `ovpipe ([a-z][a-z0-9-]*)")


def _section(lines: list[str], title: str) -> range:
    start = lines.index(title)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return range(start, end)


def _listed() -> list[tuple[str, str]]:
    """(name, help) of each command ``ovpipe --help`` lists, in its order."""
    from ovpipe.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [(a.dest, a.help) for a in sub._choices_actions]


def test_the_cli_table_has_a_row_for_every_command_of_ovpipe_help(monkeypatch):
    monkeypatch.delenv("OVPIPE_EXTRA_STEPS", raising=False)      # a lab's own steps are not the README's
    lines = README.read_text().splitlines()
    rows = {m.group(1): i for i in _section(lines, "## The CLI") if (m := ROW.match(lines[i]))}
    listed = _listed()
    problems, after = [], None
    for name, what in listed:
        if name not in rows:
            where = (f"after README.md line {rows[after] + 1} (the row of `ovpipe {after}`)" if after
                     else "in the table under '## The CLI'")
            problems.append(f"README.md's CLI table has no row for `ovpipe {name}`; add this line {where}:\n"
                            f"| `ovpipe {name}` | {what} |")
        else:
            after = name
    gone = sorted(set(rows) - {name for name, _ in listed})
    problems += [f"README.md line {rows[n] + 1} is the row of `ovpipe {n}`, which `ovpipe --help` does not list: "
                 f"remove it" for n in gone]
    assert not problems, "\n".join(problems)


def test_the_layout_block_names_every_top_level_package():
    lines = README.read_text().splitlines()
    block = [lines[i] for i in _section(lines, "## Layout and layers")]
    named = {ln.split("/")[0] for ln in block if re.match(r"^[a-z_]+/ ", ln)}
    packages = sorted(p.parent.name for p in README.parent.glob("*/__init__.py"))
    missing = [p for p in packages if p not in named]
    assert not missing, (f"README.md's layout block (under '## Layout and layers') lacks {missing}: add a line "
                         f"'<package>/   what it holds' for each")
