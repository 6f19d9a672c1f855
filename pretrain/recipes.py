"""Named recipes (the test matrix) and their three stages, validated before launch.

| recipe | vision | LLM |
| --- | --- | --- |
| ``tiny`` | 2×32 ViT (patch 14) | 2×64 Qwen3-style, vocab 512 |
| ``llava-ov-1.5-4b`` | RICE-ViT-L/14 (24 × 1024, 16 heads) | Qwen3-4B (36 × 2560, GQA 32/8) |
| ``llava-ov-1.5-8b`` | RICE-ViT-L/14 | Qwen3-8B (36 × 4096, GQA 32/8) |

Stages (defaults as published): 1 — projector only, lr 1e-4; 1.5 — all parameters on the
concept-balanced packs, lr 1e-5; 2 — all parameters on instruction packs, lr 1e-5; cosine decay to
1e-6, warmup 0.2%, Adam ε 1e-5, bf16 and full recompute at scale.
"""
from __future__ import annotations

from dataclasses import dataclass

from pretrain.model import LLM_SIZES, LLMSize
from pretrain.vision import VIT_SIZES, ViTSize


@dataclass(frozen=True)
class Recipe:
    name: str
    vit: ViTSize
    llm: LLMSize


RECIPES = {
    "tiny": Recipe("tiny", VIT_SIZES["tiny"], LLM_SIZES["tiny"]),
    "llava-ov-1.5-4b": Recipe("llava-ov-1.5-4b", VIT_SIZES["rice-vit-l-14"], LLM_SIZES["qwen3-4b"]),
    "llava-ov-1.5-8b": Recipe("llava-ov-1.5-8b", VIT_SIZES["rice-vit-l-14"], LLM_SIZES["qwen3-8b"]),
}


@dataclass
class StageConfig:
    stage: str
    lr: float
    min_lr: float = 1e-6
    warmup_frac: float = 0.002
    adam_eps: float = 1e-5
    trainable: str = "all"            # "projector" | "all"
    data: str = "pack"                # packed-shard step folder
    bf16: bool = True
    recompute: str = "full"


STAGES = {
    "1": StageConfig("1", 1e-4, trainable="projector", data="pack"),
    "1.5": StageConfig("1.5", 1e-5, trainable="all", data="pack"),
    "2": StageConfig("2", 1e-5, trainable="all", data="pack-instruct"),
}
PREVIOUS = {"1.5": "1", "2": "1.5"}


@dataclass
class Parallelism:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = True
    seq_len: int = 8192
    world_size: int = 1


def validate(recipe: Recipe, par: Parallelism) -> None:
    """Reject impossible combinations before anything launches, naming both settings."""
    llm = recipe.llm
    errs = []
    if llm.num_attention_heads % par.tp:
        errs.append(f"tp={par.tp} must divide num_attention_heads={llm.num_attention_heads}")
    if llm.num_query_groups % par.tp:
        errs.append(f"tp={par.tp} must divide num_query_groups={llm.num_query_groups}")
    if par.pp > llm.num_layers:
        errs.append(f"pp={par.pp} exceeds num_layers={llm.num_layers}")
    if par.sequence_parallel and par.tp == 1:
        errs.append("sequence_parallel=True requires tp > 1")
    if par.cp > 1 and par.seq_len % (2 * par.cp):
        errs.append(f"cp={par.cp} requires seq_len={par.seq_len} divisible by 2·cp (load-balanced THD split)")
    if par.world_size % (par.tp * par.pp * par.cp):
        errs.append(f"world_size={par.world_size} must be a multiple of tp·pp·cp={par.tp * par.pp * par.cp}")
    if errs:
        raise ValueError("; ".join(errs))


def pipeline_layers(num_layers: int, pp: int) -> list[list[int]]:
    """LLM layers per pipeline stage (balanced, earlier stages take the remainder); the vision tower
    and projector live on stage 0, so with uneven splits stage 0 gets the *fewer* layers."""
    base, extra = divmod(num_layers, pp)
    sizes = [base + (1 if i >= pp - extra else 0) for i in range(pp)]
    out, start = [], 0
    for s in sizes:
        out.append(list(range(start, start + s)))
        start += s
    return out
