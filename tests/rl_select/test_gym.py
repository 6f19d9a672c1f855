"""G1's VLM-Gym rules and rewards (arXiv 2505.13426 §3 and Appendix C; chenllliang/G1 vlmgym/sandbox/games),
each checked on a board built to show it."""
import json

import numpy as np
import pytest

from rl_select.gym import (GAMES, VecEnv, components, format_reward, metrics, perception_reward, play, reward,
                           score_actions)
from rl_select.gym import games

UP, RIGHT, DOWN, LEFT = 0, 1, 2, 3


def ans(game, action, perception="", think="t"):
    return f"<perception>\n{perception}\n</perception><think>{think}</think><answer>{games.format_action(game, action)}</answer>"


def test_2048_merge_only_reward_and_integer_actions():
    b = [[2, 2, 4, 0], [0, 0, 0, 0], [2, 0, 2, 2], [0, 0, 0, 4]]
    assert games.move_2048(b, LEFT) == ([[4, 4, 0, 0], [0, 0, 0, 0], [4, 2, 0, 0], [4, 0, 0, 0]], 4 + 4)
    assert games.move_2048(b, RIGHT)[0][0] == [0, 0, 4, 4]
    assert games.move_2048(b, UP)[0][0] == [4, 2, 4, 2]
    s = {"game": "2048", "board": b, "score": 0}
    nxt, r = games.step(s, LEFT)
    assert r == 1.0 and nxt["score"] == 8 and sum(v > 0 for row in nxt["board"] for v in row) == 5 + 1
    # Appendix C: a shift without a merge is a failed move (−1), though the tiles move and a tile spawns
    shift = {"game": "2048", "board": [[2, 0, 0, 0], [0, 4, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]], "score": 0}
    moved, r = games.step(shift, LEFT)
    assert r == -1.0 and moved["board"] != shift["board"] and moved["score"] == 0
    assert games.step(shift, UP)[1] == -1.0
    assert games.step(s, 4) == (s, -1.0)                                  # 4: gymnasium-2048's "still"
    full = [[2, 4, 2, 4], [4, 2, 4, 2], [2, 4, 2, 4], [4, 2, 4, 2]]
    assert games.legal_actions({"game": "2048", "board": full}) == []
    assert games.parse_action("2048", "<think>left merges</think><answer>Action 3</answer>") == 3
    assert games.parse_action("2048", "<answer>left</answer>") is None


def tile(color, shape):
    return 1 + games.SHISEN_COLORS.index(color) * len(games.SHISEN_SHAPES) + games.SHISEN_SHAPES.index(shape)


def test_shisen_sho_pairs_match_on_shape_and_colour_within_two_turns():
    R, r_, B = tile("Red", "circle"), tile("Red", "square"), tile("Blue", "circle")
    X = tile("Green", "star")
    b = [[R, X, R, 0],
         [X, B, B, X],
         [r_, X, X, r_]]
    assert games.shisen_legal(b, (1, 1), (1, 2))                          # adjacent, same colour and shape
    assert games.shisen_legal(b, (0, 0), (0, 2))                          # over the top border: two turns
    assert not games.shisen_legal(b, (0, 0), (1, 1))                      # same shape, other colour
    assert not games.shisen_legal(b, (0, 0), (2, 0))                      # same colour, other shape
    # Appendix C: a pair whose only path needs more than two turns fails
    maze = [[R, X, X, X],
            [0, 0, 0, X],
            [X, X, 0, X],
            [X, R, 0, X],
            [X, X, X, X]]
    assert not games.shisen_legal(maze, (0, 0), (3, 1))                   # down, right, down, left: three turns
    s = {"game": "shisen-sho", "board": b, "score": 0}
    nxt, rew = games.step(s, ((1, 1), (1, 2)))
    assert rew == 1.0 and nxt["board"][1][1:3] == [0, 0] and nxt["score"] == 1
    assert games.step(s, ((0, 0), (1, 1))) == (s, -1.0)
    assert games.perception_text(s).splitlines()[0] == " Red circle | Green star | Red circle | - "


def test_shisen_sho_default_board_is_8x8_of_four_tiles_per_kind():
    s = games.new_board("shisen-sho", np.random.default_rng(0))
    flat = [v for row in s["board"] for v in row]
    assert len(s["board"]) == 8 and all(len(r) == 8 for r in s["board"])
    assert sorted(set(flat.count(v) for v in flat)) == [4] and len(set(flat)) == 16


def test_cifar10_variant_matches_by_class_across_drawings():
    cat_a, cat_b, dog = 1 + 3, 1 + 3 + 10, 1 + 5                           # 1 + class + 10·drawing
    b = [[cat_a, cat_b, dog, 0]]
    assert games.shisen_legal(b, (0, 0), (0, 1), "shisen-sho-cifar10")    # two different cat pictures
    assert not games.shisen_legal(b, (0, 1), (0, 2), "shisen-sho-cifar10")
    assert not games.shisen_legal(b, (0, 0), (0, 1), "shisen-sho")        # in plain Shisen-Sho they differ
    s = games.new_board("shisen-sho-cifar10", np.random.default_rng(1))
    flat = [v for row in s["board"] for v in row]
    assert len(s["board"]) == 6 and all(flat.count(v) == 1 for v in flat)              # every tile its own drawing
    assert all(sum((w - 1) % 10 == (v - 1) % 10 for w in flat) % 4 == 0 for v in flat)  # classes four at a time
    assert "cat" in games.perception_text({"game": "shisen-sho-cifar10", "board": b})


