"""``embed-concepts``: the concept vocabulary through the same model's text tower.

Each concept is embedded CLIP-zero-shot style: every prompt template (``"a photo of a {}."``, …)
is filled in, the L2-normalised text embeddings are averaged, and the mean is normalised again:

    t_c = normalize( (1/|T|) Σ_{τ∈T} normalize(f_text(τ(c))) )

The vocabulary (≈500K rows in the recipe) is a text file (one concept per line; line number =
``concept_id``) or a Parquet file with a ``text`` (or ``concept``) column and optionally
``concept_id``. Ranks take contiguous slices; output: fp16 ``.npy`` shards + ``concepts`` manifest.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ovpipe.config import check_local_path, check_range
from ovpipe.step import Step, TaskContext, slice_bounds

DEFAULT_TEMPLATES = ["a photo of a {}.", "a picture of a {}.", "an image showing a {}.", "{}"]


@dataclass
class EmbedConceptsConfig:
    vocabulary: str = ""                      # concepts.txt or .parquet
    model: str = "ViT-H-14-quickgelu"        # the open_clip architecture (the embed step's)
    pretrained: str = "metaclip_fullcc"      # an open_clip tag or a checkpoint path
    templates: list[str] = field(default_factory=lambda: list(DEFAULT_TEMPLATES))  # prompts, one '{}' each; averaged
    batch_size: int = 1024                   # concept texts encoded per forward pass
    device: str = "auto"                     # auto: cuda when present, else cpu

    def __post_init__(self):
        if not self.vocabulary:
            raise ValueError("vocabulary: path of the concept list (.txt, one per line, or .parquet)")
        bad = [t for t in self.templates if t.count("{}") != 1]
        if not self.templates or bad:
            raise ValueError(f"templates: each needs exactly one '{{}}' placeholder, bad: {bad}")
        check_range(self, "batch_size", 1)

    def check(self, run_dir) -> None:
        from curation.clip import check_clip

        check_local_path("vocabulary", self.vocabulary)
        check_clip(self.model, self.pretrained, run_dir)


def read_vocabulary(path: str) -> tuple[np.ndarray, list[str]]:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        t = pq.read_table(path)
        col = "text" if "text" in t.column_names else "concept"
        texts = t.column(col).to_pylist()
        ids = np.asarray(t.column("concept_id").to_pylist() if "concept_id" in t.column_names
                         else range(len(texts)), dtype=np.int64)
    else:
        with open(path, encoding="utf-8") as f:
            texts = [line.rstrip("\n") for line in f]
        while texts and not texts[-1]:
            texts.pop()
        ids = np.arange(len(texts), dtype=np.int64)
    return ids, texts


def embed_texts(texts: list[str], templates: list[str], net, tokenizer, device: str, batch_size: int) -> np.ndarray:
    import torch

    from curation.clip import autocast

    acc = None
    with torch.inference_mode():
        for tpl in templates:
            chunks = []
            for i in range(0, len(texts), batch_size):
                tokens = tokenizer([tpl.format(t) for t in texts[i:i + batch_size]]).to(device)
                with autocast(device):
                    e = net.encode_text(tokens)
                chunks.append(torch.nn.functional.normalize(e.float(), dim=-1).cpu())
            e = torch.cat(chunks) if chunks else torch.zeros(0, 1)
            acc = e if acc is None else acc + e
        return torch.nn.functional.normalize(acc / len(templates), dim=-1).numpy()


def run(cfg: EmbedConceptsConfig, task: TaskContext) -> None:
    from curation.clip import load_clip

    ids, texts = read_vocabulary(cfg.vocabulary)
    lo, hi = slice_bounds(len(texts), task.rank, task.world_size)
    net, _, tokenizer, device = load_clip(cfg.model, cfg.pretrained, cfg.device)
    mine = [t.strip() for t in texts[lo:hi]]
    empty = [i for i, t in enumerate(mine) if not t]
    with task.stats.timer("embed"):
        emb = embed_texts(mine, cfg.templates, net, tokenizer, device, cfg.batch_size)
    rel = task.write_npy(f"concepts-{task.rank:05d}.npy", emb.astype(np.float16))
    task.stats.inc("concepts", hi - lo)
    task.stats.inc("empty_concepts", len(empty))
    task.write_part("concepts", {"concept_id": ids[lo:hi].astype(np.int32), "text": texts[lo:hi],
                                 "file": [rel] * (hi - lo), "row": np.arange(hi - lo, dtype=np.int32)})


STEP = Step("embed-concepts", EmbedConceptsConfig, run, outputs=("concepts",), check=EmbedConceptsConfig.check,
            description="concept vocabulary through the text tower, prompt-template ensemble")
