"""One VLM generation backend, shared by ``rollout`` (N responses per RL prompt) and ``recaption``
(bilingual captions of the balanced set) — so the two steps cannot drift apart.

A caller hands over ``Request``s — Hugging Face chat ``messages`` with content parts
(``{"type": "image"}`` in place, as ``manifests.conversation.to_messages`` makes them), the encoded
image bytes in placeholder order, how many samples and a per-request seed — and gets back, per
request, ``n`` ``Generation``s (text, generated tokens, finish reason ``stop`` | ``length``, or an
``error`` for that request alone: one unreadable image never fails the batch).

Backends:

* ``transformers`` (CPU or GPU): any Hugging Face VLM folder or hub id —
  ``AutoProcessor.from_pretrained`` + ``AutoModelForImageTextToText`` (falling back to
  ``AutoModelForCausalLM``, the class the published ``LLaVAOneVision1_5_ForConditionalGeneration``
  folder maps in its ``auto_map``), ``trust_remote_code=True``. The prompt is the processor's own
  chat template; the PIL images really go through the processor (pixel values, grids), never stay
  text placeholders. A folder with only a tokenizer (a text-only LM) serves text-only requests;
  a request with images then gets an error. A checkpoint that leaves parameters of the class
  unloaded is refused (``load_model``), never run on random weights. One ``generate`` per request, seeded with
  ``torch.manual_seed(request.seed)``: a request's output does not depend on what else the task
  does, so it is the same for any task count (a batched ``generate`` would mix padding and one RNG
  stream across requests). ``temperature: 0`` is greedy (``n`` copies of the one greedy answer).
* ``vllm`` (GPU): ``LLM(model, trust_remote_code=True)`` once, then every request in one
  ``llm.generate(inputs, [SamplingParams(n, seed=request.seed, …) per request])``, images as
  ``multi_modal_data`` — vLLM's own continuous batching; the per-request seed keeps a request's
  samples independent of the batch it ran in.

Rows produced elsewhere come in through the ``file`` backend (``CannedResponses``): the JSONL indexed
once for the rows a task needs — byte offsets, not rows — and read back a chunk at a time; each step
maps a canned row to its own. ``read_jsonl`` is the shared streaming reader (bad lines counted, never
raised). Chunked, resumable generation over any of these is ``inference.chunked``.
"""
from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Iterator, Literal

BACKENDS = ("vllm", "transformers", "file")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def check_backend_fields(cfg, file_is: str) -> None:
    """The config fields every step on this backend shares (``rollout``, ``recaption``): ``file``
    given for the file backend, ``model`` for the others, a known ``dtype`` — failing before any
    work, naming the field. ``file_is``: what the file holds, for the message."""
    if cfg.backend == "file" and not cfg.file:
        raise ValueError(f"file: the JSONL of {file_is} (backend=file)")
    if cfg.backend != "file" and not cfg.model:
        raise ValueError(f"model: a VLM folder or model id (backend={cfg.backend})")
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype: one of {', '.join(DTYPES)}, got {cfg.dtype!r}")


def check_backend_runtime(cfg) -> None:
    """Before any task (the steps' ``check``): the installed transformers can load the official
    remote code that exported LLaVA-OneVision-1.5 folders carry — one line naming the installed
    version and the supported range, not a ``ModuleNotFoundError`` in a task log."""
    if cfg.backend != "file":
        from llava_ov.official import check_transformers

        check_transformers(f"the {cfg.backend} backend (remote-code folders such as ovpipe's export)")


@dataclass
class Request:
    messages: list[dict]                 # HF chat messages, content parts; one {"type": "image"} per image
    images: list[bytes] = field(default_factory=list)
    n: int = 1
    seed: int = 0


@dataclass
class Generation:
    text: str
    tokens: int                          # generated tokens, end-of-sequence token included
    finish_reason: Literal["stop", "length", "error"] = "stop"
    error: str | None = None


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 512

    def as_dict(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "max_new_tokens": self.max_new_tokens}


def seed_for(seed: int, key: str) -> int:
    """A request's seed from the step seed and a stable key (a sample or prompt id, a language):
    the same request draws the same samples whatever rank, task count or batch it lands in."""
    import xxhash

    return (seed * 1_000_003 + xxhash.xxh3_64_intdigest(key.encode())) % (2 ** 31)


def decode_image(b: bytes):
    """Encoded bytes → RGB PIL image, EXIF orientation applied (as ingest measures it)."""
    from PIL import Image, ImageOps

    im = Image.open(io.BytesIO(b))
    return ImageOps.exif_transpose(im).convert("RGB")


