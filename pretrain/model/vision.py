"""RICE-ViT vision tower (native resolution) and the 2×2-merge projector, as the released
LLaVA-OneVision-1.5 model (``LLaVAOneVision1_5_ForConditionalGeneration``'s ``visual``) runs them.

RICE-ViT: patch 14 convolution (no bias), a learned class token per image with its own rotary
angles (``class_pos_emb``), pre-LayerNorm, CLIP-style pre-LN encoder layers (LayerNorm → MHA with
2D RoPE → LayerNorm → GELU MLP), and 2D axial RoPE: of each head's rotary frequencies half follow
the patch row, half the column (``[h, w, h, w]`` over the head dimension). There is no final
LayerNorm: the published tower hands its last layer's patches straight to the merger (the
``post_layernorm`` of ``MLCDVisionModel`` is not part of the model, and is dropped on import).
Parameter names here match ``MLCDVisionModel``'s state dict, so its checkpoints load as they are
(``load_mlcd``); ``llava_ov.convert`` maps them to and from the published names (``visual.*``:
fused ``qkv``, ``norm1/2``, ``blocks``).

Native resolution, packed: every image keeps its own grid (its size from ``packing.tokens``);
its patches are re-ordered into 2×2 merge windows — (h//2, w//2, h%2, w%2) — so the projector's
2×2 merge is a reshape, and all images of a micro-batch run as one THD sequence whose attention
is confined to each image (block-diagonal, ``cu_seqlens`` per image, class token included). The
loader prepares that sequence on the CPU (``prepare_images`` → ``VisionInputs``); the tower then
runs it with one patch-embedding matmul and one varlen attention per layer (``forward_packed``).

Projector (``Projector``, the published ``visual.merger``): LayerNorm (the tower's ε, 1e-5) → 2×2
neighbour merge (4 consecutive tokens → one 4D vector) → Linear(4D → 4D) → GELU → Linear(4D → LLM
hidden). Plain torch modules: the tower is ~0.3B of a 4–8B model and runs data-parallel; the LLM is
the tensor-parallel part.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from pretrain.model import fused
from pretrain.model.attention import packed_attention


from pretrain.model.sizes import VIT_SIZES, ViTSize  # noqa: F401  (the tables live with no torch import)


def merge_window_order(gh: int, gw: int) -> torch.Tensor:
    """Row-major patch index → 2×2-window order: (h//2, w//2, h%2, w%2)."""
    h = torch.arange(gh).repeat_interleave(gw)
    w = torch.arange(gw).repeat(gh)
    key = ((h // 2) * (gw // 2) + (w // 2)) * 4 + (h % 2) * 2 + (w % 2)
    return torch.argsort(key)


class Attention(nn.Module):
    def __init__(self, s: ViTSize):
        super().__init__()
        self.heads, self.hd = s.num_heads, s.hidden_size // s.num_heads
        self.q_proj = nn.Linear(s.hidden_size, s.hidden_size)
        self.k_proj = nn.Linear(s.hidden_size, s.hidden_size)
        self.v_proj = nn.Linear(s.hidden_size, s.hidden_size)
        self.out_proj = nn.Linear(s.hidden_size, s.hidden_size)

    def forward(self, x, cos, sin, lens: list[int]):
        """``lens``: the per-image token counts (``Spans``: with their ``cu_seqlens`` on the device
        and the longest, so the attention needs no host sync). Attention is confined to each image:
        one varlen call over all images (``pretrain.model.attention.packed_attention``, non-causal)."""
        t = x.shape[0]
        q, k, v = (p(x).view(t, self.heads, self.hd) for p in (self.q_proj, self.k_proj, self.v_proj))
        c, s_ = cos[:, None, :], sin[:, None, :]          # rotary in fp32 (at least), as HF does
        q, k = fused.rotary_acc(q, c, s_), fused.rotary_acc(k, c, s_)
        if not isinstance(lens, Spans):
            lens = Spans(lens)
        cu = lens.cu_seqlens(x.device)
        out = packed_attention(q, k, v, cu, lens.max_len, causal=False, bounds=lens.bounds)
        return self.out_proj(out.reshape(t, -1))


class Spans(list):
    """The per-image token counts of a packed tower sequence (a list of ints), with their
    cumulative boundaries (``cu``, int32; moved to the device once per micro-batch) and the longest."""

    def __init__(self, lens, cu: torch.Tensor | None = None):
        super().__init__(int(n) for n in lens)
        if cu is None:
            cu = torch.zeros(len(self) + 1, dtype=torch.int32)
            cu[1:] = torch.tensor(list(self), dtype=torch.int32).cumsum(0)
        self.cu = cu
        self.max_len = max(self, default=0)
        self.bounds = [0] + torch.tensor(list(self)).cumsum(0).tolist() if self else [0]

    def cu_seqlens(self, device) -> torch.Tensor:
        if self.cu.device != torch.device(device):
            self.cu = self.cu.to(device, non_blocking=True)
        return self.cu


class MLP(nn.Module):
    def __init__(self, s: ViTSize):
        super().__init__()
        self.fc1 = nn.Linear(s.hidden_size, s.intermediate_size)
        self.fc2 = nn.Linear(s.intermediate_size, s.hidden_size)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Layer(nn.Module):
    def __init__(self, s: ViTSize):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(s.hidden_size, eps=s.layer_norm_eps)
        self.self_attn = Attention(s)
        self.layer_norm2 = nn.LayerNorm(s.hidden_size, eps=s.layer_norm_eps)
        self.mlp = MLP(s)

        self.recompute_mlp = False          # selective recompute: the MLP's activations rebuilt in backward

    def forward(self, x, cos, sin, lens: list[int]):
        x = x + self.self_attn(self.layer_norm1(x), cos, sin, lens)
        if self.recompute_mlp and self.training and torch.is_grad_enabled():
            return x + torch.utils.checkpoint.checkpoint(self._mlp, x, use_reentrant=False)
        return x + self._mlp(x)

    def _mlp(self, x):
        return self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, s: ViTSize):
        super().__init__()
        self.layers = nn.ModuleList(Layer(s) for _ in range(s.num_layers))


class Embeddings(nn.Module):
    def __init__(self, s: ViTSize):
        super().__init__()
        self.class_embedding = nn.Parameter(torch.randn(s.hidden_size) * 0.02)
        self.patch_embedding = nn.Conv2d(3, s.hidden_size, s.patch_size, s.patch_size, bias=False)


@dataclass
class VisionInputs:
    """All images of a micro-batch as the tower consumes them, built on the CPU (the loader's
    workers, ``prepare_images``) so the step itself has no per-image work:

    - ``patches`` [N, 3·p·p]: every image's patches flattened (the stride-p convolution is then one
      matmul), in 2×2 merge-window order, image after image;
    - ``gather`` [N + n]: tower position → row of ``cat(class tokens [n], patches [N])`` (each
      image is its class token, then its patches); ``patch_index`` [N]: the patches' tower positions;
    - ``cos`` / ``sin`` [N, head_dim] (fp32): the patches' 2D rotary tables (the class token's
      angle is a parameter, ``class_pos_emb``, added in the forward);
    - ``spans``: per-image token counts with their ``cu_seqlens`` and the longest (``Spans``);
    - ``token_index`` [N / 4]: the LLM positions of the ``<|image_pad|>`` tokens they replace
      (set by ``pretrain.data.collate``)."""

    patches: torch.Tensor
    gather: torch.Tensor
    patch_index: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    spans: Spans
    token_index: torch.Tensor | None = None

    @property
    def n_images(self) -> int:
        return len(self.spans)

    def _map(self, fn) -> "VisionInputs":
        spans = Spans(self.spans, fn(self.spans.cu))
        return VisionInputs(fn(self.patches), fn(self.gather), fn(self.patch_index), fn(self.cos), fn(self.sin),
                            spans, None if self.token_index is None else fn(self.token_index))

    def to(self, device) -> "VisionInputs":
        return self._map(lambda x: x.to(device, non_blocking=True))

    def pin_memory(self) -> "VisionInputs":
        return self._map(lambda x: x.pin_memory())


def patch_angles(s: ViTSize, gh: int, gw: int, order: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The 2D rotary angles [gh·gw, head_dim] of a grid's patches (in ``order``): half the head's
    frequencies follow the row, half the column, ``[h, w, h, w]``; fp32 (fp64 for an fp64 model)."""
    spatial = s.hidden_size // s.num_heads // 2
    inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, spatial, 2).to(dtype) / spatial))
    h = torch.arange(gh).repeat_interleave(gw)[order].to(dtype)
    w = torch.arange(gw).repeat(gh)[order].to(dtype)
    hw = torch.cat([h[:, None] * inv_freq, w[:, None] * inv_freq], dim=-1)
    return torch.cat([hw, hw], dim=-1)


def prepare_images(images: list[torch.Tensor], s: ViTSize, merge_order: bool = True,
                   dtype: torch.dtype | None = None, rotary_dtype: torch.dtype = torch.float32) -> VisionInputs:
    """[3, H, W] images (H, W multiples of the patch) → ``VisionInputs``, on the CPU. ``dtype``:
    the patches' (the training dtype: the convolution read them in it anyway)."""
    p = s.patch_size
    n = len(images)
    patches, angles, lens = [], [], []
    for img in images:
        gh, gw = img.shape[-2] // p, img.shape[-1] // p
        x = img.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3 * p * p)
        order = merge_window_order(gh, gw) if merge_order else torch.arange(gh * gw)
        patches.append(x[order])
        angles.append(patch_angles(s, gh, gw, order, rotary_dtype))
        lens.append(1 + gh * gw)
    lens_t = torch.tensor(lens, dtype=torch.long)
    starts = torch.cumsum(lens_t, 0) - lens_t                       # each image's class-token position
    total = int(lens_t.sum())
    is_cls = torch.zeros(total, dtype=torch.bool)
    is_cls[starts] = True
    patch_index = (~is_cls).nonzero().squeeze(-1)
    gather = torch.empty(total, dtype=torch.long)
    gather[starts] = torch.arange(n)
    gather[patch_index] = n + torch.arange(total - n)
    ang = torch.cat(angles) if angles else torch.zeros(0, s.hidden_size // s.num_heads, dtype=rotary_dtype)
    x = torch.cat(patches) if patches else torch.zeros(0, 3 * p * p)
    return VisionInputs(x if dtype is None else x.to(dtype), gather, patch_index, ang.cos(), ang.sin(), Spans(lens))


class RiceViT(nn.Module):
    def __init__(self, s: ViTSize):
        super().__init__()
        self.size = s
        hd = s.hidden_size // s.num_heads
        self.embeddings = Embeddings(s)
        self.pre_layrnorm = nn.LayerNorm(s.hidden_size, eps=s.layer_norm_eps)
        self.encoder = Encoder(s)
        self.recompute = False              # "full" (or True): every layer rebuilt in backward;
        self.class_pos_emb = nn.Parameter(torch.randn(1, hd // 2) * 0.02)   # "selective": each MLP
        spatial = hd // 2
        self.register_buffer("inv_freq", 1.0 / (s.rope_theta ** (torch.arange(0, spatial, 2).float() / spatial)),
                             persistent=False)

    def _acc(self):
        return torch.promote_types(self.class_pos_emb.dtype, torch.float32)

    def _angles(self, gh: int, gw: int, order: torch.Tensor) -> torch.Tensor:
        # in fp32 (fp64 for an fp64 model) whatever the training dtype: a bf16 model's buffers are
        # bf16, and bf16 frequencies × positions are off by tenths of a radian
        acc = self._acc()
        patch = patch_angles(self.size, gh, gw, order.cpu(), acc).to(self.class_pos_emb.device)
        cls = torch.cat([self.class_pos_emb, self.class_pos_emb], dim=-1).to(acc)
        return torch.cat([cls, patch], dim=0)

    def forward_packed(self, vi: VisionInputs) -> torch.Tensor:
        """All images of a micro-batch at once: [N_tower, D] hidden states (class token first in each
        image, patches in merge-window order). One patch-embedding matmul, one varlen attention per
        layer, no per-image loop and no host sync."""
        w = self.embeddings.patch_embedding.weight                       # [D, 3, p, p]
        x = vi.patches.to(w.dtype) @ w.reshape(w.shape[0], -1).t()       # the stride-p conv as a matmul
        n = vi.n_images
        cls = self.embeddings.class_embedding.to(x.dtype)[None].expand(n, -1)
        x = self.pre_layrnorm(torch.cat([cls, x])[vi.gather])
        acc = self._acc()
        cls_ang = torch.cat([self.class_pos_emb, self.class_pos_emb], dim=-1).to(acc)
        cos = torch.cat([cls_ang.cos().expand(n, -1), vi.cos.to(acc)])[vi.gather]
        sin = torch.cat([cls_ang.sin().expand(n, -1), vi.sin.to(acc)])[vi.gather]
        spans = vi.spans
        spans.cu_seqlens(x.device)
        mode = {True: "full", False: "none"}.get(self.recompute, self.recompute)
        ckpt = mode == "full" and self.training and torch.is_grad_enabled()
        for layer in self.encoder.layers:      # recompute: each layer's activations rebuilt in backward
            layer.recompute_mlp = mode == "selective"
            x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, spans, use_reentrant=False) if ckpt \
                else layer(x, cos, sin, spans)
        return x

    def forward(self, images: list[torch.Tensor], merge_order: bool = True) -> tuple[list[torch.Tensor], torch.Tensor]:
        """images: [3, H, W] each (H, W multiples of patch·2). Returns per-image hidden states
        [1 + gh·gw, D] (class token first, patches in merge-window order) and cu_seqlens. A
        convenience over ``forward_packed`` (the trainer hands prepared ``VisionInputs``)."""
        dev = self.class_pos_emb.device
        vi = prepare_images([x.detach().cpu() for x in images], self.size,
                            merge_order, rotary_dtype=self._acc()).to(dev)
        x = self.forward_packed(vi)
        cu = vi.spans.cu.long().cpu()
        b = vi.spans.bounds
        return [x[b[i]:b[i + 1]] for i in range(len(b) - 1)], cu


class Projector(nn.Module):
    def __init__(self, vit_hidden: int, llm_hidden: int, merge: int = 2, eps: float = 1e-5):
        super().__init__()
        self.merge = merge
        merged = vit_hidden * merge * merge
        self.ln_q = nn.LayerNorm(vit_hidden, eps=eps)
        self.mlp = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, llm_hidden))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [n, D] in merge-window order → [n / merge², llm_hidden]."""
        x = self.ln_q(patches)
        return self.mlp(x.reshape(-1, x.shape[-1] * self.merge * self.merge))


def load_mlcd(path: str) -> RiceViT:
    """A saved ``transformers.MLCDVisionModel`` → our tower, weights as they are (its
    ``post_layernorm``, which the published model does not run, is left out)."""
    from transformers import MLCDVisionConfig, MLCDVisionModel

    cfg = MLCDVisionConfig.from_pretrained(path)
    s = ViTSize(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size,
                cfg.patch_size, float(cfg.rope_parameters["rope_theta"]), cfg.layer_norm_eps)
    ours = RiceViT(s)
    hf = MLCDVisionModel.from_pretrained(path).state_dict()
    hf = {k.removeprefix("vision_model."): v for k, v in hf.items()}
    missing, unexpected = ours.load_state_dict(hf, strict=False)
    unexpected = [k for k in unexpected if not any(x in k for x in ("position_ids", "inv_freq", "position_embedding",
                                                                     "post_layernorm"))]
    if missing or unexpected:
        raise KeyError(f"MLCD weights do not map: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return ours
