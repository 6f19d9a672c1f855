"""The multimodal model: RICE-ViT → projector → image embeddings replace the ``<|image_pad|>``
positions of the LLM's text embeddings → megatron ``GPTModel`` (via ``decoder_input``).

A micro-batch may hold no image at all (text-only conversations): the tower and projector then
run on a dummy image whose contribution is ``0 ·`` (``VLM.embed``), so DDP's overlapped gradient
reduction sees every trainable parameter on every step.

One class for every layout. Under pipeline parallelism the first stage holds RICE-ViT, the
projector, the word embedding and its share of the LLM layers, the last stage the output layer
and the loss, the stages between layers only (``pre_process`` / ``post_process`` from megatron's
parallel state); parameter names do not depend on the layout, so a distributed checkpoint saved
at one TP/PP size loads at another. The attributes megatron's schedules and ``finalize_model_grads``
look for on the model (``config``, ``model_type``, ``set_input_tensor``, the shared-embedding
accessors for tied input/output weights across stages) are forwarded to the LLM.

Context parallelism: the first stage embeds the *whole* micro-batch (images are not split), then
keeps this CP rank's tokens (``batch.cp_index``; labels and loss mask arrive already split, see
``pretrain.model.parallel.shard_batch``). Sequence parallelism:
the GPT embedding does not scatter (``scatter_embedding_sequence_parallel=False``); the merged
text+image embedding is scattered over the TP ranks here, after the image tokens are in place.
"""
from __future__ import annotations

import torch
from torch import nn

from pretrain.model.llm import build_llm, packed_seq_params
from pretrain.model.vision import Projector, RiceViT, VisionInputs, prepare_images


