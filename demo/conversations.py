"""The demo's conversation sets, in the layouts the recipe's data ships in.

``write_demo_conversations(out, seed)`` writes, next to the caption shards of ``demo.corpus``:

- ``llava-558k/blip_laion_cc_sbu_558k.json`` + ``llava-558k/images/*.jpg`` — a LLaVA-558K-style
  alignment set (stage 1): ``human: "<image>\\n" + a brief-caption prompt``, ``gpt: caption``.
  Broken on purpose: 2 rows whose image file is missing, 2 with a truncated JPEG, 2 with an empty
  ``gpt`` turn.
- ``instruct/llava/instruct.json`` + ``instruct/llava/images/*.jpg`` — LLaVA JSON instruction set
  (stage 2), and ``instruct/finevision/train-00000.parquet`` — the FineVision layout (``images``
  with embedded bytes, ``texts: [{user, assistant}]``, ``source`` = the category, and the four
  ``*_ratings`` columns). Both hold multi-turn Q&A about rendered shapes in five categories —
  ``counting`` ("How many shapes are there?" → "There are 3 shapes."), ``color``, ``position``
  (left/right, top/bottom, corners), ``comparison`` (two images: "Which image has more shapes?")
  and ``text`` (text-only arithmetic and shape trivia) — plus two broken rows of each kind the
  layout can express. LLaVA JSON: image_mismatch, bad_last_turn, unknown_role, unexpected_key
  (a ``markdown`` key, as in the published instruct data), empty assistant turn, missing image.
  FineVision (fixed struct fields, so no unknown role or extra key): image_mismatch (a literal
  ``<image>`` in the text), bad_last_turn (null last assistant), empty assistant turn, missing
  image, corrupt image. The first FineVision row is the first LLaVA conversation over the same
  image bytes: ingest gives both the same ``sample_id`` and marks one ``duplicate``.
- ``instruct/llava/short_answer.json`` (images beside the others, ``images/answer-*.jpg``) — the
  answer-only skills the RL stage verifies (``ANSWER_SKILLS``): ``answer_color`` ("What color is the
  shape?" on one shape → ``<answer>teal</answer>``) and ``answer_count`` ("How many shapes are there?" on
  1–5 shapes → ``<answer>4</answer>``), the user turn ending in the recipe's answer-only suffix exactly as
  ``rollout``'s ``answer_only`` template writes it. ``demo.rl`` draws the RL prompts from the same
  skills (``answer_question``), so what stage 2 teaches is what the rollouts are scored on.

Independent RNG streams (``[seed, 558]``, ``[seed, 2]``, ``[seed, 62]``), so the caption corpus of
``write_demo_corpus`` stays byte-identical; everything here is deterministic for a seed.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from demo.corpus import COLORS, SHAPES, caption_for, concept_names, render_image, zipf_probs

BRIEF_PROMPTS = [
    "Describe the image concisely.",
    "Give a brief description of the image.",
    "Provide a brief description of the given image.",
    "Summarize the visual content of the image.",
    "Write a terse but informative summary of the picture.",
]
TRIVIA = [
    ("What color do you get by mixing blue and yellow?", "Mixing blue and yellow gives green."),
    ("What color do you get by mixing red and white?", "Mixing red and white gives pink."),
    ("What color do you get by mixing red and blue?", "Mixing red and blue gives purple."),
    ("How many sides does a hexagon have?", "A hexagon has 6 sides."),
    ("How many sides does a pentagon have?", "A pentagon has 5 sides."),
    ("How many sides does an octagon have?", "An octagon has 8 sides."),
    ("How many corners does a triangle have?", "A triangle has 3 corners."),
    ("Is a square a kind of rectangle?", "Yes, a square is a rectangle with four equal sides."),
]
CATEGORIES = ("counting", "color", "position", "comparison", "text")
RATINGS = ("relevance", "image_correspondence", "visual_dependency", "formatting")
CORNERS = {2: ["on the left", "on the right"], 3: ["in the top left", "in the top right", "at the bottom"],
           4: ["in the top left", "in the top right", "in the bottom left", "in the bottom right"]}


def _plural(shape: str) -> str:
    return shape + ("es" if shape.endswith(("s", "x")) else "s")


def _count(n: int, what: str = "shape") -> str:
    return f"There is 1 {what}." if n == 1 else f"There are {n} {_plural(what)}."


def _scene(rng: np.random.Generator, k: int) -> list[tuple[str, str]]:
    """``k`` shapes, all different (so "the circle" names one), colours drawn with replacement."""
    shapes = rng.choice(len(SHAPES), size=k, replace=False)
    colors = list(COLORS)
    return [(colors[int(rng.integers(len(colors)))], SHAPES[int(s)]) for s in shapes]


def _render(scene: list[tuple[str, str]], rng: np.random.Generator, sides: tuple[int, int] = (64, 256)) -> bytes:
    """The scene drawn by the demo's renderer: objects in reading order on a near-square grid."""
    names = concept_names()
    ids = [names.index(f"{c} {s}") for c, s in scene]
    lo, hi = sides
    return render_image(ids, names, rng, int(rng.integers(lo, hi + 1)), int(rng.integers(lo, hi + 1)))


