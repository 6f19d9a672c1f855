"""A test fixture: rollouts of a simulated policy with a known success rate per prompt.

The selection rules and the trainer handoff are checked on rates chosen to cover every rule's case
(never, rarely, sometimes, mostly, always solved), which a real model's rollouts give only by chance.
`make demo` selects on the demo model's own rollouts instead (mk/rl.mk); this stays a fixture.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

LEVELS = (0.0, 0.1, 0.3, 0.6, 1.0)


def simulate_rollouts(run_dir: Path, out: Path, n: int = 8, seed: int = 0) -> dict:
    """Per ok prompt of ``run_dir``'s ``rl_prompts``, a success probability from ``LEVELS`` in turn; ``n``
    answer-only + ``n`` thinking rollouts as the ``file`` backend's JSONL. Returns {prompt_id: rate}."""
    from manifests import read_manifest

    rng = np.random.default_rng(seed)
    prompts = [p for p in read_manifest(run_dir, "rl_prompts").to_pylist() if p["status"] == "ok"]
    truth = {}
    with open(out, "w") as f:
        for j, p in enumerate(prompts):
            rate = LEVELS[j % len(LEVELS)]
            truth[p["prompt_id"]] = rate
            idx = 0
            for ptype in ("answer_only", "thinking"):
                for _ in range(n):
                    ok = rng.random() < rate
                    ans = p["ground_truth"] if ok else str(int(rng.integers(100, 999)))
                    body = f"<answer>{ans}</answer>" if ptype == "answer_only" else \
                        f"<think>Let me look at the image carefully.</think><answer>{ans}</answer>"
                    f.write(json.dumps({"prompt_id": p["prompt_id"], "rollout_idx": idx, "prompt_type": ptype,
                                        "response": body, "model": "simulated-policy"}) + "\n")
                    idx += 1
    return truth
