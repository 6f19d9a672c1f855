"""ROLL's two example rows from its docs (docs_roll/.../vl_rlvr_pipeline_start.md, "Data Format"), written in
ROLL's parquet schema with images as the `datasets` Image feature, through rl-ingest → rollout (file) →
score → select → export --format roll, and the verifier rules checked against ROLL's own definitions."""
import ast
import json
import os

import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageDraw

from manifests import read_manifest
from ovpipe.cli import main
from rl_select.rewards import score_one
from rl_select.rewards.detection import (coco_ap, detection_accuracy, dynamic_threshold, match_max_iou_first,
                                         match_max_iou_first_roll_code, match_max_label_first, parse_boxes,
                                         verify_format)

datasets = pytest.importorskip("datasets")

V3DET_BOXES = ("[{'bbox_2d': [484, 227, 818, 998], 'label': 'shiba dog'}, {'bbox_2d': [106, 142, 473, 998], "
               "'label': 'shiba dog'}, {'bbox_2d': [274, 468, 427, 652], 'label': 'dog collar'}, "
               "{'bbox_2d': [490, 522, 609, 611], 'label': 'dog collar'}]")
RATIOS = {"iou_max_label_first": 1.0, "iou_max_iou_first": 0.0, "iou_completeness": 0.30000001192092896,
          "map": 0.0, "map50": 0.0, "map75": 0.0}
MATH_Q = ("<image>As shown in the figure, point D is the midpoint of line segment AC, $BC = \\frac{1}{2}AB$, and "
          "$BD = 1$cm. What is the length of AB?")
DET_Q = ("<image>\nLocate all objects of the designated class present in the image:\n- dog collar\n- shiba dog\n\n"
         "Begin by clearly explaining your thought process enclosed within <think> and </think> tags. Afterward, "
         "present your final detection results enclosed within <answer> and </answer> tags.\nFor example:\n<think>\n"
         "Your detailed reasoning process here.\n</think>\n<answer>\n[{'bbox_2d': [x1,y1,x2,y2],'label': label_name}]"
         "\n</answer>")


def roll_features():
    from datasets import Features, Image as HFImage, Sequence, Value

    f32 = Value("float32")
    return Features({
        "data_source": Value("string"), "images": Sequence(HFImage()),
        "prompt": [{"content": Value("string"), "role": Value("string")}], "ability": Value("string"),
        "reward_model": {"answer": Value("string"), "ground_truth": Value("string"), "accuracy_ratio": f32,
                         "format_ratio": f32, "verifier": Value("string"),
                         "verifier_parm": {"det_verifier_normalized": Value("bool"),
                                           "det_reward_ratio": {k: f32 for k in RATIOS}}},
        "extra_info": {"id": Value("string"), "image_path": Value("string")}})


def drawn(size, boxes=()):
    """A stand-in for the row's image (ROLL's images are not shipped): its size, shapes where the boxes are."""
    im = Image.new("RGB", size, (200, 200, 190))
    d = ImageDraw.Draw(im)
    for x1, y1, x2, y2 in boxes:
        d.rectangle([x1 * size[0] / 1000, y1 * size[1] / 1000, x2 * size[0] / 1000, y2 * size[1] / 1000],
                    outline=(120, 60, 20), width=3)
    return im


def pixel_answer(boxes_1000, size):
    """The ground truth in the image's own pixels (what a Qwen2.5-VL-style model answers with): the centre of
    each 1000-frame unit, so ROLL's truncating rescale gives the ground truth back exactly."""
    w, h = size
    return json.dumps([{"bbox_2d": [round((x + 0.5) * s / 1000, 2) for x, s in zip(b["bbox_2d"], (w, h, w, h))],
                        "label": b["label"]} for b in boxes_1000])