def make_sample(category: str, rng: np.random.Generator) -> tuple[list[tuple[str, str]], list[bytes]]:
    """(question/answer pairs, images) of one sample; questions carry no ``<image>`` placeholder."""
    if category == "counting":
        scene = _scene(rng, int(rng.integers(1, 6)))
        qa = [("How many shapes are there?", _count(len(scene)))]
        if rng.random() < 0.6:
            color = scene[int(rng.integers(len(scene)))][0]
            n = sum(c == color for c, _ in scene)
            qa.append((f"How many of them are {color}?", f"{n} of them {'is' if n == 1 else 'are'} {color}."))
        return qa, [_render(scene, rng)]
    if category == "color":
        scene = _scene(rng, int(rng.integers(1, 5)))
        asked = rng.permutation(len(scene))[: int(rng.integers(1, min(3, len(scene)) + 1))]
        qa = [(f"What color is the {scene[i][1]}?", f"The {scene[i][1]} is {scene[i][0]}.") for i in asked]
        return qa, [_render(scene, rng)]
    if category == "position":
        scene = _scene(rng, int(rng.integers(2, 5)))
        where = CORNERS[len(scene)]
        asked = rng.permutation(len(scene))[: int(rng.integers(1, 3))]
        qa = []
        for i in asked:
            c, s = scene[i]
            if rng.random() < 0.5:
                qa.append((f"Which shape is {where[i]}?", f"The {c} {s} is {where[i]}."))
            else:
                qa.append((f"Where is the {s}?", f"The {s} is {where[i]}."))
        return qa, [_render(scene, rng)]
    if category == "comparison":
        a, b = rng.choice(np.arange(1, 6), size=2, replace=False).tolist()
        first, second = _scene(rng, a), _scene(rng, b)
        more = "first" if a > b else "second"
        qa = [("Which image has more shapes?", f"The {more} image has more shapes: {a} versus {b}.")]
        if rng.random() < 0.5:
            qa.append(("How many shapes are there in the two images together?", f"There are {a + b} shapes in total."))
        return qa, [_render(first, rng), _render(second, rng)]
    if category == "text":  # arithmetic first (so samples rarely repeat), sometimes a trivia follow-up
        x, y = (int(v) for v in rng.integers(2, 100, size=2))
        qa = [(f"What is {x} + {y}?", f"{x} + {y} = {x + y}.") if rng.random() < 0.6 else
              (f"What is {x} times {y}?", f"{x} times {y} is {x * y}.")]
        if rng.random() < 0.5:
            qa.append(TRIVIA[int(rng.integers(len(TRIVIA)))])
        return qa, []
    raise ValueError(f"unknown demo category {category!r}")


# The answer-only skills: one short, checkable answer about one rendered image (colour: 15 answers, some
# of them near each other — teal/cyan/green, navy/blue, magenta/pink/purple; count: 1–5 shapes on the
# renderer's grid), so a small model learns some of each and its sampled answers spread.
ANSWER_SKILLS = {"color": "What color is the shape?", "count": "How many shapes are there?"}
# Small images (4–25 image tokens after the 2×2 merge): many answers per pack, so stage 2's steps teach them.
ANSWER_SIDES = (56, 140)


def answer_question(skill: str, rng: np.random.Generator) -> tuple[str, str, bytes]:
    """(question without placeholder or suffix, short answer, image) of one draw of an answer-only skill."""
    if skill == "color":
        scene = _scene(rng, 1)
        return ANSWER_SKILLS[skill], scene[0][0], _render(scene, rng, ANSWER_SIDES)
    if skill == "count":
        scene = _scene(rng, int(rng.integers(1, 6)))
        return ANSWER_SKILLS[skill], str(len(scene)), _render(scene, rng, ANSWER_SIDES)
    raise ValueError(f"unknown answer-only skill {skill!r}; known: {sorted(ANSWER_SKILLS)}")


def answer_only_turn(question: str) -> str:
    """The user turn's text after the image: the question and the recipe's answer-only suffix, the same
    template ``rollout`` applies to an RL prompt (``prompt_types: [answer_only]``)."""
    from rl_select.rollout import TEMPLATES

    return TEMPLATES["answer_only"].format(question=question)


