"""`select` as map → reduce → apply: the reduce cuts the sorted prompt list into one prompt_id range per
apply rank (DuckDB, under a memory limit); each apply rank reads only its range's rewards / rollouts /
rl_prompts rows. The merged `selection` is byte-identical to the whole-corpus computation (`aggregate` +
`decide` on every row) for 1, 3 and 8 tasks, and an apply rank's memory follows its slice, not the corpus."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from manifests import read_manifest
from manifests.io import read_part, write_part, write_table
from ovpipe.cli import main
from ovpipe.config import load_config
from rl_select.select import SelectConfig, selection_table

MiB = 1 << 20


def write_corpus(run: Path, n: int = 3000, seed: int = 0, odd_ids: bool = True) -> None:
    """`rl_prompts` (3 parts; duplicates, repeated non-duplicate ids, bad rows, a NULL status), `rewards`
    (fractional rewards, every status, `format` rows, orphan ids, prompts with only `format` rows; rows
    shuffled across 4 parts in two step folders, two parts not even sorted within) and `rollouts`."""
    rng = np.random.default_rng(seed)
    ids = [f"{x:016x}" for x in rng.integers(0, 2 ** 63, n)]
    if odd_ids:                                   # any string orders the same in DuckDB, polars and pyarrow
        ids[:4] = ["A", "zz-é", "0", "0" * 20]
    src = rng.choice(["geo", "chart", "ocr"], n)
    cat = rng.choice(["math", "chart", "default"], n)
    status = rng.choice(["ok", "bad_row", "image_mismatch"], n, p=[0.9, 0.06, 0.04]).astype(object)
    if n > 5:
        status[5] = None                          # a NULL status is not a prompt (`!= "duplicate"` is NULL)
    prompts = [(ids[i], src[i], cat[i], status[i]) for i in range(n)]
    prompts += [(ids[i], "dup-src", "dup", "duplicate") for i in rng.choice(n, n // 30, replace=False)]
    prompts += [(ids[i], "again", "again", "ok") for i in rng.choice(n, n // 50, replace=False)]   # first one wins
    order = rng.permutation(len(prompts))
    for k, part in enumerate(np.array_split(order, 3)):
        rows = [prompts[i] for i in part]
        m = len(rows)
        write_part({"prompt_id": [r[0] for r in rows], "source": [r[1] for r in rows], "category": [r[2] for r in rows],
                    "question": ["<image>q"] * m, "images": [[]] * m, "ground_truth": ["1"] * m,
                    "answer_type": ["math"] * m, "extra": ["{}"] * m, "status": [r[3] for r in rows],
                    "error": [None] * m}, run / "rl-ingest" / "rl_prompts" / f"part-{k:05d}.parquet", "rl_prompts",
                   sort=True)
    rewarded = [ids[i] for i in rng.choice(n, int(n * 0.85), replace=False)]
    rewarded += [f"orphan{i:04d}" for i in range(n // 50)]            # rewards of a prompt not in rl_prompts
    reward_rows, rollout_rows = [], []
    for j, pid in enumerate(rewarded):
        r = int(rng.choice([4, 8, 16]))
        only_format = j % 97 == 3
        p = rng.beta(0.7, 0.7)
        for i in range(r):
            reward = float(rng.random() < p) if j % 3 else float(rng.random())   # a third fractional
            st = rng.choice(["ok", "bad_response", "timeout", "error"], p=[0.97, 0.015, 0.01, 0.005]) if j % 7 else "ok"
            if not only_format:
                reward_rows.append((pid, i, reward, reward > 0.5, "math", st))
            if j % 2 or only_format:
                reward_rows.append((pid, i, 1.0, True, "format", "ok"))
            rollout_rows.append((pid, i, "answer_only" if (i + j) % 3 else "thinking"))
    order = rng.permutation(len(reward_rows))
    folders = ["rescore", "score", "score", "score"]
    for k, part in enumerate(np.array_split(order, 4)):
        rows = [reward_rows[i] for i in part]
        write_part({"prompt_id": [r[0] for r in rows], "rollout_idx": [r[1] for r in rows],
                    "reward": [r[2] for r in rows], "correct": [r[3] for r in rows],
                    "reward_type": [r[4] for r in rows],
                    "status": [str(r[5]) for r in rows], "error": [None] * len(rows)},
                   run / folders[k] / "rewards" / f"part-{k:05d}.parquet", "rewards", sort=k % 2 == 0)
    order = rng.permutation(len(rollout_rows))
    for k, part in enumerate(np.array_split(order, 2)):
        rows = [rollout_rows[i] for i in part]
        m = len(rows)
        write_part({"prompt_id": [r[0] for r in rows], "rollout_idx": [r[1] for r in rows],
                    "prompt_type": [r[2] for r in rows], "response": [""] * m, "tokens": [1] * m,
                    "backend": ["file"] * m, "model": ["m"] * m, "sampling": ["{}"] * m},
                   run / "rollout" / "rollouts" / f"part-{k:05d}.parquet", "rollouts", sort=True)


def merged_bytes(run: Path, tmp: Path) -> bytes:
    f = tmp / "merged-selection.parquet"
    write_table(read_manifest(run, "selection"), f)
    return f.read_bytes()


def reference_bytes(run: Path, cfg: SelectConfig, tmp: Path) -> tuple[bytes, dict]:
    """The whole-corpus computation (what every rank used to do): every row of every input through
    `aggregate` + `decide` at once."""
    rewards = read_manifest(run, "rewards", sort=False)
    rollouts = read_manifest(run, "rollouts", step=cfg.rollouts_step, sort=False) \
        if cfg.split_rule == "prompt_type" else None
    prompts = read_manifest(run, "rl_prompts", columns=["prompt_id", "source", "category", "status"])
    table, reasons = selection_table(rewards, rollouts, prompts, cfg)
    part = write_part(table, tmp / "ref" / "part-00000.parquet", "selection", sort=True)   # as a part is written
    f = tmp / "ref-selection.parquet"
    write_table(read_part(part, "selection"), f)
    return f.read_bytes(), reasons


CONFIGS = {
    "gap": [],
    "prompt_type": ["--set", "split_rule=prompt_type", "--set", "ks=[1,3,8]"],
    "category_mean_band": ["--set", "split_rule=category", "--set", "cot_categories=['math']",
                           "--set", "rule=mean_band", "--set", "timeouts_as_incorrect=true"],
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_selection_is_byte_identical_to_the_whole_corpus_computation_for_1_3_8_tasks(tmp_path, name):
    ref = None
    for tasks in (1, 3, 8):
        run = tmp_path / f"t{tasks}"
        write_corpus(run)
        assert main(["select", "--run-dir", str(run), "--tasks", str(tasks), "--quiet", *CONFIGS[name]]) == 0
        if ref is None:
            cfg = load_config(SelectConfig, json.loads((run / "select" / "config.json").read_text()))
            ref, reasons = reference_bytes(run, cfg, tmp_path)
            report = (run / "select" / "report.md").read_text()
        assert merged_bytes(run, tmp_path) == ref, (name, tasks)
        assert (run / "select" / "report.md").read_text() == report
        st = json.loads((run / "select" / "stats.json").read_text())["counters"]
        assert {k: v for k, v in st.items() if k.startswith("reason/")} == {f"reason/{k}": v
                                                                          for k, v in reasons.items()}
        # the reduce left one small artifact (the ranges), each apply rank its sorted part
        sdir = run / "select"
        assert [p.name for p in (sdir / "reduced").iterdir()] == ["ranges.npz"]
        assert sorted(p.name for p in (sdir / "selection").iterdir()) == [f"part-{r:05d}.parquet" for r in range(tasks)]
        assert not list(sdir.glob(".duckdb-*"))


def test_selection_counts_every_kind_of_prompt(tmp_path):
    run = tmp_path / "run"
    write_corpus(run, n=600)
    assert main(["select", "--run-dir", str(run), "--tasks", "3", "--quiet"]) == 0
    sel = read_manifest(run, "selection").to_pylist()
    ids = [r["prompt_id"] for r in sel]
    assert ids == sorted(set(ids))                                               # one row a prompt, sorted
    by = {r["prompt_id"]: r for r in sel}
    assert by["A"]["n"] > 0 or by["A"]["reason"] == "error"
    orphans = [r for r in sel if r["prompt_id"].startswith("orphan")]
    assert orphans and all(r["source"] is None for r in orphans)                 # rewarded, not in rl_prompts
    first = {}                                    # a repeated prompt: its first non-duplicate row (part, then row)
    for f in sorted((run / "rl-ingest" / "rl_prompts").glob("part-*.parquet")):
        for p in read_part(f, "rl_prompts").to_pylist():
            if p["status"] not in (None, "duplicate"):
                first.setdefault(p["prompt_id"], p["source"])
    assert {pid: by[pid]["source"] for pid in first} == first
    assert "again" in first.values() and not any(r["source"] == "dup-src" for r in sel)
    unscored = [r for r in sel if r["n"] == 0]
    assert unscored and all(r["reason"] == "error" and r["pass_at_1"] is None and r["pass_at_k"] is None
                            for r in unscored)


def test_more_tasks_than_prompts_and_the_ranges(tmp_path):
    run = tmp_path / "run"
    write_corpus(run, n=4, odd_ids=False)
    assert main(["select", "--run-dir", str(run), "--tasks", "8", "--quiet"]) == 0
    ref, _ = reference_bytes(run, SelectConfig(), tmp_path)
    assert merged_bytes(run, tmp_path) == ref
    r = np.load(run / "select" / "reduced" / "ranges.npz")
    rows = r["rows"].tolist()
    assert sum(rows) == read_manifest(run, "selection").num_rows and rows[-1] == 0
    live = [i for i, k in enumerate(rows) if k]
    ids = json.loads(r["ids"].tobytes())
    first, last = ids["first"], ids["last"]
    assert all(first[a] <= last[a] < first[b] for a, b in zip(live, live[1:]))


def test_an_apply_rank_refuses_a_range_that_changed_under_it(tmp_path):
    from ovpipe.executors.task import TaskFailed, run_task

    run = tmp_path / "run"
    write_corpus(run, n=300)
    assert main(["select", "--run-dir", str(run), "--tasks", "2", "--quiet"]) == 0
    f = run / "select" / "reduced" / "ranges.npz"
    r = dict(np.load(f))
    r["rows"] = r["rows"] + 1
    np.savez(f, **r)
    (run / "select" / "completions" / "apply-00000").unlink()
    with pytest.raises(TaskFailed, match="prompts in its range"):
        run_task("select", run, 0, 2, phase="apply")


def test_a_null_prompt_id_is_a_clear_error(tmp_path):
    run = tmp_path / "run"
    write_corpus(run, n=100)
    write_part({"prompt_id": [None], "rollout_idx": [0], "reward": [1.0], "correct": [True], "reward_type": ["math"],
                "status": ["ok"], "error": [None]}, run / "score" / "rewards" / "part-00009.parquet", "rewards")
    assert main(["select", "--run-dir", str(run), "--tasks", "2", "--quiet"]) == 1
    log = (run / "select" / "failures" / "reduce").read_text()
    assert "NULL prompt_id" in log and "rewards" in log


MEASURE = r"""
import json, sys
from pathlib import Path
import numpy, polars, pyarrow, pyarrow.parquet, pyarrow.compute, duckdb, matplotlib  # not the task's memory
import rl_select.select, rl_select.passk, manifests.io, ovpipe.executors.task
from ovpipe.executors.task import run_task
from ovpipe.mapreduce import vmhwm_bytes

