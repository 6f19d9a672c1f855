"""select's per-prompt counting and rules on hand-made reward tables."""
import numpy as np
import pyarrow as pa

from rl_select.select import SelectConfig, aggregate, decide


def rewards(rows):
    cols = ["prompt_id", "rollout_idx", "reward", "correct", "reward_type", "status"]
    return pa.table({c: [r[i] for r in rows] for i, c in enumerate(cols)})


def test_bad_response_is_incorrect_but_error_drops_the_prompt():
    rows = [("a", i, float(i < 2), i < 2, "detection", "ok" if i < 6 else "bad_response") for i in range(8)]
    rows += [("b", i, float(0 < i < 2), 0 < i < 2, "math", "ok" if i else "timeout") for i in range(8)]
    rows += [("a", i, 1.0, True, "format", "ok") for i in range(8)]            # format rows are not correctness
    agg = aggregate(rewards(rows)).to_dicts()
    a, b = agg
    assert (a["n"], a["c"], a["errors"]) == (8, 2, 0) and (b["n"], b["c"], b["errors"]) == (7, 1, 1)
    d = decide([8, 7], [2, 1], [0, 1], [a["mean_reward"], b["mean_reward"]], [0, 0], [0, 0], ["x", "x"], SelectConfig())
    assert list(d["reason"]) == ["kept", "error"] and d["split"][0] == "stage1-answer-only"
    b2 = aggregate(rewards(rows), timeouts_as_incorrect=True).to_dicts()[1]
    assert (b2["n"], b2["c"], b2["errors"]) == (8, 1, 0)


def test_rules_and_splits():
    cfg = SelectConfig()
    n = np.full(5, 16)
    c = np.array([0, 16, 1, 4, 12])
    d = decide(n, c, np.zeros(5), c / 16, n, c, ["a", "b", "a", "b", "a"], cfg)
    # c=0 too hard; c=16 too easy; c=1 gap 1−1/16 kept → CoT (pass@1 < .25); c=4 kept → answer-only;
    # c=12 pass@1 .75 > .7 → too easy
    assert list(d["reason"]) == ["too_hard", "too_easy", "kept", "kept", "too_easy"]
    assert list(d["split"]) == [None, None, "stage2-cot", "stage1-answer-only", None]
    band = decide(n, c, np.zeros(5), c / 16, n, c, ["a"] * 5, SelectConfig(rule="mean_band"))
    assert list(band["reason"]) == ["too_hard", "too_easy", "kept", "kept", "too_easy"]
    cat = decide(n, c, np.zeros(5), c / 16, n, c, ["a", "b", "a", "b", "a"],
                 SelectConfig(split_rule="category", cot_categories=["a"]))
    assert list(cat["split"])[2:4] == ["stage2-cot", "stage1-answer-only"]
    no_gap = decide([4], [3], [0], [0.75], [4], [3], ["a"], SelectConfig(max_pass_at_1=0.9, min_gap=0.3))
    assert no_gap["reason"][0] == "no_gap"                                      # 1 − 0.75 < 0.3


def test_unscored_prompt_has_undefined_rates_not_zero():
    d = decide([0, 4], [0, 2], [1, 0], [float("nan"), 0.5], [0, 4], [0, 2], ["a", "a"], SelectConfig(ks=[1, 4]))
    assert np.isnan(d["pass_at_1"][0]) and np.isnan(d["pass_at_n"][0]) and np.isnan(d["gap"][0])
    assert np.isnan(d["passk"][4][0]) and d["passk"][4][1] == 1.0 and d["reason"][0] == "error"
    assert list(d["valid"]) == [False, True]


def test_pass_at_k_map_is_typed_and_null_when_unscored():
    import pyarrow as pa

    from rl_select.select import pass_at_k_map

    m = pass_at_k_map({1: np.array([0.0, 0.25]), 4: np.array([0.0, 0.75])}, np.array([True, False]))
    assert m.type == pa.map_(pa.int32(), pa.float64())
    assert m.to_pylist() == [None, [(1, 0.25), (4, 0.75)]]


def test_held_out_sources_are_measured_and_never_kept():
    """A held-out prompt keeps its rates (what a trained policy is compared on) and is never kept, however it
    scores; an error still names it an error; the spread table counts it under its own source."""
    import polars as pl

    from rl_select.select import spread_lines

    n, c = np.full(4, 8), np.array([3, 3, 0, 8])
    src = ["train", "held", "held", "held"]
    d = decide(n, c, [0, 0, 0, 1], c / 8, n, c, ["a"] * 4, SelectConfig(held_out_sources=["held"]), src)
    assert list(d["reason"]) == ["kept", "held_out", "held_out", "error"] and list(d["kept"]) == [True] + [False] * 3
    assert d["pass_at_1"][1] == 3 / 8 and d["pass_at_n"][1] == 1.0 and d["split"][1] is None
    assert list(decide(n, c, np.zeros(4), c / 8, n, c, ["a"] * 4, SelectConfig(), src)["reason"])[:2] == ["kept"] * 2
    scored = pl.DataFrame({"source": src, "pass_at_1": c / 8, "pass_at_n": [1.0, 1.0, 0.0, 1.0]})
    rows = spread_lines(scored)[2:]
    assert rows == ["| held | 3 | 1 | 1 | 1 | 1 | 0 | 2 | 0.458 | 0.667 |",
                    "| train | 1 | 0 | 1 | 0 | 0 | 0 | 1 | 0.375 | 1.000 |"]
