"""``export``: kept prompts in the layouts GRPO trainers read, one folder per split.

* ``verl`` (also EasyR1): ``RUN/export/verl/<split>.parquet`` — ``data_source``, ``prompt`` (chat
  messages; the user turn keeps one ``<image>`` per image), ``images`` (``[{"bytes": …}]``),
  ``ability``, ``reward_model {style: "rule", ground_truth}``, ``extra_info {index, prompt_id,
  answer_type, split, reward_params}``, plus ``problem``/``answer`` so EasyR1's default keys read the same file;
* ``areal`` (what the published RL recipe hands to AReaL): ``RUN/export/areal/<split>/part-NNNNN.jsonl``,
  2000 rows per shard — ``id, images, problem, answer, problem_type, answer_type, source,
  prompt_type`` (``normal`` | ``thinking``, as the recipe's dataset reads it), ``reward_params``;
  images written once as PNG/JPEG files under ``areal/images/`` and referenced by path;
* ``roll`` (ROLL VLM, its docs' schema): parquet like verl with images as the ``datasets`` ``Image`` feature,
  ``reward_model.{answer, ground_truth, accuracy_ratio, format_ratio, verifier, verifier_parm {det_verifier_normalized,
  det_reward_ratio}, reward_params}`` and ``tag`` (= ``data_source``, what ROLL routes by); ratios come from the
  prompt's ``extra`` (a ROLL input) else the config;
* ``openrlhf``: ``RUN/export/openrlhf/<split>.jsonl`` — ``{"id", "prompt", "label", "reward_label", "images":
  [paths], "datasource"}`` (``reward_label``: ground truth + answer type + reward parameters, JSON).

Every layout carries what ``rl_select.trainers`` needs to score a rollout with the same reward as
``ovpipe score`` (``answer_type`` and ``reward_params``), and beside each one ``HANDOFF.md`` gives the
trainer's command line wiring the data and our reward function together (``rl_select/handoff.py``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from ovpipe.config import check_range
from ovpipe.step import Step, TaskContext

FORMATS = ("verl", "areal", "roll", "openrlhf")


@dataclass
class ExportConfig:
    # the select step folder read; "": every folder holding a selection
    selection_step: str = ""
    # the trainers' layouts written: verl, areal, roll, openrlhf
    formats: list[str] = field(default_factory=lambda: list(FORMATS))
    areal_shard_rows: int = 2000  # prompts per AReaL JSONL part
    accuracy_ratio: float = 1.0  # ROLL: the accuracy reward's weight
    format_ratio: float = 0.0  # ROLL: the format reward's weight

    def __post_init__(self):
        bad = [f for f in self.formats if f not in FORMATS]
        if bad:
            raise ValueError(f"formats: unknown {bad}; choose from {list(FORMATS)}")
        if self.areal_shard_rows < 1:
            raise ValueError("areal_shard_rows must be >= 1")
        check_range(self, "accuracy_ratio", 0)
        check_range(self, "format_ratio", 0)


def _ext(b: bytes) -> str:
    return "png" if b[:8] == b"\x89PNG\r\n\x1a\n" else "jpg"


PROMPT_BATCH = 256     # rl_prompts rows (images inline) decoded at once; also the Parquet exports' row group


def kept_splits(task: TaskContext) -> dict[str, tuple[str, float]]:
    """``{prompt_id: (split, pass_at_1)}`` of the kept prompts: the selection's light columns only."""
    cols = ["prompt_id", "kept", "split", "pass_at_1"]
    return {pid: (split, p1) for b in task.iter_input("selection", cols)
            for pid, kept, split, p1 in zip(*(b.column(c).to_pylist() for c in cols)) if kept}


def kept_rows(task: TaskContext):
    """The kept ``ok`` prompts with their ``split`` and ``pass_at_1``, streamed in canonical order: a
    batch of prompts (their images inline) at a time, never the export's whole set."""
    sel = kept_splits(task)
    for b in task.iter_input("rl_prompts", batch_rows=PROMPT_BATCH):
        for p in b.to_pylist():
            if p["prompt_id"] in sel and p["status"] == "ok":
                split, p1 = sel[p["prompt_id"]]
                yield {**p, "split": split, "pass_at_1": p1}


def reward_label(p: dict) -> str:
    """OpenRLHF hands its reward function only the query, the prompt and one label field: the label
    carries the answer type and reward parameters (``--label_key reward_label``)."""
    return json.dumps({"ground_truth": p["ground_truth"], "answer_type": p["answer_type"],
                       "reward_params": p["extra"] or "{}"}, sort_keys=True)


DET_RATIO_KEYS = ("iou_max_label_first", "iou_max_iou_first", "iou_completeness", "map", "map50", "map75")


