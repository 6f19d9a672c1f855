"""Image decode + preprocess for ``embed-images``, kept ahead of the model and off its thread's GIL.

A slice is cut into batches at global row numbers that are multiples of ``batch_size`` (so a batch
is the same set of rows whatever the task count, except the two that a slice boundary splits).
Each batch is prepared by one of:

* ``threads`` (the default on a CPU machine): a thread pool decodes the rows of up to ``prefetch``
  batches ahead of the model (PIL releases the GIL while it decodes; the model's forward has the
  cores anyway).
* ``processes`` (the default on a GPU): a ``torch.utils.data.DataLoader`` with ``workers`` processes.
  Each batch is cut into decode units of ``decode_unit`` rows (256 by default); worker ``w`` of
  ``W`` prepares the units ``u ≡ w (mod W)`` (numbered across batches), which the loader hands back
  round-robin, i.e. in order, and the main process reassembles each batch from its units (positions
  shifted, pixel stacks concatenated into pinned memory when the model is on a GPU): the same batch a
  single worker would have prepared. A batch is thus decoded by several workers at once, so the model
  waits one unit's decode for its first batch rather than a whole batch's, and a batch's latency no
  longer grows with ``batch_size``. At most ``workers × prefetch`` units are in flight. Each worker
  reads the slice's manifest rows itself (the metadata columns only, not images): cheap for ``samples``
  parts in canonical order (ingest's shuffle writes them so); parts that are not make each worker run
  ``iter_parts``' DuckDB sort.

Either way a bounded number of rows is in flight, never the slice. The preprocess is
open_clip's own transform, split before its ``ToTensor`` + ``Normalize`` tail: the workers produce
uint8 ``[3, H, W]`` (a quarter of the float32 bytes to move and pin) and the model's device runs the
tail (``x.float().div(255)``, then ``sub(mean).div(std)``, the same float ops torchvision runs, so the
CPU output is bit-identical to ``preprocess(image)``).

``jpeg_decode = "nvjpeg"`` leaves a JPEG's pixels to the GPU: the workers read the bytes (and the
header, to send CMYK or EXIF-rotated files to the CPU path), ``torchvision.io.decode_jpeg(...,
device="cuda")`` decodes the batch, and the resize (bicubic, antialiased, shortest side) and centre
crop run on the GPU. ``nvjpeg_share`` < 1 splits the JPEGs between nvJPEG and the CPU workers by a hash
of the ``sample_id`` (both then work; the split is the same whatever the task count). Other formats,
and a JPEG nvJPEG refuses, take the CPU path; a file neither decodes is a ``decode_error`` row either
way. The GPU resize is not PIL's, so the embeddings match the CPU path's within bf16 tolerance, not bit
for bit (``tests/curation/test_embed_decode.py``). ``jpeg_draft`` lets libjpeg decode a JPEG at the
smallest DCT scale (1/2, 1/4, 1/8) that still covers the crop, before the same resize: far less
decode and resize work on the CPU, and again within bf16 tolerance of the full decode, not bit for bit.
"""
from __future__ import annotations

import io
import itertools
import zlib
from collections import deque
from dataclasses import dataclass, replace
from functools import lru_cache, partial

import numpy as np

DECODE_MODES = ("auto", "threads", "processes")
JPEG_DECODERS = ("auto", "cpu", "nvjpeg")


CPU_THREADS = 8      # decode threads beside the model on a CPU (the path CPU runs have always measured)
MAX_WORKERS = 32     # decode processes at most by default: enough to feed one GPU (docs/curation.md); a
                     # task that sees a whole unbound 200-core node must not fork 200 (each holds its units)


