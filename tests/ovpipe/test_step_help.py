"""``ovpipe <step> --help`` lists the step's config fields (type, default, one line of help) from the dataclass
itself, so a field added without a comment fails here rather than leaving users to read the code."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from ovpipe.cli import main
from ovpipe.config_help import field_help, fields_text, missing_help
from ovpipe.registry import STEPS, WRITERS, get_step


@dataclass
class _Documented:
    seq_len: int = 8192                 # tokens per pack
    # the step folder read
    # (and its config)
    lengths_step: str = "lengths"
    buffers: list[int] = field(default_factory=lambda: [1, 2])  # sizes
                                                                # compared against (a continuation: aligned with it)
    quiet: bool = field(default=False, metadata={"help": "from the metadata"})
    undocumented: int = 0


def test_help_comes_from_the_comments_beside_or_above_each_field():
    helps = field_help(_Documented)
    assert helps["seq_len"] == "tokens per pack"
    assert helps["lengths_step"] == "the step folder read (and its config)"
    assert helps["buffers"] == "sizes compared against (a continuation: aligned with it)"
    assert helps["quiet"] == "from the metadata"
    assert missing_help(_Documented) == ["undocumented"]
    text = fields_text(_Documented)
    assert "  seq_len: int = 8192\n      tokens per pack" in text and "buffers: list[int] = [1, 2]" in text


@pytest.mark.parametrize("name", sorted(STEPS))
def test_every_field_of_every_step_has_help(name):
    cfg = get_step(name).config
    assert missing_help(cfg) == [], (f"{name}: give each of these fields of {cfg.__name__} a comment beside it "
                                     f"(its line in `ovpipe {name} --help`)")


def test_step_help_lists_every_field_with_type_and_default(capsys):
    with pytest.raises(SystemExit):
        main(["pack", "--help"])
    out = capsys.readouterr().out
    cfg = get_step("pack").config
    for f in dataclasses.fields(cfg):
        assert f"  {f.name}: " in out, f.name
    assert "  seq_len: int = 8192\n      tokens per pack" in out
    assert "--account" in out and "--gres" in out and "--sbatch-arg" in out


def test_the_writers_table_is_the_steps_outputs():
    made: dict[str, set] = {}
    for name in STEPS:
        for kind in get_step(name).outputs:
            made.setdefault(kind, set()).add(name)
    assert {k: set(v) for k, v in WRITERS.items()} == made