def roll_reward_model(p: dict, cfg: ExportConfig) -> dict:
    """ROLL's ``reward_model`` struct: ``answer``, ``ground_truth``, the ratios (a ROLL row's own, else the
    config's), ``verifier`` (the answer type), ``verifier_parm`` (``det_verifier_normalized`` and the six
    ``det_reward_ratio`` weights; nulls where the row has none, as ROLL's own math rows), and
    ``reward_params``: every ovpipe reward parameter as JSON (ROLL hands a reward worker ``reward_model`` and
    ``tag`` only, so ``rl_select.trainers.roll_reward`` reads them here)."""
    extra = json.loads(p["extra"] or "{}")
    vp = extra.get("verifier_parm") or {}
    vp = json.loads(vp) if isinstance(vp, str) else vp
    ratios = vp.get("det_reward_ratio") or {}
    return {"answer": p["ground_truth"], "ground_truth": p["ground_truth"],
            "accuracy_ratio": float(extra.get("accuracy_ratio", cfg.accuracy_ratio)),
            "format_ratio": float(extra.get("format_ratio", cfg.format_ratio)),
            "verifier": p["answer_type"],
            "verifier_parm": {"det_verifier_normalized": vp.get("det_verifier_normalized"),
                              "det_reward_ratio": {k: ratios.get(k) for k in DET_RATIO_KEYS}},
            "reward_params": p["extra"] or "{}"}


def _verl_row(i: int, p: dict, roll: bool, cfg: ExportConfig) -> dict:
    rm = roll_reward_model(p, cfg) if roll else {"style": "rule", "ground_truth": p["ground_truth"]}
    row = {"data_source": p["source"], "prompt": [{"role": "user", "content": p["question"]}],
           "images": [{"bytes": b, "path": None} if roll else {"bytes": b} for b in p["images"]],
           "ability": p["category"], "reward_model": rm,
           # answer_type + reward_params (the prompt's `extra`, JSON) are what the verl adapter scores with
           "extra_info": {"index": i, "prompt_id": p["prompt_id"], "answer_type": p["answer_type"], "split": p["split"],
                          "reward_params": p["extra"] or "{}"},
           # EasyR1's defaults (data.prompt_key=problem, answer_key=answer, image_key=images) read the same file
           "problem": p["question"], "answer": p["ground_truth"]}
    if roll:
        row["tag"] = p["source"]        # ROLL's VLM loader routes by tag = data_source (vlm_dataset_utils.py)
    return row


def _roll_features() -> dict:
    """The ``datasets`` features of ROLL's VLM schema (its docs' ``Sequence(Image)``, ``reward_model`` struct),
    as the ``huggingface`` schema metadata ``datasets`` writes, so ``load_dataset("parquet")`` decodes the
    images as ``Image`` features. Written by hand: the export does not import ``datasets``."""
    v = lambda t: {"dtype": t, "_type": "Value"}  # noqa: E731
    return {"data_source": v("string"), "images": {"feature": {"_type": "Image"}, "_type": "Sequence"},
            "prompt": [{"role": v("string"), "content": v("string")}], "ability": v("string"),
            "reward_model": {"answer": v("string"), "ground_truth": v("string"), "accuracy_ratio": v("float32"),
                             "format_ratio": v("float32"), "verifier": v("string"),
                             "verifier_parm": {"det_verifier_normalized": v("bool"),
                                               "det_reward_ratio": {k: v("float32") for k in DET_RATIO_KEYS}},
                             "reward_params": v("string")},
            "extra_info": {"index": v("int64"), "prompt_id": v("string"), "answer_type": v("string"),
                           "split": v("string"), "reward_params": v("string")},
            "problem": v("string"), "answer": v("string"), "tag": v("string")}


def verl_schema(roll: bool):
    """The verl / ROLL Parquet schema, fixed up front: the files are written a row group at a time, and a
    batch whose prompts carry no image must not make ``images`` a list of nulls."""
    import pyarrow as pa

    s, f32 = pa.string(), pa.float32()
    if roll:
        rm = [("answer", s), ("ground_truth", s), ("accuracy_ratio", f32), ("format_ratio", f32), ("verifier", s),
              ("verifier_parm", pa.struct([("det_verifier_normalized", pa.bool_()),
                                           ("det_reward_ratio", pa.struct([(k, f32) for k in DET_RATIO_KEYS]))])),
              ("reward_params", s)]
        image = pa.struct([("bytes", pa.binary()), ("path", s)])
    else:
        rm, image = [("style", s), ("ground_truth", s)], pa.struct([("bytes", pa.binary())])
    fields = [("data_source", s), ("prompt", pa.list_(pa.struct([("role", s), ("content", s)]))),
              ("images", pa.list_(image)), ("ability", s),
              ("reward_model", pa.struct(rm)),
              ("extra_info", pa.struct([("index", pa.int64()), ("prompt_id", s), ("answer_type", s), ("split", s),
                                        ("reward_params", s)])),
              ("problem", s), ("answer", s)] + ([("tag", s)] if roll else [])
    meta = {"huggingface": json.dumps({"info": {"features": _roll_features()}})} if roll else None
    return pa.schema(fields, metadata=meta)


