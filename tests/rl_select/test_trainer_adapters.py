"""The GRPO handoff, checked with the trainers' own code: the demo RL run's export is read by each
trainer's dataset code and every rollout is scored through our adapter the way the trainer's reward
manager calls it; the scores equal the ``rewards`` manifest that ``ovpipe score`` wrote, exactly.

The trainers (verl 0.9.1, openrlhf 0.11.2, areal 1.0.4) and the light packages their dataset /
reward-manager modules import are pip-installed ``--no-deps`` into a cache folder outside the venv
(``$OVPIPE_TRAINERS_DIR``, default ``~/.cache/ovpipe/trainers-<hash of requirements/trainers.txt>``,
about 30 s once) and run in a subprocess (``trainer_checks.py``), so ray, pandas and datasets never
enter this process and torch / transformers stay the venv's.
"""
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from manifests import read_manifest
from ovpipe.cli import main

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
REQS = REPO / "requirements" / "trainers.txt"   # pinned with hashes by `make lock`


@pytest.fixture(scope="session")
def trainers_site() -> Path:
    key = hashlib.sha256(REQS.read_bytes()).hexdigest()[:12]
    base = Path(os.environ.get("OVPIPE_TRAINERS_DIR", Path.home() / ".cache" / "ovpipe"))
    site = base / f"trainers-{key}"
    if not (site / ".complete").exists():
        tmp = base / f"trainers-{key}.partial-{os.getpid()}"
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                               "--target", str(tmp), "-r", str(REQS)], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            pytest.skip(f"could not pip-install the trainers from the package registry: {proc.stderr[-300:]}")
        (tmp / ".complete").write_text(key)
        try:
            tmp.rename(site)
        except OSError:          # another session finished first: use its copy
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return site


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The demo RL recipe with the simulated policy's 8 + 8 rollouts (tests/rl_select/simulated_policy.py) in
    place of the demo model's: prompts → rl-ingest → rollouts → score → select → export; plus the exported
    rollouts as JSONL."""
    from demo.rl import main as demo_main
    from tests.rl_select.simulated_policy import simulate_rollouts

    run = tmp_path_factory.mktemp("rlhandoff")
    data = run / "rl-data"
    assert demo_main(["prompts", "--out", str(data), "--n", "16", "--n-heldout", "8"]) == 0
    args = ["--run-dir", str(run), "--quiet", "--tasks", "2"]
    assert main(["rl-ingest", "--config", "configs/demo/rl-ingest.yaml", "--set",
                 f"inputs=['{data}/prompts.parquet']", *args]) == 0
    simulate_rollouts(run, data / "rollouts.jsonl", n=8)
    assert main(["rollout", "--config", "configs/demo/rollout.yaml", "--set", "backend=file", "--set",
                 f"file={data}/rollouts.jsonl", "--set", "model=simulated-policy", "--set", "n=8", "--set",
                 "prompt_types=[answer_only, thinking]", *args]) == 0
    for step in ("score", "select"):
        assert main([step, "--config", f"configs/demo/{step}.yaml", *args]) == 0
    assert main(["export", "--config", "configs/demo/export.yaml", "--run-dir", str(run), "--quiet"]) == 0
    kept = {r["prompt_id"] for r in read_manifest(run, "selection").to_pylist() if r["kept"]}
    prompts = {p["prompt_id"]: p for p in read_manifest(run, "rl_prompts").to_pylist()}
    rewards = {(r["prompt_id"], r["rollout_idx"]): r for r in read_manifest(run, "rewards").to_pylist()
               if r["reward_type"] == prompts[r["prompt_id"]]["answer_type"]}
    with open(data / "exported_rollouts.jsonl", "w") as f:
        for r in read_manifest(run, "rollouts").to_pylist():
            if r["prompt_id"] in kept:
                f.write(json.dumps({"prompt_id": r["prompt_id"], "rollout_idx": r["rollout_idx"],
                                    "response": r["response"], "question": prompts[r["prompt_id"]]["question"]}) + "\n")
    return run, kept, prompts, rewards


@pytest.fixture(scope="module")
def trainer_checks(demo_run, trainers_site, tmp_path_factory) -> dict:
    """verl's and OpenRLHF's side, in one subprocess (one import of torch, transformers and ray)."""
    run = demo_run[0]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(trainers_site), str(REPO)]),
           "RAY_DISABLE_IMPORT_WARNING": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "trainer_checks.py"), "all", str(run / "export"),
                           str(run / "rl-data" / "exported_rollouts.jsonl"), str(tmp_path_factory.mktemp("trainers"))],
                          capture_output=True, text=True, env=env, cwd=str(REPO), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_demo_selection_has_no_zero_rates_for_unscored_prompts(demo_run):
    from manifests.catalog import connect

    run, *_ = demo_run
    con = connect(run)
    assert con.sql("SELECT count(*) FROM selection WHERE n = 0 AND pass_at_1 IS NOT NULL").fetchall()[0][0] == 0
    assert con.sql("SELECT count(*) FROM selection WHERE n = 0").fetchall()[0][0] >= 1     # the mismatch row


def test_demo_output_check_reads_the_spread_selection_saw(demo_run, tmp_path):
    """`make demo`'s output check passes a selection with prompts solved sometimes and kept, and names a run
    whose rollouts never spread (here: the same run with every reward 0)."""
    import importlib.util
    import shutil

    spec = importlib.util.spec_from_file_location("check_demo_output", REPO / "scripts" / "check_demo_output.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    run = demo_run[0]
    assert check.selection_problems(run) == []
    dead = tmp_path / "dead"
    shutil.copytree(run, dead)
    parts = sorted((dead / "score" / "rewards").glob("part-*.parquet"))
    assert parts
    for f in parts:
        t = pq.read_table(f)
        t = t.set_column(t.schema.get_field_index("reward"), "reward", pa.array([0.0] * t.num_rows))
        t = t.set_column(t.schema.get_field_index("correct"), "correct", pa.array([False] * t.num_rows))
        pq.write_table(t, f)
    assert main(["select", "--config", "configs/demo/select.yaml", "--run-dir", str(dead), "--quiet", "--overwrite"]) == 0
    (problem,) = check.selection_problems(dead)
    assert problem.startswith("select: 0 prompt(s) with 0 < pass@1 < 1 and 0 kept")


@pytest.mark.slow
def test_verl_dataset_and_reward_managers_score_like_ovpipe(demo_run, trainer_checks):
    """verl's RLHFDataset (Qwen2-VL processor) reads every exported row with its image as a content
    part; verl loads our file as `custom_reward_function.path`, and its reward-loop manager (what the
    0.9.1 trainer runs, concurrent calls from a thread pool) and the legacy naive and batch managers
    score a batch of every kept prompt's 16 rollouts exactly as the rewards manifest."""
    run, kept, prompts, rewards = demo_run
    out = trainer_checks["verl"]
    assert out["rows"] == len(kept) and out["answer_types"] == sorted({prompts[p]["answer_type"] for p in kept})
    exported = [r for f in sorted((run / "export" / "verl").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert out["image_parts"] == [len(r["images"]) for r in exported] and min(out["image_parts"]) >= 1
    assert out["roundtrip"]                        # the response text verl decodes is the rollout's, byte for byte
    want = [rewards[tuple(k)]["reward"] for k in out["keys"]]
    assert len(want) == 16 * len(kept) and 0 < sum(want) < len(want)
    assert out["reward_loop"] == want and out["naive"] == want and out["batch"] == want
    assert out["extra_keys"] == ["accuracy", "correct", "failed", "format", "score"]


@pytest.mark.slow
def test_openrlhf_reward_func_scores_like_ovpipe(demo_run, trainer_checks):
    """OpenRLHF's prompt preprocessing turns `<image>` into image parts; its SingleTurnAgentExecutor
    loads our file as `--reward.remote_url` and calls `reward_func(queries, prompts, labels)`."""
    run, kept, prompts, rewards = demo_run
    out = trainer_checks["openrlhf"]
    assert out["rows"] == len(kept) and out["image_parts"] == out["images"]
    assert out["scores"] == [rewards[tuple(k)]["reward"] for k in out["keys"]]
    assert out["extra_logs"] == ["accuracy", "correct", "failed", "format"]


@pytest.mark.slow
def test_verl_shuffle_r1_reshapes_a_dataproto_as_the_trl_path_does(trainer_checks):
    """Shuffle-R1 over verl's DataProto after verl's GRPO advantage (``compute_grpo_outcome_advantage``): 8 groups
    × 8 rollouts, rows reordered as balance_batch reorders them, α = 0.5, S = 4 → 16 pairs kept as 4 × 4. The rows
    are the pure selection's and the TRL reshaper's for the same advantages, seed and step, nothing padded or
    tiled; every tensor and non-tensor key follows its row; meta_info kept, its per-row token counts re-selected;
    the dp_size layout makes optimizer step s on both ranks sub-sampling s."""
    import numpy as np

    from grpo.shuffle_r1 import reshape_indices

    out = trainer_checks["shuffle_r1"]
    G, N, S = 8, 8, 4
    P = G * (N // 2 // 2)                                       # ⌊α·N/2⌋ = 2 pairs a group
    assert out["type"] == "DataProto" and out["rows_in"] == G * N
    assert out["rows_out"] == out["flat_rows"] == 2 * P == 32   # the kept pairs' rows, not the batch's 64
    m = out["metrics"]
    assert (m["shuffle_r1/pairs_kept"], m["shuffle_r1/S"], m["shuffle_r1/T"]) == (P, S, P // S)
    # the pure function on the same advantages, the rows in group order (first appearance of each uid)
    uid, rid, adv = np.array(out["uid_in"]), out["row_id_in"], np.array(out["adv_in"])
    first = {u: i for i, u in reversed(list(enumerate(uid)))}
    perm = np.argsort([first[u] for u in uid], kind="stable")
    idx, _ = reshape_indices(adv[perm], N, 0.5, S, rng=np.random.default_rng([7, 3, 0]))
    want = [rid[i] for i in perm[idx]]
    assert out["row_id_flat"] == want
    # the TRL path (ovpipe grpo's Hook 1, run in the trainers' process) on the same advantages, seed and step
    assert out["row_id_trl"] == want
    # S sub-samplings of T distinct pairs, pair members of one group, some pairs drawn twice across sub-samplings
    pairs = [tuple(want[i:i + 2]) for i in range(0, len(want), 2)]
    subs = [pairs[s * (P // S):(s + 1) * (P // S)] for s in range(S)]
    assert all(len(set(sub)) == P // S for sub in subs)
    assert all(uid[rid.index(a)] == uid[rid.index(b)] for a, b in pairs)
    assert len(set(pairs)) < P and len(set(want)) < len(want) and set(want) <= set(rid)
    # dp_size=2: rank r's contiguous half holds the r-th half of every sub-sampling
    T2 = 2 * (P // S)
    assert out["row_id_out"] == [want[s * T2 + r * T2 // 2 + j] for r in range(2) for s in range(S)
                                 for j in range(T2 // 2)]
    assert all(out["aligned"]) and len(out["aligned"]) == 32
    assert out["batch_keys"] == ["advantages", "attention_mask", "response_mask", "responses", "returns", "row",
                                 "token_level_rewards"]
    assert out["non_tensor_keys"] == ["data_source", "row_id", "uid"] and out["meta_kept"]
    assert m["shuffle_r1/small_advantage_share"] < m["shuffle_r1/small_advantage_share_in"]
    assert m["shuffle_r1/token_utilization"] == 1.0 > m["shuffle_r1/token_utilization_in"]
    assert "adv_estimator=grpo" in out["errors"]["token_varying"]
    assert "rollout.n" in out["errors"]["uneven_groups"]


def test_areal_reward_fn_matches_its_workflow_call(demo_run, trainers_site):
    """AReaL's `areal.api` imports its whole runtime (numba, llvmlite, openai, uvloop, flask …), too
    heavy to install here, so the call is checked against the installed source instead: the keywords
    `VisionRLVRWorkflow` passes to the reward function, then our `reward_fn` called with them and each
    exported AReaL row as `**data`."""
    import ast

    from rl_select.trainers.areal_reward import reward_fn, reward_parts

    src = (trainers_site / "areal" / "workflow" / "vision_rlvr.py").read_text()
    calls = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "async_reward_fn"]
    assert len(calls) == 1
    kw = {k.arg for k in calls[0].keywords}
    assert kw == {"prompt", "completions", "prompt_ids", "completion_ids", None}      # None: **task_data
    run, kept, prompts, rewards = demo_run
    rows = [json.loads(line) for f in sorted((run / "export" / "areal").glob("*/part-*.jsonl"))
            for line in f.read_text().splitlines()]
    assert {r["id"] for r in rows} == kept
    assert {r["prompt_type"] for r in rows} <= {"normal", "thinking"}
    resp = {(r["prompt_id"], r["rollout_idx"]): r["response"] for r in read_manifest(run, "rollouts").to_pylist()}
    got, want = [], []
    for row in rows:
        for key in sorted(k for k in rewards if k[0] == row["id"]):
            got.append(reward_fn(prompt="p", completions=resp[key], prompt_ids=[1], completion_ids=[2], **row))
            want.append(rewards[key]["reward"])
    assert got == want and len(got) == 16 * len(kept)
    # the recipe's format reward (reward/format.py): one <think>, a \\boxed{} after it
    parts = reward_parts(prompt="p", completions="<think>a few words of reasoning</think> so \\boxed{x}",
                         prompt_ids=[], completion_ids=[], **rows[0])
    assert set(parts) == {"reward", "acc_reward", "format_reward"} and parts["format_reward"] == 1.0
    assert reward_parts(prompt="p", completions="<think>a</think><answer>x</answer>", prompt_ids=[], completion_ids=[],
                        **rows[0])["format_reward"] == 0.0


def test_roll_reward_worker_core_scores_like_ovpipe(demo_run):
    """ROLL is not on PyPI (the `roll` package there is an unrelated project), so its worker cannot
    run here: `score_roll` takes what ROLL's reward worker hands over (the decoded responses and each
    row's `reward_model`) and is checked on the exported ROLL parquet."""
    from rl_select.trainers.roll_reward import score_roll

    run, kept, prompts, rewards = demo_run
    rows = [r for f in sorted((run / "export" / "roll").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    resp = {(r["prompt_id"], r["rollout_idx"]): r["response"] for r in read_manifest(run, "rollouts").to_pylist()}
    keys = [k for r in rows for k in sorted(rewards) if k[0] == r["extra_info"]["prompt_id"]]
    rm = {r["extra_info"]["prompt_id"]: r["reward_model"] for r in rows}
    out = score_roll([resp[k] for k in keys], [rm[k[0]] for k in keys], step=3, total_steps=10)
    assert [o["score"] for o in out] == [rewards[k]["reward"] for k in keys]
    assert {r["tag"] for r in rows} == {prompts[p]["source"] for p in kept}      # ROLL routes by data_source


def test_verl_adapter_loads_from_a_file_path_and_maps_statuses():
    """What `custom_reward_function.path` does: load the file by path; a stalled reward is a `timeout`
    → score 0 with `failed = 1`; an unparseable detection answer is an ordinary 0."""
    spec = importlib.util.spec_from_file_location("ovpipe_verl_reward", REPO / "rl_select/trainers/verl_reward.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from rl_select.rewards import score_one

    cases = [("multiple_choice", "\\boxed{b.}", "B", "{}"),
             ("number", "<answer>0.5</answer>", "1/2", "{}"),
             ("detection", "<answer>not json</answer>", '[{"bbox_2d": [0, 0, 1, 1], "label": "a"}]', "{}")]
    for t, resp, gt, params in cases:
        got = mod.compute_score("src", resp, gt, {"answer_type": t, "reward_params": params, "num_turns": None})
        assert got["score"] == score_one((t, resp, gt, params))[0]
        assert got["failed"] == 0.0
    stalled = mod.compute_score("src", "<answer>9^{9^{9^{9^{9}}}}</answer>", "1", {"answer_type": "math"},
                                timeout_s=1.0)
    assert stalled["score"] == 0.0 and stalled["failed"] == 1.0
    with pytest.raises(ValueError, match="answer_type"):
        mod.compute_score("src", "x", "y", {})


def test_openrlhf_response_and_label():
    from rl_select.trainers.openrlhf_reward import parse_label, response_of

    prompt = "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    assert response_of(prompt + "<answer>4</answer><|im_end|>", prompt) == "<answer>4</answer>"
    expanded = "<|im_start|>user\n<|image_pad|><|image_pad|>Q<|im_end|>\n<|im_start|>assistant\nA<|im_end|><|endoftext|>"
    assert response_of(expanded, prompt) == "A"
    with pytest.raises(ValueError, match="reward_label"):
        parse_label("4")


def test_handoff_snippets_wire_existing_data_to_existing_entry_points(demo_run):
    """Each export folder has a HANDOFF.md whose command names files that exist and entry points
    that the adapter modules define."""
    import re

    import rl_select.trainers.areal_reward as areal
    import rl_select.trainers.openrlhf_reward as orl
    import rl_select.trainers.verl_reward as verl

    run, kept, prompts, _ = demo_run
    ex = run / "export"
    splits = sorted(f.stem for f in (ex / "verl").glob("*.parquet"))
    for fmt in ("verl", "openrlhf", "areal", "roll"):
        text = (ex / fmt / "HANDOFF.md").read_text()
        assert all(f"## {s}" in text for s in splits), fmt
        found = re.findall(r"(?:^|[\s='\[])(/[^\s'\"\]]+\.(?:parquet|jsonl|py))", text, re.M)
        assert len(found) >= len(splits) if fmt != "areal" else found == [], (fmt, found)
        for path in found:
            assert Path(path).exists(), (fmt, path)
        assert "timeout" in text.lower()
    verl_text = (ex / "verl" / "HANDOFF.md").read_text()
    path = re.search(r"reward\.custom_reward_function\.path=(\S+)", verl_text).group(1)
    name = re.search(r"reward\.custom_reward_function\.name=(\S+)", verl_text).group(1)
    assert Path(path).resolve() == Path(verl.__file__).resolve() and callable(getattr(verl, name))
    # Shuffle-R1's block: the file it loads defines the function, and its mini-batch is one ABS sub-sampling
    from grpo.shuffle_r1 import pairs_kept_per_group

    sr = verl_text[verl_text.index("## Shuffle-R1"):]
    sr_path, sr_name = re.search(r'load_extern_object\("([^"]+)", "(\w+)"\)', sr).groups()
    spec = importlib.util.spec_from_file_location("verl_reshaper", sr_path)
    sr_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sr_mod)
    assert callable(getattr(sr_mod, sr_name))
    alpha, S = float(re.search(r"alpha=([\d.]+)", sr).group(1)), int(re.search(r"\bS=(\d+)", sr).group(1))
    n, mini = (int(re.search(rf"{k}=(\d+)", sr).group(1)) for k in ("rollout.n", "ppo_mini_batch_size"))
    batch = int(re.search(r"train_batch_size=(\d+)", verl_text).group(1))
    assert mini * n == 2 * batch * pairs_kept_per_group(n, alpha) // S
    assert "after `batch = compute_advantage(...)`" in sr and "self._update_actor(batch)" in sr
    assert "--data.label_key reward_label" in (ex / "openrlhf" / "HANDOFF.md").read_text() and callable(orl.reward_func)
    areal_text = (ex / "areal" / "HANDOFF.md").read_text()
    assert "reward_parts" in areal_text and callable(areal.reward_parts)
    folders = re.findall(r"train_dataset\.path=(\S+)", areal_text)
    assert len(folders) == len(splits) and all(list(Path(f).glob("part-*.jsonl")) for f in folders)
    roll_text = (ex / "roll" / "HANDOFF.md").read_text()
    assert "rl_select.trainers.roll_reward.OvpipeRewardWorker" in roll_text
    assert all(prompts[p]["source"] in roll_text for p in kept) and "domain_interleave_probs" in roll_text


def test_areal_reward_fn_runs_in_a_process_pool_worker():
    """AReaL's AsyncRewardWrapper calls the reward function in a ProcessPoolExecutor worker: our
    sandbox workers start from there too (and a pickled call finds the function by import)."""
    from concurrent.futures import ProcessPoolExecutor

    from rl_select.trainers.areal_reward import reward_fn

    with ProcessPoolExecutor(1) as ex:
        got = [ex.submit(reward_fn, prompt="p", completions=c, prompt_ids=[], completion_ids=[], answer="4",
                         answer_type="math", reward_params="{}").result() for c in ("<answer>4</answer>", "5")]
    assert got == [1.0, 0.0]


def test_handoff_takes_the_time_limit_of_the_score_step_the_selection_read(tmp_path):
    """A score step run under another name, with its own limit: the handoff finds it through the
    selection's inputs, not a fixed folder name."""
    import json

    from rl_select.handoff import score_timeout
    from rl_select.trainers import DEFAULT_TIMEOUT_S

    def folder(name, step, config, outputs):
        (tmp_path / name).mkdir()
        (tmp_path / name / "executor.json").write_text(json.dumps({"step": step, "outputs": outputs}))
        (tmp_path / name / "config.json").write_text(json.dumps(config))

    folder("score-strict", "score", {"timeout_s": 9.0}, ["rewards"])
    folder("pick", "select", {}, ["selection"])
    assert score_timeout(tmp_path, ["pick"]) == 9.0
    assert score_timeout(tmp_path, ["elsewhere"]) == DEFAULT_TIMEOUT_S != 9.0