@pytest.fixture(scope="module")
def roll_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("roll")
    gt_boxes = ast.literal_eval(V3DET_BOXES)
    rows = [
        {"data_source": "mm_math", "images": [drawn((252, 56))], "prompt": [{"content": MATH_Q, "role": "user"}],
         "ability": "math",
         "reward_model": {"answer": "4", "ground_truth": "\\boxed{4}", "accuracy_ratio": 1.0, "format_ratio": 0.0,
                          "verifier": "mathverify",
                          "verifier_parm": {"det_verifier_normalized": None,
                                            "det_reward_ratio": {k: None for k in RATIOS}}},
         "extra_info": {"id": None, "image_path": "images/51284809.png"}},
        {"data_source": "v3det_train", "images": [drawn((799, 533), [b["bbox_2d"] for b in gt_boxes])],
         "prompt": [{"content": DET_Q, "role": "user"}], "ability": "cv_detection",
         "reward_model": {"answer": V3DET_BOXES, "ground_truth": f"<answer>\n{V3DET_BOXES}\n</answer>",
                          "accuracy_ratio": 1.0, "format_ratio": 0.10000000149011612, "verifier": "detection",
                          "verifier_parm": {"det_verifier_normalized": True, "det_reward_ratio": RATIOS}},
         "extra_info": {"id": None, "image_path": "images/a00004438/19_1169_36968567106_1209f085a7_c.jpg"}}]
    data = run / "data"
    data.mkdir()
    datasets.Dataset.from_list(rows, features=roll_features()).to_parquet(str(data / "roll.parquet"))
    assert main(["rl-ingest", "--set", f"inputs=['{data}/roll.parquet']", "--set", "layout=roll",
                 "--run-dir", str(run), "--quiet"]) == 0
    prompts = {p["source"]: p for p in read_manifest(run, "rl_prompts").to_pylist()}
    perfect_det = f"<think>\nTwo shiba dogs, two collars.\n</think>\n<answer>\n{pixel_answer(gt_boxes, (799, 533))}\n</answer>"
    responses = {
        "mm_math": ["<think>\nAB = 2 BC and BD = 1, so AB = 4.\n</think>\n<answer>\\boxed{4}</answer>",
                    "<think>\nAB = 4\n</think>\n\\boxed{4}", "<think>\nguess\n</think>\n\\boxed{3}",
                    "\\boxed{4}",             # no </think> and no blank line: ROLL finds no answer part
                    "<think>a</think><think>b</think>\\boxed{4}", "<think>\nx\n</think>\n\\boxed{5}",
                    "<think>\nx\n</think>\n2", "<think>\nx\n</think>\n\\boxed{6}"],
        "v3det_train": [perfect_det,
                        perfect_det.replace("\n<answer>\n", "<answer>"),               # right boxes, ROLL's format 0
                        "<think>\nhmm\n</think>\n<answer>\n[{'bbox_2d': [0, 0, 5, 5], 'label': 'shiba dog'}]\n</answer>",
                        "<answer>\nnot boxes\n</answer>", "no answer at all",
                        "<think>\nx\n</think>\n<answer>\n[]\n</answer>",
                        "<think>\nx\n</think>\n<answer>\n[{'bbox_2d': [700, 500, 780, 530], 'label': 'cat'}]\n</answer>",
                        "<answer>\n[{'bbox_2d': [1, 2, 3]]\n</answer>"]}
    with open(data / "rollouts.jsonl", "w") as f:
        for src, resps in responses.items():
            for i, r in enumerate(resps):
                f.write(json.dumps({"prompt_id": prompts[src]["prompt_id"], "rollout_idx": i, "response": r}) + "\n")
    for argv in (["rollout", "--set", "backend=file", "--set", f"file={data}/rollouts.jsonl"], ["score"],
                 ["select", "--set", "ks=[1,2,4,8]"], ["export", "--set", "formats=[roll]"]):
        assert main(argv + ["--run-dir", str(run), "--quiet"]) == 0
    return run, prompts


def rewards_by_source(run, prompts):
    src = {p["prompt_id"]: s for s, p in prompts.items()}
    out = {}
    for r in read_manifest(run, "rewards").to_pylist():
        out.setdefault(src[r["prompt_id"]], {})[r["rollout_idx"]] = r
    return out


def test_both_example_rows_ingest_and_score_without_an_error_row(roll_run):
    run, prompts = roll_run
    assert {s: p["status"] for s, p in prompts.items()} == {"mm_math": "ok", "v3det_train": "ok"}
    assert prompts["mm_math"]["answer_type"] == "mathverify" and prompts["v3det_train"]["answer_type"] == "detection"
    assert json.loads(prompts["v3det_train"]["extra"])["input_size"] == [799, 533]
    got = rewards_by_source(run, prompts)
    assert {r["status"] for rs in got.values() for r in rs.values()} == {"ok"}
    # ROLL's mathverify: the answer part after the one </think>; a bare \boxed{4} has none, two <think>s void it
    assert [got["mm_math"][i]["reward"] for i in range(8)] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_a_perfect_detection_answer_gets_the_top_score(roll_run):
    run, prompts = roll_run
    det = rewards_by_source(run, prompts)["v3det_train"]
    # accuracy 1 (normalised from pixels back to the 1000 frame) and ROLL's format 1: (1·1 + 0.1·1) / 1.1
    assert det[0]["reward"] == pytest.approx(1.0) and det[0]["correct"]
    assert det[1]["reward"] == pytest.approx(1 / 1.10000000149011612)     # same boxes, `<answer>` not on its own line
    assert max(r["reward"] for r in det.values()) == det[0]["reward"]
    assert all(det[i]["reward"] < 0.5 for i in range(2, 8))


