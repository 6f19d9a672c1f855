"""What a step reads: every input manifest declared once, against the config field naming its folder,
and turned into step folders in one place.

A step declares its inputs as ``{kind: declaration}``::

    STEP = Step("pack", PackConfig, ..., inputs={
        "lengths": "lengths_step",                                           # cfg.lengths_step names the folder
        "mixed": Input("mix_step", when=lambda c: c.copies_from == "mixed"),  # optional: read only when ...
        "balanced": Input(when=lambda c: c.copies_from == "balanced"),        # no field: every folder holding it
        "samples": Input(via="lengths_step"),                                 # what the lengths step read
    })

* ``field``: a config field whose value is one step folder name or a list of them (read in that
  order). Left empty (``""`` / ``[]``) in the config, or ``None`` in the declaration: every folder
  of the run holding the kind, in name order.
* ``when``: the input is optional; it is read only when ``when(cfg)`` holds.
* ``via``: the folders the step named by that field itself read for this kind (pack reads the
  ``samples`` and ``captions`` its lengths step read), resolved by this same rule on that step's
  saved config.

``resolve`` is the one place these become folders. It serves the check before any work
(``check_inputs``), the upstream config hashes ``runfolder.prepare.prepare`` records and compares
(``up_to_date``, ``ovpipe status``' stale inputs), the Slurm executor's ``afterok`` chain and the
reads themselves (``TaskContext.read_input`` and friends read only resolved folders, and refuse a
kind the step does not declare), so a folder a step reads is a folder whose change it sees.

A step folder is never its own input. Steps declared the older way (``inputs=("samples",)``, no
field) read every folder holding the kind, narrowed to folders the config names in a ``*_step`` /
``*_steps`` / ``inputs`` field when one of those holds it.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping


# Inputs that are folders of their own format rather than Parquet manifests: a step holds one when the
# folder has an entry that is not a temp file (a training stage's megatron checkpoints, ``dist_ckpt/``; the
# export step's verl splits, ``verl/<split>.parquet``, which ``grpo`` trains on).
ARTIFACTS = frozenset({"dist_ckpt", "verl"})


@dataclass(frozen=True)
class Input:
    field: str | None = None                   # config field naming the step folder(s)
    when: Callable[[Any], bool] | None = None  # optional input: read only when when(cfg)
    via: str | None = None                     # the folders the step named by this field read
    named_by_config: bool = False              # the older tuple declaration's narrowing rule

    def __post_init__(self):
        if self.field and self.via:
            raise ValueError("an input is named by a config field or read via an upstream step, not both")

    def active(self, cfg) -> bool:
        return self.when is None or bool(self.when(cfg))


def normalise(inputs) -> dict[str, Input]:
    """``Step.inputs`` as ``{kind: Input}``: a mapping of kind → field name / ``Input`` / ``None``, or
    the older tuple of kinds."""
    if isinstance(inputs, Mapping):
        out = {}
        for kind, spec in inputs.items():
            if spec is None or isinstance(spec, str):
                out[kind] = Input(spec or None)
            elif isinstance(spec, Input):
                out[kind] = spec
            else:
                raise TypeError(f"input {kind!r}: declare a config field name, Input(...) or None, got {spec!r}")
        return out
    return {kind: Input(named_by_config=True) for kind in inputs}


def holds(step_dir: Path, kind: str) -> bool:
    """Whether a step folder holds manifest ``kind``: parts on disk, or ``kind`` among the outputs its
    ``executor.json`` records (a step already launched, e.g. still queued on Slurm; whether it has
    finished is ``runfolder.prepare.prepare``'s check)."""
    step_dir = Path(step_dir)
    if any((step_dir / kind).glob("part-*.parquet")):
        return True
    if kind in ARTIFACTS and (step_dir / kind).is_dir() and any(
            not p.name.startswith(".tmp-") for p in (step_dir / kind).iterdir()):
        return True
    try:
        return kind in json.loads((step_dir / "executor.json").read_text()).get("outputs", [])
    except (OSError, ValueError):
        return False


def _field_values(cfg, name: str) -> list[str]:
    value = getattr(cfg, name)
    if isinstance(value, str):
        return [value] if value else []
    return [v for v in value or [] if v]


def _config_named_folders(cfg, run_dir: Path) -> set[str]:
    """Folders of the run named by a config field ``*_step``, ``*_steps`` or ``inputs`` (the older rule)."""
    out = set()
    for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(cfg) else []:
        if not (f.name.endswith("_step") or f.name.endswith("_steps") or f.name == "inputs"):
            continue
        value = getattr(cfg, f.name, None)
        values = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else []
        for v in values:
            if isinstance(v, str) and v and "/" not in v and v not in (".", "..") and (run_dir / v).is_dir():
                out.add(v)
    return out


def holding_folders(run_dir: Path, kind: str, own: str) -> list[str]:
    if not run_dir.is_dir():
        return []
    return [d.name for d in sorted(run_dir.iterdir()) if d.is_dir() and d.name != own and holds(d, kind)]


def upstream_config(run_dir: Path, folder: str, step=None):
    """The step and the loaded config a step folder was prepared with (``config.json``; the step from
    ``executor.json`` unless given, for a folder written by another tool)."""
    from ovpipe.config import load_config
    from ovpipe.registry import get_step

    sdir = Path(run_dir) / folder
    if step is None:
        step = get_step(json.loads((sdir / "executor.json").read_text())["step"])
    return step, load_config(step.config, json.loads((sdir / "config.json").read_text()))


def resolve(step, cfg, run_dir: Path, name: str | None = None) -> dict[str, list[str]]:
    """``{kind: [step folder, ...]}`` for every active input of ``step`` under ``cfg``: the folders
    named by the declared fields (in the config's order), or every folder holding the kind. A folder
    named but missing is still listed (``check_inputs`` says what is missing); a ``via`` input whose
    upstream cannot be read yet resolves to nothing (its upstream is itself an input, checked)."""
    run_dir = Path(run_dir)
    own = name or step.name
    out: dict[str, list[str]] = {}
    for kind, spec in normalise(step.inputs).items():
        if not spec.active(cfg):
            continue
        if spec.via:
            folders = []
            for up in _field_values(cfg, spec.via):
                try:
                    ustep, ucfg = upstream_config(run_dir, up)
                except (OSError, ValueError, KeyError):
                    continue
                folders += [f for f in resolve(ustep, ucfg, run_dir, up).get(kind, []) if f not in folders]
        elif spec.field and _field_values(cfg, spec.field):
            folders = _field_values(cfg, spec.field)
        else:
            folders = holding_folders(run_dir, kind, own)
            if spec.named_by_config:
                named = _config_named_folders(cfg, run_dir)
                folders = [f for f in folders if f in named] or folders
        out[kind] = [f for f in folders if f != own]
    return out


def check_inputs(step, cfg, run_dir: Path, name: str | None = None) -> None:
    """Before any work: every input the step will read is there. ``ValueError`` naming the kind, the
    folder and the config field that names it."""
    run_dir = Path(run_dir)
    resolved = resolve(step, cfg, run_dir, name)
    for kind, spec in normalise(step.inputs).items():
        if kind not in resolved or spec.via:
            continue
        folders = resolved[kind]
        if not folders:
            raise ValueError(f"no {kind!r} manifest under {run_dir / '*' / kind}/ — run the step that writes it first")
        for f in folders:
            if not holds(run_dir / f, kind):
                raise ValueError(f"no {kind!r} manifest under {run_dir / f / kind}/ ({spec.field} names {f!r}) — "
                                 f"run the step that writes it first")


def input_folders(step, cfg, run_dir: Path, name: str | None = None) -> list[str]:
    """Every step folder ``step`` reads, once, in name order."""
    return sorted({f for folders in resolve(step, cfg, run_dir, name).values() for f in folders})
