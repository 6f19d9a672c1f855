"""The demo's evaluation set: a small image-QA task in lmms-eval's task YAML format.

``write_demo_eval_tasks(out, seed)`` writes ``out/eval-tasks/``:

- ``demo_vqa.yaml`` — an lmms-eval task over a local JSONL (``dataset_path: json``, ``data_files`` relative
  to the folder, which ``ovpipe eval`` runs lmms-eval inside), ``output_type: generate_until``,
  ``exact_match`` (case and punctuation ignored) as the metric;
- ``utils.py`` — ``doc_to_visual`` (opens the doc's image, relative to this folder) and ``doc_to_text``,
  named as ``!function utils.…`` from the YAML (lmms-eval loads it beside the YAML);
- ``test.jsonl`` + ``images/*.jpg`` — shape scenes drawn by the demo's renderer, with one-word questions:
  the colour of a single shape, or how many shapes there are.

No absolute path anywhere, so the folder is byte-identical for a seed wherever it is written. Its own RNG
stream (``[seed, 25]``), so the caption and conversation sets stay as they were.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from demo.corpus import COLORS, SHAPES, concept_names, render_image

TASK = "demo_vqa"
TASK_YAML = f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: test.jsonl
test_split: test
output_type: generate_until
doc_to_visual: !function utils.doc_to_visual
doc_to_text: !function utils.doc_to_text
doc_to_target: answer
generation_kwargs:
  max_new_tokens: 8
  until: ["<|im_end|>"]
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
metadata:
  version: 1
"""
UTILS = '''"""doc_to_visual / doc_to_text of the demo_vqa task (written by `ovpipe demo-data`)."""
from pathlib import Path

from PIL import Image

HERE = Path(__file__).resolve().parent


def doc_to_visual(doc):
    return [Image.open(HERE / doc["image"]).convert("RGB")]


def doc_to_text(doc):
    return doc["question"]
'''


def write_demo_eval_tasks(out: Path, seed: int = 0, n: int = 16) -> dict:
    """Write ``out/eval-tasks/`` (see the module docstring); half colour, half counting questions."""
    folder = Path(out) / "eval-tasks"
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 25])
    names, colours = concept_names(), list(COLORS)
    docs = []
    for i in range(n):
        if i % 2 == 0:
            c, s = colours[int(rng.integers(len(colours)))], SHAPES[int(rng.integers(len(SHAPES)))]
            concepts, question, answer = [names.index(f"{c} {s}")], "What colour is the shape? Answer in one word.", c
        else:
            k = int(rng.integers(1, 5))
            concepts = sorted(int(x) for x in rng.choice(len(names), size=k, replace=False))
            question, answer = "How many shapes are there? Answer with a number.", str(k)
        img = render_image(concepts, names, rng, int(rng.integers(64, 193)), int(rng.integers(64, 193)))
        (folder / "images" / f"{i:04d}.jpg").write_bytes(img)
        docs.append({"id": i, "image": f"images/{i:04d}.jpg", "question": question, "answer": answer})
    (folder / "test.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / f"{TASK}.yaml").write_text(TASK_YAML)
    (folder / "utils.py").write_text(UTILS)
    return {"task": TASK, "docs": len(docs), "folder": folder.name}
