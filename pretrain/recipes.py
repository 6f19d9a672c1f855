"""Named recipes (the test matrix) and their three stages, validated before launch.

| recipe | vision | LLM |
| --- | --- | --- |
| ``tiny`` | 2×32 ViT (patch 14) | 2×64 Qwen3-style, vocab 512 |
| ``llava-ov-1.5-4b`` | RICE-ViT-L/14 (24 × 1024, 16 heads) | Qwen3-4B (36 × 2560, GQA 32/8) |
| ``llava-ov-1.5-8b`` | RICE-ViT-L/14 | Qwen3-8B (36 × 4096, GQA 32/8) |

Stages (defaults as published): 1 — projector only, lr 1e-4, on LLaVA-558K-style caption
conversations; 1.5 — all parameters on the concept-balanced caption packs, lr 1e-5; 2 — all
parameters on the mixed instruction packs (multi-turn, multi-image, text-only), lr 1e-5; cosine
decay to 1e-6, warmup 0.2%, Adam β 0.9/0.95 and weight decay 0.01 in stages 1 and 1.5, β 0.9/0.99 and
no weight decay in stage 2, ε 1e-5, clip 1.0, bf16 (the LLaVA-OneVision-1.5 repository's quick-start
scripts, ``examples/llava_ov_1_5/quick_start/stage_*_llava_ov_4b.sh``). Recompute ``auto``: the trainer estimates each mode's
peak for the recipe, layout, pack length and card and runs the least recompute that fits
(``pretrain.trainer.memory``); for the 4B stage 1.5 on one H200 that is the LLM kept whole with each
tower MLP rebuilt in backward and liger's loss, the fastest setting measured there (nothing recomputed
runs out of memory; figures in docs/pretrain.md).

Each stage names its data by pack step (the ``ovpipe pack --name STEP`` folder of the run):

| stage | pack step | what it holds |
| --- | --- | --- |
| 1 | ``pack-align`` | LLaVA-558K-style caption data (``ingest`` of the LLaVA JSON → ``lengths`` → ``pack``) |
| 1.5 | ``pack`` | concept-balanced caption packs (``balance`` copies) |
| 2 | ``pack-instruct`` | mixed instruction packs (``mix`` → ``lengths`` → ``pack``) |

``ovpipe pretrain --data STEP`` reads another pack step.
"""
from __future__ import annotations

from dataclasses import dataclass

from pretrain.model.sizes import LLM_SIZES, VIT_SIZES, LLMSize, ViTSize


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
    adam_beta2: float = 0.95
    weight_decay: float = 0.01        # megatron's: matrices only (biases and norms are not decayed)
    trainable: str = "all"            # "projector" | "all"
    data: str = "pack"                # pack step folder whose shards (and `packs` manifest) the stage reads
    bf16: bool = True
    recompute: str = "auto"           # full | selective | mlp | none | auto (GPU only; a CPU run keeps everything)


STAGES = {
    "1": StageConfig("1", 1e-4, trainable="projector", data="pack-align"),
    "1.5": StageConfig("1.5", 1e-5, trainable="all", data="pack"),
    "2": StageConfig("2", 1e-5, adam_beta2=0.99, weight_decay=0.0, trainable="all", data="pack-instruct"),
}
PREVIOUS = {"1": "0", "1.5": "1", "2": "1.5"}   # "0": HF weights converted by pretrain.import_model


def stage_folder(stage: str) -> str:
    """A stage's step folder in the run (``pretrain/stage-1.5``): trained there, or imported into it."""
    return f"pretrain/stage-{stage}"


def start_folder(stage: str) -> str | None:
    """The step folder a stage starts from by default: the stage before it (stage 1: stage 0, the weights
    ``import-model`` converts)."""
    return stage_folder(PREVIOUS[stage]) if stage in PREVIOUS else None


@dataclass
class Parallelism:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = True
    seq_len: int | None = None
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
    if par.cp > 1 and par.seq_len is not None and par.seq_len % (2 * par.cp):
        errs.append(f"cp={par.cp} requires seq_len={par.seq_len} divisible by 2·cp (load-balanced THD split)")
    if par.world_size % (par.tp * par.pp * par.cp):
        errs.append(f"world_size={par.world_size} must be a multiple of tp·pp·cp={par.tp * par.pp * par.cp}")
    if par.sequence_parallel and par.seq_len is not None and par.seq_len % par.tp:
        errs.append(f"sequence_parallel=True requires seq_len={par.seq_len} divisible by tp={par.tp}")
    if errs:
        raise ValueError("; ".join(errs))


def pipeline_sizes(num_layers: int, pp: int) -> list[int]:
    """LLM layers per pipeline stage in the shape megatron accepts (equal middle stages; first and
    last set by ``num_layers_in_first/last_pipeline_stage``). The slowest stage sets the pace, so
    the largest stage is kept as small as possible; among those splits the first stage (which also
    runs RICE-ViT and the projector) and the last (output layer and loss over the whole vocabulary)
    take the fewer layers."""
    if pp == 1:
        return [num_layers]
    best = None
    for m in {num_layers // pp, -(-num_layers // pp)}:
        rest = num_layers - m * (pp - 2)
        if rest < 2:
            continue
        sizes = [rest // 2] + [m] * (pp - 2) + [rest - rest // 2]
        key = (max(sizes), sizes[0])
        if best is None or key < best[0]:
            best = (key, sizes)
    return best[1]


def pipeline_overrides(num_layers: int, pp: int) -> dict:
    """``TransformerConfig`` fields for an uneven split (none when ``pp`` divides the layers)."""
    if pp == 1 or num_layers % pp == 0:
        return {}
    sizes = pipeline_sizes(num_layers, pp)
    return {"num_layers_in_first_pipeline_stage": sizes[0], "num_layers_in_last_pipeline_stage": sizes[-1]}


def pipeline_layers(num_layers: int, pp: int) -> list[list[int]]:
    """Global LLM layer indices per pipeline stage (``pipeline_sizes``)."""
    sizes = pipeline_sizes(num_layers, pp)
    out, start = [], 0
    for s in sizes:
        out.append(list(range(start, start + s)))
        start += s
    return out