def test_export_round_trips_rolls_schema(roll_run, tmp_path):
    run, prompts = roll_run
    (f,) = (run / "export" / "roll").glob("*.parquet")
    ds = datasets.Dataset.from_parquet(str(f))
    want = roll_features()
    for k in ("data_source", "images", "prompt", "ability"):
        assert ds.features[k] == want[k], k
    for k, v in want["reward_model"].items():
        assert ds.features["reward_model"][k] == v, k
    rows = {r["data_source"]: r for r in ds}
    assert isinstance(rows["v3det_train"]["images"][0], Image.Image) and rows["v3det_train"]["images"][0].size == (799, 533)
    assert rows["v3det_train"]["tag"] == "v3det_train"
    rm = rows["v3det_train"]["reward_model"]
    assert (rm["verifier"], rm["verifier_parm"]["det_verifier_normalized"]) == ("detection", True)
    assert rm["verifier_parm"]["det_reward_ratio"]["iou_completeness"] == pytest.approx(0.3)
    assert rows["mm_math"]["reward_model"]["verifier_parm"]["det_reward_ratio"]["map"] is None
    # the export ingests again to the same prompts, and the same responses score the same
    assert main(["rl-ingest", "--set", f"inputs=['{f}']", "--set", "layout=roll", "--run-dir", str(tmp_path),
                 "--quiet"]) == 0
    again = {p["source"]: p for p in read_manifest(tmp_path, "rl_prompts").to_pylist()}
    for s, p in prompts.items():
        q = again[s]
        assert (q["question"], q["ground_truth"], q["answer_type"], q["images"]) == \
            (p["question"], p["ground_truth"], p["answer_type"], p["images"])
        e1, e2 = json.loads(p["extra"]), json.loads(q["extra"])
        assert {k: e2[k] for k in e1} == e1
    handoff = (run / "export" / "roll" / "HANDOFF.md").read_text()
    assert "domain_interleave_probs" in handoff and "v3det_train" in handoff and "mm_math" in handoff


# -- the verifier's definitions, each against ROLL's text ---------------------------------------------------------
def test_boxes_read_as_rolls_data_ships_them_and_nothing_runs():
    boxes = parse_boxes(V3DET_BOXES)
    assert [b["label"] for b in boxes] == ["shiba dog", "shiba dog", "dog collar", "dog collar"]
    assert parse_boxes(json.dumps([{"bbox_2d": [1, 2, 3, 4], "label": "A"}]))[0]["label"] == "a"
    with pytest.raises(ValueError):
        parse_boxes("[__import__('os').system('echo pwned')]")
    # ROLL drops invalid items and repeated positions
    assert len(parse_boxes("[{'bbox_2d': [5, 5, 1, 1], 'label': 'x'}, {'bbox_2d': [0, 0, 1, 1], 'label': 'x'},"
                           " {'bbox_2d': [0, 0, 1, 1], 'label': 'y'}]")) == 1


def test_dynamic_threshold_is_rolls_schedule():
    # "0.85 for the first 10% training steps, and 0.95 for the next 15%, and 0.99 for the remaining"
    assert [dynamic_threshold(s, 100) for s in (0, 10, 11, 25, 26, 100)] == [0.85, 0.85, 0.95, 0.95, 0.99, 0.99]


def test_threshold_from_det_iou_threshold(monkeypatch):
    gt = [{"bbox_2d": [0.0, 0.0, 100.0, 100.0], "label": "a"}]
    pred = [{"bbox_2d": [0.0, 0.0, 100.0, 90.0], "label": "a"}]      # IoU 0.9
    ratios = {"det_reward_ratio": {"iou_max_label_first": 1.0, "iou_completeness": 0.0}}
    monkeypatch.setenv("DET_IOU_THRESHOLD", "0.9")
    assert detection_accuracy(pred, gt, ratios) == pytest.approx(0.9)
    monkeypatch.setenv("DET_IOU_THRESHOLD", "0.95")
    assert detection_accuracy(pred, gt, ratios) == 0.0
    monkeypatch.setenv("DET_IOU_THRESHOLD", "average")              # matched at 0.5 … 0.9: 9 of 11 thresholds
    assert detection_accuracy(pred, gt, ratios) == pytest.approx(0.9 * 9 / 11)
    monkeypatch.setenv("DET_IOU_THRESHOLD", "0.42")                 # not one of ROLL's: ROLL falls back to average
    assert detection_accuracy(pred, gt, ratios) == pytest.approx(0.9 * 9 / 11)
    monkeypatch.delenv("DET_IOU_THRESHOLD")
    assert detection_accuracy(pred, gt, ratios) == pytest.approx(0.9 * 9 / 11)


