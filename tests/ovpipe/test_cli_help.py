"""`ovpipe --help`: one line per command saying what it does, without importing any step."""
from __future__ import annotations

import subprocess
import sys

from ovpipe.registry import COMMANDS, STEPS


def _help(env_extra: dict | None = None) -> str:
    import os

    env = {**os.environ, "COLUMNS": "80", **(env_extra or {})}
    code = ("import sys\nfrom ovpipe.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'pyarrow', 'duckdb', 'curation', 'packing', 'rl_select', 'pretrain')"
            " if m in sys.modules]\nassert not heavy, heavy\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_every_step_and_command_has_a_short_description():
    for name, (module, what) in STEPS.items():
        assert module and what, name
        assert len(what) <= 58, f"{name}: keep its --help line to 58 characters ({len(what)})"
    for name, (target, what) in COMMANDS.items():
        assert ":" in target and what, name
        assert len(what) <= 58, f"{name}: keep its --help line to 58 characters ({len(what)})"


def test_help_lists_each_step_with_its_description_and_imports_no_step():
    out = _help()
    lines = out.splitlines()
    for name, (module, what) in STEPS.items():
        assert module not in out, f"{name}: --help shows the module, not what it does"
        # the description sits on the name's line, or on the next one for a name too long for the column
        # (a step that is also a command, with its own parser, shows the command's line)
        what = COMMANDS[name][1] if name in COMMANDS else what
        i = next(i for i, ln in enumerate(lines) if ln.split()[:1] == [name])
        assert what in lines[i] or what in lines[i + 1], (name, lines[i:i + 2])
    for name in ("sql", "report", "summary", "status", *COMMANDS):
        assert any(ln.split()[:1] == [name] and len(ln.split()) > 1 for ln in lines), name
    assert "SUPPRESS" not in out and "_task" not in out and "_finalize" not in out


def test_an_extra_step_gets_a_generic_line():
    out = _help({"OVPIPE_EXTRA_STEPS": "my-step=mypkg.mystep"})
    assert any(ln.split()[:1] == ["my-step"] and "OVPIPE_EXTRA_STEPS" in ln for ln in out.splitlines()), out
