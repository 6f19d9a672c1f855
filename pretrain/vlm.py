"""The multimodal model: RICE-ViT → projector → image embeddings replace the ``<|image_pad|>``
positions of the LLM's text embeddings → megatron ``GPTModel`` (via ``decoder_input``)."""
from __future__ import annotations

import torch
from torch import nn

from pretrain.model import build_llm, packed_seq_params
from pretrain.recipes import Recipe
from pretrain.vision import Projector, RiceViT


class VLM(nn.Module):
    def __init__(self, recipe: Recipe, image_pad_id: int, tp: int = 1, backend: str = "auto"):
        super().__init__()
        self.vision = RiceViT(recipe.vit)
        self.projector = Projector(recipe.vit.hidden_size, recipe.llm.hidden_size)
        self.llm = build_llm(recipe.llm, tp=tp, backend=backend)
        self.image_pad_id = image_pad_id

    def set_trainable(self, which: str) -> None:
        for name, p in self.named_parameters():
            p.requires_grad = which == "all" or name.startswith("projector.")

    def embed(self, tokens, position_ids, images: list[torch.Tensor]):
        emb = self.llm.embedding(input_ids=tokens, position_ids=position_ids)     # [T, 1, H]
        if images:
            outs, _ = self.vision(images)
            img = torch.cat([self.projector(o[1:]) for o in outs])               # drop each class token
            where = (tokens[0] == self.image_pad_id).nonzero().squeeze(-1)
            if len(where) != img.shape[0]:
                raise ValueError(f"{len(where)} <|image_pad|> tokens but {img.shape[0]} image embeddings — "
                                 f"packing and the vision tower disagree on the image grid")
            emb = emb.clone()
            emb[where, 0] = img.to(emb.dtype)
        return emb

    def forward(self, batch, labels=None):
        emb = self.embed(batch.tokens, batch.position_ids, batch.images)
        return self.llm(None, batch.position_ids, attention_mask=None, decoder_input=emb,
                        labels=batch.labels if labels is None else labels,
                        packed_seq_params=packed_seq_params(batch.cu_seqlens, batch.max_seqlen))
