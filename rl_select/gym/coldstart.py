"""``gym-cold-start``: G1's perception-enhanced cold start (§3.4) as instruction data for pretrain stage 2.

    ovpipe gym-cold-start --run-dir RUN            # after rl-gym; then ingest RUN/gym-cold-start/llava/*.json

G1 fine-tunes on game responses whose perception is the ground truth before RL, so the policy starts out
reading the board. For every ``ok`` gym prompt the step writes one LLaVA-JSON conversation (the format
``ingest`` reads for the recipe's instruct sets): the user turn is the prompt (the rendered board as
``<image>``), the assistant turn is ``<perception>`` + the board's ground-truth transcript + ``</perception>``, a
``<think>`` and the ``<answer>`` of a +1 action (2048: the merge worth the most; else the first +1 action).
G1 takes the reasoning from a teacher model's responses; with no teacher here, the ``<think>`` is a rule-written
account of the move (which legal actions score and why this one) — a stand-in for the teacher's text, while
the perception, the structure and the action are the ground truth's. Images go to ``llava/images/`` as PNG.

Output: ``RUN/gym-cold-start/llava/part-{rank:05d}.json`` (a JSON list), ``category = g1-cold-start-<game>``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ovpipe.step import Step, TaskContext, slice_bounds


@dataclass
class ColdStartConfig:
    gym_step: str = "rl-gym"          # the rl-gym step whose rl_prompts are turned into conversations

    def __post_init__(self):
        from ovpipe.config import check_step_folder

        check_step_folder("gym_step", self.gym_step)


def reasoning(state: dict, legal: list, action) -> str:
    from rl_select.gym import games

    g = state["game"]
    if g == "2048":
        names = {a: games.ACTIONS_2048[a] for a in legal}
        gains = {a: games.move_2048(state["board"], a)[1] for a in legal}
        moves = ", ".join(f"{names[a]} ({a}) merges tiles worth {gains[a]}" for a in legal)
        return f"Moves that merge: {moves}. {names[action]} merges the most, so I play {action}."
    what = "line up three or more identical tiles" if g == "swap" else "connect two matching tiles in at most two turns"
    return (f"{len(legal)} action(s) {what}. Taking {games.format_action(g, action)}: "
            f"{games.cell_text(g, state['board'][action[0][0]][action[0][1]])} and "
            f"{games.cell_text(g, state['board'][action[1][0]][action[1][1]])}.")


def conversation(p: dict) -> dict | None:
    """One rl_prompts row of a gym game → a LLaVA-JSON record (without the image file), or None when the state has
    no +1 action."""
    from rl_select.gym import games

    extra = json.loads(p["extra"])
    state = extra["state"]
    legal = [a if isinstance(a, int) else tuple(map(tuple, a)) for a in json.loads(p["ground_truth"])]
    if p["status"] != "ok" or not legal:
        return None
    if state["game"] == "2048":
        action = max(legal, key=lambda a: (games.move_2048(state["board"], a)[1], -a))
    else:
        action = legal[0]
    answer = (f"<perception>\n{extra['perception']}\n</perception><think>{reasoning(state, legal, action)}</think>"
              f"<answer>{games.format_action(state['game'], action)}</answer>")
    return {"id": p["prompt_id"], "image": f"images/{p['prompt_id']}.png", "category": f"g1-cold-start-{state['game']}",
            "conversations": [{"from": "human", "value": p["question"]}, {"from": "gpt", "value": answer}]}


def run(cfg: ColdStartConfig, task: TaskContext) -> None:
    out = task.step_dir / "llava"
    (out / "images").mkdir(parents=True, exist_ok=True)
    n = sum(b.num_rows for b in task.iter_input("rl_prompts", ["prompt_id"]))
    lo, hi = slice_bounds(n, task.rank, task.world_size)
    records = []
    for p in (r for b in task.iter_input("rl_prompts", lo=lo, hi=hi) for r in b.to_pylist()):
        rec = conversation(p) if (p["answer_type"] or "").startswith("gym-") else None
        if rec is None:
            task.stats.inc("skipped")
            continue
        (out / rec["image"]).write_bytes(p["images"][0])
        records.append(rec)
        task.stats.inc(f"conversations/{rec['category']}")
    tmp = out / f".part-{task.rank:05d}.json.tmp"
    tmp.write_text(json.dumps(records, indent=1))
    tmp.rename(out / f"part-{task.rank:05d}.json")


STEP = Step("gym-cold-start", ColdStartConfig, run, inputs={"rl_prompts": "gym_step"},
            description="G1's perception cold start: gym states → LLaVA-JSON conversations for stage 2")