def kind(color, shape):
    return 1 + games.SWAP_COLORS.index(color) * len(games.SWAP_SHAPES) + games.SWAP_SHAPES.index(shape)


def test_swap_is_match3():
    a, b_, c = kind("Red", "circle"), kind("Blue", "square"), kind("Green", "triangle")
    y, z = kind("Yellow", "circle"), kind("Yellow", "square")
    board = [[a, a, b_, a],
             [c, y, z, y],
             [z, c, y, c],
             [y, z, c, z]]
    s = {"game": "swap", "board": board, "score": 0}
    # swapping (0,2)<->(0,3) lines up three red circles: they disappear, tiles fall in from the top
    nxt, r = games.step(s, ((0, 2), (0, 3)))
    assert r == 1.0 and nxt["score"] >= 3 * (1 + 3 - 2) and not games.find_lines(nxt["board"])

    class Refill:            # new tiles in a fixed order, so the fall is visible (the step's own refill is seeded)
        kinds = iter([kind("Blue", "circle"), kind("Red", "triangle"), kind("Green", "circle")] * 10)

        def integers(self, lo, hi):
            return next(self.kinds)

    after, points = games._resolve(games._swapped(board, (0, 2), (0, 3)), Refill())
    assert points == 3 * (1 + 3 - 2)                                      # G1's gamematch3 points
    assert after[0] == [kind("Blue", "circle"), kind("Red", "triangle"), kind("Green", "circle"), b_]
    assert after[1:] == board[1:]                                         # three new tiles fell into row 0
    # Appendix C: a swap that makes no line of three is −1 and reverts
    assert games.step(s, ((1, 0), (2, 0))) == (s, -1.0)
    assert games.step(s, ((0, 0), (1, 1))) == (s, -1.0)                   # not orthogonally adjacent
    assert games.swap_valid(board, (0, 2), (0, 3)) and not games.swap_valid(board, (1, 0), (2, 0))
    fresh = games.new_board("swap", np.random.default_rng(0))["board"]
    assert len(fresh) == 8 and not games.find_lines(fresh) and games.swap_moves(fresh)


def test_final_reward_is_game_plus_alpha_format_plus_beta_perception():
    s = {"game": "2048", "board": [[2, 2, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]], "score": 0}
    truth = games.perception_text(s)
    full = ans("2048", LEFT, truth)
    assert components(s, full) == {"game": 1.0, "format": 1.0, "perception": 1.0}
    assert reward("gym-2048", full, "[]", {"state": s}) == (2.0, True)                    # α = 1, β = 0
    assert reward("gym-2048", full, "[]", {"state": s, "g1_beta": 1.0}) == (3.0, True)
    wrong_board = ans("2048", LEFT, truth.replace("2", "4", 1))
    assert components(s, wrong_board)["perception"] == 0.0                                # PR: fully correct or 0
    assert reward("gym-2048", ans("2048", UP, truth), "[]", {"state": s}) == (0.0, False)  # −1 + 1: no merge
    no_structure = f"<answer>{LEFT}</answer>"
    assert format_reward(no_structure) == 0.0 and perception_reward(s, no_structure) == 0.0
    assert reward("gym-2048", no_structure, "[]", {"state": s}) == (1.0, True)
    out_of_order = f"<think>t</think><perception>\n{truth}\n</perception><answer>3</answer>"
    assert format_reward(out_of_order) == 0.0 and perception_reward(s, out_of_order) == 0.0
    # cells compared with the whitespace around them ignored
    assert perception_reward(s, ans("2048", LEFT, truth.replace(" | ", "|"))) == 1.0


def test_initial_states_are_random_walks_of_g1s_lengths():
    assert games.WALK_STEPS == {"2048": 100, "shisen-sho": 250, "shisen-sho-cifar10": 250, "swap": 250}
    rng = lambda: np.random.default_rng(7)  # noqa: E731
    walked = games.reset("2048", rng())
    fresh = games.new_board("2048", rng())
    assert walked["board"] != fresh["board"] and sum(v > 0 for r in walked["board"] for v in r) > 2
    assert games.reset("2048", rng()) == walked                            # seeded: the same walk
    assert games.reset("2048", rng(), walk_steps=0)["board"] == fresh["board"]
    # by hand: the same draws through the public step
    g = np.random.default_rng(7)
    state = games.new_board("2048", g)
    for _ in range(100):
        state = games.step(state, games.random_action(state, g))[0]
    assert state["board"] == walked["board"]


