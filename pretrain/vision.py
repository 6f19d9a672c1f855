"""RICE-ViT vision tower (native resolution) and the 2×2-merge projector.

RICE-ViT is what ``transformers.MLCDVisionModel`` holds: patch 14 convolution (no bias), a learned
class token with its own rotary angles (``class_pos_emb``), pre-LayerNorm, CLIP-style pre-LN
encoder layers (LayerNorm → MHA with 2D RoPE → LayerNorm → GELU MLP), and 2D axial RoPE: of each
head's rotary frequencies half follow the patch row, half the column. Parameter names here match
``MLCDVisionModel``'s state dict, so its checkpoints load as they are (``load_mlcd``).

Native resolution, packed: every image keeps its own grid (its size from ``packing.tokens``);
its patches are re-ordered into 2×2 merge windows — (h//2, w//2, h%2, w%2) — so the projector's
2×2 merge is a reshape, and all images of a micro-batch run as one THD sequence whose attention
is confined to each image (block-diagonal, ``cu_seqlens`` per image, class token included).

Projector (``Projector``): LayerNorm → 2×2 neighbour merge (4 consecutive tokens → one 4D vector)
→ Linear → GELU → Linear into the LLM hidden size. Plain torch modules: the tower is ~0.3B of a
4–8B model and runs data-parallel; the LLM is the tensor-parallel part.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
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

    def forward(self, x, cos, sin, mask):
        t = x.shape[0]
        q, k, v = (p(x).view(t, self.heads, self.hd) for p in (self.q_proj, self.k_proj, self.v_proj))
        c, s_ = cos[:, None, :], sin[:, None, :]
        q = q * c + rotate_half(q) * s_
        k = k * c + rotate_half(k) * s_
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
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

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.layer_norm1(x), cos, sin, mask)
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
        self.post_layernorm = nn.LayerNorm(s.hidden_size, eps=s.layer_norm_eps)
        self.class_pos_emb = nn.Parameter(torch.randn(1, hd // 2) * 0.02)
        spatial = hd // 2
        self.register_buffer("inv_freq", 1.0 / (s.rope_theta ** (torch.arange(0, spatial, 2).float() / spatial)),
                             persistent=False)

    def _angles(self, gh: int, gw: int, order: torch.Tensor) -> torch.Tensor:
        h = torch.arange(gh).repeat_interleave(gw)[order].float()
        w = torch.arange(gw).repeat(gh)[order].float()
        fh, fw = h[:, None] * self.inv_freq, w[:, None] * self.inv_freq
        hw = torch.cat([fh, fw], dim=-1)
        patch = torch.cat([hw, hw], dim=-1)
        cls = torch.cat([self.class_pos_emb, self.class_pos_emb], dim=-1)
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
        seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        mask = seg[:, None] == seg[None, :]                 # attention confined to each image
        for layer in self.encoder.layers:
            x = layer(x, cos, sin, mask)
        return [x[cu[i]:cu[i + 1]] for i in range(len(lens))], cu


class Projector(nn.Module):
    def __init__(self, vit_hidden: int, llm_hidden: int, merge: int = 2):
        super().__init__()
        self.merge = merge
        self.ln_q = nn.LayerNorm(vit_hidden, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(vit_hidden * merge * merge, llm_hidden), nn.GELU(),
                                 nn.Linear(llm_hidden, llm_hidden))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [n, D] in merge-window order → [n / merge², llm_hidden]."""
        x = self.ln_q(patches)
        return self.mlp(x.reshape(-1, x.shape[-1] * self.merge * self.merge))


def load_mlcd(path: str) -> RiceViT:
    """A saved ``transformers.MLCDVisionModel`` → our tower, weights as they are."""
    from transformers import MLCDVisionConfig, MLCDVisionModel

    cfg = MLCDVisionConfig.from_pretrained(path)
    s = ViTSize(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size,
                cfg.patch_size, float(cfg.rope_parameters["rope_theta"]), cfg.layer_norm_eps)
    ours = RiceViT(s)
    hf = MLCDVisionModel.from_pretrained(path).state_dict()
    hf = {k.removeprefix("vision_model."): v for k, v in hf.items()}
    missing, unexpected = ours.load_state_dict(hf, strict=False)
    unexpected = [k for k in unexpected if "position_ids" not in k and "inv_freq" not in k and "position_embedding" not in k]
    if missing or unexpected:
        raise KeyError(f"MLCD weights do not map: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return ours
