"""Every step by name → the module that defines its ``STEP``.

The CLI imports only the module of the step it runs, so `ovpipe sql` or `ovpipe pack`
never pay for torch. A stage adds a step by adding one line here.
"""
from __future__ import annotations

import importlib
import os

STEP_MODULES: dict[str, str] = {
    # curation
    "ingest": "curation.ingest",
    "embed-images": "curation.embed",
    "embed-concepts": "curation.concepts",
    "assign": "curation.assign",
    "balance": "curation.balance",
    "balance-report": "curation.report",
    "mix": "curation.mix",
    "recaption": "curation.recaption",
    "demo-clip": "curation.demo_clip",
    # packing
    "lengths": "packing.lengths",
    "pack": "packing.pack",
    # pretrain
    "eval": "pretrain.evaluate",
    # rl_select
    "rl-ingest": "rl_select.ingest",
    "rollout": "rl_select.rollout",
    "score": "rl_select.score",
    "select": "rl_select.select",
    "export": "rl_select.export",
    "rl-gym": "rl_select.gym.step",
}


# Commands that are not steps, by the function that runs them: the core CLI names the stage (or the demo)
# that implements them, and imports it only when the command runs, as it does for steps.
COMMANDS: dict[str, str] = {
    "pretrain": "pretrain.launch:main",              # its own argument parser (torchrun / srun launch options)
    "export-model": "pretrain.export:main",
    "import-model": "pretrain.hf_import:main",
    "demo-data": "demo:write_demo_data",
}


def get_command(name: str):
    module, _, attr = COMMANDS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def _extra_steps() -> dict[str, str]:
    """Steps from outside the package: ``OVPIPE_EXTRA_STEPS="my-step=mypkg.mystep,other=pkg.mod"``.

    The variable is inherited by local pool workers and by Slurm jobs (sbatch exports the
    submitting environment), so a lab's own steps run on both executors unchanged.
    """
    out = {}
    for item in os.environ.get("OVPIPE_EXTRA_STEPS", "").split(","):
        if item.strip():
            name, _, module = item.strip().partition("=")
            out[name.strip()] = module.strip()
    return out


def all_steps() -> dict[str, str]:
    return {**STEP_MODULES, **_extra_steps()}


def get_step(name: str):
    steps = all_steps()
    try:
        module = steps[name]
    except KeyError:
        raise KeyError(f"unknown step {name!r}; steps: {sorted(steps)}") from None
    module, _, attr = module.partition(":")
    return getattr(importlib.import_module(module), attr or "STEP")
