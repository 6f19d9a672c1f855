"""Every step by name → the module that defines its ``STEP``.

The CLI imports only the module of the step it runs, so `ovpipe sql` or `ovpipe pack`
never pay for torch. A stage adds a step by adding one line to ``STEPS``: its module and what it does.
"""
from __future__ import annotations

import importlib
import os

# name: (the module that defines its STEP, what it does: its line in `ovpipe --help`, ≤ 58 characters so
# that it stays one line on an 80-column terminal)
STEPS: dict[str, tuple[str, str]] = {
    # curation
    "ingest": ("curation.ingest", "webdataset / LLaVA JSON / Parquet → the samples manifest"),
    "embed-images": ("curation.embed", "MetaCLIP image embeddings of the samples (.npy shards)"),
    "embed-concepts": ("curation.concepts", "the concept vocabulary through the CLIP text tower"),
    "assign": ("curation.assign", "top-K concepts per image, exact inner product"),
    "dedup": ("curation.dedup", "semantic near-duplicates: k-means + cosine per cluster"),
    "index": ("curation.index", "faiss index + 2-D map layout of the image vectors"),
    "align": ("curation.align", "image–text CLIP score per sample; low_alignment cut"),
    "balance": ("curation.concept_balance", "concept frequencies → inverse-frequency resampling"),
    "balance-report": ("curation.report", "did balancing lift the long tail: before/after + plot"),
    "mix": ("curation.mix", "ingested sources → a seeded draw to target proportions"),
    "recaption": ("curation.recaption", "bilingual VLM captions of the balanced set, checked"),
    "demo-clip": ("curation.demo_clip", "train the demo's tiny CLIP on the demo corpus (demo only)"),
    # packing
    "lengths": ("packing.lengths", "training tokens per sample (text + image tokens)"),
    "pack": ("packing.pack", "bin-pack samples into fixed-length packed shards"),
    "pack-official": ("packing.pack_official", "a pack step's bins in the official LLaVA-OV layout"),
    "import-packs": ("packing.import_packs", "official-layout packs → ovpipe packs (+ statuses)"),
    # pretrain (the first three run through their own commands below: `ovpipe pretrain --stage S`, ...)
    "pretrain": ("pretrain.stage", "one training stage (RUN/pretrain/stage-<S>)"),
    "import-model": ("pretrain.import_model", "a HF folder → a stage's dist checkpoint"),
    "export-model": ("pretrain.export", "a trained stage → a HF LLaVA-OV-1.5 folder"),
    "eval": ("pretrain.evaluate", "lmms-eval over an exported model → the eval manifest"),
    # rl_select
    "rl-ingest": ("rl_select.ingest", "RL prompt sets (Parquet / JSONL) → the rl_prompts manifest"),
    "rollout": ("rl_select.rollout", "N responses per prompt (vllm / transformers / a file)"),
    "score": ("rl_select.score", "a rule-based reward for every rollout (sandboxed)"),
    "select": ("rl_select.select", "pass@k per prompt; keep a Pass@N − Pass@1 gap"),
    "export": ("rl_select.export", "kept prompts in GRPO trainers' layouts (verl, …)"),
    "rl-gym": ("rl_select.gym.step", "VLM-Gym game states as an rl_prompts manifest"),
    "gym-cold-start": ("rl_select.gym.coldstart", "G1's perception cold start: states → LLaVA JSON"),
    # grpo
    "grpo": ("grpo.step", "GRPO on TRL over the export's splits → an HF folder"),
}
# Steps whose one task is a group of processes (``Step.distributed``) and that go through the generic command
# line: it gives them the launch flags (--nproc here; --nodes, --gpus-per-node, --tasks-per-node on Slurm).
# Listed here, not read off the step, so that building the parser imports no step module.
DISTRIBUTED_STEPS = frozenset({"grpo"})
STEP_MODULES: dict[str, str] = {name: module for name, (module, _) in STEPS.items()}

# manifest kind: the steps that write it (their ``Step.outputs``; a test holds this to them), so a missing
# input names the command that makes it without importing every step module to ask
WRITERS: dict[str, tuple[str, ...]] = {
    "samples": ("ingest",), "shards": ("ingest",), "image_embeddings": ("embed-images",),
    "concepts": ("embed-concepts",), "assignments": ("assign",), "dedup": ("dedup",), "embedding_map": ("index",),
    "alignment": ("align",), "balanced": ("balance",), "concept_counts": ("balance",), "mixed": ("mix",),
    "captions": ("recaption",), "lengths": ("lengths",), "packs": ("pack", "import-packs"),
    "official_packs": ("pack-official",), "imported_packs": ("import-packs",), "dist_ckpt": ("pretrain", "import-model"),
    "eval": ("eval",), "rl_prompts": ("rl-ingest", "rl-gym"), "rollouts": ("rollout",), "rewards": ("score",),
    "selection": ("select",), "grpo_metrics": ("grpo",),
}


def writers_text(kind: str) -> str:
    """``ovpipe ingest`` / ``ovpipe pack or ovpipe import-packs``: the command(s) that write manifest ``kind``."""
    steps = WRITERS.get(kind)
    return " or ".join(f"`ovpipe {s}`" for s in steps) if steps else "the step that writes it"


# Commands that are not steps, by the function that runs them: the core CLI names the stage (or the demo)
# that implements them, and imports it only when the command runs, as it does for steps.
# name: (module:function, what it does: its line in `ovpipe --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "pretrain": ("pretrain.stage:main",           # its own argument parser (layout, torchrun / srun options)
                 "three-stage megatron-core training (its own --help)"),
    "export-model": ("pretrain.export:main",
                     "a trained stage → a HF folder (its own --help)"),
    "import-model": ("pretrain.import_model:main",
                     "a HF folder → a stage's dist checkpoint (its own --help)"),
    "plan": ("pretrain.plan:main",
             "a stage's layouts, memory and hours on N GPUs"),
    "demo-data": ("demo:write_demo_data",
                  "write the synthetic demo corpus"),
    "view": ("viewer.serve:main",
             "browse a run in a web page on this machine (own --help)"),
}


def command_help(name: str) -> str:
    return COMMANDS[name][1]


def step_help(name: str) -> str:
    """The step's one line in ``ovpipe --help``; a step from OVPIPE_EXTRA_STEPS gets a generic one
    (its module is not imported to ask it: ``ovpipe --help`` stays fast)."""
    if name in STEPS:
        return STEPS[name][1]
    return f"a step from OVPIPE_EXTRA_STEPS ({all_steps().get(name, '?')})"


def get_command(name: str):
    module, _, attr = COMMANDS[name][0].partition(":")
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