def test_two_matchings_completeness_and_size_penalty():
    gt = [{"bbox_2d": [0.0, 0.0, 10.0, 10.0], "label": "a"}]
    # the wrong label overlaps best: max-IoU-first takes it (IoU 0 for the label), max-label-first skips it
    pred = [{"bbox_2d": [0.0, 0.0, 10.0, 10.0], "label": "b"}, {"bbox_2d": [0.0, 0.0, 10.0, 8.0], "label": "a"}]
    assert match_max_iou_first(pred, gt, 0.5) == [(0, 0, 0.0)]
    assert match_max_label_first(pred, gt, 0.5) == [(1, 0, pytest.approx(0.8))]
    p = {"iou_threshold": 0.5, "det_reward_ratio": {"iou_max_label_first": 1.0, "iou_completeness": 0.5}}
    # one match of 1 gt, 2 predictions: completeness 1 − (0 + 1/2)/2 = 0.75; size penalty 0.6^|2−1|
    assert detection_accuracy(pred, gt, p) == pytest.approx(0.6 * (0.5 * 0.8 + 0.5 * 0.75))
    p["det_reward_ratio"] = {"iou_max_iou_first": 1.0, "iou_completeness": 0.5}
    assert detection_accuracy(pred, gt, p) == pytest.approx(0.6 * (0.5 * 0.0 + 0.5 * 0.75))


def test_rolls_released_max_iou_first_pairs_the_last_free_boxes():
    """ROLL's code reuses its loop variables, so it pairs the last free prediction with the last free ground truth
    (scored with the best IoU); `det_match_impl: roll_code` reproduces that, the documented rule is the default."""
    gt = [{"bbox_2d": [0.0, 0.0, 10.0, 10.0], "label": "a"}, {"bbox_2d": [50.0, 50.0, 60.0, 60.0], "label": "b"}]
    pred = [gt[0], {"bbox_2d": [0.0, 0.0, 10.0, 9.0], "label": "b"}]
    assert match_max_iou_first(pred, gt, 0.5) == [(0, 0, 1.0)]
    # the far box gt[1] goes to pred[1] (same label, IoU 0) and is scored with the best IoU, 1.0
    assert match_max_iou_first_roll_code(pred, gt, 0.5) == [(1, 1, 1.0), (0, 0, 1.0)]


def test_map_is_cocos_ap():
    gt = parse_boxes(V3DET_BOXES)
    assert coco_ap(gt, gt) == {"map": 1.0, "map50": 1.0, "map75": 1.0}
    # one of the two 'shiba dog' boxes found, both collars: APs 0.5 and 1 (101-point, monotone precision)
    half = coco_ap(gt[1:], gt)
    assert half["map50"] == pytest.approx((51 / 101 + 1.0) / 2)
    assert coco_ap([{"bbox_2d": [0.0, 0.0, 1.0, 1.0], "label": "cat"}], gt)["map"] == 0.0


def test_roll_format_and_ratio_weighting():
    ans = "<answer>\n" + V3DET_BOXES + "\n</answer>"
    assert verify_format("<think>x</think>\n" + ans) == 1.0
    assert verify_format("<think>x</think>" + ans.replace("\n<answer>\n", "<answer>")) == 0.0
    params = json.dumps({"accuracy_ratio": 2.0, "format_ratio": 1.0, "verifier_parm": {"det_reward_ratio": RATIOS}})
    # accuracy 1 from the ground truth itself (no normalisation without an input size), format 0: 2/3
    assert score_one(("detection", ans.replace("\n<answer>\n", "<answer>"), ans, params))[0] == pytest.approx(2 / 3)
    # the weighting applies to every verifier: a math row with format_ratio 1 and ROLL's math format
    mp = json.dumps({"accuracy_ratio": 1.0, "format_ratio": 1.0})
    assert score_one(("mathverify", "<think>\nx\n</think>\n<answer>\\boxed{4}</answer>", "\\boxed{4}", mp))[0] == 1.0
    assert score_one(("mathverify", "<think>\nx\n</think>\n\\boxed{4}", "\\boxed{4}", mp))[0] == 0.5
    assert score_one(("math", "\\boxed{4}", "4", json.dumps({"accuracy_ratio": 0, "format_ratio": 0})))[2] == "error"

