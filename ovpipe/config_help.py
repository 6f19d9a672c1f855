"""A step config's fields as ``ovpipe <step> --help`` lists them: name, type, default and one line of help.

The help of a field is the comment written beside it in the dataclass — the same text a reader of the
code sees, so the two cannot drift: the comment on the field's own line(s) with the comment lines that
continue it (indented past the field's start), else the comment block right above the field. A field
declared ``field(..., metadata={"help": "..."})`` uses that instead. ``missing_help(cls)`` lists the
fields with none (a test holds every registered step to none missing).
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing


def _comments(source: str) -> dict[int, tuple[int, str, bool]]:
    """{line: (column, comment text, whether the line holds only the comment)} of ``source`` (1-based)."""
    out = {}
    code_lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = (tok.start[1], tok.string.lstrip("#").strip(), tok.start[0] not in code_lines)
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    return out


def _class_field_comments(cls) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    comments = _comments(source)
    out: dict[str, str] = {}
    for item in node.body:
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        beside = [comments[ln] for ln in range(item.lineno, item.end_lineno + 1) if ln in comments
                  and not comments[ln][2]]
        if beside:
            col = beside[-1][0]
            parts = [c[1] for c in beside]
            ln = item.end_lineno + 1
            while ln in comments and comments[ln][2] and comments[ln][0] > item.col_offset:
                parts.append(comments[ln][1])
                ln += 1
        else:
            parts = []
            ln = item.lineno - 1
            while ln in comments and comments[ln][2] and comments[ln][0] == item.col_offset:
                parts.insert(0, comments[ln][1])
                ln -= 1
        text = " ".join(p for p in parts if p)
        if text:
            out[item.target.id] = text
    return out


def field_help(cls) -> dict[str, str]:
    """{field: its help text} of dataclass ``cls`` (its bases' fields too)."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            out.update(_class_field_comments(base))
    for f in dataclasses.fields(cls):
        if f.metadata.get("help"):
            out[f.name] = f.metadata["help"]
    return out


def missing_help(cls) -> list[str]:
    helps = field_help(cls)
    return [f.name for f in dataclasses.fields(cls) if f.init and not helps.get(f.name)]


def _type_text(tp) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "").replace("NoneType", "None")


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return f"{type(value).__name__}(...)"
    text = "null" if value is None else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def fields_text(cls, width: int = 100) -> str:
    """The config fields of ``cls`` as an indented list: ``name: type = default`` then the help, wrapped."""
    hints = typing.get_type_hints(cls)
    helps = field_help(cls)
    lines = [f"config fields ({cls.__name__}; set in --config YAML or with --set FIELD=VALUE):"]
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        lines.append(f"  {f.name}: {_type_text(hints.get(f.name, f.type))} = {_default_text(f)}")
        lines += textwrap.wrap(helps.get(f.name, ""), width=width, initial_indent="      ",
                               subsequent_indent="      ")
    return "\n".join(lines)
