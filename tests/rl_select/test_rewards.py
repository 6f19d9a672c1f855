import json
import time

import pytest

from rl_select.rewards import RewardRunner, resolve, score_one
from rl_select.rewards.safe_math import Unsafe, to_sympy


def R(t, response, gt, extra=None):
    return resolve(t)(response, gt, extra or {})


@pytest.mark.parametrize("resp, gt, ok", [
    ("<answer>\\frac{1}{2}</answer>", "0.5", True),
    ("so \\boxed{2x+2}", "2(x+1)", True),
    ("<answer>\\sqrt{4}</answer>", "2", True),
    ("<answer>3</answer>", "2", False),
    ("no answer at all", "2", False),
])
def test_math(resp, gt, ok):
    assert R("math", resp, gt)[1] is ok


def test_safe_math_never_evaluates_code():
    for bad in ["__import__('os').system('true')", "(lambda: 1)()", "x.__class__", "open('/etc/passwd')"]:
        with pytest.raises((Unsafe, SyntaxError)):
            to_sympy(bad)
    with pytest.raises(Unsafe):
        to_sympy("9**9**9**9")


@pytest.mark.parametrize("t, resp, gt, ok", [
    ("choice", "<answer>(B)</answer>", "B", True),
    ("choice", "The answer is C.", "B", False),
    ("number", "<answer>1,234.0</answer>", "1234", True),
    ("number", "<answer>\\frac{3}{4}</answer>", "0.75", True),
    ("number", "<answer>12</answer>", "13", False),
    ("bool", "<answer>Yes.</answer>", "true", True),
    ("bool", "<answer>no</answer>", "true", False),
    ("string", "<answer>  Red Circle! </answer>", "red circle", True),
    ("string", "<answer>blue</answer>", "red", False),
])
def test_simple_types(t, resp, gt, ok):
    assert R(t, resp, gt)[1] is ok


def test_bbox_iou():
    r, ok = R("bbox", "<answer>[0, 0, 10, 10]</answer>", "[5, 0, 15, 10]")
    assert abs(r - 50 / 150) < 1e-9 and not ok
    assert R("bbox", '<answer>{"bbox_2d": [0,0,10,10]}</answer>', "[0,0,10,10]") == (1.0, True)
    assert R("bbox", "<answer>[1, 2, oops</answer>", "[0,0,10,10]") == (0.0, False)  # malformed


def test_ocr_levenshtein_and_floor():
    r, _ = R("ocr", "<answer>hello world</answer>", "hello world")
    assert r == 1.0
    r, _ = R("ocr", "<answer>helo world</answer>", "hello world")
    assert abs(r - (1 - 1 / 11)) < 1e-9
    assert R("ocr", "<answer>xyz</answer>", "hello world")[0] == 0.0  # below 0.5 → 0


def test_html_weights():
    gt = "<div><p>hello there</p></div>"
    assert R("html", gt, gt)[0] == 1.0
    r, _ = R("html", "<span>hello there</span>", gt)
    assert abs(r - (0.6 * 1.0 + 0.4 * 0.0)) < 1e-9


SVG = "<svg xmlns='http://www.w3.org/2000/svg' width='64' height='64'><rect x='8' y='8' width='30' height='30' fill='red'/></svg>"


def test_svg_reward_and_external_refs():
    assert R("svg", SVG, SVG)[0] > 0.99
    other = SVG.replace("width='30'", "width='10'")
    assert 0.3 < R("svg", other, SVG)[0] < 0.99
    for evil in ["<svg xmlns='http://www.w3.org/2000/svg'><image href='http://example.com/x.png'/></svg>",
                 "<!DOCTYPE svg [<!ENTITY x SYSTEM 'file:///etc/passwd'>]><svg>&x;</svg>",
                 "<svg xmlns='http://www.w3.org/2000/svg'><rect style=\"fill:url(http://x/y)\"/></svg>"]:
        reward, correct, status, error = score_one(("svg", evil, SVG, "{}"))
        assert status == "bad_response" and reward == 0.0 and not correct   # an incorrect rollout, not a crash


