"""What the plan's parts share: the card table (``GPUS``) and the parameters one rank holds (``rank_params``),
read by the time model (``pretrain.plan.model``) and the calibration (``pretrain.plan.calibration``) alike."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float          # what torch reports as total memory
    peak_tflops: float         # dense bf16
    nvlink_gbs: float          # per GPU and direction, within a node
    network_gbs: float         # per GPU and direction, across nodes (8 NICs a node)
    hbm_gbs: float             # memory bandwidth (the optimizer step is bound by it)
    pcie_gbs: float            # host ↔ GPU per GPU and direction, achieved (offload)
    host_gbs: float            # host memory bandwidth one GPU's process streams at (offload's CPU Adam)
    per_node: int = 8


# NVLink and HBM from the vendors' sheets; network: 8 × 400 Gb/s NDR (Hopper), 8 × 200 Gb/s HDR (A100/A800), the
# usual rail-optimised nodes; PCIe: ~80% of Gen5 (64 GB/s) and Gen4 (32 GB/s) x16; host: a 2-socket node's DRAM
# (DDR5 ≈ 2 × 460 GB/s, DDR4 ≈ 2 × 205 GB/s) over 8 processes at ~60% for a streaming optimizer. The last two
# are assumptions, never measured here.
GPUS = {
    "H100": Gpu("H100", 79.2, 989.0, 450.0, 50.0, 3350.0, 50.0, 69.0),
    "H200": Gpu("H200", 139.8, 989.0, 450.0, 50.0, 4800.0, 50.0, 69.0),
    "A100": Gpu("A100", 79.2, 312.0, 300.0, 25.0, 2039.0, 25.0, 30.0),
    "A800": Gpu("A800", 79.2, 312.0, 200.0, 25.0, 2039.0, 25.0, 30.0),   # NVLink cut to 400 GB/s both ways
}
PACK_FILL = 0.97           # tokens per pack / seq_len that ovpipe's packing reaches (docs/packing.md)
IMAGE_SHARE = 0.75         # share of a caption pack's tokens that are image tokens (--image-share)
PATCHES_PER_IMAGE = 1024   # tower tokens of one image (its attention is per image)
HOST_ADAM_BYTES = 56       # host bytes per parameter of torch's CPU AdamW (foreach): 28 B read/written + temporaries
OFFLOAD_COPY_BYTES = 4     # fp32 gradient down, fp32 parameter back, per offloaded parameter and direction


def parse_gpus(text: str) -> tuple[int, Gpu]:
    """``128xA800`` → (128, the A800)."""
    count, _, kind = text.lower().partition("x")
    gpu = GPUS.get(kind.upper())
    if not count.isdigit() or int(count) < 1 or gpu is None:
        raise ValueError(f"--gpus {text!r}: give COUNTxKIND with KIND one of {', '.join(GPUS)} (e.g. 128xA800)")
    return int(count), gpu


def rank_params(recipe, trainable: str, tp: int, pp: int, pp_rank: int = 0) -> dict:
    """Parameters (elements) one rank of pipeline stage ``pp_rank`` holds, by part, as the trainer builds them:
    the tower and projector whole on the first stage (on every TP and CP rank), the word embedding and the
    output layer split over TP (a tied output layer on the last stage when pp > 1), each LLM layer's
    matrices split over TP and its four RMSNorm weights whole. ``trained``: those in the DDP buffer (stage 1:
    the projector); ``sp_norms``: the trained norm weights whose gradients are summed over TP under SP."""
    from pretrain.recipes import pipeline_sizes

    llm, vit = recipe.llm, recipe.vit
    h, d, f, v = llm.hidden_size, llm.kv_channels, llm.ffn_hidden_size, llm.vocab_size
    q, kv = llm.num_attention_heads * d, llm.num_query_groups * d
    D, inter = vit.hidden_size, vit.intermediate_size
    first, last = pp_rank == 0, pp_rank == pp - 1
    layers = pipeline_sizes(llm.num_layers, pp)[pp_rank]
    norms = layers * (2 * h + 2 * d) + (h if last else 0)
    parts = {
        "vit": (vit.num_layers * (4 * (D * D + D) + 2 * D * inter + inter + D + 4 * D) + D
                + 3 * vit.patch_size ** 2 * D + 2 * D + D // vit.num_heads // 2) if first else 0,
        "projector": (2 * D + 16 * D * D + 4 * D + 4 * D * h + h) if first else 0,
        "embedding": v * h // tp if first else 0,
        "layers": layers * (h * (q + 2 * kv) + q * h + 3 * h * f) // tp + norms,
        "output": v * h // tp if last and (pp > 1 or not llm.tie_embeddings) else 0,
    }
    trained = parts["projector"] if trainable != "all" else sum(parts.values())
    return {**parts, "trained": trained, "sp_norms": norms if trainable == "all" else 0}
