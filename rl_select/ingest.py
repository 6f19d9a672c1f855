"""``rl-ingest``: RL prompt sets (Parquet / JSONL) → the ``rl_prompts`` manifest.

Adapters (``layout``):

* ``generic`` — columns ``question``/``problem``, ``answer``/``ground_truth``, ``images`` (list of
  bytes, ``{"bytes": …}`` structs or paths), optional ``answer_type``, ``source``, ``category``;
* ``geometry3k`` — ``images`` / ``problem`` / ``answer`` (the hiyouga/geometry3k parquet); math,
  category ``geometry`` unless optional ``answer_type`` / ``source`` / ``category`` columns say otherwise;
* ``verl`` — ``data_source``, ``prompt`` (chat messages), ``images``, ``ability``,
  ``reward_model {style, ground_truth}``, ``extra_info``;
* ``roll`` — the ROLL VLM schema: verl-like plus ``reward_model.{accuracy_ratio, format_ratio,
  verifier, verifier_parm}``, kept in ``extra``.

``<image>`` placeholders must match the number of images: a mismatch is a row with
``status = image_mismatch``; with ``auto_placeholder`` a question with *no* placeholder gets one
per image prepended (most public sets omit them). ``prompt_id`` = xxh3-64 of source, question,
ground truth and image bytes.

JSON/JSONL records, image cells and chat messages are parsed by ``manifests.sources``, the parsers
``ingest`` uses: a record that does not parse is a ``bad_row`` row, an image that cannot be read a
``bad_image`` row.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal

from manifests.conversation import IMAGE_TOKEN
from manifests.sources import BadRow, image_cell, image_path, iter_json_records, message_turns
from ovpipe.config import check_range
from ovpipe.step import Step, TaskContext

PLACEHOLDER = IMAGE_TOKEN


@dataclass
class RLIngestConfig:
    inputs: list[str] = field(default_factory=list)  # paths or globs of the prompt files (.parquet, .jsonl)
    # the files' layout: generic columns, Geometry3K, verl or ROLL parquet
    layout: Literal["generic", "geometry3k", "verl", "roll"] = "generic"
    source: str | None = None  # source name; default: the row's, else the file's stem
    default_answer_type: str = "math"  # the reward kind of a row that names none (rl_select.rewards.REWARDS)
    auto_placeholder: bool = True  # prepend one <image> per image to a question that has none
    max_images: int = 16  # a prompt with more images: a status row

    def __post_init__(self):
        if not self.inputs:
            raise ValueError("inputs: give at least one .parquet / .jsonl path or glob")
        check_range(self, "max_images", 0)


SPILL_ROWS = 64     # prompts (with their images) made a table, a spill run's row group, a merge batch per run


def _read_rows(path: str) -> Iterator[tuple[object, str | None]]:
    """``(record, parse error or None)`` of a Parquet or JSON/JSONL file (``manifests.sources``)."""
    if path.endswith((".jsonl", ".json")):
        for _, rec, _, err in iter_json_records(path):
            yield rec, err
        return
    import pyarrow.parquet as pq

    # batches, not the file at once; pre_buffer off: with it, the reader keeps every row group it read
    for b in pq.ParquetFile(path, pre_buffer=False).iter_batches(batch_size=SPILL_ROWS, use_threads=False):
        for rec in b.to_pylist():
            yield rec, None


def _image_bytes(v, base: Path) -> bytes:
    """An image cell (``manifests.sources.image_cell``) as bytes; a path is read relative to ``base``."""
    got = image_cell(v)
    if got is None:
        raise ValueError("null image" if v is None else "image struct without bytes or path")
    return Path(image_path(got, base)).read_bytes() if isinstance(got, str) else got


def _message_text(prompt) -> str:
    """The user turns of chat ``messages`` (``manifests.sources.message_turns``), one per line."""
    if isinstance(prompt, str):
        return prompt
    turns, _ = message_turns(prompt or [])
    return "\n".join(text for role, text in turns if role == "user")


def adapt(row: dict, layout: str, cfg: RLIngestConfig) -> dict:
    """One input row → (question, ground_truth, images raw, answer_type, source, category, extra)."""
    if layout == "geometry3k":
        return {"question": row.get("problem"), "ground_truth": row.get("answer"), "images": row.get("images") or [],
                "answer_type": row.get("answer_type") or "math", "source": row.get("source") or "geometry3k",
                "category": row.get("category") or "geometry", "extra": {}}
    if layout in ("verl", "roll"):
        rm = row.get("reward_model") or {}
        extra = {k: v for k, v in (row.get("extra_info") or {}).items()}
        if layout == "roll":
            extra.update(roll_extra(rm))
        gt = rm.get("ground_truth")
        return {"question": _message_text(row.get("prompt")) or row.get("problem"),
                "ground_truth": gt if isinstance(gt, str) or gt is None else json.dumps(gt),
                "images": row.get("images") or [],
                "answer_type": row.get("answer_type") or rm.get("verifier")
                or (rm.get("style") if rm.get("style") not in (None, "rule") else None),
                "source": row.get("data_source"), "category": row.get("ability"), "extra": extra}
    q = row.get("question") if row.get("question") is not None else row.get("problem")
    gt = row.get("ground_truth") if row.get("ground_truth") is not None else row.get("answer")
    return {"question": q, "ground_truth": gt if isinstance(gt, str) or gt is None else json.dumps(gt),
            "images": row.get("images") or ([row["image"]] if row.get("image") is not None else []),
            "answer_type": row.get("answer_type"), "source": row.get("source"), "category": row.get("category"),
            "extra": {k: row[k] for k in ("id", "prompt_type") if k in row}}


def _drop_nulls(v):
    """ROLL's schema gives every row every ``verifier_parm`` field (nulls where a verifier has none)."""
    if isinstance(v, dict):
        return {k: _drop_nulls(x) for k, x in v.items() if x is not None and _drop_nulls(x) != {}}
    return v