def usable_cpus() -> list[int]:
    """The CPUs this process may run on: its affinity mask (a Slurm task's ``--cpus-per-task``), else all."""
    import os

    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class DecodeConfig:
    """The decoder's knobs, one value passed whole from the config (``embed-images``' fields of the same
    names) to ``make_decoder`` and ``decoded_batches``. Checked as it is made (a ``ValueError`` naming the
    field); ``resolve(device)`` is the one place where ``auto`` and None become the device's values."""
    decode: str = "auto"                # threads | processes; auto: processes on a GPU, threads on a CPU
    decode_workers: int | None = None   # None: processes on every CPU the task may use but one (at most
                                        # MAX_WORKERS), threads: CPU_THREADS
    prefetch: int = 2                   # decode units ahead, per worker process (batches, per pool, for threads)
    decode_unit: int = 256              # processes: rows a worker decodes at a time
    jpeg_decode: str = "auto"           # cpu | nvjpeg; auto: cpu
    nvjpeg_share: float = 1.0           # with nvjpeg: the share of JPEG rows it takes (the rest: CPU workers)
    jpeg_draft: bool | None = None      # libjpeg's reduced-scale decode; None: on with a GPU, off on a CPU
    fast_resize: bool | None = None     # torch's uint8 resize + crop; None: on with a GPU, off on a CPU

    def __post_init__(self):
        if self.decode_workers is not None and self.decode_workers < 1:
            raise ValueError(f"decode_workers must be >= 1 (or unset: the CPUs this task may use), "
                             f"got {self.decode_workers}")
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {self.prefetch}")
        if self.decode_unit < 1:
            raise ValueError(f"decode_unit must be >= 1, got {self.decode_unit}")
        if self.decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {DECODE_MODES}, got {self.decode!r}")
        if self.jpeg_decode not in JPEG_DECODERS:
            raise ValueError(f"jpeg_decode must be one of {JPEG_DECODERS}, got {self.jpeg_decode!r}")
        if not 0 <= self.nvjpeg_share <= 1:
            raise ValueError(f"nvjpeg_share must be in [0, 1], got {self.nvjpeg_share}")

    def resolve(self, device: str) -> "DecodeConfig":
        """This config with every ``auto`` / None made concrete for ``device`` (resolving a resolved one
        changes nothing):

        * ``decode``: processes on a GPU, threads on a CPU;
        * ``decode_workers``: for worker processes (the GPU path), every CPU this process may run on but
          one, which feeds the GPU (a Slurm task's ``--cpus-per-task``: its affinity mask), at most
          ``MAX_WORKERS``: they keep the GPU fed there (docs/curation.md); for threads, ``CPU_THREADS``;
        * ``jpeg_decode``: the CPU workers (with ``jpeg_draft`` they kept ViT-H-14 and ViT-L-14 fed on 16
          cores, and nvJPEG for half the JPEGs measured slower: docs/curation.md);
        * ``jpeg_draft``: libjpeg's draft decode on a GPU (the fastest measured path there), the full
          decode on a CPU;
        * ``fast_resize``: torch's uint8 resize on a GPU (where the decode workers bound the step), PIL's
          on a CPU (bit-identical to open_clip's transform)."""
        gpu = str(device).startswith("cuda")
        mode = ("processes" if gpu else "threads") if self.decode == "auto" else self.decode
        workers = self.decode_workers
        if workers is None:
            workers = max(1, min(len(usable_cpus()) - 1, MAX_WORKERS)) if mode == "processes" else CPU_THREADS
        return replace(self, decode=mode, decode_workers=workers,
                       jpeg_decode="cpu" if self.jpeg_decode == "auto" else self.jpeg_decode,
                       jpeg_draft=gpu if self.jpeg_draft is None else self.jpeg_draft,
                       fast_resize=gpu if self.fast_resize is None else self.fast_resize)


@dataclass(frozen=True)
class SplitPreprocess:
    """open_clip's eval transform cut before ``ToTensor``: ``to_uint8`` (PIL → uint8 CHW tensor) runs
    where the image is decoded, ``finish`` (uint8 batch → normalised float batch) on the model's device.
    ``resize``/``crop``/``interpolation``: the geometry, for the GPU (nvJPEG) path."""
    to_uint8: object
    mean: tuple | None
    std: tuple | None
    resize: int | None = None
    crop: tuple | None = None
    interpolation: object = None

    def finish(self, x):
        import torch

        if x.dtype != torch.uint8:          # a transform with no ToTensor + Normalize tail ran whole
            return x
        x = x.to(torch.float32).div(255)
        if self.mean is None:
            return x
        mean, std = _norm_tensors(self.mean, self.std, x.device)
        return x.sub_(mean).div_(std)


