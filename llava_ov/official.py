"""The official LLaVA-OneVision-1.5 modeling code, as the registry ships it — found, never copied.

``lmms-engine`` (installed ``--no-deps`` by ``make install``: it pins ``transformers<5.9`` and its
package ``__init__`` imports its whole training engine) carries the two files the released
checkpoints' ``auto_map`` points at::

    lmms_engine/models/llava_onevision1_5/configuration_llavaonevision1_5.py
    lmms_engine/models/llava_onevision1_5/modeling_llavaonevision1_5.py

``files()`` finds them in the installed wheel without importing ``lmms_engine`` (``find_spec`` of a
top-level package only locates it); ``load()`` imports just those two files as a small package of
their own (the modeling file imports its configuration relatively), so the rest of lmms-engine and
its dependencies are never needed. ``pretrain.export`` copies the same two files into an exported
folder, which is how ``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)`` (the
quick start, lmms-eval's ``llava_onevision1_5``) finds them there.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

CONFIG_FILE = "configuration_llavaonevision1_5.py"
MODELING_FILE = "modeling_llavaonevision1_5.py"
MODEL_CLASS = "LLaVAOneVision1_5_ForConditionalGeneration"
CONFIG_CLASS = "Llavaonevision1_5Config"
AUTO_MAP = {"AutoConfig": f"{CONFIG_FILE[:-3]}.{CONFIG_CLASS}",
            "AutoModel": f"{MODELING_FILE[:-3]}.{MODEL_CLASS}",
            "AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.{MODEL_CLASS}"}
_PACKAGE = "ovpipe_llava_onevision1_5_official"

# The transformers releases the official modeling file (lmms-engine 0.1.4) runs under; the same range
# as pyproject.toml's (a test holds the two equal). 5.24 removed ``transformers.modeling_attn_mask_utils``,
# which the modeling file imports at its top. docs/install.md says how to move the bound.
SUPPORTED_TRANSFORMERS = ">=4.45,<5.24"


class IncompatibleTransformers(ValueError):
    """The installed transformers is outside ``SUPPORTED_TRANSFORMERS``: one line, raised before any work."""


def installed_transformers() -> str | None:
    """The installed transformers version from its distribution metadata (no import: milliseconds)."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_transformers(what: str = "the official LLaVA-OneVision-1.5 modeling code") -> None:
    """Raise ``IncompatibleTransformers`` naming the installed version and the supported range unless
    the installed transformers can import ``what`` — called by everything that loads the remote code
    (export, import, the transformers / vLLM generation backends, ``load()``) before its first task."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    have = installed_transformers()
    if have is None:
        raise IncompatibleTransformers(f"transformers is not installed; {what} needs transformers"
                                       f"{SUPPORTED_TRANSFORMERS} (make install)")
    if Version(have) not in SpecifierSet(SUPPORTED_TRANSFORMERS):
        raise IncompatibleTransformers(
            f"transformers {have} is installed, but {what} supports transformers{SUPPORTED_TRANSFORMERS} "
            f"— reinstall from the lock (make install) or see docs/install.md")


def files() -> tuple[Path, Path] | None:
    """(configuration, modeling) file of the installed lmms-engine, or None when it is not installed."""
    spec = importlib.util.find_spec("lmms_engine")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0]) / "models" / "llava_onevision1_5"
    cfg, mod = root / CONFIG_FILE, root / MODELING_FILE
    return (cfg, mod) if cfg.exists() and mod.exists() else None


def load() -> ModuleType:
    """The official modeling module (``.LLaVAOneVision1_5_ForConditionalGeneration``,
    ``.Llavaonevision1_5Config`` via ``.configuration``); raises ``ImportError`` saying how to install."""
    if f"{_PACKAGE}.modeling" in sys.modules:
        return sys.modules[f"{_PACKAGE}.modeling"]
    check_transformers()
    found = files()
    if found is None:
        raise ImportError("the official LLaVA-OneVision-1.5 modeling code comes from lmms-engine: "
                          "pip install --no-deps lmms-engine==0.1.4 (make install does this)")
    cfg, mod = found
    pkg = ModuleType(_PACKAGE)
    pkg.__path__ = [str(cfg.parent)]
    sys.modules[_PACKAGE] = pkg
    out = {}
    for short, path in ((CONFIG_FILE[:-3], cfg), (MODELING_FILE[:-3], mod)):
        spec = importlib.util.spec_from_file_location(f"{_PACKAGE}.{short}", path)
        m = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = m
        spec.loader.exec_module(m)
        out[short] = m
    modeling = out[MODELING_FILE[:-3]]
    modeling.configuration = out[CONFIG_FILE[:-3]]
    sys.modules[f"{_PACKAGE}.modeling"] = modeling
    return modeling


def repair_buffers(model) -> int:
    """Recompute the RICE tower's rotary ``inv_freq`` after ``from_pretrained`` under transformers >= 5.

    transformers 5 builds a model on the meta device and re-creates non-persistent buffers through
    ``_init_weights``; the official ``_init_weights`` does not know ``RiceRotaryEmbedding`` (it has no
    ``original_inv_freq`` for the generic rule either), so its ``inv_freq`` is left as uninitialised
    memory and the vision RoPE is garbage. Each such module gets the buffer of a fresh instance of its
    own class (``RiceRotaryEmbedding(dim)``, the tower's default θ). Matched by class name, so the copy
    a ``trust_remote_code`` load imports from the model folder is repaired too. Returns how many."""
    n = 0
    for m in model.modules():
        if type(m).__name__ == "RiceRotaryEmbedding":
            fresh = type(m)(2 * m.inv_freq.numel())
            m.inv_freq = fresh.inv_freq.to(m.inv_freq.device)
            n += 1
    return n


def repair_tied_keys(model) -> int:
    """Give modules whose ``_tied_weights_keys`` is transformers 4's list (the official class's ``["lm_head.weight"]``)
    transformers 5's mapping ``{target: source}``, on the instance, so that ``save_pretrained`` (which calls
    ``.keys()`` on it) can save the model: a target tied to the input embeddings maps to their parameter's name, an
    untied one is left out. Returns how many modules were repaired."""
    n = 0
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    emb_names = [x for x in names.get(id(emb.weight), []) if not x.endswith("lm_head.weight")] if emb is not None else []
    for prefix, m in model.named_modules():
        keys = getattr(type(m), "_tied_weights_keys", None)
        if not isinstance(keys, (list, tuple)):
            continue
        mapping = {}
        for k in keys:
            full = f"{prefix}.{k}" if prefix else k
            target = dict(m.named_parameters()).get(k)
            if target is not None and emb is not None and target is emb.weight and emb_names:
                src = emb_names[0]
                mapping[k] = src[len(prefix) + 1:] if prefix and src.startswith(prefix + ".") else src
            del full
        m._tied_weights_keys = mapping
        n += 1
    return n


def from_pretrained(folder, **kwargs):
    """The official class loaded from a folder in the published layout, under this environment's
    transformers: its own ``_checkpoint_conversion_mapping`` passed as ``key_mapping`` (transformers
    >= 5.9 no longer applies it to remote code by itself) and ``repair_buffers``. ``kwargs`` go to
    ``from_pretrained`` (``dtype=``, ``output_loading_info=``)."""
    cls = load().LLaVAOneVision1_5_ForConditionalGeneration
    out = cls.from_pretrained(str(folder), key_mapping=cls._checkpoint_conversion_mapping, **kwargs)
    repair_buffers(out[0] if isinstance(out, tuple) else out)
    return out