def text_messages(messages: list[dict]) -> list[dict]:
    """Content parts → plain string content (for a tokenizer-only model's template)."""
    return [{"role": m["role"], "content": "".join(p.get("text", "") for p in m["content"])
             if isinstance(m["content"], list) else m["content"]} for m in messages]


def load_model(model: str, dtype, trust_remote_code: bool = True):
    """The model of an HF folder: ``AutoModelForImageTextToText``, else ``AutoModelForCausalLM`` (a
    text-only LM, or an ``auto_map`` naming only that class, as the published LLaVA-OneVision-1.5 does).

    Never generates from weights it did not load: when the checkpoint leaves parameters missing, the
    class's own ``_checkpoint_conversion_mapping`` is applied as ``key_mapping`` (transformers >= 5.9 no
    longer does this for remote code, so the published LLaVA-OneVision-1.5 layout would otherwise load
    its language model as random weights), and if parameters are still missing it raises, naming them.
    ``llava_ov.official.repair_buffers`` then recomputes the RICE tower's rotary buffers, which
    transformers 5 leaves uninitialised for that remote class (a no-op for any other model)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from llava_ov.official import repair_buffers

    errors = []
    for auto in (AutoModelForImageTextToText, AutoModelForCausalLM):
        kw = dict(dtype=dtype, trust_remote_code=trust_remote_code, output_loading_info=True)
        mapping = remote_key_mapping(model, auto.__name__, trust_remote_code)
        try:
            m, info = auto.from_pretrained(model, **kw, **({"key_mapping": mapping} if mapping else {}))
        except ValueError as e:                # this auto class does not map the config
            errors.append(f"{auto.__name__}: {e}")
            continue
        own = getattr(type(m), "_checkpoint_conversion_mapping", None)
        if info["missing_keys"] and own and not mapping:
            m, info = auto.from_pretrained(model, key_mapping=own, **kw)
        if info["missing_keys"]:
            miss = sorted(info["missing_keys"])
            raise ValueError(f"{model}: {len(miss)} parameter(s) of {type(m).__name__} are not in the checkpoint "
                             f"(e.g. {miss[:3]}); refusing to generate from randomly initialised weights")
        repair_buffers(m)
        return m
    raise ValueError(f"{model}: no image-text-to-text or causal-LM class loads it ({'; '.join(errors)})")


def remote_key_mapping(model: str, auto_name: str, trust_remote_code: bool) -> dict | None:
    """The ``_checkpoint_conversion_mapping`` of the remote-code class ``auto_map[auto_name]`` of a
    folder's config (None for a built-in class, which applies its own), found before loading so the
    weights are read once."""
    if not trust_remote_code:
        return None
    try:
        from transformers import AutoConfig
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        auto_map = getattr(AutoConfig.from_pretrained(model, trust_remote_code=True), "auto_map", None) or {}
        ref = auto_map.get(auto_name)
        if ref is None:
            return None
        return getattr(get_class_from_dynamic_module(ref, model), "_checkpoint_conversion_mapping", None)
    except (OSError, ValueError, ImportError, AttributeError):
        return None


class TransformersBackend:
    """Any HF VLM folder on CPU or GPU (see the module docstring)."""

    name = "transformers"

    def __init__(self, model: str, device: str = "auto", dtype: str = "auto", cpu_threads: int = 0,
                 trust_remote_code: bool = True):
        import torch
        from transformers import AutoProcessor
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()      # the task's own progress/log is enough
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        if self.device == "cpu" and cpu_threads > 0:
            torch.set_num_threads(cpu_threads)
        torch_dtype = (torch.bfloat16 if self.device.startswith("cuda") else torch.float32) if dtype == "auto" \
            else getattr(torch, dtype)
        self.processor = AutoProcessor.from_pretrained(model, trust_remote_code=trust_remote_code)
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.vision = getattr(self.processor, "image_processor", None) is not None
        self.model = load_model(model, torch_dtype, trust_remote_code).to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos:
            eos.append(self.tokenizer.eos_token_id)
        self.eos = set(eos)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else (eos or [0])[0]
        # Processor outputs the model's forward does not take (a newer processor's `mm_token_type_ids`
        # for an older remote-code class) are dropped, not passed to generate (which refuses them).
        import inspect

        params = inspect.signature(self.model.forward).parameters
        self.accepts = None if any(p.kind == p.VAR_KEYWORD for p in params.values()) else set(params)

    def prompt(self, req: Request) -> str:
        if self.vision:
            return self.processor.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.apply_chat_template(text_messages(req.messages), add_generation_prompt=True,
                                                  tokenize=False)

    def inputs(self, req: Request):
        text = self.prompt(req)
        if req.images:
            if not self.vision:
                raise ValueError("the model folder has no image processor (a text-only model) but the request "
                                 f"has {len(req.images)} image(s)")
            return self.processor(text=[text], images=[decode_image(b) for b in req.images], return_tensors="pt")
        if self.vision:
            return self.processor(text=[text], return_tensors="pt")
        return self.tokenizer([text], return_tensors="pt", add_special_tokens=False)

    def generate_one(self, req: Request, sp: Sampling) -> list[Generation]:
        import torch

        try:
            inputs = self.inputs(req).to(self.device)
        except Exception as e:                 # an unreadable image, a template error: this request only
            return [Generation("", 0, "error", f"{type(e).__name__}: {e}")] * req.n
        if self.accepts is not None:
            inputs = {k: v for k, v in inputs.items() if k in self.accepts}
        greedy = sp.temperature == 0
        torch.manual_seed(req.seed)
        kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=sp.temperature, top_p=sp.top_p)
        with torch.inference_mode():
            out = self.model.generate(**inputs, **kw, max_new_tokens=sp.max_new_tokens,
                                      num_return_sequences=1 if greedy else req.n, pad_token_id=self.pad_id)
        gens = []
        for seq in out[:, inputs["input_ids"].shape[1]:].tolist():
            stop = next((i for i, t in enumerate(seq) if t in self.eos), None)
            body = seq if stop is None else seq[:stop]
            gens.append(Generation(self.tokenizer.decode(body, skip_special_tokens=True),
                                   len(seq) if stop is None else stop + 1,
                                   "stop" if stop is not None or len(seq) < sp.max_new_tokens else "length"))
        return gens * req.n if greedy else gens

    def generate(self, requests: list[Request], sp: Sampling, progress: Callable[[int], None] | None = None
                 ) -> list[list[Generation]]:
        out = []
        for r in requests:
            out.append(self.generate_one(r, sp))
            if progress is not None:
                progress(1)
        return out


class VllmBackend:  # the engine itself needs a GPU; request building is tested against a stand-in
    """``vllm.LLM`` once per task; every request of a call in one ``llm.generate``."""

    name = "vllm"

    def __init__(self, model: str, seed: int = 0, max_images: int = 16, trust_remote_code: bool = True,
                 engine_args: dict | None = None):
        from transformers import AutoProcessor
        from vllm import LLM

        self.processor = AutoProcessor.from_pretrained(model, trust_remote_code=trust_remote_code)
        self.llm = LLM(model=model, seed=seed, limit_mm_per_prompt={"image": max_images},
                       trust_remote_code=trust_remote_code, **(engine_args or {}))

    def build(self, requests: list[Request], sp: Sampling) -> tuple[list[dict], list, list[str | None]]:
        """``(inputs, sampling params, errors)``: one vLLM input per request (prompt + PIL images as
        ``multi_modal_data``); a request whose images do not decode gets an error instead."""
        from vllm import SamplingParams

        inputs, params, errors = [], [], []
        for r in requests:
            try:
                images = [decode_image(b) for b in r.images]
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
                continue
            prompt = self.processor.apply_chat_template(r.messages, add_generation_prompt=True)
            inputs.append({"prompt": prompt, **({"multi_modal_data": {"image": images}} if images else {})})
            params.append(SamplingParams(n=r.n, temperature=sp.temperature, top_p=sp.top_p,
                                         max_tokens=sp.max_new_tokens, seed=r.seed))
            errors.append(None)
        return inputs, params, errors

    def generate(self, requests: list[Request], sp: Sampling, progress: Callable[[int], None] | None = None
                 ) -> list[list[Generation]]:
        inputs, params, errors = self.build(requests, sp)
        outs = iter(self.llm.generate(inputs, params) if inputs else [])
        result = []
        for r, err in zip(requests, errors):
            if err is not None:
                result.append([Generation("", 0, "error", err)] * r.n)
                continue
            o = next(outs)
            result.append([Generation(c.text, len(c.token_ids), "length" if c.finish_reason == "length" else "stop")
                           for c in o.outputs])
        if progress is not None:
            progress(len(requests))
        return result


def load_backend(backend: str, model: str, *, device: str = "auto", dtype: str = "auto", cpu_threads: int = 0,
                 seed: int = 0, max_images: int = 16, engine_args: dict | None = None):
    """The generation backend ``backend`` (``transformers`` | ``vllm``) over ``model``."""
    if backend == "transformers":
        return TransformersBackend(model, device=device, dtype=dtype, cpu_threads=cpu_threads)
    if backend == "vllm":
        return VllmBackend(model, seed=seed, max_images=max_images, engine_args=engine_args)
    raise ValueError(f"backend must be one of transformers, vllm (file is read by the step), got {backend!r}")


def load_for(cfg, stats=None, max_images: int = 16):
    """The generation backend of a step's config (the fields ``check_backend_fields`` checks, plus ``device``,
    ``cpu_threads``, ``seed`` and ``vllm_engine_args``), its loading timed as ``load_model`` and its device
    recorded in ``stats.info`` when ``stats`` is given."""
    import contextlib

    with stats.timer("load_model") if stats is not None else contextlib.nullcontext():
        backend = load_backend(cfg.backend, cfg.model, device=cfg.device, dtype=cfg.dtype, cpu_threads=cfg.cpu_threads,
                               seed=cfg.seed, max_images=max_images, engine_args=cfg.vllm_engine_args)
    if stats is not None:
        stats.info["device"] = getattr(backend, "device", "cuda")
    return backend


class CannedResponses:
    """The ``file`` backend of both steps: generations made elsewhere, one JSON object a line, each row
    keyed by the step (``key(row)``: the work item's key, or None for a row of no item of this task, counted
    ``other_key``; lines that are not objects count ``file/bad_json``). One streamed pass keeps the byte
    offsets of the wanted rows — every row of a key in file order, or with ``first_only`` its first — and
    ``get`` reads a key's rows back when its chunk is generated: a task holds offsets, not responses."""

    name = "file"

    def __init__(self, path: str, key: Callable[[dict], Hashable | None], stats=None, other_key: str = "file/other",
                 first_only: bool = False):
        self.at: dict = {}             # key -> offset, or a list of offsets (a key of several rows)
        for at, r in iter_jsonl_offsets(path, stats):
            k = key(r)
            if k is None:
                if stats is not None:
                    stats.inc(other_key)
                continue
            got = self.at.get(k)
            if got is None:
                self.at[k] = at
            elif first_only:
                continue
            elif isinstance(got, list):
                got.append(at)
            else:
                self.at[k] = [got, at]
        self.file = open(path, "rb")

    def get(self, k: Hashable) -> list[dict]:
        """The rows of key ``k`` in file order (none: ``[]``)."""
        at = self.at.get(k)
        if at is None:
            return []
        return [read_jsonl_at(self.file, a) for a in (at if isinstance(at, list) else [at])]

    def close(self) -> None:
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_jsonl(path: str, want: Callable[[dict], bool], stats=None, bad_key: str = "file/bad_json",
               other_key: str = "file/other") -> Iterable[dict]:
    """The JSON objects of a JSONL file for which ``want`` holds, streamed (memory stays flat).
    Blank lines are skipped; a line that is not a JSON object counts ``bad_key``, a row ``want``
    rejects counts ``other_key`` (rows of other ranks or other prompts)."""
    for _, r in iter_jsonl_offsets(path, stats, bad_key):
        if not want(r):
            if stats is not None:
                stats.inc(other_key)
            continue
        yield r


