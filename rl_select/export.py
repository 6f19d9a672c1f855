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
    formats: list[str] = field(default_factory=lambda: list(FORMATS))
    areal_shard_rows: int = 2000
    accuracy_ratio: float = 1.0
    format_ratio: float = 0.0

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


def kept_rows(task: TaskContext) -> list[dict]:
    sel = {r["prompt_id"]: r for r in task.read_input("selection").to_pylist() if r["kept"]}
    out = []
    for p in task.read_input("rl_prompts").to_pylist():
        if p["prompt_id"] in sel and p["status"] == "ok":
            s = sel[p["prompt_id"]]
            out.append({**p, "split": s["split"], "pass_at_1": s["pass_at_1"]})
    return out


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


def run(cfg: ExportConfig, task: TaskContext) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if task.rank != 0:
        return
    rows = kept_rows(task)
    root = task.step_dir
    splits = sorted({r["split"] for r in rows})
    for fmt in cfg.formats:
        for split in splits:
            part = [r for r in rows if r["split"] == split]
            if fmt in ("verl", "roll"):
                path = root / fmt / f"{split}.parquet"
                path.parent.mkdir(parents=True, exist_ok=True)
                pq.write_table(pa.Table.from_pylist([_verl_row(i, p, fmt == "roll", cfg) for i, p in enumerate(part)]),
                               path)
            else:
                img_dir = root / fmt / "images"
                img_dir.mkdir(parents=True, exist_ok=True)

                def paths(p):
                    out = []
                    for j, b in enumerate(p["images"]):
                        f = img_dir / f"{p['prompt_id']}_{j}.{_ext(b)}"
                        if not f.exists():
                            f.write_bytes(b)
                        out.append(str(f.relative_to(root / fmt)))
                    return out

                if fmt == "areal":
                    d = root / "areal" / split
                    d.mkdir(parents=True, exist_ok=True)
                    # the recipe's AReaL dataset gives `normal` prompts the answer-only template, others the thinking one
                    prompt_type = "normal" if split == "stage1-answer-only" else "thinking"
                    for s in range(0, max(len(part), 1), cfg.areal_shard_rows):
                        with open(d / f"part-{s // cfg.areal_shard_rows:05d}.jsonl", "w") as f:
                            for p in part[s:s + cfg.areal_shard_rows]:
                                f.write(json.dumps({"id": p["prompt_id"], "images": paths(p), "problem": p["question"],
                                                    "answer": p["ground_truth"], "problem_type": p["category"],
                                                    "answer_type": p["answer_type"], "source": p["source"],
                                                    "prompt_type": prompt_type,
                                                    "reward_params": p["extra"] or "{}"}) + "\n")
                else:
                    with open(root / "openrlhf" / f"{split}.jsonl", "w") as f:
                        for p in part:
                            f.write(json.dumps({"id": p["prompt_id"], "prompt": p["question"], "label": p["ground_truth"],
                                                "reward_label": reward_label(p), "images": paths(p),
                                                "datasource": p["source"]}) + "\n")
            task.stats.inc(f"{fmt}/{split}", len(part))
        if splits:
            from rl_select.handoff import score_timeout, write_handoff

            write_handoff(fmt, root, splits, rows, score_timeout(task.run_dir, task.input_steps("selection")))
    task.stats.inc("exported", len(rows))


STEP = Step("export", ExportConfig, run, inputs={"selection": None, "rl_prompts": None}, max_tasks=1,
            description="kept prompts → verl / AReaL / ROLL / OpenRLHF")
