"""Loading a MetaCLIP (or any open_clip) model the way open_clip users do.

``load_clip(name, pretrained)`` calls ``open_clip.create_model_and_transforms(name,
pretrained=...)``: ``pretrained`` is an open_clip tag (``metaclip_fullcc`` for the default
``ViT-H-14-quickgelu``; MetaCLIP 2.5B tags load from the Hugging Face hub cache on a cluster)
or a local checkpoint path. Model configs shipped here (``curation/model_configs/*.json``,
e.g. the demo's ``ovpipe-tiny-clip``) are registered with ``open_clip.add_model_config`` first,
so a tiny checkpoint goes through exactly the code path MetaCLIP does.

Precision: bf16 autocast on GPU (fp16 where bf16 is unsupported), fp32 on CPU.
"""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

CONFIG_DIR = Path(__file__).with_name("model_configs")
DEFAULT_MODEL = "ViT-H-14-quickgelu"
DEFAULT_PRETRAINED = "metaclip_fullcc"


def register_configs() -> None:
    import open_clip

    if not getattr(register_configs, "_done", False):
        open_clip.add_model_config(CONFIG_DIR)
        register_configs._done = True


def pick_device(device: str = "auto") -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def autocast(device: str):
    import torch

    if device.startswith("cuda"):
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.autocast("cuda", dtype=dtype)
    return nullcontext()


def load_clip(model: str = DEFAULT_MODEL, pretrained: str | None = DEFAULT_PRETRAINED, device: str = "auto"):
    """(model in eval mode, image preprocess, tokenizer, device)."""
    import open_clip

    register_configs()
    device = pick_device(device)
    net, _, preprocess = open_clip.create_model_and_transforms(model, pretrained=pretrained or None, device=device)
    net.eval()
    tokenizer = open_clip.get_tokenizer(model)
    return net, preprocess, tokenizer, device
