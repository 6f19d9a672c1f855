"""``export``: kept prompts in the layouts GRPO trainers read, one folder per split.

* ``verl`` (also EasyR1): ``RUN/export/verl/<split>.parquet`` — ``data_source``, ``prompt`` (chat
  messages; the user turn keeps one ``<image>`` per image), ``images`` (``[{"bytes": …}]``),
  ``ability``, ``reward_model {style: "rule", ground_truth}``, ``extra_info {index, prompt_id,
  answer_type, split, reward_params}``, plus ``problem``/``answer`` so EasyR1's default keys read the same file;
* ``areal`` (what the published RL recipe hands to AReaL): ``RUN/export/areal/<split>/part-NNNNN.jsonl``,
  2000 rows per shard — ``id, images, problem, answer, problem_type, answer_type, source,
  prompt_type`` (``normal`` | ``thinking``, as the recipe's dataset reads it), ``reward_params``;
  images written once as PNG/JPEG files under ``areal/images/`` and referenced by path;
* ``roll`` (ROLL VLM): parquet like verl plus ``reward_model.{accuracy_ratio, format_ratio, verifier,
  verifier_parm}`` and ``tag``; ratios come from the prompt's ``extra`` (a ROLL input) else the config;
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


def _verl_row(i: int, p: dict, roll: bool, cfg: ExportConfig) -> dict:
    rm = {"style": "rule", "ground_truth": p["ground_truth"]}
    if roll:
        extra = json.loads(p["extra"] or "{}")   # per-sample ratios ingested from a ROLL set win over the config's
        rm.update({"accuracy_ratio": float(extra.get("accuracy_ratio", cfg.accuracy_ratio)),
                   "format_ratio": float(extra.get("format_ratio", cfg.format_ratio)),
                   "verifier": p["answer_type"], "verifier_parm": json.dumps(extra, sort_keys=True)})
    row = {"data_source": p["source"], "prompt": [{"role": "user", "content": p["question"]}],
           "images": [{"bytes": b} for b in p["images"]], "ability": p["category"], "reward_model": rm,
           # answer_type + reward_params (the prompt's `extra`, JSON) are what the verl adapter scores with
           "extra_info": {"index": i, "prompt_id": p["prompt_id"], "answer_type": p["answer_type"], "split": p["split"],
                          "reward_params": p["extra"] or "{}"},
           # EasyR1's defaults (data.prompt_key=problem, answer_key=answer, image_key=images) read the same file
           "problem": p["question"], "answer": p["ground_truth"]}
    if roll:
        row["tag"] = p["category"]
    return row


def verl_schema(roll: bool):
    """The verl / ROLL Parquet schema, fixed up front: the files are written a row group at a time, and a
    batch whose prompts carry no image must not make ``images`` a list of nulls."""
    import pyarrow as pa

    s = pa.string()
    rm = [("style", s), ("ground_truth", s)] + ([("accuracy_ratio", pa.float64()), ("format_ratio", pa.float64()),
                                                  ("verifier", s), ("verifier_parm", s)] if roll else [])
    fields = [("data_source", s), ("prompt", pa.list_(pa.struct([("role", s), ("content", s)]))),
              ("images", pa.list_(pa.struct([("bytes", pa.binary())]))), ("ability", s),
              ("reward_model", pa.struct(rm)),
              ("extra_info", pa.struct([("index", pa.int64()), ("prompt_id", s), ("answer_type", s), ("split", s),
                                        ("reward_params", s)])),
              ("problem", s), ("answer", s)] + ([("tag", s)] if roll else [])
    return pa.schema(fields)


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
        self.tags.add(p["category"])
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


STEP = Step("export", ExportConfig, run, inputs={"selection": None, "rl_prompts": None}, max_tasks=1,
            description="kept prompts → verl / AReaL / ROLL / OpenRLHF")