@lru_cache(maxsize=8)
def _norm_tensors(mean: tuple, std: tuple, device):
    """``Normalize``'s mean and std as [C, 1, 1] float32 tensors on ``device``, made once: building them per
    batch copies from pageable host memory, and such a copy to a GPU waits for the stream to drain, i.e.
    for the previous batch's forward, so the host could queue no batch ahead of the GPU."""
    import torch

    return (torch.as_tensor(mean, dtype=torch.float32, device=device).view(-1, 1, 1),
            torch.as_tensor(std, dtype=torch.float32, device=device).view(-1, 1, 1))


def split_preprocess(preprocess) -> SplitPreprocess:
    """Cut a torchvision ``Compose`` before its ``ToTensor`` (+ ``Normalize``); a transform of another
    shape runs whole where the image is decoded (float tensors then travel: 4× the bytes)."""
    from torchvision import transforms as T

    steps = list(getattr(preprocess, "transforms", []))
    at = next((i for i, s in enumerate(steps) if isinstance(s, T.ToTensor)), None)
    tail = steps[at + 1:] if at is not None else None
    if at is None or not (tail == [] or (len(tail) == 1 and isinstance(tail[0], T.Normalize))):
        return SplitPreprocess(to_uint8=preprocess, mean=None, std=None)
    head = steps[:at]
    norm = tail[0] if tail else None
    resize = next((s for s in head if isinstance(s, T.Resize)), None)
    crop = next((s for s in head if isinstance(s, T.CenterCrop)), None)
    size = resize.size if resize is not None else None
    if isinstance(size, (list, tuple)):
        size = size[0] if len(size) == 1 else None          # (h, w): a squash resize, not shortest-side
    return SplitPreprocess(
        to_uint8=uint8_head(head),
        mean=tuple(norm.mean) if norm is not None else None, std=tuple(norm.std) if norm is not None else None,
        resize=size if resize is not None and resize.max_size is None else None,
        crop=tuple(crop.size) if crop is not None else None,
        interpolation=resize.interpolation if resize is not None else None)


def _rgb_only(step) -> bool:
    """open_clip's mode steps (``MaybeConvertMode("RGB")``, older releases' ``_convert_to_rgb``)."""
    return (type(step).__name__ == "MaybeConvertMode" and getattr(step, "mode", None) == "RGB") or \
        getattr(step, "__name__", None) == "_convert_to_rgb"


def uint8_head(head: list):
    """The transform's head + ``PILToTensor``, for PIL images. open_clip's eval head (``Resize`` →
    ``CenterCrop`` → ``MaybeConvertMode``) runs as ``Resize`` → RGB where not already → ``PILToTensor`` →
    ``CenterCrop`` on the tensor: the same pixels (a mode change is per pixel, so it commutes with the
    crop; the crop offsets are torchvision's for both), without PIL's copy of the crop and of an RGB
    image's ``convert``; the crop is a view the unit's ``torch.stack`` copies once. Any other head
    runs as it is."""
    from torchvision import transforms as T

    from manifests.conversation import as_rgb

    crops = [i for i, s in enumerate(head) if isinstance(s, T.CenterCrop)]
    simple = all(isinstance(s, (T.Resize, T.CenterCrop)) or _rgb_only(s) for s in head)
    if not simple or len(crops) != 1 or any(isinstance(s, T.Resize) for s in head[crops[0]:]):
        return T.Compose(head + [T.PILToTensor()])
    rest = [as_rgb if _rgb_only(s) else s for i, s in enumerate(head) if i != crops[0]]
    return T.Compose(rest + [T.PILToTensor(), head[crops[0]]])


