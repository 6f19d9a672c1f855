"""YAML configs mapped onto one dataclass per step, validated before any work starts.

``load_config(cls, source)`` accepts a YAML path, a mapping, or None (all defaults).
An unknown field fails with the closest field names ("did you mean") and the allowed fields
listed; a value of the wrong type fails naming the field, its value and the expected type. A
scalar given for a list field is the one-item list (``--set inputs=/x.parquet``). A value given
with ``overrides`` (the CLI's ``--set``) is reported as ``--set FIELD``, not as the YAML file's. Nested dataclasses, ``list[...]``,
``tuple[...]``, ``dict[str, ...]``, ``Optional[...]`` and ``Literal[...]`` are checked.
A dataclass may add its own checks in ``__post_init__`` (raise ``ValueError`` naming
the field). YAML is read with YAML 1.2's floats (``yaml_load``: ``1e-4`` is a number).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Union, get_args, get_origin


class ConfigError(ValueError):
    pass


# YAML 1.1 (PyYAML's resolver) reads `1e-4` and `3E5` as strings: a float there needs a dot and a signed exponent
# (`1.0e-4`). A learning rate is written `1e-4` everywhere else (YAML 1.2, JSON, Python), so configs and `--set`
# values are read with YAML 1.2's float pattern: `1e-4` is the number 0.0001.
_FLOAT_12 = (r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)"
             r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")


@functools.cache
def _yaml12_loader():
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(_FLOAT_12), list("-+0123456789."))
    return Loader


def yaml_load(text: str):
    """``yaml.safe_load`` with YAML 1.2's floats (``1e-4`` a number, not a string)."""
    import yaml

    return yaml.load(text, Loader=_yaml12_loader())


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: {value!r} is not a {_type_name(tp)}")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed and not isinstance(value, bool) and str(value) in allowed:
            return str(value)  # `--set game=2048` parses as an int; the choice is the string "2048"
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not one of {list(allowed)}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {value!r}")
        return _build(tp, value, where)
    if origin in (list, tuple, set, frozenset) or tp in (list, tuple):
        args = get_args(tp)
        fixed = origin is tuple and args and args[-1] is not Ellipsis
        if not isinstance(value, (list, tuple)) and not fixed and value is not None \
                and not isinstance(value, Mapping):
            value = [value]     # `--set inputs=/x.parquet`: a scalar for a list field is its one-item list
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{where}: expected {len(args)} items, got {len(value)}")
            return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        args = get_args(tp) or (Any, Any)
        return {_coerce(k, args[0], f"{where}.key"): _coerce(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if isinstance(tp, type):
        if not isinstance(value, tp):
            raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


def did_you_mean(name: str, choices) -> str:
    """`` (did you mean 'verify'?)`` for the closest of ``choices`` (difflib), or ``""``."""
    import difflib

    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _build(cls, data: Mapping, where: str, origins: Mapping[str, str] | None = None):
    """``cls(**data)`` checked; ``origins``: {field: where its value came from} (``--set FIELD``), for
    the fields not read from ``where``."""
    origins = origins or {}
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        k = unknown[0]
        raise ConfigError(
            f"{origins.get(k, where)}: unknown field(s) {unknown}{did_you_mean(k, fields)}; "
            f"allowed fields of {cls.__name__}: {sorted(fields)} (`ovpipe <step> --help` lists them)")
    kwargs = {k: _coerce(v, hints[k], origins.get(k, f"{where}.{k}")) for k, v in data.items()}
    missing = [n for n, f in fields.items() if n not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}: missing required field(s) {missing}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        # a check in __post_init__ names its field first ("seq_len must be >= 64"): a field given with --set
        # is reported as --set's, not the file's
        import re

        named = [k for k in origins if re.search(rf"(?<![\w.]){re.escape(k)}(?!\w)", str(e))]
        raise ConfigError(f"{origins[named[0]] if named else where}: {e}") from e


def load_config(cls, source: str | Path | Mapping | None = None, overrides: Mapping | None = None):
    """Build and validate ``cls`` from a YAML file / mapping, then apply ``overrides``."""
    if source is None:
        data: dict = {}
        where = cls.__name__
    elif isinstance(source, Mapping):
        data = dict(source)
        where = cls.__name__
    else:
        import yaml

        path = Path(source)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config file ({e.strerror or e})") from None
        try:
            data = yaml_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({yaml_error_line(e)})") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: top level must be a mapping of {cls.__name__} fields")
        where = str(path)
    origins = {}
    if overrides:
        data.update(overrides)
        origins = {k: f"--set {k}" for k in overrides}
    return _build(cls, data, where, origins)


def yaml_error_line(e: Exception) -> str:
    """A PyYAML error in one line: what is wrong and where (line/column are 1-based)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


# --- range checks shared by the step configs' __post_init__ (each raises ValueError naming the field)

def check_range(cfg, name: str, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> None:
    """``getattr(cfg, name)`` is a finite number in [lo, hi] (``(lo, hi]`` if ``lo_open``); None passes."""
    import math

    v = getattr(cfg, name)
    if v is None:
        return
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")


def check_step_folder(name: str, value) -> None:
    """A step folder name (``lengths_step: lengths``) is one plain path component inside the run folder."""
    if not is_safe_component(value):
        raise ValueError(f"{name} must be a step folder name (letters, digits, '.', '_', '-'; "
                         f"not a path), got {value!r}")


def is_safe_component(value) -> bool:
    import re

    return (isinstance(value, str) and value not in (".", "..")
            and re.fullmatch(r"[A-Za-z0-9_.][A-Za-z0-9_.+-]*", value) is not None)


def looks_like_local_path(value: str) -> bool:
    """``./tok``, ``/models/qwen``, ``tok/sub`` on this OS — but not a hub id like ``Qwen/Qwen3-4B``?

    A hub id is ``owner/name`` (exactly one '/', no leading '.' or '/'): treat it as a hub name.
    Anything starting with '/', '.', '~', or with more than one separator is a local path."""
    import os

    if value.startswith(("/", ".", "~")) or (os.sep != "/" and os.sep in value):
        return True
    return value.count("/") > 1


def check_local_path(name: str, value: str) -> None:
    """A field holding a local file/folder path: it must exist (checked before any work)."""
    if value and not Path(value).expanduser().exists():
        raise ValueError(f"{name}: {value!r} does not exist")


def to_dict(cfg) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def _dump(d: dict) -> str:
    return json.dumps(d, indent=2, sort_keys=True) + "\n"


def config_json(cfg) -> str:
    return _dump(to_dict(cfg))


# A field declared ``field(..., metadata=NOT_HASHED)`` is saved in config.json but left out of the config
# hash: it changes how a step runs, not what it makes (a training stage's TP/PP/CP layout — checkpoints
# reshard —, its kernels, its save cadence), so changing it neither refuses a rerun nor makes the
# step's readers stale.
NOT_HASHED = {"hash": False}
# A field added to a step's config after runs of that step exist is declared ``field(..., metadata=
# HASHED_UNLESS_DEFAULT)``: it is left out of the config hash while it equals its declared default and hashed
# otherwise, so every run made before the field existed keeps its hash (a rerun is still a no-op, its readers
# are not stale), and a run that sets the field is a different config. Saved in config.json either way.
HASHED_UNLESS_DEFAULT = {"hash": "unless_default"}


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"field {f.name!r}: metadata HASHED_UNLESS_DEFAULT needs a declared default")


def config_hash(cfg) -> str:
    d = to_dict(cfg)
    if dataclasses.is_dataclass(cfg):
        for f in dataclasses.fields(cfg):
            rule = f.metadata.get("hash")
            if rule is False or (rule == "unless_default" and getattr(cfg, f.name) == _default(f)):
                d.pop(f.name, None)
    return hashlib.sha256(_dump(d).encode()).hexdigest()[:16]
