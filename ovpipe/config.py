"""YAML configs mapped onto one dataclass per step, validated before any work starts.

``load_config(cls, source)`` accepts a YAML path, a mapping, or None (all defaults).
An unknown field fails with the allowed fields listed; a value of the wrong type fails
naming the field, its value and the expected type. Nested dataclasses, ``list[...]``,
``tuple[...]``, ``dict[str, ...]``, ``Optional[...]`` and ``Literal[...]`` are checked.
A dataclass may add its own checks in ``__post_init__`` (raise ``ValueError`` naming
the field).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Union, get_args, get_origin


class ConfigError(ValueError):
    pass


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
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        args = get_args(tp)
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


def _build(cls, data: Mapping, where: str):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ConfigError(
            f"{where}: unknown field(s) {unknown}; allowed fields of {cls.__name__}: {sorted(fields)}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    missing = [n for n, f in fields.items() if n not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}: missing required field(s) {missing}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where}: {e}") from e


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
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: top level must be a mapping of {cls.__name__} fields")
        where = str(path)
    if overrides:
        data.update(overrides)
    return _build(cls, data, where)


def to_dict(cfg) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def config_json(cfg) -> str:
    return json.dumps(to_dict(cfg), indent=2, sort_keys=True) + "\n"


def config_hash(cfg) -> str:
    return hashlib.sha256(config_json(cfg).encode()).hexdigest()[:16]
