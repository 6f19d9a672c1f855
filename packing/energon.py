"""Packed shards as a Megatron-Energon dataset: the ``.nv-meta/`` that ``energon prepare`` writes, and the
cooker that turns energon's crude samples back into packed sequences.

Every ``pack`` step with shards is an energon dataset rooted at its step folder (``RUN/pack/``): the
``finalize`` phase runs energon's own CLI (``energon prepare --non-interactive --sample-type
CrudeWebdataset``) over ``data/pack-*.tar``, which writes ``.nv-meta/dataset.yaml`` (the
``CrudeWebdataset`` class), ``split.yaml`` (every shard in the ``train`` split, in pack_id order),
``.info.json`` (packs per shard), ``index.sqlite`` and ``index.uuid``. Nothing in ``.nv-meta/`` is written
by hand.

Why crude samples and a cooker, not a ``sample_loader.py``: the packs are already tokenised (ids, loss
mask, image grids), so no energon sample type fits them, and a ``sample_loader.py`` must live inside
``.nv-meta/`` (a copy of our code beside every dataset). With ``CrudeWebdataset`` the dataset stays
plain data and the trainer brings the cooker in its task encoder — the convention of the offline-packed
LLaVA-OneVision trainers (their ``cooker_packed_*`` functions over ``CrudeWebdataset`` shards).

Reading, at any rank / worker layout (``docs/packing.md`` has the fields)::

    from megatron.energon import WorkerConfig, get_train_dataset, get_savable_loader
    from packing.energon import PackedTaskEncoder

    ds = get_train_dataset("RUN/pack", batch_size=1, shuffle_buffer_size=None, max_samples_per_sequence=None,
                           worker_config=WorkerConfig(rank=r, world_size=n, num_workers=w),
                           task_encoder=PackedTaskEncoder())
    for batch in get_savable_loader(ds):   # a list of PackedSample, one per pack
        ...

The task encoder reads undecoded members (``decoder = None``): the ids and mask are ``.npy`` bytes that
``packing.shards.decode_packed`` loads, and the images stay the bytes that were ingested (decoding and
resizing belong to the trainer's image processor, on its own worker).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from megatron.energon import Cooker, DefaultTaskEncoder, Sample, basic_sample_keys, stateless
from megatron.energon.edataclass import edataclass

from packing.shards import decode_packed

SHARD_PATTERN = "data/pack-[0-9]+[.]tar"   # energon's split pattern (a regex matched on the relative path)


@edataclass
class PackedSample(Sample):
    """One packed sequence, as energon hands it to the task encoder (fields as ``packing.shards.PackedSequence``)."""

    pack_id: int
    sample_ids: list[str]
    input_ids: np.ndarray        # int32[T]: every sub-sample's ids, concatenated, image pads expanded
    loss_mask: np.ndarray        # uint8[T]: 1 on assistant-turn tokens and their end-of-turn token
    cu_seqlens: np.ndarray       # int32[n_samples + 1]: sub-sample boundaries (THD attention)
    position_ids: np.ndarray     # int32[T]: restart at 0 in every sub-sample
    images: list[bytes]          # every image of the pack, sample by sample, in placeholder order
    image_grids: np.ndarray      # int32[n_images, 2]: ViT patch grid (h/14, w/14) per image
    images_per_sample: list[int]  # aligned with sample_ids; sums to len(images)
    seq_len: int


@stateless
def cook_packed(raw: dict) -> PackedSample:
    """Energon's crude sample (the tar entry's members, undecoded) → :class:`PackedSample`."""
    seq = decode_packed(raw)
    return PackedSample(**basic_sample_keys(raw), pack_id=seq.pack_id, sample_ids=seq.sample_ids,
                        input_ids=seq.input_ids, loss_mask=seq.loss_mask, cu_seqlens=seq.cu_seqlens,
                        position_ids=seq.position_ids, images=seq.images, image_grids=seq.image_grids,
                        images_per_sample=seq.images_per_sample, seq_len=seq.seq_len)


class PackedTaskEncoder(DefaultTaskEncoder):
    """Cooks the packs and batches them as lists: a pack is already a whole micro-batch row (the recipe
    trains one pack per micro-batch), and its variable-length arrays have nothing to stack."""

    cookers = [Cooker(cook_packed)]
    decoder = None

    @stateless
    def batch(self, samples: list[PackedSample]) -> list[PackedSample]:
        return list(samples)


def prepare(step_dir: Path, n_shards: int, log_path: Path, sample_type: str | None = "CrudeWebdataset") -> None:
    """Run energon's ``energon prepare`` command over the step folder's ``data/pack-*.tar``, its output to
    ``log_path``. Every shard goes to the ``train`` split, in name (= pack_id) order; earlier metadata is
    overwritten. ``sample_type=None``: no ``dataset.yaml`` (the caller writes one for a sample type energon's
    CLI does not know, as ``pack-official`` does). In this process (a subprocess would pay energon's ~5 s import for every pack step); its
    indexer forces the ``fork`` start method process-wide, so the caller's method is put back after."""
    import contextlib
    import multiprocessing

    from megatron.energon.tools.prepare import command

    args = [str(step_dir), "--non-interactive", "--force-overwrite", "--no-progress",
            "--split-parts", f"train:{SHARD_PATTERN}", "--exclude", r"(^|/)\.tmp-",
            "--num-workers", str(max(1, min(n_shards, 4)))]
    args += ["--sample-type", sample_type] if sample_type else ["--skip-dataset-yaml"]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    method = multiprocessing.get_start_method(allow_none=True)
    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        print("energon prepare " + " ".join(args), flush=True)
        try:
            command.main(args, prog_name="energon prepare", standalone_mode=False)
        except (Exception, SystemExit) as e:  # click errors, and the sys.exit(1) of a duplicate-key shard
            print(f"failed: {e!r}", flush=True)
            raise RuntimeError(f"`energon prepare {step_dir}` failed ({e!r}): see {log_path}") from None
        finally:
            multiprocessing.set_start_method(method, force=True)
    meta = step_dir / ".nv-meta"
    missing = [f for f in ("dataset.yaml",) * bool(sample_type) + ("split.yaml", ".info.json", "index.sqlite")
               if not (meta / f).is_file()]
    if missing:
        raise RuntimeError(f"`energon prepare {step_dir}` left no {', '.join(missing)} in {meta}: see {log_path}")