def test_format_reward_is_the_recipes():
    """LLaVA-OneVision-1.5-RL reward/format.py: one <think>…</think>, a \\boxed{} after it, <answer> blocks
    (+9 characters each) at most 20% of the response."""
    ok = "<think>" + "reasoning " * 5 + "</think> so the answer is \\boxed{3}"
    assert R("format", ok, "")[0] == 1.0
    assert R("format", "<think>a</think><answer>3</answer>", "")[0] == 0.0             # no \\boxed: the recipe's 0
    assert R("format", "<think>a</think><think>b</think>\\boxed{3}", "")[0] == 0.0     # two <think>
    assert R("format", "<think>x</think>\\boxed{3}<answer>" + "y" * 50 + "</answer>", "")[0] == 0.0   # > 20%
    # the named variant beside it takes what the recipe's thinking prompt asks for
    assert R("format-answer-or-boxed", "<think>a</think><answer>3</answer>", "")[0] == 1.0
    assert R("format-answer-or-boxed", "<think>" + "x" * 10 + "</think>\\boxed{" + "y" * 50 + "}", "")[0] == 0.0


def test_shuffle_r1_reward_mix():
    """Shuffle-R1 §5.1: 0.9 · accuracy + 0.1 · format (<think> then \\boxed{})."""
    mix = json.dumps({"reward_mix": "shuffle-r1"})
    assert score_one(("math", "<think>x</think> \\boxed{4}", "4", mix))[:3] == (1.0, True, "ok")
    assert score_one(("math", "\\boxed{4}", "4", mix))[0] == pytest.approx(0.9)
    assert score_one(("math", "<think>x</think> \\boxed{5}", "4", mix))[0] == pytest.approx(0.1)
    assert score_one(("math", "\\boxed{4}", "4", json.dumps({"reward_mix": "other"})))[2] == "error"


def test_detection_through_the_registry():
    """Rule-level checks against ROLL's text live in test_roll_examples.py; here the registry's statuses."""
    gt = [{"bbox_2d": [0, 0, 10, 10], "label": "cat"}, {"bbox_2d": [20, 20, 30, 30], "label": "dog"}]
    gts = json.dumps(gt)
    ratios = {"det_reward_ratio": {"iou_max_label_first": 1.0, "iou_completeness": 0.3}}
    resp = "<think>x</think><answer>" + gts + "</answer>"
    assert R("detection", resp, gts, ratios) == (pytest.approx(1.0), True)
    swapped = "<answer>" + json.dumps([{**gt[0], "label": "dog"}, {**gt[1], "label": "cat"}]) + "</answer>"
    assert R("detection", swapped, gts, ratios)[0] < 0.5
    spam = "<answer>" + json.dumps(gt + [{"bbox_2d": [50 + i, 50, 60 + i, 60], "label": "cat"} for i in range(10)]) + "</answer>"
    assert R("detection", spam, gts, ratios)[0] < 0.01                       # 0.6 ** 10 size penalty
    assert score_one(("detection", "<answer>[{not boxes</answer>", gts, json.dumps(ratios)))[:3] == (0.0, False, "ok")
    assert score_one(("detection", resp, "[{broken reference", "{}"))[2] == "error"     # the ground truth's fault


def test_runner_timeouts_and_adversarial_inputs():
    jobs = [
        ("math", "<answer>9^{9^{9^{9^{9}}}}</answer>", "1", "{}"),              # huge exponent
        ("math", "<answer>" + "\\frac{1}{" * 2000 + "2" + "}" * 2000 + "</answer>", "1", "{}"),  # deep LaTeX
        ("number", "<answer>" + "9" * 10_000_000 + "</answer>", "1", "{}"),     # 10 MB response
        ("math", "<answer>2</answer>", "2", "{}"),
        ("nonexistent-type", "x", "y", "{}"),
    ]
    t0 = time.time()
    with RewardRunner(workers=2, timeout_s=3.0) as runner:
        out = runner.score(jobs)
    assert time.time() - t0 < 20
    for reward, correct, status, error in out[:3]:
        assert status in ("ok", "timeout", "error") and reward == 0.0 and not correct
    assert out[3][:3] == (1.0, True, "ok")
    assert out[4][2] == "error" and "no reward" in out[4][3]


def test_runner_kills_only_the_stuck_job():
    jobs = [("math", "<answer>9^{9^{9^{9^{9}}}}</answer>", "1", "{}")] + [("math", "<answer>2</answer>", "2", "{}")] * 6
    with RewardRunner(workers=2, timeout_s=1.5) as runner:
        out = runner.score(jobs)
    assert all(o[:3] == (1.0, True, "ok") for o in out[1:])