def iter_jsonl_offsets(path: str, stats=None, bad_key: str = "file/bad_json") -> Iterator[tuple[int, dict]]:
    """``(byte offset of the line, object)`` of each JSON object of a JSONL file, one at a time; lines are
    read by ``manifests.sources.iter_jsonl_lines``, as ingest reads JSONL, and a line that is not a JSON
    object counts ``bad_key``."""
    from manifests.sources import iter_jsonl_lines

    for at, r, _, _ in iter_jsonl_lines(path):
        if not isinstance(r, dict):
            if stats is not None:
                stats.inc(bad_key)
            continue
        yield at, r


def index_jsonl(path: str, key: Callable[[dict], Hashable | None], stats=None, bad_key: str = "file/bad_json",
                other_key: str = "file/other") -> dict:
    """``{key(r): byte offset of r's line}`` for the JSON objects of a JSONL file whose ``key`` is not None,
    the first line of each key kept — an index, so a task that needs many rows holds their offsets, not
    the rows (``read_jsonl_at`` reads one back). Lines are split and counted as ``read_jsonl`` does."""
    out: dict = {}
    for at, r in iter_jsonl_offsets(path, stats, bad_key):
        k = key(r)
        if k is None:
            if stats is not None:
                stats.inc(other_key)
            continue
        out.setdefault(k, at)
    return out


def read_jsonl_at(f, offset: int) -> dict:
    """The JSON object on the line at byte ``offset`` of the open binary file ``f`` (``index_jsonl``)."""
    import json

    f.seek(offset)
    return json.loads(f.readline())