def write_short_answer(out: Path, seed: int = 0, n: int = 400) -> dict:
    """The answer-only instruction set, LLaVA JSON (see the module docstring); skills alternate."""
    rng = np.random.default_rng([seed, 62])
    root = out / "instruct" / "llava"
    (root / "images").mkdir(parents=True, exist_ok=True)
    skills = list(ANSWER_SKILLS)
    records = []
    for i in range(n):
        skill = skills[i % len(skills)]
        question, answer, image = answer_question(skill, rng)
        rel = f"images/answer-{i:06d}.jpg"
        (root / rel).write_bytes(image)
        records.append({"id": f"answer-{i:06d}", "category": f"answer_{skill}", "image": rel, "conversations": [
            {"from": "human", "value": "<image>\n" + answer_only_turn(question)},
            {"from": "gpt", "value": f"<answer>{answer}</answer>"}]})
    (root / "short_answer.json").write_text(json.dumps(records, indent=1, ensure_ascii=False) + "\n")
    return {"samples": n, "skills": skills}


def _jpeg_truncated(data: bytes) -> bytes:
    return data[: len(data) // 3]


def write_llava_558k(out: Path, seed: int = 0, n: int = 300) -> dict:
    """LLaVA-558K-style caption conversations (see the module docstring)."""
    rng = np.random.default_rng([seed, 558])
    names = concept_names()
    probs = zipf_probs(len(names), 1.2, rng)
    root = out / "llava-558k"
    (root / "images").mkdir(parents=True, exist_ok=True)
    broken = {7: "missing_image", 101: "missing_image", 19: "corrupt_image", 150: "corrupt_image",
              31: "empty_turn", 211: "empty_turn"}
    records = []
    for i in range(n):
        k = int(rng.choice([1, 2, 2, 3, 3, 4]))
        concepts = [int(c) for c in rng.choice(len(names), size=k, replace=False, p=probs)]
        img = render_image(concepts, names, rng, int(rng.integers(56, 321)), int(rng.integers(56, 321)))
        caption = caption_for(concepts, names, rng)
        prompt = BRIEF_PROMPTS[int(rng.integers(len(BRIEF_PROMPTS)))]
        kind = broken.get(i)
        rel = f"images/{i:09d}.jpg"
        if kind != "missing_image":
            (root / rel).write_bytes(_jpeg_truncated(img) if kind == "corrupt_image" else img)
        records.append({"id": f"{i:09d}", "image": rel, "conversations": [
            {"from": "human", "value": "<image>\n" + prompt},
            {"from": "gpt", "value": "" if kind == "empty_turn" else caption}]})
    (root / "blip_laion_cc_sbu_558k.json").write_text(json.dumps(records, indent=1, ensure_ascii=False) + "\n")
    return {"samples": n, "broken": sorted(set(broken.values()))}


def _llava_record(i: int, category: str, qa, images: list[bytes], root: Path, kind: str | None) -> dict:
    rels = []
    for j, data in enumerate(images):
        rel = f"images/{i:06d}_{j}.jpg"
        if kind != "missing_image" or j > 0:
            (root / rel).write_bytes(data)
        rels.append(rel)
    conv = []
    if category == "text" and i % 4 == 0 and kind is None:
        conv.append({"from": "system", "value": "You are a helpful assistant. Answer in one sentence."})
    for t, (q, a) in enumerate(qa):
        prefix = "<image>\n" * len(images) if t == 0 and kind != "image_mismatch" else ""
        conv += [{"from": "human", "value": prefix + q}, {"from": "gpt", "value": a}]
    if kind == "bad_last_turn":
        conv.append({"from": "human", "value": "Tell me more."})
    elif kind == "unknown_role":
        conv[0]["from"] = "narrator"
    elif kind == "unexpected_key":
        conv[-1]["markdown"] = "**" + conv[-1]["value"] + "**"
    elif kind == "empty_turn":
        conv[-1]["value"] = ""
    rec = {"id": f"instruct-{i:06d}", "category": category}
    if len(rels) == 1:
        rec["image"] = rels[0]
    elif rels:
        rec["images"] = rels
    rec["conversations"] = conv
    return rec


def _finevision_row(category: str, qa, images: list[bytes], kind: str | None, rng) -> dict:
    imgs = [{"bytes": d, "path": None} for d in images]
    texts = [{"user": q, "assistant": a} for q, a in qa]
    if kind == "image_mismatch":
        texts[0]["user"] = "Look at this <image> again. " + texts[0]["user"]
    elif kind == "bad_last_turn":  # a pair whose assistant is null: the conversation ends with the user
        texts.append({"user": "Tell me more.", "assistant": None})
    elif kind == "empty_turn":
        texts[-1]["assistant"] = ""
    elif kind == "missing_image":
        imgs[0] = {"bytes": None, "path": "images/not-uploaded.jpg"}
    elif kind == "corrupt_image":
        imgs[0] = {"bytes": _jpeg_truncated(images[0]), "path": None}
    n = len(texts)
    # FineVision rates each turn 1-5; a text-only turn does not depend on (or match) any image.
    seen = (lambda: rng.integers(3, 6, size=n)) if images else (lambda: np.ones(n, dtype=np.int64))
    ratings = {"relevance": rng.integers(3, 6, size=n), "image_correspondence": seen(),
               "visual_dependency": seen(), "formatting": rng.integers(4, 6, size=n)}
    return {"images": imgs, "texts": texts, "source": category,
            **{f"{k}_ratings": [int(x) for x in ratings[k]] for k in RATINGS}}


def _categories(rng, n: int, shares=(0.25, 0.25, 0.2, 0.15, 0.15)) -> list[str]:
    counts = [int(round(n * s)) for s in shares]
    counts[0] += n - sum(counts)
    cats = [c for c, k in zip(CATEGORIES, counts) for _ in range(k)]
    return [cats[int(i)] for i in rng.permutation(len(cats))]


LLAVA_BROKEN = ("image_mismatch", "bad_last_turn", "unknown_role", "unexpected_key", "empty_turn", "missing_image")
FINEVISION_BROKEN = ("image_mismatch", "bad_last_turn", "empty_turn", "missing_image", "corrupt_image")


def write_instruct(out: Path, seed: int = 0, n_llava: int = 300, n_finevision: int = 200) -> dict:
    """The instruction set as LLaVA JSON and FineVision Parquet (see the module docstring)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng([seed, 2])
    lroot = out / "instruct" / "llava"
    (lroot / "images").mkdir(parents=True, exist_ok=True)
    cats = _categories(rng, n_llava)
    # Broken rows: two of each kind, on image-holding rows spread over the file.
    with_images = [i for i, c in enumerate(cats) if c != "text"]
    spots = [with_images[int(j)] for j in np.linspace(3, len(with_images) - 1, 2 * len(LLAVA_BROKEN)).astype(int)]
    broken = {i: LLAVA_BROKEN[j % len(LLAVA_BROKEN)] for j, i in enumerate(spots)}
    records, first = [], None
    for i, cat in enumerate(cats):
        qa, images = make_sample(cat, rng)
        if first is None and cat != "text" and i not in broken:
            first = (cat, qa, images)
        records.append(_llava_record(i, cat, qa, images, lroot, broken.get(i)))
    (lroot / "instruct.json").write_text(json.dumps(records, indent=1, ensure_ascii=False) + "\n")

    froot = out / "instruct" / "finevision"
    froot.mkdir(parents=True, exist_ok=True)
    cats = _categories(rng, n_finevision)
    with_images = [i for i, c in enumerate(cats) if c != "text"]
    spots = [with_images[int(j)] for j in np.linspace(5, len(with_images) - 1, 2 * len(FINEVISION_BROKEN)).astype(int)]
    fbroken = {i: FINEVISION_BROKEN[j % len(FINEVISION_BROKEN)] for j, i in enumerate(spots)}
    rows = []
    for i, cat in enumerate(cats):
        if i == 0:  # the same conversation and image bytes as the first LLaVA one: a cross-format duplicate
            cat, qa, images = first
        else:
            qa, images = make_sample(cat, rng)
        rows.append(_finevision_row(cat, qa, images, fbroken.get(i), rng))
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("images", pa.list_(image)),
                        ("texts", pa.list_(pa.struct([("user", pa.string()), ("assistant", pa.string())]))),
                        ("source", pa.string()), *[(f"{k}_ratings", pa.list_(pa.int64())) for k in RATINGS]])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), froot / "train-00000.parquet", compression="zstd")
    return {"llava": n_llava, "finevision": n_finevision,
            "broken": {"llava": sorted(set(broken.values())), "finevision": sorted(set(fbroken.values()))}}


def write_demo_conversations(out: Path, seed: int = 0, n_caption: int = 300, n_llava: int = 300,
                             n_finevision: int = 200, n_answer: int = 400) -> dict:
    out = Path(out)
    return {"llava_558k": write_llava_558k(out, seed, n_caption),
            "instruct": write_instruct(out, seed, n_llava, n_finevision),
            "short_answer": write_short_answer(out, seed, n_answer)}