def roll_extra(rm: dict) -> dict:
    """A ROLL ``reward_model``'s reward parameters: ovpipe's own ``reward_params`` (JSON, where the row came from
    ``export --format roll``), then the ratios, the verifier and ``verifier_parm`` (a struct, or its JSON text)."""
    out = json.loads(rm["reward_params"]) if isinstance(rm.get("reward_params"), str) and rm["reward_params"] else {}
    out.update({k: rm[k] for k in ("accuracy_ratio", "format_ratio", "verifier") if rm.get(k) is not None})
    vp = rm.get("verifier_parm")
    vp = json.loads(vp) if isinstance(vp, str) and vp.strip().startswith("{") else vp
    if isinstance(vp, dict) and _drop_nulls(vp):
        out["verifier_parm"] = _drop_nulls(vp)
    return out


def _input_size(image: bytes) -> list[int]:
    """[W, H] of the first image: the frame a detection answer's boxes are in, which ``det_verifier_normalized``
    rescales to 1000 (ROLL reads it from the processor's image grid)."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(image)) as im:
        return list(im.size)


def ingest_file(path: str, cfg: RLIngestConfig, stats) -> Iterator[dict]:
    """The ``rl_prompts`` rows of one input file, in its order, one at a time."""
    import xxhash

    base = Path(path).parent
    for row, parse_error in _read_rows(path):
        status, error, images = "ok", None, []
        try:
            if parse_error is not None:
                raise BadRow(parse_error)
            a = adapt(row, cfg.layout, cfg)
        except Exception as e:
            a = {"question": None, "ground_truth": None, "images": [], "answer_type": None, "source": None,
                 "category": None, "extra": {}}
            status, error = "bad_row", f"{type(e).__name__}: {e}"[:300]
        q = a["question"] or ""
        try:
            images = [_image_bytes(v, base) for v in a["images"]]
        except Exception as e:
            status, error = "bad_image", f"{type(e).__name__}: {e}"[:300]
        n_ph = q.count(PLACEHOLDER)
        if status == "ok" and images and (a["extra"].get("verifier_parm") or {}).get("det_verifier_normalized"):
            try:
                a["extra"].setdefault("input_size", _input_size(images[0]))
            except Exception as e:
                status, error = "bad_image", f"{type(e).__name__}: {e}"[:300]
        if status == "ok":
            if not q.strip():
                status, error = "empty_question", "question is empty"
            elif a["ground_truth"] in (None, ""):
                status, error = "missing_ground_truth", "no ground truth"
            elif len(images) > cfg.max_images:
                status, error = "too_many_images", f"{len(images)} > {cfg.max_images}"
            elif n_ph == 0 and images and cfg.auto_placeholder:
                q = PLACEHOLDER * len(images) + q
            elif n_ph != len(images):
                status, error = "image_mismatch", f"{n_ph} {PLACEHOLDER} placeholder(s) for {len(images)} image(s)"
        source = cfg.source or a["source"] or Path(path).stem
        h = xxhash.xxh3_64()
        for part in (source, q, a["ground_truth"] or "", *images):
            h.update(part if isinstance(part, bytes) else str(part).encode())
            h.update(b"\x00")
        stats.inc(f"status/{status}")
        yield {"prompt_id": h.hexdigest(), "source": source, "category": a["category"] or "default",
               "question": q, "images": images, "ground_truth": a["ground_truth"],
               "answer_type": a["answer_type"] or cfg.default_answer_type,
               "extra": json.dumps(a["extra"], default=str, sort_keys=True), "status": status, "error": error}


def run(cfg: RLIngestConfig, task: TaskContext) -> None:
    """This rank's input files (every ``world_size``-th), their rows sorted by prompt_id into its part
    through spilled sorted runs (``ovpipe.shuffle.SpillWriter``, merged by ``merge_sorted``): a task holds
    one run being filled (``shuffle.SPILL_BYTES``), then ``SPILL_ROWS`` rows of each of at most
    ``shuffle.MERGE_FAN_IN`` runs while merging (the prompts carry their images) — not its files' rows. The
    part has the bytes a sort of all its rows would give (ties in input order)."""
    import shutil

    from manifests.schemas import schema_for
    from ovpipe.shuffle import SpillWriter, merge_sorted, spill_path

    files = sorted({str(Path(f).resolve()) for p in cfg.inputs for f in glob.glob(os.path.expanduser(p))})
    if not files:
        raise FileNotFoundError(f"rl-ingest.inputs {cfg.inputs} match no file")
    sdir = task.step_dir / "spill" / f"{task.rank:05d}"
    spill = SpillWriter(sdir, task.rank, "rl_prompts", convert_rows=SPILL_ROWS, group_rows=SPILL_ROWS)
    for f in files[task.rank::task.world_size]:
        for row in ingest_file(f, cfg, task.stats):
            spill.add(row)
    spill.flush()
    runs = [spill_path(sdir, task.rank, r) for r in range(spill.runs)]
    with task.part_writer("rl_prompts") as out:
        for t in merge_sorted(runs, "prompt_id", schema_for("rl_prompts").names, batch_rows=SPILL_ROWS):
            out.write(t.drop_columns(["_file", "_row"]))
    shutil.rmtree(sdir, ignore_errors=True)


def finalize(cfg: RLIngestConfig, task: TaskContext) -> None:
    """Identical prompts (same prompt_id) across all parts: the first (part, row) stays, the rest
    become ``status = duplicate`` — so a prompt is never rolled out, scored or exported twice. The parts
    are each sorted by prompt_id, so their ids are merged in (prompt_id, part, row) order
    (``ovpipe.shuffle.merge_sorted``: a row group per part at a time) and the repeats found as they stream;
    only the parts that hold a repeat are rewritten."""
    import pyarrow as pa

    import pyarrow.parquet as pq

    from manifests.io import PartWriter
    from ovpipe.shuffle import FirstOccurrence, merge_sorted

    files = task.output_files("rl_prompts")
    first = FirstOccurrence("prompt_id")
    repeats: dict[int, list[int]] = {}       # part → its rows that repeat an earlier prompt
    for t in merge_sorted(files, "prompt_id", ["prompt_id", "status"], work_dir=task.step_dir):
        rep = first.repeats(t)
        if rep is None:
            continue
        part, row, status = (t.column(c).to_pylist() for c in ("_file", "_row", "status"))
        for i, r in enumerate(rep):
            if r is not None and status[i] != "duplicate":
                repeats.setdefault(part[i], []).append(row[i])
    for k, rows in sorted(repeats.items()):      # rewritten a row group at a time (the prompts carry images)
        rows = sorted(rows)
        task.stats.inc("duplicates", len(rows))
        at, j = 0, 0
        with PartWriter(files[k], "rl_prompts") as out:          # a temp file, renamed over the part at the end
            for b in pq.ParquetFile(files[k], pre_buffer=False).iter_batches(batch_size=SPILL_ROWS, use_threads=False):
                status, error = b.column("status").to_pylist(), b.column("error").to_pylist()
                while j < len(rows) and rows[j] < at + b.num_rows:
                    i = rows[j] - at
                    status[i], error[i] = "duplicate", "same source, question, answer and images as another row"
                    j += 1
                at += b.num_rows
                t = pa.Table.from_batches([b])
                t = t.set_column(t.schema.get_field_index("status"), "status", pa.array(status, pa.string()))
                t = t.set_column(t.schema.get_field_index("error"), "error", pa.array(error, pa.string()))
                out.write(t)


STEP = Step("rl-ingest", RLIngestConfig, run, outputs=("rl_prompts",), finalize=finalize,
            description="RL prompt sets (geometry3k / verl / ROLL / generic) → rl_prompts")
