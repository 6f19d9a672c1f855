"""``ovpipe grpo``: the recipe's RL stage on TRL's ``GRPOTrainer``, as an ordinary step.

    ovpipe grpo --run-dir RUN --set model=RUN/pretrain/hf-stage-2                      (this machine)
    ovpipe grpo --run-dir RUN --set model=… --nproc 2                                  (torchrun: gloo on CPU)
    ovpipe grpo --run-dir RUN --set model=… --executor slurm --nodes 2 --gpus-per-node 8

It trains an HF folder — the stage-2 export, a released LLaVA-OneVision-1.5 folder, or any VLM or LM that TRL
loads — on the ``export`` step's verl splits, in the recipe's two stages, each from the one before:

* ``answer_only`` (stage 1) on split ``stage1-answer-only``, the user turn "Put ONLY your final answer within
  <answer></answer>." then the question (``rl_select.rollout``'s ``answer_only`` template, so a re-selection asks
  the trained model exactly what it was trained on), rewarded by the prompt's answer type;
* ``cot`` (stage 2) on split ``stage2-cot`` with the recipe's chain-of-thought instruction (``thinking``), rewarded
  by the answer type plus the recipe's format reward.

Defaults are the published settings (LLaVA-OneVision-1.5-RL): Adam, lr 2e-6, weight decay 0.01, constant after a
0.1% warm-up; 512 rollouts a step = 32 prompts × 16; at most 4,096 new tokens at temperature 1.0; clip ε 0.2 /
ε_high 0.28; reward scale 10, bias −0.5; no KL; bf16 where the device has it. ``--set`` overrides any of them.

What the step adds to TRL: the lock, the check of its inputs before any work (the model folder, the export's
splits, every answer type in them against the reward registry, the batch arithmetic at the launch's world size),
resumable checkpoints (a killed rerun continues at its last saved step; on the CPU with a fixed seed it ends with the
uninterrupted run's metrics), SIGTERM / SIGUSR1 → save and stop (``Stopped``: a Slurm requeue resumes), the
``grpo_metrics`` manifest, and the output folder ``RUN/grpo/model/`` that ``rollout``, ``eval`` and
``export-model``'s consumers load unchanged. The step is ``distributed``: ``--nproc`` starts its ranks under
``torchrun`` here, ``--nodes`` / ``--gpus-per-node`` under ``srun`` on Slurm; accelerate runs DDP over them (gloo on
the CPU, NCCL on GPUs), and ``deepspeed`` / ``fsdp`` hand TRL a DeepSpeed ZeRO or FSDP config.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ovpipe.config import NOT_HASHED, check_range, check_step_folder
from ovpipe.inputs import Input
from ovpipe.step import Step, Stopped, TaskContext, save_json

_RUN = dict(metadata=NOT_HASHED)        # how the stage runs, not what it makes

# The recipe's two stages: the export split each reads, the template of its user turn (``rl_select.rollout``'s own:
# the recipe's instruction, then the question, so a re-selection asks what was trained), its rewards.
STAGES: dict[str, dict[str, Any]] = {
    "answer_only": {"split": "stage1-answer-only", "prompt_type": "answer_only", "rewards": ["accuracy"]},
    "cot": {"split": "stage2-cot", "prompt_type": "thinking", "rewards": ["accuracy", "format"]},
}
REWARD_KINDS = ("accuracy", "format")
METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True)
class GRPOStepConfig:
    model: str = ""                              # the HF folder trained by the first stage
    export_step: str = "export"                  # its verl/<split>.parquet are the prompts
    # or: a select step's kept prompts read directly (its selection + rl_prompts), no export step; "": the export
    selection_step: str = ""
    # the stages trained in order: answer_only, then cot (chain of thought)
    stages: list[str] = field(default_factory=lambda: ["answer_only", "cot"])
    splits: dict[str, str] = field(default_factory=dict)     # {stage: split}; unset: STAGES' split
    rewards: dict[str, list[str]] = field(default_factory=dict)   # {stage: [accuracy, format]}; unset: STAGES'
    reward_weights: dict[str, float] = field(default_factory=dict)   # {kind: weight}; unset: 1
    steps: int = 100                             # optimizer steps per stage
    # the published settings
    learning_rate: float = 2e-6  # the recipe's learning rate
    weight_decay: float = 0.01  # AdamW weight decay
    warmup_ratio: float = 0.001  # share of the steps warming up the learning rate
    lr_scheduler: str = "constant_with_warmup"  # transformers' scheduler name
    batch_size: int = 512                        # rollouts per optimizer step (TRL's generation batch): 32 × 16
    num_generations: int = 16                    # rollouts per prompt (the group)
    max_completion_length: int = 4096  # the longest rollout, in tokens
    temperature: float = 1.0  # sampling temperature of the rollouts
    top_p: float = 1.0  # nucleus sampling of the rollouts
    # 0: no top-k cut (TRL's and vLLM's default; the recipe samples at temperature 1.0 from the whole distribution).
    # `rollout`'s transformers backend samples with generate()'s default top_k 50: 50 here trains on the
    # distribution that backend measures (the demo does)
    top_k: int = 0
    epsilon: float = 0.2  # the clip range below (1 - epsilon)
    epsilon_high: float = 0.28  # the clip range above (1 + epsilon_high, DAPO's clip-higher)
    beta: float = 0.0                            # KL coefficient: none in the recipe
    loss_type: str = "dapo"                      # TRL's token-level normalisation (AReaL's token mean)
    reward_scale: float = 10.0  # a reward r enters as (r + reward_bias) * reward_scale (AReaL's)
    reward_bias: float = -0.5  # added after reward_scale
    seed: int = 0  # initialisation, prompt order and sampling
    # options (the official GRPO path's lora_enable / freeze_vision_tower / freeze_merger)
    lora: dict[str, Any] = field(default_factory=dict)   # {r, alpha, dropout, target_modules}; empty: full weights
    freeze_vision: bool = False  # the vision tower is not trained
    freeze_projector: bool = False  # the projector is not trained
    shuffle_r1: dict[str, Any] = field(default_factory=dict)   # {alpha, S, …}: grpo.shuffle_r1; empty: off
    sortedrl: dict[str, Any] = field(default_factory=dict)     # {mode, …}: grpo.sortedrl; empty: off
    reward_timeout_s: float = 5.0  # a reward slower than this scores 0 (sandboxed)
    reward_workers: int = 2  # sandboxed reward processes
    # how it runs
    micro_batch: int = field(default=8, **_RUN)            # rollouts per forward/backward on a rank
    precision: str = field(default="auto", **_RUN)         # auto (bf16 where the card has it) | bf16 | fp32
    device: str = field(default="auto", **_RUN)            # auto | cpu | cuda
    generation: str = field(default="transformers", **_RUN)    # transformers | vllm-colocate | vllm-server
    vllm_server: str = field(default="", **_RUN)           # host:port of `trl vllm-serve` (vllm-server)
    distributed: str = field(default="ddp", **_RUN)        # ddp | deepspeed (a ZeRO json) | fsdp
    deepspeed_config: str = field(default="", **_RUN)  # distributed=deepspeed: the ZeRO JSON
    save_every: int = field(default=10, **_RUN)            # optimizer steps between checkpoints
    keep: int = field(default=2, **_RUN)  # checkpoints kept (the latest K)
    cpu_threads: int = field(default=2, **_RUN)  # torch threads per rank on a CPU

    def __post_init__(self):
        if not self.model:
            raise ValueError("model: give the HF folder to train (e.g. --set model=RUN/pretrain/hf-stage-2)")
        check_step_folder("export_step", self.export_step)
        if self.selection_step:
            check_step_folder("selection_step", self.selection_step)
        if not self.stages:
            raise ValueError(f"stages: give at least one of {list(STAGES)}")
        bad = [s for s in self.stages if s not in STAGES]
        if bad or len(set(self.stages)) != len(self.stages):
            raise ValueError(f"stages: {self.stages!r} — each of {list(STAGES)} at most once, in order")
        for name, d in (("splits", self.splits), ("rewards", self.rewards)):
            extra = sorted(set(d) - set(self.stages))
            if extra:
                raise ValueError(f"{name}: {extra} are not among stages {self.stages}")
        for stage, kinds in self.rewards.items():
            unknown = [k for k in kinds if k not in REWARD_KINDS]
            if unknown or not kinds:
                raise ValueError(f"rewards.{stage}: unknown reward {unknown or kinds!r}; choose from {list(REWARD_KINDS)}")
        unknown = sorted(set(self.reward_weights) - set(REWARD_KINDS))
        if unknown:
            raise ValueError(f"reward_weights: unknown reward {unknown}; choose from {list(REWARD_KINDS)}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.num_generations < 2:
            raise ValueError(f"num_generations must be >= 2 (a group's advantages need two rollouts), "
                             f"got {self.num_generations}")
        if self.batch_size % self.num_generations:
            raise ValueError(f"num_generations={self.num_generations} does not divide batch_size={self.batch_size} "
                             f"(rollouts per step = prompts per step × num_generations)")
        for name in ("learning_rate", "weight_decay", "temperature", "epsilon", "epsilon_high", "beta",
                     "reward_timeout_s"):
            check_range(self, name, 0)
        check_range(self, "warmup_ratio", 0, 1)   # a share of the steps, < 1 (TrainingArguments.warmup_steps)
        check_range(self, "top_p", 0, 1, lo_open=True)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no cut), got {self.top_k}")
        if self.max_completion_length < 1 or self.micro_batch < 1 or self.reward_workers < 1:
            raise ValueError("max_completion_length, micro_batch and reward_workers must be >= 1")
        choices = {"precision": ("auto", "bf16", "fp32"), "device": ("auto", "cpu", "cuda"),
                   "generation": ("transformers", "vllm-colocate", "vllm-server"),
                   "distributed": ("ddp", "deepspeed", "fsdp"),
                   "loss_type": ("grpo", "dapo", "dr_grpo", "bnpo")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        if self.generation == "vllm-server" and not self.vllm_server:
            raise ValueError("vllm_server: give host:port of `trl vllm-serve` for generation=vllm-server")
        if self.distributed == "deepspeed" and not self.deepspeed_config:
            raise ValueError("deepspeed_config: give the DeepSpeed ZeRO json for distributed=deepspeed")
        if self.lora:
            unknown = sorted(set(self.lora) - {"r", "alpha", "dropout", "target_modules"})
            if unknown:
                raise ValueError(f"lora: unknown keys {unknown}; known: r, alpha, dropout, target_modules")
        if self.shuffle_r1 and self.sortedrl:
            raise ValueError("shuffle_r1 and sortedrl: one batch-shaping algorithm at a time")
        self.reshape_config()
        self.check_world(1)
        if self.sortedrl:
            from grpo.sortedrl import SortedRLConfig

            SortedRLConfig.from_dict(dict(self.sortedrl))     # mode, group, slots: named and checked before any work

    def reshape_config(self):
        """``shuffle_r1`` as ``grpo.shuffle_r1.ShuffleR1Config`` (None when off), unknown keys refused."""
        if not self.shuffle_r1:
            return None
        from dataclasses import fields

        from grpo.shuffle_r1 import ShuffleR1Config

        known = [f.name for f in fields(ShuffleR1Config)]
        unknown = sorted(set(self.shuffle_r1) - set(known))
        if unknown:
            raise ValueError(f"shuffle_r1: unknown keys {unknown}; known: {', '.join(known)}")
        return ShuffleR1Config(**self.shuffle_r1)

    def generation_micro_batch(self) -> int:
        """TRL's ``per_device_train_batch_size``: the rollouts a rank generates per micro-step. With ``shuffle_r1``
        the update keeps 2⌊α·N⌋ of a group's ``num_generations`` (the paper: 16 generated, 8 kept), so a rank
        generates ``micro_batch · num_generations / kept`` for each ``micro_batch`` it trains on."""
        sr = self.reshape_config()
        if sr is None:
            return self.micro_batch
        kept = 2 * sr.pairs_per_group(self.num_generations)
        if (self.micro_batch * self.num_generations) % kept:
            raise ValueError(f"micro_batch={self.micro_batch}: shuffle_r1 keeps {kept} of num_generations="
                             f"{self.num_generations} rollouts a prompt, so micro_batch × {self.num_generations} "
                             f"must be a multiple of {kept}")
        return self.micro_batch * self.num_generations // kept

    def check_world(self, world: int) -> None:
        """The batch splits evenly into micro-batches on ``world`` ranks (TRL's own rule, named by field); with
        ``shuffle_r1``, each rank's share is whole groups whose kept pairs the paper's S × T holds."""
        per = self.generation_micro_batch() * world
        if self.batch_size % per:
            raise ValueError(f"batch_size={self.batch_size} is not a multiple of micro_batch={self.micro_batch} × "
                             f"{world} rank(s)"
                             + (f" × {per // (self.micro_batch * world)} (shuffle_r1 generates that many rollouts "
                                f"for each one it trains on)" if per != self.micro_batch * world else "")
                             + "; choose micro_batch so that it divides batch_size / ranks")
        sr = self.reshape_config()
        if sr is not None:
            local = self.batch_size // world
            if local % self.num_generations:
                raise ValueError(f"batch_size={self.batch_size} on {world} rank(s) splits a group of "
                                 f"num_generations={self.num_generations}: shuffle_r1 pairs within whole groups")
            sr.check_sizes(self.num_generations, local // self.num_generations, self.batch_size // per)

    def split(self, stage: str) -> str:
        return self.splits.get(stage, STAGES[stage]["split"])

    def reward_kinds(self, stage: str) -> list[str]:
        return list(self.rewards.get(stage, STAGES[stage]["rewards"]))


# ----------------------------------------------------------------------------------------------- the check

def check(cfg: GRPOStepConfig, run_dir: Path) -> None:
    """Before any work: the model folder, each stage's export split, every answer type in it against the
    registry, and the batch at the launch's world size."""
    from rl_select.rewards import resolve

    model = Path(cfg.model)
    if not (model / "config.json").exists():
        raise ValueError(f"model: {cfg.model!r} is not an HF folder (no config.json)")
    have = sorted(prompt_splits(cfg, run_dir))
    for stage in cfg.stages:
        if cfg.split(stage) not in have:
            source = (f"the select step {cfg.selection_step!r} kept no prompt in" if cfg.selection_step else
                      f"the export step {cfg.export_step!r} did not write "
                      f"({Path(run_dir) / cfg.export_step / 'verl' / (cfg.split(stage) + '.parquet')})")
            raise ValueError(f"stages: stage {stage!r} reads split {cfg.split(stage)!r}, which {source}; its splits: "
                             f"{have or 'none'} — set splits.{stage}, or leave {stage!r} out of stages")
        types = {r["extra_info"]["answer_type"] for r in split_rows(cfg, run_dir, cfg.split(stage), images=False)}
        for t in sorted(types):
            try:
                resolve(t)
            except (KeyError, ValueError) as e:
                raise ValueError(f"stages: split {cfg.split(stage)!r} has answer type {t!r}, which the reward "
                                 f"registry does not know ({e})") from None


# ----------------------------------------------------------------------------------------------- data

def prompt_splits(cfg: GRPOStepConfig, run_dir: Path) -> set[str]:
    """The splits there are prompts for: the export's verl files, or the select step's kept prompts' splits."""
    if not cfg.selection_step:
        return {p.stem for p in (Path(run_dir) / cfg.export_step / "verl").glob("*.parquet")}
    return set(_kept_splits(cfg, run_dir).values())


def _kept_splits(cfg: GRPOStepConfig, run_dir: Path) -> dict[str, str]:
    from manifests.io import iter_parts, manifest_files
    from ovpipe.inputs import resolve as resolve_inputs

    files = manifest_files(run_dir, "selection", resolve_inputs(STEP, cfg, Path(run_dir))["selection"])
    return {pid: split for b in iter_parts(files, "selection", ["prompt_id", "kept", "split"])
            for pid, kept, split in zip(*(b.column(c).to_pylist() for c in ("prompt_id", "kept", "split"))) if kept}


def split_rows(cfg: GRPOStepConfig, run_dir: Path, split: str, images: bool = True) -> list[dict]:
    """The split's prompts as verl rows (``rl_select.export``'s schema): the export's file, or — with
    ``selection_step`` — the select step's kept ``ok`` prompts built by the export's own row function, in the
    canonical order the export writes them, so both sources train on the same rows. ``images=False`` leaves the
    image bytes out (the pre-start check reads only the answer types)."""
    import pyarrow.parquet as pq

    if not cfg.selection_step:
        path = Path(run_dir) / cfg.export_step / "verl" / f"{split}.parquet"
        cols = None if images else [c for c in pq.read_schema(path).names if c != "images"]
        return pq.read_table(path, columns=cols).to_pylist()
    from manifests.io import iter_parts, manifest_files
    from manifests.schemas import schema_for
    from ovpipe.inputs import resolve as resolve_inputs
    from rl_select.export import PROMPT_BATCH, ExportConfig, _verl_row

    kept = {pid for pid, s in _kept_splits(cfg, run_dir).items() if s == split}
    files = manifest_files(run_dir, "rl_prompts", resolve_inputs(STEP, cfg, Path(run_dir))["rl_prompts"])
    cols = None if images else [c for c in schema_for("rl_prompts").names if c != "images"]   # bytes not read
    rows, ecfg = [], ExportConfig()
    for b in iter_parts(files, "rl_prompts", cols, batch_rows=PROMPT_BATCH):
        for p in b.to_pylist():
            if p["prompt_id"] in kept and p["status"] == "ok":
                rows.append(_verl_row(len(rows), {**p, "split": split, **({} if images else {"images": []})},
                                      False, ecfg))
    return rows


def stage_dataset(cfg: GRPOStepConfig, run_dir: Path, stage: str):
    """The stage's export split as TRL's prompt dataset: ``prompt`` (the chat turn, ``<image>`` placeholders as
    image parts, the stage's template applied), ``images`` (PIL), and the columns the reward reads."""
    import io

    from datasets import Dataset
    from PIL import Image

    from manifests.conversation import to_messages
    from rl_select.rollout import TEMPLATES

    rows = []
    template = TEMPLATES[STAGES[stage]["prompt_type"]]
    for r in split_rows(cfg, run_dir, cfg.split(stage)):
        prompt, images, rm, info = r["prompt"], r["images"], r["reward_model"], r["extra_info"]
        question = next(m["content"] for m in prompt if m["role"] == "user")
        row = {"prompt": to_messages([("user", template.format(question=question))]),
               "ground_truth": rm["ground_truth"], "answer_type": info["answer_type"],
               "reward_params": info["reward_params"] or "{}", "prompt_id": info["prompt_id"]}
        if images:
            row["images"] = [Image.open(io.BytesIO(im["bytes"])).convert("RGB") for im in images]
        rows.append(row)
    if not rows:
        raise ValueError(f"stages: split {cfg.split(stage)!r} of {cfg.selection_step or cfg.export_step!r} has no prompts")
    if any("images" in r for r in rows) and not all("images" in r for r in rows):
        raise ValueError(f"split {cfg.split(stage)!r} mixes prompts with and without images, which TRL's "
                         f"VLM batches cannot; export them as separate splits")
    if "images" not in rows[0]:
        for r in rows:        # a text-only turn: plain text content, as a text-only chat template wants it
            r["prompt"] = [{"role": "user", "content": "".join(p.get("text") or "" for p in r["prompt"][0]["content"])}]
    return Dataset.from_list(rows)


# ----------------------------------------------------------------------------------------------- one stage

def load_policy(cfg: GRPOStepConfig, folder: str, device: str):
    """The model and processor of ``folder`` (``inference.backends.load_model``: the published LLaVA-OneVision-1.5
    layout's key mapping and rotary-buffer repair, refusing missing weights), frozen parts and LoRA applied."""
    import torch
    from transformers import AutoProcessor

    from grpo.trainer import drop_unaccepted_outputs
    from inference.backends import load_model
    from llava_ov.official import repair_tied_keys

    dtype = torch.bfloat16 if bf16(cfg, device) else torch.float32
    model = load_model(folder, dtype)
    repair_tied_keys(model)          # the published class's transformers-4 list, which save_pretrained refuses
    processor = AutoProcessor.from_pretrained(folder, trust_remote_code=True)
    drop_unaccepted_outputs(processor, model)
    frozen = freeze(model, cfg)
    return model, processor, frozen


def freeze(model, cfg: GRPOStepConfig) -> int:
    """``freeze_vision`` / ``freeze_projector``: the tower's and the projector's parameters stop training. Matched
    by the published names (``visual.`` / ``merger``) and HF's (``vision_tower`` / ``multi_modal_projector``).
    Returns how many parameters were frozen."""
    n = 0
    for name, p in model.named_parameters():
        is_proj = any(k in name for k in ("merger", "multi_modal_projector", "mm_projector"))
        is_vision = not is_proj and any(k in name for k in ("visual.", "vision_tower", "vision_model"))
        if (cfg.freeze_vision and is_vision) or (cfg.freeze_projector and is_proj):
            p.requires_grad_(False)
            n += p.numel()
    return n


def bf16(cfg: GRPOStepConfig, device: str) -> bool:
    import torch

    if cfg.precision == "fp32" or device == "cpu":
        return False
    if cfg.precision == "bf16":
        return True
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def trl_config(cfg: GRPOStepConfig, out: Path, stage: str, device: str, world: int):
    from trl import GRPOConfig

    per_device = cfg.generation_micro_batch()
    accum = cfg.batch_size // (per_device * world)
    kw: dict[str, Any] = {}
    if cfg.generation.startswith("vllm"):
        kw.update(use_vllm=True, vllm_mode=cfg.generation.split("-", 1)[1])
        if cfg.generation == "vllm-server":
            host, _, port = cfg.vllm_server.rpartition(":")
            kw.update(vllm_server_host=host or "127.0.0.1", vllm_server_port=int(port))
    if cfg.distributed == "deepspeed":
        kw["deepspeed"] = cfg.deepspeed_config
    elif cfg.distributed == "fsdp":
        kw.update(fsdp="full_shard auto_wrap")
    return GRPOConfig(
        output_dir=str(out / "checkpoints"), max_steps=cfg.steps, learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_ratio, lr_scheduler_type=cfg.lr_scheduler,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999,
        per_device_train_batch_size=per_device, gradient_accumulation_steps=accum, steps_per_generation=accum,
        num_generations=cfg.num_generations, max_completion_length=cfg.max_completion_length,
        temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
        beta=cfg.beta, loss_type=cfg.loss_type, seed=cfg.seed, data_seed=cfg.seed,
        bf16=bf16(cfg, device), use_cpu=device == "cpu", logging_steps=1, save_strategy="steps",
        save_steps=cfg.save_every, save_total_limit=cfg.keep, report_to=[], disable_tqdm=True,
        reward_weights=[cfg.reward_weights.get(k, 1.0) for k in cfg.reward_kinds(stage)],
        remove_unused_columns=False, dataloader_num_workers=0, log_completions=False,
        ddp_backend="gloo" if device == "cpu" and world > 1 else None, **kw)


class ScaledReward:
    """The recipe's reward shift and scale, ``(r + bias) · scale``, over one registry reward."""

    def __init__(self, inner, scale: float, bias: float):
        self.inner, self.scale, self.bias = inner, scale, bias
        self.__name__ = inner.__name__

    @property
    def status(self):
        return self.inner.status

    @status.setter
    def status(self, v):
        self.inner.status = v

    def __call__(self, *a, **kw):
        return [(r + self.bias) * self.scale for r in self.inner(*a, **kw)]


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest whole HF checkpoint (``trainer_state.json`` is the Trainer's last write), or None."""
    best = None
    for p in Path(folder).glob("checkpoint-*"):
        if (p / "trainer_state.json").exists() and p.name.split("-")[-1].isdigit():
            if best is None or int(p.name.split("-")[-1]) > int(best.name.split("-")[-1]):
                best = p
    return best


class _Signals:
    """SIGTERM / SIGUSR1 (a Slurm time limit, a pre-emption) → the trainer saves at the step's end and stops."""

    def __init__(self):
        self.signum = 0

    def __enter__(self):
        self._old = {s: signal.signal(s, self._on) for s in (signal.SIGTERM, signal.SIGUSR1)}
        return self

    def _on(self, signum, frame):
        self.signum = signum

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def train_stage(cfg: GRPOStepConfig, run_dir: Path, stage: str, start: str, out: Path, device: str, world: int,
                signals: _Signals) -> dict:
    """One stage from ``start`` (an HF folder) into ``out/model``; resumes from ``out/checkpoints``."""
    import torch
    from transformers import TrainerCallback

    from grpo.trainer import OvpipeGRPOTrainer, RegistryReward, StepMetrics, read_records
    from rl_select.rewards import RewardRunner

    out.mkdir(parents=True, exist_ok=True)
    ckpt = latest_checkpoint(out / "checkpoints")
    metrics = out / METRICS_FILE
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0:                    # a resumed stage redoes the steps after its checkpoint: their records go
        kept = read_records(metrics, int(ckpt.name.split("-")[-1]) if ckpt else 0)
        metrics.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
    torch.manual_seed(cfg.seed)
    model, processor, frozen = load_policy(cfg, start, device)
    peft_config = None
    if cfg.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=int(cfg.lora.get("r", 64)), lora_alpha=int(cfg.lora.get("alpha", 16)),
                                 lora_dropout=float(cfg.lora.get("dropout", 0.05)),
                                 target_modules=cfg.lora.get("target_modules", "all-linear"), task_type="CAUSAL_LM")
    sr = cfg.reshape_config()
    reshaper = sr.reshaper(cfg.seed) if sr is not None else None
    rollout_func = None
    if cfg.sortedrl:
        from grpo.sortedrl import make_rollout_func

        rollout_func = make_rollout_func(cfg.sortedrl, processor)

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if signals.signum:
                control.should_save = True
                control.should_training_stop = True

    with RewardRunner(cfg.reward_workers, cfg.reward_timeout_s) as runner:
        rewards = [ScaledReward(RegistryReward(runner, k), cfg.reward_scale, cfg.reward_bias)
                   for k in cfg.reward_kinds(stage)]
        holder: dict = {}
        trainer = OvpipeGRPOTrainer(
            model=model, reward_funcs=rewards, args=trl_config(cfg, out, stage, device, world),
            train_dataset=stage_dataset(cfg, run_dir, stage), processing_class=processor, peft_config=peft_config,
            callbacks=[StepMetrics(metrics, stage, lambda: holder["t"]), Stop()], batch_reshaper=reshaper,
            **({"rollout_func": rollout_func} if rollout_func is not None else {}))
        holder["t"] = trainer
        result = trainer.train(resume_from_checkpoint=str(ckpt) if ckpt else None)
    if signals.signum:
        return {"stopped": signals.signum, "step": trainer.state.global_step}
    if rank0:
        save_policy(trainer, processor, start, out / "model", cfg)
    return {"step": trainer.state.global_step, "frozen_params": frozen,
            "train_runtime_s": result.metrics.get("train_runtime")}


def save_policy(trainer, processor, start: str, dest: Path, cfg: GRPOStepConfig) -> None:
    """The trained policy as an HF folder in the layout it came in (a LoRA run is merged first): the weights from
    ``save_pretrained``, and every other file — config, tokenizer, processor, the published remote code,
    ``ovpipe_export.json`` — copied from the start folder as it was. RL changes the weights only; a re-saved
    config or tokenizer is not the same file (transformers 5 writes ``use_cache: false`` from training, expands the
    text config, renames the tokenizer's special-token lists), so the start folder's own are kept. Written as
    ``dest.partial`` and renamed when whole."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if cfg.lora:
        model = model.merge_and_unload()
    tmp = dest.with_name(dest.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(str(tmp), safe_serialization=True)
    weights = {p.name for p in tmp.iterdir() if p.name.endswith(".safetensors") or
               p.name == "model.safetensors.index.json"}
    for p in list(tmp.iterdir()):
        if p.name not in weights:
            p.unlink()
    for p in Path(start).iterdir():
        if p.is_file() and not p.name.endswith((".safetensors", ".bin")) and p.name != "model.safetensors.index.json":
            shutil.copy2(p, tmp / p.name)
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)


# ----------------------------------------------------------------------------------------------- the step

def run(cfg: GRPOStepConfig, task: TaskContext) -> None:
    import torch

    from grpo.trainer import read_records

    torch.set_num_threads(max(1, cfg.cpu_threads))
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.check_world(world)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    sdir = task.step_dir
    start = cfg.model
    records = []
    with _Signals() as signals:
        for i, stage in enumerate(cfg.stages):
            out = sdir / f"stage-{stage}"
            if not (out / "model" / "config.json").exists():
                res = train_stage(cfg, task.run_dir, stage, start, out, device, world, signals)
                if res.get("stopped"):
                    raise Stopped(res["stopped"], f"stage {stage} saved at step {res['step']} and stopped on a "
                                                  f"signal; rerun the same command (or let Slurm requeue it) to resume")
                if rank0:
                    print(f"grpo: stage {stage} trained {res['step']} steps → {out / 'model'}", flush=True)
            start = str(out / "model")
            records += read_records(out / METRICS_FILE)
    if not rank0:
        return
    final = sdir / "model"
    if final.exists():
        shutil.rmtree(final)
    shutil.copytree(start, final)
    with task.part_writer("grpo_metrics") as w:
        w.write(sorted((metrics_row(r) for r in records), key=lambda r: (r["stage"], r["step"])))
    task.stats.inc("steps", len(records))
    task.stats.inc("rollouts", int(sum(r.get("generated_rollouts") or 0 for r in records)))
    task.stats.info.update({"model": str(final), "stages": list(cfg.stages), "device": device, "world": world})
    # the prompts each split trained on, by id: what `ovpipe summary` compares before and after, whichever source
    prompts = {cfg.split(s): [r["extra_info"]["prompt_id"] for r in split_rows(cfg, task.run_dir, cfg.split(s), False)]
               for s in cfg.stages}
    save_json(sdir / "grpo.json", {"model": str(final), "stages": list(cfg.stages),
                                   "splits": [cfg.split(s) for s in cfg.stages], "prompts": prompts,
                                   "last": {k: v for k, v in (records[-1] if records else {}).items()}})


def metrics_row(r: dict) -> dict:
    """A metrics record as a ``grpo_metrics`` row: the schema's columns; everything else the record holds (TRL's
    own logged figures, the hooks' columns) in ``extras`` (JSON)."""
    from manifests.schemas import schema_for

    names = schema_for("grpo_metrics").names
    extras = json.loads(r.get("extras") or "{}")
    extras.update({k: v for k, v in r.items() if k not in names and k != "extras"})
    row = {k: r.get(k) for k in names if k != "extras"}
    row["extras"] = json.dumps(extras, sort_keys=True)
    return row


STEP = Step("grpo", GRPOStepConfig, run, max_tasks=1, distributed=True,
            inputs={"verl": Input("export_step", when=lambda c: not c.selection_step),
                    "selection": Input("selection_step", when=lambda c: bool(c.selection_step)),
                    "rl_prompts": Input(via="selection_step", when=lambda c: bool(c.selection_step))},
            outputs=("grpo_metrics",), check=check,
            description="GRPO on TRL over the export's splits (or a selection) → an HF folder (RUN/grpo/model)")