run, tasks = Path(sys.argv[1]), int(sys.argv[2])
base = vmhwm_bytes()
(run / "select" / "completions" / "apply-00000").unlink()
run_task("select", run, 0, tasks, phase="apply")
print(json.dumps({"delta": vmhwm_bytes() - base}))
"""


def _apply_delta(run: Path, tasks: int) -> float:
    assert main(["select", "--run-dir", str(run), "--tasks", str(tasks), "--workers", "2", "--quiet",
                 "--set", "split_rule=prompt_type"]) == 0
    r = subprocess.run([sys.executable, "-c", MEASURE, str(run), str(tasks)], capture_output=True, text=True,
                       cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])["delta"] / MiB


def test_apply_rank_memory_follows_its_slice_not_the_corpus(tmp_path):
    """The same slice (~2.5K prompts) out of an 8× larger corpus (2 → 16 tasks): an apply rank's peak
    resident memory stays flat. The old step held every rank's whole corpus (rewards, rollouts, prompts)."""
    small, large = tmp_path / "small", tmp_path / "large"
    write_corpus(small, n=5000, seed=1)
    write_corpus(large, n=40_000, seed=2)
    a, b = _apply_delta(small, 2), _apply_delta(large, 16)
    print(f"VmHWM added by apply rank 0, MiB: 5K prompts / 2 tasks {a:.1f}; 40K prompts / 16 tasks {b:.1f}")
    assert b - a < 24, (a, b)