class VLM(nn.Module):
    def __init__(self, recipe, image_pad_id: int, tp: int = 1, backend: str = "auto",
                 sequence_parallel: bool = False, **overrides):
        super().__init__()
        from megatron.core import parallel_state as ps

        pp_ready = ps.model_parallel_is_initialized()
        self.pre_process = ps.is_pipeline_first_stage() if pp_ready else True
        self.post_process = ps.is_pipeline_last_stage() if pp_ready else True
        if self.pre_process:
            self.vision = RiceViT(recipe.vit)
            self.projector = Projector(recipe.vit.hidden_size, recipe.llm.hidden_size, eps=recipe.vit.layer_norm_eps)
        self.llm = build_llm(recipe.llm, tp=tp, backend=backend, pre_process=self.pre_process,
                             post_process=self.post_process, sequence_parallel=sequence_parallel,
                             **overrides)
        self.image_pad_id = image_pad_id
        self.rope_theta = recipe.llm.rope_theta
        self.text_only_dummy = True       # run the dummy image on text-only micro-batches (see ``embed``)
        self.loss_kernel = "megatron"     # the output layer + loss (``pretrain.model.fused.output_processor``)
        self._loss_fn = None
        # read by megatron's schedules / DDP / finalize_model_grads
        self.config, self.model_type = self.llm.config, self.llm.model_type
        self.share_embeddings_and_output_weights = self.llm.share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self):
        return self.llm.shared_embedding_or_output_weight()

    def set_input_tensor(self, t) -> None:
        self.llm.set_input_tensor(t)

    def set_loss_kernel(self, kind: str) -> None:
        """``megatron`` | ``liger`` | ``torch``: how the last stage turns hidden states into per-token losses
        (``pretrain.model.fused``); checked by ``TrainConfig``."""
        from pretrain.model.fused import output_processor

        self.loss_kernel, self._loss_fn = kind, output_processor(kind)

    def set_trainable(self, which: str) -> None:
        """``all`` | ``projector``: which parameters train (the rest are frozen). Every parameter is
        in the forward pass (the published tower has no final LayerNorm; MLCD's is dropped on import),
        so DDP's overlapped gradient reduction sees each one's gradient on every step."""
        for name, p in self.named_parameters():
            p.requires_grad = which == "all" or name.startswith("projector.")

    def image_embeddings(self, images) -> torch.Tensor:
        """RICE-ViT → projector: [Σ (gh·gw)/4, llm_hidden] for the images in order: a list of
        [3, H, W] tensors, or ``VisionInputs`` (the loader's; then no per-image work here). The
        projector runs once over the patches of all images (class tokens dropped)."""
        if not isinstance(images, VisionInputs):
            dtype = next(self.vision.parameters()).dtype
            images = prepare_images([x.detach().cpu() for x in images], self.vision.size, dtype=dtype,
                                    rotary_dtype=self.vision._acc()).to(next(self.vision.parameters()).device)
        x = self.vision.forward_packed(images)
        return self.projector(x[images.patch_index])

    def _vision_needs_grad(self) -> bool:
        return torch.is_grad_enabled() and any(
            p.requires_grad for m in (self.vision, self.projector) for p in m.parameters())

    def text_only_zero(self, like: torch.Tensor) -> torch.Tensor:
        """``0 · Σ`` of the vision tower + projector run on one 2×2-merge dummy image (28×28 px, one
        LLM token): a scalar that is exactly 0 in value and puts every trainable vision/projector
        parameter in the backward graph with a zero gradient. See ``embed``."""
        w = self.vision.embeddings.patch_embedding.weight
        key = (w.device, w.dtype)
        if getattr(self, "_dummy", (None,))[0] != key:      # built once, kept on the device
            patch = self.vision.size.patch_size
            vi = prepare_images([torch.zeros(3, 2 * patch, 2 * patch)], self.vision.size, dtype=w.dtype,
                                rotary_dtype=self.vision._acc())
            self._dummy = (key, vi.to(w.device))
        return 0 * self.image_embeddings(self._dummy[1]).sum().to(like.dtype)

    def embed(self, tokens, position_ids, images, cp_index=None):
        """Text embeddings with the image embeddings in the ``<|image_pad|>`` positions.

        A micro-batch without any image (text-only samples) would leave the vision tower and the
        projector out of the backward pass. megatron's DDP with ``overlap_grad_reduce`` launches a
        bucket's reduction when every parameter in it has reported its gradient (the count of the
        first step is the reference), so those buckets would never be issued and
        ``finish_grad_sync`` asserts (on every DP rank that saw no image; with stage 1's frozen LLM
        the loss would not even have a graph). Instead the tower and projector run on one tiny
        dummy image and ``0 · Σ`` of the result is added to the embeddings: the values (and so the
        loss) are unchanged, every trainable parameter gets its (zero) gradient exactly once per
        backward — as on a step with images — and the buckets fire."""
        emb = self.llm.embedding(input_ids=tokens, position_ids=position_ids)     # [T, 1, H]
        has = images.n_images > 0 if isinstance(images, VisionInputs) else bool(images)
        if has:
            img = self.image_embeddings(images)
            where = getattr(images, "token_index", None)
            if where is None:               # no loader index (a list of images): find the pads, a host sync
                where = (tokens[0] == self.image_pad_id).nonzero().squeeze(-1)
                if len(where) != img.shape[0]:
                    raise ValueError(f"{len(where)} <|image_pad|> tokens but {img.shape[0]} image embeddings — "
                                     f"packing and the vision tower disagree on the image grid")
            emb = emb.index_put((where.to(emb.device),), img.to(emb.dtype)[:, None])
        elif self.text_only_dummy and self._vision_needs_grad():
            emb = emb + self.text_only_zero(emb)
        if cp_index is not None:
            emb = emb[cp_index]                                                  # this CP rank's tokens
        if self.config.sequence_parallel:
            from megatron.core import tensor_parallel

            emb = tensor_parallel.scatter_to_sequence_parallel_region(emb)
        return emb

    def forward(self, batch, labels=None):
        """``batch``: a ``pretrain.data.PackedBatch`` — with ``vision`` (``VisionInputs``) and
        ``rotary`` (the LLM's tables) when the loader prepared them, else built here."""
        cp_index = getattr(batch, "cp_index", None)
        vision = getattr(batch, "vision", None)
        images = vision if vision is not None else (batch.images or [])
        emb = self.embed(batch.tokens, batch.position_ids, images, cp_index) if self.pre_process else None
        rotary = getattr(batch, "rotary", None)
        if rotary is None and self.llm.position_embedding_type == "none":     # the local spec's rotary
            from pretrain.model.attention import rotary_tables

            pos = batch.position_ids[0] if cp_index is None else batch.position_ids[0, cp_index]
            rotary = rotary_tables(pos, self.config.kv_channels, self.rope_theta)
        labels = batch.labels if labels is None else labels
        extra = {"output_processor": self._loss_fn} if self._loss_fn is not None and labels is not None else {}
        return self.llm(None, batch.position_ids, attention_mask=None, decoder_input=emb, labels=labels,
                        packed_seq_params=packed_seq_params(batch.cu_seqlens, batch.max_seqlen, rotary), **extra)