@dataclass(frozen=True)
class TensorHead:
    """open_clip's eval head (shortest-side ``Resize``, ``CenterCrop``) on the decoded pixels as a uint8
    tensor: torch's antialiased interpolation of uint8 images (``F.interpolate(..., antialias=True)``,
    a port of Pillow-SIMD's separable resampling) in place of PIL's. Within two uint8 levels of PIL's
    pixels (0.003-0.05 on average), the output size by torchvision's rule; the resize takes about a
    quarter of PIL's time on one core, the whole decode + head 0.64× (``bench/results/
    cpu.md``). ``fast_resize`` (the GPU default, beside ``jpeg_draft``): a GPU's decode
    workers are its bottleneck."""
    size: int
    crop: tuple
    mode: str

    def __call__(self, im):
        import torch
        import torch.nn.functional as F
        from torchvision.transforms import functional as TF

        from manifests.conversation import as_rgb

        x = torch.from_numpy(np.array(as_rgb(im))).permute(2, 0, 1)
        h, w = x.shape[1:]
        short, long = (h, w) if h <= w else (w, h)
        new_long = int(self.size * long / short)                       # torchvision's Resize([size])
        out = (self.size, new_long) if h <= w else (new_long, self.size)
        if out != (h, w):
            x = F.interpolate(x[None], size=out, mode=self.mode, antialias=True)[0]
        return TF.center_crop(x, list(self.crop))


def tensor_head(pre) -> "TensorHead | None":
    """The ``TensorHead`` of a split open_clip eval transform, or None where it has another shape or this
    torch cannot interpolate uint8 with antialiasing."""
    import torch
    import torch.nn.functional as F

    mode = getattr(pre.interpolation, "value", None)
    if pre.resize is None or pre.crop is None or mode not in ("bicubic", "bilinear"):
        return None
    try:
        F.interpolate(torch.zeros(1, 3, 8, 8, dtype=torch.uint8), size=(5, 5), mode=mode, antialias=True)
    except (RuntimeError, NotImplementedError):
        return None
    return TensorHead(pre.resize, tuple(pre.crop), mode)


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"[:300]


def decode_cpu(row: dict, to_uint8, draft: int | None = None):
    """(uint8 CHW tensor, None) or (None, error): PIL decode, upright, RGB, then the transform's head.
    ``draft``: a JPEG is decoded at the smallest DCT scale (1/2, 1/4, 1/8) that keeps both sides ≥ it."""
    from PIL import Image

    from curation.ingest import read_image_bytes
    from manifests.conversation import upright_rgb

    try:
        with Image.open(io.BytesIO(read_image_bytes(row))) as im:   # upright, as ingest sized it
            if draft:
                im.draft("RGB", (draft, draft))
            return to_uint8(upright_rgb(im)), None
    except Exception as e:  # corrupt data that passed ingest's header check
        return None, _error(e)


@dataclass(frozen=True)
class RowDecoder:
    """What a worker does with one row: ``("pixels", uint8 tensor)``, ``("jpeg", byte tensor)`` (left for
    nvJPEG) or ``("error", message)``. ``nvjpeg_share`` of the JPEG rows, chosen by a hash of the
    ``sample_id`` (so the same rows whatever the task count), go to nvJPEG; the rest, and the JPEGs
    nvJPEG cannot take (CMYK, EXIF-rotated), are decoded here."""
    to_uint8: object
    draft: int | None = None
    nvjpeg_share: float = 0.0

    def to_gpu(self, row: dict) -> bool:
        if self.nvjpeg_share >= 1 or self.nvjpeg_share <= 0:
            return self.nvjpeg_share >= 1
        return zlib.crc32(str(row.get("sample_id")).encode()) % 10_000 < self.nvjpeg_share * 10_000

    def __call__(self, row: dict):
        if self.to_gpu(row):
            return read_jpeg(row, self.to_uint8, self.draft)
        x, err = decode_cpu(row, self.to_uint8, self.draft)
        return ("pixels", x) if err is None else ("error", err)


