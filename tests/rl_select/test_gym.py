import json

import pytest

from rl_select.gym import GAMES, VecEnv, format_reward, perception_reward, reward, score_actions
from rl_select.gym import games


def test_2048_moves_and_merges():
    b = [[2, 2, 4, 0], [0, 0, 0, 0], [2, 0, 2, 2], [0, 0, 0, 4]]
    assert games.move_2048(b, "left") == [[4, 4, 0, 0], [0, 0, 0, 0], [4, 2, 0, 0], [4, 0, 0, 0]]
    assert games.move_2048(b, "right")[0] == [0, 0, 4, 4]
    assert games.move_2048(b, "up")[0] == [4, 2, 4, 2]
    full = [[2, 4, 2, 4], [4, 2, 4, 2], [2, 4, 2, 4], [4, 2, 4, 2]]
    assert games.legal_actions({"game": "2048", "board": full}) == []


def test_shisen_connection_rules():
    b = [[1, 2, 1],
         [3, 3, 0],
         [2, 0, 0]]
    assert games.shisen_legal(b, (1, 0), (1, 1))          # adjacent
    assert games.shisen_legal(b, (0, 0), (0, 2))          # over the top border: 3 segments
    assert not games.shisen_legal(b, (0, 1), (1, 1))      # different kinds
    blocked = [[1, 2, 2, 1],
               [2, 2, 2, 2],
               [2, 2, 2, 2]]
    assert games.shisen_legal(blocked, (0, 0), (0, 3))    # via the outside ring above
    boxed = [[2, 2, 2, 2, 2],
             [2, 1, 2, 1, 2],
             [2, 2, 2, 2, 2]]
    assert not games.shisen_legal(boxed, (1, 1), (1, 3))  # walled in


def test_swap_progress():
    b = [[2, 1], [3, 4]]
    assert games.swap_progress(b, (0, 0), (0, 1))
    assert not games.swap_progress(b, (0, 0), (1, 1))     # not adjacent
    assert not games.swap_progress(b, (1, 0), (1, 1))     # both already home, no progress


@pytest.mark.parametrize("game", GAMES)
def test_parallel_actions_do_not_advance_and_vec_env_steps(game):
    env = VecEnv(game, n=4, seed=1)
    state = json.loads(json.dumps(env.states[0]))
    legal = games.legal_actions(state)
    good = [f"<answer>{a}</answer>" if game == "2048" else f"<answer>({a[0][0]},{a[0][1]}),({a[1][0]},{a[1][1]})</answer>"
            for a in legal[:2]]
    r = score_actions(state, good + ["<answer>nonsense</answer>"])
    assert r.tolist() == [1.0] * len(good) + [-1.0]
    assert env.states[0] == state                        # nothing advanced
    obs = env.observations()
    assert len(obs) == 4 and all(o[:8] == b"\x89PNG\r\n\x1a\n" for o in obs)
    resp = [good[0] if i == 0 and good else "<answer>bad</answer>" for i in range(4)]
    rewards = env.step(resp)
    assert rewards[1:].tolist() == [-1.0] * 3
    if good:
        assert rewards[0] == 1.0 and env.states[0] != state


def test_perception_and_format_rewards():
    state = {"game": "swap", "board": [[2, 1], [3, 4]]}
    good = "<perception>2 1\n3 4</perception><think>swap the first two</think><answer>(0,0),(0,1)</answer>"
    assert perception_reward(state, good) == 1.0 and format_reward(good) == 1.0
    assert perception_reward(state, "<perception>2 1\n4 3</perception>") == 0.5
    assert format_reward("<answer>(0,0),(0,1)</answer>") == 0.0
    assert reward("gym-swap", good, "[]", {"state": state}) == (1.0, True)


def test_rl_gym_step_feeds_the_pipeline(tmp_path):
    from manifests import read_manifest
    from ovpipe.cli import main

    assert main(["rl-gym", "--set", "game=shisen-sho-pictures", "--set", "states=6", "--run-dir", str(tmp_path),
                 "--tasks", "2", "--quiet"]) == 0
    rows = read_manifest(tmp_path, "rl_prompts").to_pylist()
    assert len(rows) == 6 and all(r["answer_type"] == "gym-shisen-sho-pictures" for r in rows)
    ok = [r for r in rows if r["status"] == "ok"]
    from rl_select.rewards import score_one

    for r in ok:
        a = json.loads(r["ground_truth"])[0]
        resp = f"<answer>({a[0][0]},{a[0][1]}),({a[1][0]},{a[1][1]})</answer>"
        assert score_one((r["answer_type"], resp, r["ground_truth"], r["extra"]))[:3] == (1.0, True, "ok")
        assert score_one((r["answer_type"], "<answer>(0,0),(0,0)</answer>", r["ground_truth"], r["extra"]))[0] == -1.0