def test_cumulative_score_and_metrics():
    s = {"game": "2048", "board": [[2, 2, 4, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]], "score": 0}
    out = play(lambda st: f"<answer>{LEFT}</answer>", s, turns=2)
    # turn 1: 2+2 → 4 (score 4); turn 2: 4+4 → 8 (score 8) unless the spawn blocked it; the score is merged values
    first = games.step(s, LEFT)[0]
    second, r2 = games.step(first, LEFT)
    assert out["score"] == 4 + (second["score"] - first["score"]) and out["state"] == second
    m = metrics([s, s], [ans("2048", LEFT, games.perception_text(s)), "<answer>0</answer>"])
    assert m == {"game_reward": 0.0, "perception_accuracy": 0.5, "format_rate": 0.5}


@pytest.mark.parametrize("game", GAMES)
def test_parallel_actions_do_not_advance_and_vec_env_steps(game):
    env = VecEnv(game, n=3, seed=1, walk_steps=5)
    state = json.loads(json.dumps(env.states[0]))
    legal = games.legal_actions(state)
    good = [f"<answer>{games.format_action(game, a)}</answer>" for a in legal[:2]]
    assert score_actions(state, good + ["<answer>nonsense</answer>"]).tolist() == [1.0] * len(good) + [-1.0]
    assert env.states[0] == state
    assert all(o[:8] == b"\x89PNG\r\n\x1a\n" for o in env.observations())
    rewards = env.step([good[0] if good else "x", "<answer>bad</answer>", "<answer>bad</answer>"])
    assert rewards[1:].tolist() == [-1.0, -1.0] and (not good or (rewards[0] == 1.0 and env.states[0] != state))


def test_rl_gym_writes_every_game_in_one_step(tmp_path):
    from manifests import read_manifest
    from ovpipe.cli import main
    from rl_select.rewards import score_one

    args = ["rl-gym", "--set", "states=3", "--set", "sizes={shisen-sho: 4, shisen-sho-cifar10: 4, swap: 5}",
            "--set", "walk_steps={shisen-sho: 20, shisen-sho-cifar10: 20, swap: 20}"]
    assert main(args + ["--run-dir", str(tmp_path / "a"), "--tasks", "3", "--quiet"]) == 0
    assert main(args + ["--run-dir", str(tmp_path / "b"), "--quiet"]) == 0
    rows = read_manifest(tmp_path / "a", "rl_prompts").to_pylist()
    assert sorted(rows, key=lambda r: r["prompt_id"]) == \
        sorted(read_manifest(tmp_path / "b", "rl_prompts").to_pylist(), key=lambda r: r["prompt_id"])
    assert sorted({r["answer_type"] for r in rows}) == sorted(f"gym-{g}" for g in GAMES) and len(rows) == 12
    for r in rows:
        if r["status"] != "ok":
            continue
        extra = json.loads(r["extra"])
        a = json.loads(r["ground_truth"])[0]
        a = a if isinstance(a, int) else tuple(map(tuple, a))
        best = ans(extra["state"]["game"], a, extra["perception"])
        assert score_one((r["answer_type"], best, r["ground_truth"], r["extra"]))[:3] == (2.0, True, "ok")
        assert score_one((r["answer_type"], "<answer>none</answer>", r["ground_truth"], r["extra"]))[0] == -1.0


def test_cold_start_conversations_hold_the_ground_truth_perception_and_ingest_for_stage_2(tmp_path):
    """G1 §3.4: rl-gym → gym-cold-start → ingest (the instruct sets' LLaVA JSON): every conversation's answer is the
    ground-truth perception in G1's structure with a +1 action, so the gym reward gives it GR + FR = 2 and PR = 1."""
    from manifests import read_manifest
    from ovpipe.cli import main
    from rl_select.gym import components

    args = ["--set", "states=2", "--set", "sizes={shisen-sho: 4, shisen-sho-cifar10: 4, swap: 5}",
            "--set", "walk_steps={'2048': 30, shisen-sho: 20, shisen-sho-cifar10: 20, swap: 20}"]
    assert main(["rl-gym", *args, "--run-dir", str(tmp_path), "--quiet"]) == 0
    assert main(["gym-cold-start", "--run-dir", str(tmp_path), "--tasks", "2", "--quiet"]) == 0
    prompts = {p["prompt_id"]: p for p in read_manifest(tmp_path, "rl_prompts").to_pylist() if p["status"] == "ok"}
    records = [r for f in sorted((tmp_path / "gym-cold-start" / "llava").glob("part-*.json"))
               for r in json.loads(f.read_text())]
    assert sorted(r["id"] for r in records) == sorted(prompts)
    for r in records:
        state = json.loads(prompts[r["id"]]["extra"])["state"]
        assert components(state, r["conversations"][1]["value"]) == {"game": 1.0, "format": 1.0, "perception": 1.0}
    data = tmp_path / "gym-cold-start" / "llava"
    assert main(["ingest", "--set", f"inputs=['{data}/part-*.json']", "--run-dir", str(tmp_path / "sft"),
                 "--quiet"]) == 0
    samples = read_manifest(tmp_path / "sft", "samples").to_pylist()
    assert len(samples) == len(records) and {s["status"] for s in samples} == {"ok"}
    assert all(s["conversation"][1]["text"].startswith("<perception>\n") and s["n_images"] == 1 for s in samples)