def read_jpeg(row: dict, to_uint8, draft: int | None = None):
    """nvJPEG path: ("jpeg", uint8 byte tensor) for a baseline RGB / grey JPEG with no EXIF rotation,
    else the CPU decode's ("pixels", tensor) / ("error", message)."""
    import torch
    from PIL import Image

    from curation.image_header import exif_orientation
    from curation.ingest import read_image_bytes

    try:
        data = read_image_bytes(row)
        with Image.open(io.BytesIO(data)) as im:        # the header only
            gpu_ok = im.format == "JPEG" and im.mode in ("RGB", "L") and exif_orientation(im) == 1
    except Exception as e:
        return "error", _error(e)
    if gpu_ok:
        return "jpeg", torch.frombuffer(bytearray(data), dtype=torch.uint8)
    x, err = decode_cpu(row, to_uint8, draft)
    return ("pixels", x) if err is None else ("error", err)


def _rows(batch) -> list[dict]:
    return batch.to_pylist() if hasattr(batch, "to_pylist") else list(batch)


def _todo(rows: list[dict]) -> list[int]:
    """Positions to decode; a text-only ``ok`` sample becomes ``no_image`` here (curation embeds a
    sample's first image)."""
    todo = []
    for j, r in enumerate(rows):
        if r.get("status", "ok") == "ok":
            if "images" in r and not r["images"]:
                r["status"], r["error"] = "no_image", "text-only sample: nothing to embed"
            else:
                todo.append(j)
    return todo


def _assemble(rows, todo, results) -> dict:
    """One prepared batch: ``rows``; ``pos`` / ``x``: the CPU-decoded images and their positions;
    ``jpeg_pos`` / ``jpeg``: JPEG bytes left for nvJPEG; ``errors``: {position: message}."""
    import torch

    pos, xs, jpeg_pos, jpeg, errors = [], [], [], [], {}
    for j, (kind, v) in zip(todo, results):
        if kind == "pixels":
            pos.append(j)
            xs.append(v)
        elif kind == "jpeg":
            jpeg_pos.append(j)
            jpeg.append(v)
        else:
            errors[j] = v
    return {"rows": rows, "pos": pos, "x": torch.stack(xs) if xs else None, "jpeg_pos": jpeg_pos,
            "jpeg": jpeg, "errors": errors}


def prepare_batch(batch, decoder: RowDecoder) -> dict:
    """Decode one batch in this process (a DataLoader worker)."""
    rows = _rows(batch)
    todo = _todo(rows)
    return _assemble(rows, todo, [decoder(rows[j]) for j in todo])


def list_batches(rows: list[dict], batch_size: int):
    for a in range(0, len(rows), batch_size):
        yield rows[a:a + batch_size]


