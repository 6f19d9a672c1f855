"""Loading a MetaCLIP (or any open_clip) model the way open_clip users do.

``load_clip(name, pretrained)`` calls ``open_clip.create_model_and_transforms(name,
pretrained=...)``: ``pretrained`` is an open_clip tag (``metaclip_fullcc`` for the default
``ViT-H-14-quickgelu``; MetaCLIP 2.5B tags load from the Hugging Face hub cache on a cluster)
or a local checkpoint path. Model configs shipped here (``curation/model_configs/*.json``,
e.g. the demo's ``ovpipe-tiny-clip``) are registered with ``open_clip.add_model_config`` first,
so a tiny checkpoint goes through exactly the code path MetaCLIP does.

Precision: bf16 autocast on GPU (fp16 where bf16 is unsupported), fp32 on CPU.

``encode_text_trimmed(net, tokens)`` is ``net.encode_text(tokens)`` run on the tokens up to the last one the
tower pools: a CLIP text tower is causal and pools at the end-of-text token, so the padding after it cannot
change the pooled vector. A short query ("handwritten receipt": 6 of 77 tokens) costs a twelfth of the work;
the vector agrees with the padded one to float rounding (cosine 1 − 1e-6, ``tests/curation/test_clip_assign.py``).
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


def model_names() -> list[str]:
    """Every open_clip architecture name (its ``model_configs/*.json``) and ours, read without importing
    open_clip (which imports torch): what ``open_clip.list_models()`` lists after ``register_configs``."""
    import importlib.util

    spec = importlib.util.find_spec("open_clip")
    dirs = [Path(p) / "model_configs" for p in (spec.submodule_search_locations or [])] if spec else []
    return sorted({f.stem for d in [*dirs, CONFIG_DIR] if d.is_dir() for f in d.glob("*.json")})


WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt")


def check_clip(model: str, pretrained: str | None, run_dir: Path | None = None, prefix: str = "") -> None:
    """Before any task (and before a Slurm job is queued): ``model`` is an open_clip architecture (a short
    "did you mean", not open_clip's list of every name) and a ``pretrained`` given as a path exists —
    unless it lies in a step folder of this run that is prepared but not done yet (the checkpoint a
    queued ``demo-clip`` writes). A tag (``metaclip_fullcc``) is open_clip's to check as it loads."""
    import os

    from ovpipe.config import did_you_mean

    if not model.startswith(("hf-hub:", "local-dir:")):
        names = model_names()
        if names and model not in names:
            raise ValueError(f"{prefix}model: {model!r} is not an open_clip model{did_you_mean(model, names)} "
                             f"({len(names)} known: python -c 'import open_clip; print(open_clip.list_models())')")
    if not pretrained or pretrained.startswith("hf-hub:"):
        return
    looks_like_path = ("/" in pretrained or os.sep in pretrained or pretrained.startswith(("~", "."))
                       or pretrained.endswith(WEIGHT_SUFFIXES))
    path = Path(pretrained).expanduser()
    if not looks_like_path or path.exists():
        return
    if run_dir is not None:
        try:
            step_dir = Path(run_dir).resolve() / path.resolve().relative_to(Path(run_dir).resolve()).parts[0]
        except (ValueError, IndexError):
            step_dir = None
        if step_dir is not None and (step_dir / "executor.json").exists():
            return     # written by a step of this run that is prepared (queued on Slurm, or to be rerun)
    raise ValueError(f"{prefix}pretrained: {pretrained!r} does not exist (give an open_clip tag such as "
                     f"{DEFAULT_PRETRAINED!r} or a checkpoint file)")


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


def load_clip(model: str = DEFAULT_MODEL, pretrained: str | None = DEFAULT_PRETRAINED, device: str = "auto",
              precision: str = "fp32"):
    """(model in eval mode, image preprocess, tokenizer, device); ``precision`` as open_clip takes it."""
    import open_clip

    register_configs()
    device = pick_device(device)
    net, _, preprocess = open_clip.create_model_and_transforms(model, pretrained=pretrained or None, device=device,
                                                               precision=precision)
    net.eval()
    tokenizer = open_clip.get_tokenizer(model)
    return net, preprocess, tokenizer, device


def query_precision() -> str:
    """open_clip's ``bf16`` (weights bf16, layer norms fp32) where this CPU's oneDNN multiplies bf16 (AVX-512,
    AMX), else ``fp32``."""
    import torch

    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return "bf16" if bf16 is not None and bf16() else "fp32"


def load_text_tower(model: str, pretrained: str | None, precision: str | None = None):
    """(the CLIP model without its image tower, its tokenizer) on the CPU, for one query at a time through
    ``embed_query``; ``precision`` defaults to ``query_precision()``. A one-token-at-a-time tower reads every
    weight once a query, so bf16 halves the bytes read: the recipe's ViT-H-14 tower answers in ≈ 0.1 s instead of
    ≈ 0.45 s on the shared 2-core machine, at cosine 0.9999 to the fp32 vector (the embed step's GPU vectors are
    bf16 autocast too); ``bench/results/bench_index.txt``."""
    net, _, tokenizer, _ = load_clip(model, pretrained, "cpu", precision or query_precision())
    net.visual = None                  # a query never runs the image tower: ViT-H-14's is 2.5 GB of fp32
    return net, tokenizer


def embed_query(net, tokenizer, text: str):
    """One text's unit vector (fp32 numpy) through ``net``'s text tower, trimmed to its tokens."""
    import torch

    with torch.inference_mode():
        e = encode_text_trimmed(net, tokenizer([text]))
        return torch.nn.functional.normalize(e.float(), dim=-1)[0].numpy()


def _causal_text_tower(net):
    """(the module holding ``net``'s text tower, its pool type, its end-of-text id) when the tower is causal and
    pools at one token (``argmax``/``eos``) with nothing appended after the text; else None."""
    from open_clip.transformer import TextTransformer

    text = getattr(net, "text", None)
    if isinstance(text, TextTransformer):              # open_clip's CustomTextCLIP
        if text.cls_emb is not None or text.use_pad_mask:
            return None
        tower, pool, eos = text, text.pool_type, getattr(text, "eos_id", None)
    elif hasattr(net, "token_embedding") and hasattr(net, "text_pool_type"):     # open_clip's CLIP
        tower, pool, eos = net, net.text_pool_type, getattr(net, "text_eos_id", None)
    else:
        return None
    if getattr(tower, "attn_mask", None) is None or pool not in ("argmax", "eos"):
        return None
    return tower, pool, eos


def encode_text_trimmed(net, tokens):
    """``net.encode_text(tokens)``, the tokens cut after the last position any row pools at (open_clip's own
    embedding, transformer blocks, final norm, pooling and projection, on the shorter sequence with its causal
    mask and positions sliced to match); a tower that is not causal or pools elsewhere runs whole."""
    import torch
    from open_clip.transformer import text_global_pool

    found = _causal_text_tower(net)
    if found is None:
        return net.encode_text(tokens)
    tower, pool, eos = found
    at = tokens.argmax(dim=-1) if pool == "argmax" else (tokens == eos).int().argmax(dim=-1)
    n = int(at.max()) + 1
    tokens = tokens[:, :n]
    cast = tower.transformer.get_cast_dtype()
    x = tower.token_embedding(tokens).to(cast) + tower.positional_embedding[:n].to(cast)
    x = tower.ln_final(tower.transformer(x, attn_mask=tower.attn_mask[:n, :n]))
    x = text_global_pool(x, tokens, pool, eos_token_id=eos)
    proj = tower.text_projection
    if proj is None:
        return x
    return proj(x) if isinstance(proj, torch.nn.Linear) else x @ proj
