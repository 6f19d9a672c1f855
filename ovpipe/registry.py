"""Every step by name → the module that defines its ``STEP``.

The CLI imports only the module of the step it runs, so `ovpipe sql` or `ovpipe pack`
never pay for torch. A stage adds a step by adding one line here.
"""
from __future__ import annotations

import importlib

STEP_MODULES: dict[str, str] = {
    # curation
    "ingest": "curation.ingest",
    "embed-images": "curation.embed",
    "embed-concepts": "curation.concepts",
    "assign": "curation.assign",
    "balance": "curation.balance",
    "balance-report": "curation.report",
    "demo-clip": "curation.demo_clip",
    # packing
    "lengths": "packing.lengths",
    "pack": "packing.pack",
    # rl_select
    "rl-ingest": "rl_select.ingest",
    "rollout": "rl_select.rollout",
    "score": "rl_select.score",
    "select": "rl_select.select",
    "export": "rl_select.export",
    "rl-gym": "rl_select.gym.step",
}


def available() -> list[str]:
    out = []
    for name, mod in STEP_MODULES.items():
        if importlib.util.find_spec(mod.split(".")[0]) is None:
            continue
        try:
            if importlib.util.find_spec(mod) is not None:
                out.append(name)
        except ModuleNotFoundError:
            pass
    return out


def get_step(name: str):
    try:
        module = STEP_MODULES[name]
    except KeyError:
        raise KeyError(f"unknown step {name!r}; steps: {sorted(STEP_MODULES)}") from None
    return importlib.import_module(module).STEP