def manifest_batches(files: list[str], columns: list[str], lo: int, hi: int, batch_size: int,
                     spill_dir: str | None = None):
    """Rows ``[lo, hi)`` of the ``samples`` parts ``files`` in canonical order as ``pyarrow.Table``s cut at
    global row numbers that are multiples of ``batch_size`` (``manifests.io.iter_parts``; a DuckDB sort,
    for parts not in canonical order, spills under ``spill_dir``)."""
    import pyarrow as pa

    from manifests.io import iter_parts

    pieces, have, pos = [], 0, lo
    end = min(hi, (lo // batch_size + 1) * batch_size)
    for rb in iter_parts(files, "samples", columns, lo, hi, batch_rows=batch_size, spill_dir=spill_dir):
        while rb.num_rows:
            take = min(rb.num_rows, end - pos - have)
            pieces.append(rb.slice(0, take))
            have += take
            rb = rb.slice(take)
            if pos + have == end:
                yield pa.Table.from_batches(pieces)
                pieces, have, pos, end = [], 0, end, min(hi, end + batch_size)
    if pieces:
        yield pa.Table.from_batches(pieces)


def sub_batches(batch, unit: int):
    """``batch`` cut into consecutive pieces of at most ``unit`` rows (a table stays a table)."""
    n = batch.num_rows if hasattr(batch, "num_rows") else len(batch)
    for a in range(0, max(n, 1), unit):
        yield batch.slice(a, min(unit, n - a)) if hasattr(batch, "slice") else batch[a:a + unit]


def _iterable_dataset():
    import torch

    class StridedUnits(torch.utils.data.IterableDataset):
        """The batches of ``source()``, each cut into decode units of ``unit`` rows; worker ``w`` of ``W``
        prepares the units ``u ≡ w (mod W)`` (numbered across batches), and the DataLoader takes one from
        each worker in turn, so they come back in order. Each unit carries its offset in its batch and
        whether it is the batch's last, for ``_merge``."""

        def __init__(self, source, prepare, unit):
            self.source, self.prepare, self.unit = source, prepare, unit

        def __iter__(self):
            # A worker calls iter() as it starts, before its first request; the DataLoader sends requests
            # only once it has forked every worker (each fork costs more the more the parent holds). So the
            # first unit is prepared here, while the parent still forks the others.
            units = self._units()
            first = next(units, None)
            return itertools.chain(() if first is None else (first,), units)

        def _units(self):
            info = torch.utils.data.get_worker_info()
            w, n = (info.id, info.num_workers) if info is not None else (0, 1)
            u = 0
            for batch in self.source():
                pieces = list(sub_batches(batch, self.unit))
                at = 0
                for p, piece in enumerate(pieces):
                    size = piece.num_rows if hasattr(piece, "num_rows") else len(piece)
                    if u % n == w:
                        out = self.prepare(piece)
                        out["offset"], out["last"] = at, p == len(pieces) - 1
                        yield out
                    at += size
                    u += 1

    return StridedUnits


def _merge(units: list[dict], pin_memory: bool = False) -> dict:
    """The prepared units of one batch, in order, as the one prepared batch ``prepare_batch`` would have
    made of it: positions shifted by each unit's offset, the pixel stacks concatenated (into pinned
    memory when the batch goes to a GPU: one host copy, and the upload stays asynchronous)."""
    import torch

    if len(units) == 1 and units[0]["offset"] == 0 and not pin_memory:
        b = units[0]
        return {k: v for k, v in b.items() if k not in ("offset", "last")}
    rows, pos, xs, jpeg_pos, jpeg, errors = [], [], [], [], [], {}
    for b in units:
        o = b["offset"]
        rows.extend(b["rows"])
        pos.extend(j + o for j in b["pos"])
        if b["x"] is not None:
            xs.append(b["x"])
        jpeg_pos.extend(j + o for j in b["jpeg_pos"])
        jpeg.extend(b["jpeg"])
        errors.update({j + o: e for j, e in b["errors"].items()})
    x = None
    if xs:
        shape = (sum(len(t) for t in xs), *xs[0].shape[1:])
        x = torch.empty(shape, dtype=xs[0].dtype, pin_memory=pin_memory)
        torch.cat(xs, out=x)
    return {"rows": rows, "pos": pos, "x": x, "jpeg_pos": jpeg_pos, "jpeg": jpeg, "errors": errors}


def decoded_batches(source, decoder: RowDecoder, decode: DecodeConfig, device: str = "cpu"):
    """Prepared batches of ``source()`` (a picklable callable yielding row batches), in order, decoded as
    ``decode`` says (resolved for ``device`` here): ``decode_workers`` processes with at most
    ``decode_workers × prefetch`` decode units of ``decode_unit`` rows in flight, reassembled into pinned
    memory for a CUDA ``device``; or a pool of ``decode_workers`` threads, ``prefetch`` batches ahead."""
    decode = decode.resolve(device)
    mode, workers, prefetch = decode.decode, decode.decode_workers, decode.prefetch
    pin_memory = str(device).startswith("cuda")
    if mode == "processes":
        import torch

        ds = _iterable_dataset()(source, partial(prepare_batch, decoder=decoder), decode.decode_unit)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, prefetch_factor=prefetch)
        units = []
        for u in loader:
            units.append(u)
            if u["last"]:
                yield _merge(units, pin_memory)
                units = []
        if units:
            raise RuntimeError("decode workers stopped inside a batch")
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        pending = deque()
        for batch in source():
            rows = _rows(batch)
            todo = _todo(rows)
            pending.append((rows, todo, pool.map(decoder, [rows[j] for j in todo])))   # submitted now
            if len(pending) > prefetch:
                rows, todo, fut = pending.popleft()
                yield _assemble(rows, todo, list(fut))
        while pending:
            rows, todo, fut = pending.popleft()
            yield _assemble(rows, todo, list(fut))


def nvjpeg_decode(datas: list, pre: SplitPreprocess, device: str):
    """[(uint8 [3, crop] tensor on ``device``, None) or (None, error)] for JPEG byte tensors: one batched
    nvJPEG call (per image if the batch fails), then resize + centre crop on the GPU."""
    import warnings

    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms.v2 import functional as F

    with warnings.catch_warnings():   # torchvision ≥ 0.29 flags torchvision.io's decoders for a future move
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            imgs = [(im, None) for im in decode_jpeg(datas, mode=ImageReadMode.RGB, device=device)]
        except RuntimeError:
            imgs = []
            for d in datas:
                try:
                    imgs.append((decode_jpeg(d, mode=ImageReadMode.RGB, device=device), None))
                except RuntimeError as e:
                    imgs.append((None, _error(e)))
    out = []
    for im, err in imgs:
        if im is None:
            out.append((None, err))
            continue
        if pre.resize is not None:
            im = F.resize(im, [pre.resize], interpolation=pre.interpolation, antialias=True)
        if pre.crop is not None:
            im = F.center_crop(im, list(pre.crop))
        out.append((im, None))
    return out


def check_nvjpeg(pre: SplitPreprocess, device: str) -> None:
    """nvJPEG needs the GPU and a shortest-side resize + centre crop it can redo there."""
    if not device.startswith("cuda"):
        raise ValueError(f"jpeg_decode='nvjpeg' needs a CUDA device, got device={device!r}")
    if pre.mean is None or pre.resize is None or pre.crop is None:
        raise ValueError("jpeg_decode='nvjpeg' needs open_clip's eval transform (shortest-side Resize, CenterCrop, "
                         "ToTensor, Normalize) to redo on the GPU; this model's preprocess has another shape")


def make_decoder(pre: SplitPreprocess, device: str, decode: DecodeConfig = DecodeConfig()) -> RowDecoder:
    """What a worker does with a row, for ``decode`` (resolved for ``device`` here: ``DecodeConfig.resolve``):
    the CPU decode, drafted with ``jpeg_draft``, then the transform's head (``TensorHead`` with
    ``fast_resize``, where the transform has that shape); with ``jpeg_decode = nvjpeg``, where the transform
    can be redone on the GPU, ``nvjpeg_share`` of the JPEGs left to nvJPEG."""
    decode = decode.resolve(device)
    if decode.jpeg_decode == "nvjpeg":
        check_nvjpeg(pre, device)
    draft = min(pre.crop) if decode.jpeg_draft and pre.crop else (pre.resize if decode.jpeg_draft else None)
    head = (tensor_head(pre) if decode.fast_resize else None) or pre.to_uint8
    return RowDecoder(head, draft, decode.nvjpeg_share if decode.jpeg_decode == "nvjpeg" else 0.0)


def describe(decode: DecodeConfig, decoder: RowDecoder) -> str:
    """One line for a task's stats: ``processes x15, jpeg cpu (draft), torch resize``."""
    return (f"{decode.decode} x{decode.decode_workers}, jpeg {'nvjpeg' if decoder.nvjpeg_share else 'cpu'}"
            + (" (draft)" if decoder.draft else "")
            + (", torch resize" if isinstance(decoder.to_uint8, TensorHead) else ""))


def model_input(batch: dict, pre: SplitPreprocess, device: str, upload=None):
    """(normalised float batch on ``device`` or None, positions of its images in ``batch["rows"]``);
    nvJPEG failures fall back to the CPU decode, whose error (if any) goes into ``batch["errors"]``.
    ``upload``: a CUDA stream for the pixels' copy, so that it runs beside the forward already queued
    (the compute stream waits for it before the batch's own kernels) instead of between two forwards."""
    import torch

    pos, parts = list(batch["pos"]), []
    if batch["x"] is not None:
        if upload is not None:
            with torch.cuda.stream(upload):
                x = batch["x"].to(device, non_blocking=True)
            torch.cuda.current_stream().wait_stream(upload)
            x.record_stream(torch.cuda.current_stream())    # (allocated on upload, freed after the forward)
        else:
            x = batch["x"].to(device, non_blocking=True)
        parts.append(x)
    if batch["jpeg"]:
        gpu = []
        for j, (im, err) in zip(batch["jpeg_pos"], nvjpeg_decode(batch["jpeg"], pre, device)):
            if im is None:
                im, cpu_err = decode_cpu(batch["rows"][j], pre.to_uint8)
                if im is None:
                    batch["errors"][j] = cpu_err
                    continue
                im = im.to(device)
            gpu.append(im)
            pos.append(j)
        if gpu:
            parts.append(torch.stack(gpu))
    if not parts:
        return None, []
    x = parts[0] if len(parts) == 1 else torch.cat(parts)
    order = np.argsort(pos, kind="stable")
    if len(parts) > 1 and (order != np.arange(len(pos))).any():
        x = x[torch.as_tensor(order, device=x.device)]
    return pre.finish(x), [pos[i] for i in order]


def embed_batches(batches, net, pre: SplitPreprocess, device: str, stats=None):
    """(prepared batch, positions embedded, float32 [n, d] L2-normalised embeddings) per batch, in order.

    On a GPU the host keeps one batch queued ahead of the one running, so the GPU never waits on the host
    between batches: batch k's pixels go up on a side stream while batch k-1's forward runs; batch k's
    forward is queued behind it; then the host waits for batch k-1 alone. Its embeddings' copy to the
    host is queued right after its own forward, into pinned memory (a copy issued after batch k's
    forward was queued would wait for that forward too, and the GPU would idle while the host wrote the
    results and fetched the next batch; docs/curation.md). The host sleeps in that
    wait (a blocking-sync event; CUDA's default wait spins a CPU that the decode workers need).
    ``stats`` gets where the host waited: ``wait_input`` (for the next decoded batch: the decode
    behind, plus the merge of its units) and ``wait_device`` (for a batch's forward): the first large
    means the decode bounds the step, the second the model."""
    import time

    import torch

    from curation.clip import autocast

    timings = stats.timings if stats is not None else {}
    timings.setdefault("wait_input", 0.0)
    timings.setdefault("wait_device", 0.0)
    upload = torch.cuda.Stream(device) if str(device).startswith("cuda") else None
    pending = None
    batches = iter(batches)
    with torch.inference_mode():
        while True:
            t0 = time.perf_counter()
            batch = next(batches, None)
            timings["wait_input"] += time.perf_counter() - t0
            if batch is None:
                break
            x, pos = model_input(batch, pre, device, upload)
            e = done = None
            if x is not None:
                with autocast(device):
                    e = net.encode_image(x)
                e = torch.nn.functional.normalize(e.float(), dim=-1)
                if e.is_cuda:
                    host = torch.empty(e.shape, dtype=e.dtype, pin_memory=True)
                    e = host.copy_(e, non_blocking=True)
                    done = torch.cuda.Event(blocking=True)
                    done.record()
                if stats is not None:
                    stats.inc("embedded", len(pos))
            if pending is not None:
                yield _host(*pending, timings)
            pending = (batch, pos, e, done)
        if pending is not None:
            yield _host(*pending, timings)


def _host(batch, pos, e, done, timings):
    import time

    t0 = time.perf_counter()
    if done is not None:
        done.synchronize()      # sleeps (cudaEventBlockingSync) until the forward and the copy into e are done
        e = e.numpy().copy()    # (out of pinned memory, which the caching host allocator then reuses)
    elif e is not None:
        e = e.numpy()
    timings["wait_device"] += time.perf_counter() - t0
    return batch, pos, e
