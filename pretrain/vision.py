"""RICE-ViT vision tower (native resolution) and the 2×2-merge projector, as the released
LLaVA-OneVision-1.5 model (``LLaVAOneVision1_5_ForConditionalGeneration``'s ``visual``) runs them.

RICE-ViT: patch 14 convolution (no bias), a learned class token per image with its own rotary
angles (``class_pos_emb``), pre-LayerNorm, CLIP-style pre-LN encoder layers (LayerNorm → MHA with
2D RoPE → LayerNorm → GELU MLP), and 2D axial RoPE: of each head's rotary frequencies half follow
the patch row, half the column (``[h, w, h, w]`` over the head dimension). There is no final
LayerNorm: the published tower hands its last layer's patches straight to the merger (the
``post_layernorm`` of ``MLCDVisionModel`` is not part of the model, and is dropped on import).
Parameter names here match ``MLCDVisionModel``'s state dict, so its checkpoints load as they are
(``load_mlcd``); ``pretrain.hf_llava_ov`` maps them to and from the published names (``visual.*``:
fused ``qkv``, ``norm1/2``, ``blocks``).

Native resolution, packed: every image keeps its own grid (its size from ``packing.tokens``);
its patches are re-ordered into 2×2 merge windows — (h//2, w//2, h%2, w%2) — so the projector's
2×2 merge is a reshape, and all images of a micro-batch run as one THD sequence whose attention
is confined to each image (block-diagonal, ``cu_seqlens`` per image, class token included).

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


@dataclass(frozen=True)
class ViTSize:
    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int = 14
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-5


VIT_SIZES = {
    "tiny": ViTSize(2, 32, 4, 64),
    "rice-vit-l-14": ViTSize(24, 1024, 16, 4096),
}


def merge_window_order(gh: int, gw: int) -> torch.Tensor:
    """Row-major patch index → 2×2-window order: (h//2, w//2, h%2, w%2)."""
    h = torch.arange(gh).repeat_interleave(gw)
    w = torch.arange(gw).repeat(gh)
    key = ((h // 2) * (gw // 2) + (w // 2)) * 4 + (h % 2) * 2 + (w % 2)
    return torch.argsort(key)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, s: ViTSize):
        super().__init__()
        self.heads, self.hd = s.num_heads, s.hidden_size // s.num_heads
        self.q_proj = nn.Linear(s.hidden_size, s.hidden_size)
        self.k_proj = nn.Linear(s.hidden_size, s.hidden_size)
        self.v_proj = nn.Linear(s.hidden_size, s.hidden_size)
        self.out_proj = nn.Linear(s.hidden_size, s.hidden_size)

    def forward(self, x, cos, sin, lens: list[int]):
        t = x.shape[0]
        q, k, v = (p(x).view(t, self.heads, self.hd) for p in (self.q_proj, self.k_proj, self.v_proj))
        c, s_ = cos[:, None, :], sin[:, None, :]
        acc = c.dtype                                       # rotary in fp32 (at least), as HF does
        q = (q.to(acc) * c + rotate_half(q.to(acc)) * s_).to(v.dtype)
        k = (k.to(acc) * c + rotate_half(k.to(acc)) * s_).to(v.dtype)
        # lens: the per-image token counts. Attention is confined to each image: one SDPA per image
        # (flash / memory-efficient kernels, memory linear in the pack), never a dense pack² mask
        q, k, v = (z.transpose(0, 1) for z in (q, k, v))
        out = torch.cat([F.scaled_dot_product_attention(qi[None], ki[None], vi[None])[0]
                         for qi, ki, vi in zip(q.split(lens, 1), k.split(lens, 1), v.split(lens, 1))], dim=1)
        return self.out_proj(out.transpose(0, 1).reshape(t, -1))


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

    def forward(self, x, cos, sin, lens: list[int]):
        x = x + self.self_attn(self.layer_norm1(x), cos, sin, lens)
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, s: ViTSize):
        super().__init__()
        self.layers = nn.ModuleList(Layer(s) for _ in range(s.num_layers))


class Embeddings(nn.Module):
    def __init__(self, s: ViTSize):
        super().__init__()
        self.class_embedding = nn.Parameter(torch.randn(s.hidden_size) * 0.02)
        self.patch_embedding = nn.Conv2d(3, s.hidden_size, s.patch_size, s.patch_size, bias=False)


class RiceViT(nn.Module):
    def __init__(self, s: ViTSize):
        super().__init__()
        self.size = s
        hd = s.hidden_size // s.num_heads
        self.embeddings = Embeddings(s)
        self.pre_layrnorm = nn.LayerNorm(s.hidden_size, eps=s.layer_norm_eps)
        self.encoder = Encoder(s)
        self.recompute = False              # the trainer sets it with recompute='full'
        self.class_pos_emb = nn.Parameter(torch.randn(1, hd // 2) * 0.02)
        spatial = hd // 2
        self.register_buffer("inv_freq", 1.0 / (s.rope_theta ** (torch.arange(0, spatial, 2).float() / spatial)),
                             persistent=False)

    def _angles(self, gh: int, gw: int, order: torch.Tensor) -> torch.Tensor:
        # in fp32 (fp64 for an fp64 model) whatever the training dtype: a bf16 model's buffers are
        # bf16, and bf16 frequencies × positions are off by tenths of a radian
        dev, acc = self.class_pos_emb.device, torch.promote_types(self.class_pos_emb.dtype, torch.float32)
        spatial = self.size.hidden_size // self.size.num_heads // 2
        inv_freq = 1.0 / (self.size.rope_theta ** (torch.arange(0, spatial, 2, device=dev).to(acc) / spatial))
        h = torch.arange(gh, device=dev).repeat_interleave(gw)[order.to(dev)].to(acc)
        w = torch.arange(gw, device=dev).repeat(gh)[order.to(dev)].to(acc)
        fh, fw = h[:, None] * inv_freq, w[:, None] * inv_freq
        hw = torch.cat([fh, fw], dim=-1)
        patch = torch.cat([hw, hw], dim=-1)
        cls = torch.cat([self.class_pos_emb, self.class_pos_emb], dim=-1).to(acc)
        return torch.cat([cls, patch], dim=0)

    def forward(self, images: list[torch.Tensor], merge_order: bool = True) -> tuple[list[torch.Tensor], torch.Tensor]:
        """images: [3, H, W] each (H, W multiples of patch·2). Returns per-image hidden states
        [1 + gh·gw, D] (class token first, patches in merge-window order) and cu_seqlens."""
        p = self.size.patch_size
        toks, angles, lens = [], [], []
        for img in images:
            gh, gw = img.shape[-2] // p, img.shape[-1] // p
            x = self.embeddings.patch_embedding(img[None].to(self.embeddings.patch_embedding.weight.dtype))
            x = x.flatten(2).transpose(1, 2)[0]
            order = merge_window_order(gh, gw) if merge_order else torch.arange(gh * gw)
            toks.append(torch.cat([self.embeddings.class_embedding[None], x[order]], dim=0))
            angles.append(self._angles(gh, gw, order))
            lens.append(1 + gh * gw)
        x = self.pre_layrnorm(torch.cat(toks))
        ang = torch.cat(angles)
        cos, sin = ang.cos(), ang.sin()
        cu = torch.zeros(len(lens) + 1, dtype=torch.long)
        cu[1:] = torch.tensor(lens).cumsum(0)
        ckpt = self.recompute and self.training and torch.is_grad_enabled()
        for layer in self.encoder.layers:      # recompute: each layer's activations rebuilt in backward
            x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, lens, use_reentrant=False) if ckpt \
                else layer(x, cos, sin, lens)
        return [x[cu[i]:cu[i + 1]] for i in range(len(lens))], cu


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
