"""Untrusted responses: every reward returns a status row quickly, whatever it is fed."""
import json
import time

import pytest

from rl_select.rewards import RewardRunner, score_one
from rl_select.rewards.detection import detection_accuracy

BIG = "x" * 10_000_000        # a 10 MB response
SVG = "<svg xmlns='http://www.w3.org/2000/svg' width='64' height='64'><rect x='8' y='8' width='30' height='30' fill='red'/></svg>"
BOXES = json.dumps([{"bbox_2d": [0, 0, 4, 4], "label": "cat"}])


@pytest.mark.parametrize("t, gt", [("ocr", "hello"), ("html", "<p>x</p>"), ("string", "x"), ("choice", "A"),
                                   ("bool", "yes"), ("number", "1"), ("bbox", "[0,0,4,4]"), ("format", ""),
                                   ("detection", BOXES), ("svg", SVG)])
def test_ten_megabyte_responses(t, gt):
    t0 = time.time()
    reward, correct, status, _ = score_one((t, BIG, gt, "{}"))
    # a guard against a super-linear parse of 10 MB (hours), not a timing: it took under 1 s alone, but a
    # loaded 2-core machine ran one past a 2 s bound
    assert time.time() - t0 < 30 and reward == 0.0 and not correct and status in ("ok", "bad_response")


@pytest.mark.parametrize("t, resp, gt, status", [
    ("number", "<answer>1e999999</answer>", "1", "ok"),                          # overflows to inf → 0
    ("number", "<answer>" + "1" * 5000 + "</answer>", "1", "ok"),
    ("bbox", '<answer>{"bbox_2d": [1, 2, "x", 4]}</answer>', "[0,0,4,4]", "ok"),  # malformed JSON box
    ("bbox", "<answer>" + "[" * 100_000 + "</answer>", "[0,0,4,4]", "ok"),        # JSON nesting bomb
    ("detection", "<answer>" + "[" * 100_000 + "]" * 100_000 + "</answer>", BOXES, "ok"),    # ROLL: no readable boxes scores 0
    ("detection", '<answer>[{"bbox_2d": null}]</answer>', BOXES, "ok"),    # ROLL: no readable boxes scores 0
    ("detection", "<answer>[1, 2]</answer>", BOXES, "ok"),    # ROLL: no readable boxes scores 0
    ("detection", '<answer>{"a": 1}</answer>', BOXES, "ok"),    # ROLL: no readable boxes scores 0
    ("svg", "<svg xmlns='http://www.w3.org/2000/svg'>" + "<rect width='1' height='1'/>" * 20_000 + "</svg>", SVG,
     "bad_response"),                                                             # over the size cap
    ("svg", "<svg xmlns:xlink='http://www.w3.org/1999/xlink' xmlns='http://www.w3.org/2000/svg'>"
            "<use xlink:href='file:///etc/passwd#a'/></svg>", SVG, "bad_response"),
    ("svg", "<svg xmlns='http://www.w3.org/2000/svg'><style>@import url(http://x/y.css);</style></svg>", SVG,
     "bad_response"),
    ("svg", "<svg xmlns='http://www.w3.org/2000/svg'><rect width='10' height='10'", SVG, "bad_response"),  # no </svg>
    ("svg", "<svg xmlns='http://www.w3.org/2000/svg'><rect></svg>", SVG, "bad_response"),  # malformed XML
])
def test_malformed_and_hostile(t, resp, gt, status):
    reward, correct, got, _ = score_one((t, resp, gt, "{}"))
    assert (reward, correct, got) == (0.0, False, status)


@pytest.mark.parametrize("resp", [
    "<svg xmlns='http://www.w3.org/2000/svg'><style>@import 'http://x/y.css';</style></svg>",
    "<svg xmlns='http://www.w3.org/2000/svg'><?xml-stylesheet href='http://x/y.css'?><rect/></svg>",
])
def test_svg_stylesheet_imports_are_refused(resp):
    assert score_one(("svg", resp, SVG, "{}"))[2] == "bad_response"


def test_svg_use_bomb_times_out():
    """10^29 <use> expansions in 7 KB: under the size cap, stopped by the runner's time limit."""
    parts = ["<svg xmlns='http://www.w3.org/2000/svg' xmlns:xlink='http://www.w3.org/1999/xlink'><defs>"
             "<g id='a0'><rect width='1' height='1'/></g>"]
    parts += [f"<g id='a{i}'>" + f"<use xlink:href='#a{i - 1}'/>" * 10 + "</g>" for i in range(1, 30)]
    bomb = "".join(parts) + "</defs><use xlink:href='#a29'/></svg>"
    t0 = time.time()
    with RewardRunner(workers=1, timeout_s=1.5) as runner:
        (out,) = runner.score([("svg", bomb, SVG, "{}")])
    assert out[:3] == (0.0, False, "timeout") and time.time() - t0 < 6


def test_svg_huge_canvas_renders_at_fixed_size():
    resp = "<svg xmlns='http://www.w3.org/2000/svg' width='100000000' height='100000000'><rect width='1' height='1'/></svg>"
    t0 = time.time()
    assert score_one(("svg", resp, SVG, "{}"))[2] == "ok" and time.time() - t0 < 2


def test_math_pathologies_are_bounded_by_the_runner():
    jobs = [("math", "<answer>" + "(" * 5000 + "1" + ")" * 5000 + "</answer>", "1", "{}"),
            ("math", "<answer>10^{10^{10}}</answer>", "1", "{}"),
            ("math", "<answer>" + "{" * 3000 + "</answer>", "1", "{}"),
            ("math", BIG, "1", "{}")]
    t0 = time.time()
    with RewardRunner(workers=2, timeout_s=3.0) as runner:
        out = runner.score(jobs)
    assert time.time() - t0 < 15
    assert all(o[0] == 0.0 and not o[1] and o[2] in ("ok", "timeout") for o in out)


def test_detection_dynamic_schedule():
    gt = [{"bbox_2d": [0.0, 0.0, 10.0, 10.0], "label": "cat"}]
    pred = [{"bbox_2d": [0.0, 0.0, 10.0, 9.0], "label": "cat"}]                   # IoU 0.9
    p = {"iou_threshold": "dynamic", "total_steps": 100,
         "det_reward_ratio": {"iou_max_label_first": 1.0, "iou_completeness": 0.5}}
    early = detection_accuracy(pred, gt, {**p, "step": 5})       # τ = 0.85: matched
    late = detection_accuracy(pred, gt, {**p, "step": 100})      # τ = 0.99: no match, completeness 0
    assert early == pytest.approx(0.5 * 0.9 + 0.5 * 1.0) and late == 0.0