class SplitWriter:
    """One format's files of one split, fed a prompt at a time: verl / ROLL rows buffered to a row group of
    ``PROMPT_BATCH``, AReaL shards of ``areal_shard_rows`` lines, the OpenRLHF JSONL; images written
    once as files (AReaL, OpenRLHF) as their prompts pass."""

    def __init__(self, fmt: str, split: str, root, cfg: ExportConfig):
        self.fmt, self.split, self.root, self.cfg = fmt, split, root, cfg
        self.n, self.rows, self.tags, self._pq, self._f = 0, [], set(), None, None
        if fmt in ("verl", "roll"):
            (root / fmt).mkdir(parents=True, exist_ok=True)
        else:
            (root / fmt / "images").mkdir(parents=True, exist_ok=True)
        if fmt == "openrlhf":
            self._f = open(root / "openrlhf" / f"{split}.jsonl", "w")

    def _paths(self, p: dict) -> list[str]:
        out = []
        for j, b in enumerate(p["images"]):
            f = self.root / self.fmt / "images" / f"{p['prompt_id']}_{j}.{_ext(b)}"
            if not f.exists():
                f.write_bytes(b)
            out.append(str(f.relative_to(self.root / self.fmt)))
        return out

    def add(self, p: dict) -> None:
        i, self.n = self.n, self.n + 1
        self.tags.add(p["source"] if self.fmt == "roll" else p["category"])   # ROLL routes by data_source
        if self.fmt in ("verl", "roll"):
            self.rows.append(_verl_row(i, p, self.fmt == "roll", self.cfg))
            if len(self.rows) == PROMPT_BATCH:
                self._flush()
        elif self.fmt == "areal":
            if i % self.cfg.areal_shard_rows == 0:
                if self._f is not None:
                    self._f.close()
                d = self.root / "areal" / self.split
                d.mkdir(parents=True, exist_ok=True)
                self._f = open(d / f"part-{i // self.cfg.areal_shard_rows:05d}.jsonl", "w")
            # the recipe's AReaL dataset gives `normal` prompts the answer-only template, others the thinking one
            prompt_type = "normal" if self.split == "stage1-answer-only" else "thinking"
            self._f.write(json.dumps({"id": p["prompt_id"], "images": self._paths(p), "problem": p["question"],
                                      "answer": p["ground_truth"], "problem_type": p["category"],
                                      "answer_type": p["answer_type"], "source": p["source"],
                                      "prompt_type": prompt_type, "reward_params": p["extra"] or "{}"}) + "\n")
        else:
            self._f.write(json.dumps({"id": p["prompt_id"], "prompt": p["question"], "label": p["ground_truth"],
                                      "reward_label": reward_label(p), "images": self._paths(p),
                                      "datasource": p["source"]}) + "\n")

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = verl_schema(self.fmt == "roll")
        if self._pq is None:
            self._pq = pq.ParquetWriter(self.root / self.fmt / f"{self.split}.parquet", schema)
        self._pq.write_table(pa.Table.from_pylist(self.rows, schema=schema))
        self.rows = []

    def close(self) -> None:
        if self.rows:
            self._flush()
        for h in (self._pq, self._f):
            if h is not None:
                h.close()


def run(cfg: ExportConfig, task: TaskContext) -> None:
    if task.rank != 0:
        return
    root = task.step_dir
    writers: dict[tuple[str, str], SplitWriter] = {}
    n = 0
    try:
        for p in kept_rows(task):
            n += 1
            for fmt in cfg.formats:
                key = (fmt, p["split"])
                if key not in writers:
                    writers[key] = SplitWriter(fmt, p["split"], root, cfg)
                writers[key].add(p)
    finally:
        for w in writers.values():
            w.close()
    from rl_select.handoff import score_timeout, write_handoff

    timeout = score_timeout(task.run_dir, task.input_steps("selection"))
    for fmt in cfg.formats:
        splits = sorted(split for f, split in writers if f == fmt)
        for split in splits:
            task.stats.inc(f"{fmt}/{split}", writers[(fmt, split)].n)
        if splits:
            write_handoff(fmt, root, splits, {s: sorted(writers[(fmt, s)].tags) for s in splits}, timeout)
    task.stats.inc("exported", n)


STEP = Step("export", ExportConfig, run, inputs={"selection": "selection_step", "rl_prompts": None}, max_tasks=1,
            description="kept prompts → verl / AReaL / ROLL / OpenRLHF")