def test_runner_batches_requeue_the_rest_after_a_timeout():
    good = ("math", "<answer>2</answer>", "2", "{}")
    stuck = ("math", "<answer>9^{9^{9^{9^{9}}}}</answer>", "1", "{}")
    jobs = [good] * 5 + [stuck] + [good] * 30 + [("number", "<answer>1</answer>", "2", "{}")]
    with RewardRunner(workers=1, timeout_s=1.5, batch=16) as runner:
        out = runner.score(jobs)
    assert out[5][2] == "timeout"
    assert all(o[:3] == (1.0, True, "ok") for j, o in enumerate(out[:-1]) if j != 5)
    assert out[-1][:3] == (0.0, False, "ok")


def test_roll_verifier_parm_reaches_the_detection_verifier():
    from rl_select.rewards import reward_params

    gt = json.dumps([{"bbox_2d": [0, 0, 10, 10], "label": "cat"}])
    resp = "<answer>" + json.dumps([{"bbox_2d": [0, 0, 10, 8], "label": "cat"}]) + "</answer>"   # IoU 0.8
    vp = {"det_reward_ratio": {"iou_max_label_first": 1.0, "iou_completeness": 0.0}}
    late = json.dumps({"accuracy_ratio": 1.0, "format_ratio": 0.0, "iou_threshold": "dynamic", "step": 10,
                       "total_steps": 10, "verifier_parm": json.dumps(vp)})
    assert reward_params(late)["det_reward_ratio"] == vp["det_reward_ratio"]
    assert score_one(("detection", resp, gt, late))[0] == 0.0                       # τ = 0.99: no match
    avg = json.dumps({"accuracy_ratio": 1.0, "format_ratio": 0.0, "verifier_parm": vp})
    assert score_one(("detection", resp, gt, avg))[0] == pytest.approx(0.8 * 7 / 11)   # matched at τ ≤ 0.8


def test_correct_threshold_override():
    r, c, status, _ = score_one(("ocr", "<answer>helo world</answer>", "hello world", "{}"))
    assert status == "ok" and r > 0.9 and c
    assert score_one(("ocr", "<answer>helo world</answer>", "hello world", '{"correct_threshold": 0.95}'))[1] is False


# -- fidelity to the published recipe's rules (reward/*.py of LLaVA-OneVision-1.5-RL) -------------
@pytest.mark.parametrize("resp, gt, ok", [
    ("\\boxed{b.}", "B", True),            # the recipe strips `.()` and uppercases the first character
    ("<answer>b.</answer>", "B", True),
    ("<answer>(c)</answer>", "C", True),
    ("<answer>D) 42</answer>", "D", True),
    ("<answer>a</answer>", "b", False),
    ("<answer>Blue</answer>", "B", False),  # deliberate: a word starting with B is not option B (the recipe says 1)
    ("<answer>The answer is C</answer>", "C", True),
])
def test_multiple_choice_recipe_rule(resp, gt, ok):
    assert R("multiple_choice", resp, gt)[1] is ok
    assert R("multiple-choice", resp, gt)[1] is ok         # the recipe's AnswerType name, same rule


def test_ocr_recipe_normalisation_and_gold_list():
    assert R("ocr", "<answer>Hello   WORLD</answer>", "hello world")[0] == 1.0     # lower-cased, spaces collapsed
    assert R("ocrtext", "<answer>helo</answer>", '["zzzz", "hello"]')[0] == pytest.approx(0.8)   # best of the golds
    assert R("ocr", "<answer></answer>", "")[0] == 0.0                              # an empty answer scores 0


def test_recipe_answer_types_resolve_and_critic_is_exact():
    for t in ("math-expressions", "html-code", "svg-code", "boolean", "ocrtext", "any", "critic"):
        assert callable(resolve(t))
    assert R("critic", "<answer> Yes </answer>", "Yes")[0] == 1.0 and R("critic", "<answer>yes</answer>", "Yes")[0] == 0.0
    with pytest.raises(KeyError):
        resolve("general-code")            # the recipe executes code for this one; we never execute a response


def test_require_answer_tag_is_the_recipes_extraction():
    strict = '{"require_answer_tag": true}'
    assert score_one(("math", "so \\boxed{4}", "4", "{}"))[0] == 1.0
    assert score_one(("math", "so \\boxed{4}", "4", strict))[:3] == (0.0, False, "ok")
    assert score_one(("math", "<ANSWER>4</ANSWER>", "4", strict))[0] == 1.0
