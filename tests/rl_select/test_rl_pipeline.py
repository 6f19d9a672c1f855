"""rl-ingest → rollout (file backend with known success rates, and a tiny real model) → score →
select → export, checked exactly."""
import io
import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from manifests import read_manifest
from ovpipe.cli import main


def png(color):
    b = io.BytesIO()
    Image.new("RGB", (20, 20), color).save(b, format="PNG")
    return b.getvalue()


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("rl")
    data = run / "data"
    data.mkdir()
    rows = [{"images": [{"bytes": png((i * 20, 0, 0)), "path": None}], "problem": f"<image>What is {i} + {i}?",
             "answer": str(2 * i)} for i in range(10)]
    rows.append({"images": [{"bytes": png("blue"), "path": None}], "problem": "<image><image>Two?", "answer": "x"})
    pq.write_table(pa.Table.from_pylist(rows), data / "train.parquet")
    assert main(["rl-ingest", "--set", f"inputs=['{data}/train.parquet']", "--set", "layout=geometry3k",
                 "--run-dir", str(run), "--quiet", "--tasks", "2"]) == 0
    prompts = [p for p in read_manifest(run, "rl_prompts").to_pylist() if p["status"] == "ok"]
    # prompt j: c_j = j correct answers out of n = 8 (answer-only)
    rates = {}
    with open(data / "rollouts.jsonl", "w") as f:
        for j, p in enumerate(sorted(prompts, key=lambda p: p["prompt_id"])):
            c = j % 9
            rates[p["prompt_id"]] = c
            for i in range(8):
                ans = p["ground_truth"] if i < c else "-1"
                f.write(json.dumps({"prompt_id": p["prompt_id"], "rollout_idx": i, "response": f"<answer>{ans}</answer>"}) + "\n")
    assert main(["rollout", "--set", "backend=file", "--set", f"file={data}/rollouts.jsonl", "--run-dir", str(run),
                 "--quiet", "--tasks", "2"]) == 0
    assert main(["score", "--run-dir", str(run), "--quiet", "--tasks", "2"]) == 0
    assert main(["select", "--run-dir", str(run), "--quiet", "--set", "ks=[1,2,4,8]"]) == 0
    assert main(["export", "--run-dir", str(run), "--quiet", "--set", "areal_shard_rows=3"]) == 0
    return run, rates


def test_ingest_placeholder_mismatch_is_a_row(rl_run):
    run, _ = rl_run
    st = {p["status"] for p in read_manifest(run, "rl_prompts").to_pylist()}
    assert st == {"ok", "image_mismatch"}


def test_selection_exact(rl_run):
    run, rates = rl_run
    sel = {r["prompt_id"]: r for r in read_manifest(run, "selection").to_pylist()}
    for pid, c in rates.items():
        r = sel[pid]
        assert (r["n"], r["correct"]) == (8, c)
        p1, pn = c / 8, 1.0 if c > 0 else 0.0
        assert r["pass_at_1"] == pytest.approx(p1) and r["pass_at_n"] == pytest.approx(pn)
        k4 = dict(r["pass_at_k"])[4]                                          # a typed MAP<int32, double>
        assert k4 == pytest.approx(1 - math.comb(8 - c, 4) / math.comb(8, 4) if 8 - c >= 4 else 1.0, abs=1e-12)
        want = "too_hard" if pn < 0.5 else "too_easy" if p1 > 0.7 else "no_gap" if pn - p1 < 0.2 else "kept"
        assert r["reason"] == want, (c, r)
        if want == "kept":
            assert r["split"] == ("stage2-cot" if p1 < 0.25 else "stage1-answer-only")
    assert sum(r["reason"] == "error" for r in sel.values()) == 1  # the mismatch row
    unscored = [r for r in sel.values() if r["n"] == 0]                    # never rolled out: rates undefined
    assert len(unscored) == 1 and all(r[k] is None for r in unscored
                                      for k in ("pass_at_1", "pass_at_n", "gap", "mean_reward", "pass_at_k"))


def test_selection_sql_nulls_and_pass_at_k_map(rl_run):
    """`ovpipe sql` sees NULL rates for unscored prompts and filters on pass@4 directly."""
    from manifests.catalog import connect

    run, rates = rl_run
    con = connect(run)
    assert con.sql("SELECT count(*) FROM selection WHERE n = 0 AND pass_at_1 IS NOT NULL").fetchall()[0][0] == 0
    want = sum((1 - math.comb(8 - c, 4) / math.comb(8, 4) if 8 - c >= 4 else 1.0) >= 0.5 for c in rates.values())
    assert con.sql("SELECT count(*) FROM selection WHERE pass_at_k[4] >= 0.5").fetchall()[0][0] == want
    assert con.sql("SELECT typeof(pass_at_k) FROM selection LIMIT 1").fetchall()[0][0] == "MAP(INTEGER, DOUBLE)"


def test_exports_round_trip(rl_run):
    run, rates = rl_run
    kept = {r["prompt_id"]: r for r in read_manifest(run, "selection").to_pylist() if r["kept"]}
    prompts = {p["prompt_id"]: p for p in read_manifest(run, "rl_prompts").to_pylist()}
    ex = run / "export"
    n = 0
    for split_file in (ex / "verl").glob("*.parquet"):
        for r in pq.read_table(split_file).to_pylist():
            p = prompts[r["extra_info"]["prompt_id"]]
            assert r["reward_model"]["ground_truth"] == p["ground_truth"]
            assert [i["bytes"] for i in r["images"]] == p["images"]
            assert r["prompt"][0]["content"].count("<image>") == len(r["images"])
            assert (r["problem"], r["answer"]) == (p["question"], p["ground_truth"])   # EasyR1 keys
            n += 1
    assert n == len(kept)
    roll = [r for f in (ex / "roll").glob("*.parquet") for r in pq.read_table(f).to_pylist()]
    assert len(roll) == len(kept) and all(r["reward_model"]["verifier"] == "math" for r in roll)
    for r in roll:
        p = prompts[r["extra_info"]["prompt_id"]]
        assert r["reward_model"]["ground_truth"] == p["ground_truth"] and [i["bytes"] for i in r["images"]] == p["images"]
        assert (r["reward_model"]["accuracy_ratio"], r["reward_model"]["format_ratio"]) == (1.0, 0.0)
        assert r["prompt"][0]["content"].count("<image>") == len(r["images"])
    areal = [(f, json.loads(line)) for f in (ex / "areal").glob("*/part-*.jsonl") for line in f.read_text().splitlines()]
    assert len(areal) == len(kept)
    assert all(len(f.read_text().splitlines()) <= 3 for f in (ex / "areal").glob("*/part-*.jsonl"))
    for f, r in areal:
        p = prompts[r["id"]]
        assert r["answer"] == p["ground_truth"] and f.parent.name == kept[r["id"]]["split"]
        assert [(ex / "areal" / i).read_bytes() for i in r["images"]] == p["images"]
        assert r["problem"].count("<image>") == len(r["images"])
    orl = [json.loads(line) for f in (ex / "openrlhf").glob("*.jsonl") for line in f.read_text().splitlines()]
    assert sorted(r["label"] for r in orl) == sorted(prompts[i]["ground_truth"] for i in kept)
    by_label = {p["ground_truth"]: p for i, p in prompts.items() if i in kept}
    for r in orl:
        p = by_label[r["label"]]
        assert [(ex / "openrlhf" / i).read_bytes() for i in r["images"]] == p["images"]
        assert r["prompt"].count("<image>") == len(r["images"])


def test_grpo_reads_the_selection_directly_as_the_export_writes_it(rl_run):
    """`ovpipe grpo --set selection_step=select` trains on the very rows the export wrote, without an export."""
    from grpo.step import GRPOStepConfig, check, prompt_splits, split_rows

    run, _ = rl_run
    via_export = GRPOStepConfig(model="m", stages=["answer_only", "cot"])
    direct = GRPOStepConfig(model="m", stages=["answer_only", "cot"], selection_step="select")
    splits = {p.stem for p in (run / "export" / "verl").glob("*.parquet")}
    assert prompt_splits(direct, run) == prompt_splits(via_export, run) == splits == {"stage1-answer-only", "stage2-cot"}
    for split in sorted(splits):
        rows = split_rows(direct, run, split)
        assert rows and rows == split_rows(via_export, run, split)       # same rows, bytes, order and index
        assert [r["extra_info"]["prompt_id"] for r in split_rows(direct, run, split, images=False)] == \
            [r["extra_info"]["prompt_id"] for r in rows]
    model = run / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    check(GRPOStepConfig(model=str(model), stages=["answer_only", "cot"], selection_step="select"), run)
    with pytest.raises(ValueError, match="stage 'cot' reads split 'nope', which the select step 'select' kept no "
                                         "prompt in"):
        check(GRPOStepConfig(model=str(model), stages=["answer_only", "cot"], selection_step="select",
                             splits={"cot": "nope"}), run)


@pytest.mark.slow
def test_tiny_transformers_model_generates_for_real(rl_run, tmp_path):
    import shutil

    from demo.tiny_vlm import build_tiny_vlm

    run, _ = rl_run
    model = build_tiny_vlm(tmp_path / "vlm")   # a VLM: the prompts' images go through its processor
    r2 = tmp_path / "run"
    shutil.copytree(run / "rl-ingest", r2 / "rl-ingest")
    assert main(["rollout", "--set", f"model={model}", "--set", "n=3", "--set", "max_new_tokens=8",
                 "--run-dir", str(r2), "--quiet"]) == 0
    rows = read_manifest(r2, "rollouts").to_pylist()
    assert len(rows) == 10 * 3
    assert all(r["backend"] == "transformers" and json.loads(r["sampling"])["n"] == 3 for r in rows)
    assert len({r["response"] for r in rows}) > 1
    # seeded per prompt: the same rollouts whatever the task count
    r3 = tmp_path / "run2"
    shutil.copytree(run / "rl-ingest", r3 / "rl-ingest")
    assert main(["rollout", "--set", f"model={model}", "--set", "n=3", "--set", "max_new_tokens=8",
                 "--run-dir", str(r3), "--quiet", "--tasks", "2"]) == 0
    assert read_manifest(r3, "rollouts").equals(read_manifest(r2, "rollouts"))


def test_outputs_do_not_depend_on_task_count(rl_run, tmp_path):
    """score and select again with one task: byte-identical rows (canonical sort order)."""
    import shutil

    run, _ = rl_run
    r1 = tmp_path / "one"
    for step in ("rl-ingest", "rollout"):
        shutil.copytree(run / step, r1 / step)
    assert main(["score", "--run-dir", str(r1), "--quiet", "--tasks", "1"]) == 0
    assert main(["select", "--run-dir", str(r1), "--quiet", "--tasks", "1", "--set", "ks=[1,2,4,8]"]) == 0
    for kind in ("rewards", "selection"):
        assert read_manifest(run, kind).equals(read_manifest(r1, kind)), kind


def test_score_streams_its_slice_in_batches_with_the_same_bytes(rl_run, tmp_path, monkeypatch):
    """score reads its slice a batch at a time; a batch boundary that falls between the prompt types of one
    rollout (answer_only, then thinking with its format reward) changes no byte of the rewards part."""
    import shutil

    from rl_select import score

    run, _ = rl_run
    prompts = sorted(p["prompt_id"] for p in read_manifest(run, "rl_prompts").to_pylist() if p["status"] == "ok")
    data = tmp_path / "rollouts.jsonl"
    with open(data, "w") as f:
        for pid in prompts[:4]:
            for i in range(3):
                for ptype in ("answer_only", "thinking"):
                    body = f"<answer>{i}</answer>" if ptype == "answer_only" else f"<think>t</think><answer>{i}</answer>"
                    f.write(json.dumps({"prompt_id": pid, "rollout_idx": i, "prompt_type": ptype,
                                        "response": body}) + "\n")

    def scored(name, batch, tasks):
        r = tmp_path / name
        shutil.copytree(run / "rl-ingest", r / "rl-ingest")
        assert main(["rollout", "--set", "backend=file", "--set", f"file={data}", "--run-dir", str(r), "--quiet"]) == 0
        monkeypatch.setattr(score, "ROLLOUT_BATCH", batch)
        assert main(["score", "--run-dir", str(r), "--quiet", "--tasks", str(tasks), "--workers", "1"]) == 0
        return r

    whole = scored("whole", 1 << 16, 1)
    rewards = read_manifest(whole, "rewards").to_pylist()
    assert sorted(r["reward_type"] for r in rewards) == ["format"] * 12 + ["math"] * 24
    part = sorted((whole / "score").rglob("*.parquet"))
    for batch in (1, 3, 5):               # 3 and 5 cut between a rollout's two prompt types
        r = scored(f"b{batch}", batch, 1)
        assert [p.read_bytes() for p in sorted((r / "score").rglob("*.parquet"))] == [p.read_bytes() for p in part]
    assert read_manifest(scored("t2", 5, 2), "rewards").equals(read_manifest(whole, "rewards"))


TASK_MEASURE = r"""
import json, sys
from pathlib import Path
import numpy, pyarrow, pyarrow.parquet, duckdb  # not the task's memory
import rl_select.score, rl_select.rollout, rl_select.rewards, manifests.io, ovpipe.executors.task
from ovpipe.executors.task import run_task
from ovpipe.mapreduce import vmhwm_bytes

step, run, tasks = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
base = vmhwm_bytes()
(run / step / "completions" / "00000").unlink()
run_task(step, run, 0, tasks)
print(json.dumps({"delta": vmhwm_bytes() - base}))
"""


def _rank0_peak_mib(step: str, run, tasks: int) -> float:
    """The VmHWM (MiB) that rank 0 of ``step``, run again in a fresh process, adds to its imports."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", TASK_MEASURE, step, str(run), str(tasks)], capture_output=True,
                       text=True, cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])["delta"] / 2 ** 20


def _score_corpus(run, n_prompts: int, parts: int) -> None:
    """``n_prompts`` ok prompts (a 2 KB extra each) and 4 rollouts of each with a 16 KB response, in ``parts``
    parts as that many rollout tasks write them (a task reads whole row groups: each part is one)."""
    from manifests.io import write_part

    ids = [f"{i:08d}" for i in range(n_prompts)]
    write_part({"prompt_id": ids, "source": ["s"] * n_prompts, "category": ["c"] * n_prompts,
                "question": ["q"] * n_prompts, "images": [[]] * n_prompts, "ground_truth": ["A"] * n_prompts,
                "answer_type": ["choice"] * n_prompts, "extra": ['{"pad": "' + "x" * 2048 + '"}'] * n_prompts,
                "status": ["ok"] * n_prompts, "error": [None] * n_prompts},
               run / "rl-ingest" / "rl_prompts" / "part-00000.parquet", "rl_prompts")
    per = n_prompts // parts
    for k in range(parts):
        m = 4 * per
        write_part({"prompt_id": [p for p in ids[k * per:(k + 1) * per] for _ in range(4)],
                    "rollout_idx": [i % 4 for i in range(m)], "prompt_type": ["answer_only"] * m,
                    "response": ["<answer>A</answer>" + " " * 16384] * m, "tokens": [4096] * m,
                    "backend": ["file"] * m, "model": ["m"] * m, "sampling": ["{}"] * m},
                   run / "rollout" / "rollouts" / f"part-{k:05d}.parquet", "rollouts")


def test_score_task_memory_follows_its_slice_not_the_corpus(tmp_path):
    """The same slice (1,000 rollouts) out of an 8× larger corpus (2 → 16 tasks): a score task's peak resident
    memory stays flat. It held the whole rollouts manifest (the responses: 64 MB of the large corpus's
    text) and every prompt before."""
    deltas = []
    for name, n, tasks in (("small", 500, 2), ("large", 4000, 16)):
        run = tmp_path / name
        _score_corpus(run, n, tasks)
        assert main(["score", "--run-dir", str(run), "--tasks", str(tasks), "--workers", "2", "--quiet"]) == 0
        deltas.append(_rank0_peak_mib("score", run, tasks))
    print(f"VmHWM added by score rank 0, MiB: 2K rollouts / 2 tasks {deltas[0]:.1f}; "
          f"16K rollouts / 16 tasks {deltas[1]:.1f}")
    assert deltas[1] - deltas[0] < 24, deltas


def test_rollout_killed_mid_slice_resumes_from_its_last_chunk(rl_run, tmp_path, monkeypatch):
    """A rank pre-empted while writing its 2nd chunk keeps its 1st; the rerun generates only the rest, leaves
    the finished rank alone, and gives the bytes of an uninterrupted run (and of any chunk size)."""
    import shutil

    import inference.chunked as chunked

    run, _ = rl_run
    data = run / "data" / "rollouts.jsonl"

    def rollout(r, chunk):
        return main(["rollout", "--set", "backend=file", "--set", f"file={data}", "--set", f"chunk_size={chunk}",
                     "--run-dir", str(r), "--quiet", "--tasks", "2", "--workers", "1"])

    def fresh(name):
        r = tmp_path / name
        shutil.copytree(run / "rl-ingest", r / "rl-ingest")
        return r

    ref = fresh("ref")
    assert rollout(ref, 2) == 0
    assert not (ref / "rollout" / "chunks").exists()                     # finalize removed them

    killed = fresh("killed")
    real_write = chunked.write_chunk

    def dying_write(path, rows, kind):
        if path.parent.name == "00001" and path.name.startswith("chunk-000001-"):
            raise KeyboardInterrupt("pre-empted")
        real_write(path, rows, kind)

    monkeypatch.setattr(chunked, "write_chunk", dying_write)
    with pytest.raises(KeyboardInterrupt):
        rollout(killed, 2)
    sdir = killed / "rollout"
    assert (sdir / "completions" / "00000").exists() and not (sdir / "completions" / "00001").exists()
    assert [p.name[:12] for p in sorted((sdir / "chunks" / "00001").glob("chunk-*"))] == ["chunk-000000"]
    rank0 = (sdir / "stats" / "00000.json").read_bytes()

    monkeypatch.setattr(chunked, "write_chunk", real_write)
    assert rollout(killed, 2) == 0
    rank1 = json.loads((sdir / "stats" / "00001.json").read_text())["counters"]
    assert rank1["chunks/resumed"] == 1 and rank1["chunks/written"] == -(-rank1["prompts"] // 2) - 1
    assert (sdir / "stats" / "00000.json").read_bytes() == rank0           # the finished rank was not redone
    parts = lambda r: [p.read_bytes() for p in sorted((r / "rollout" / "rollouts").glob("*.parquet"))]  # noqa: E731
    assert parts(killed) == parts(ref)
    other = fresh("chunk5")
    assert rollout(other, 5) == 0 and parts(other) == parts(ref)




def _rollout_corpus(run, n_prompts: int, parts: int, response_bytes: int = 0, per_prompt: int = 1) -> Path:
    """``n_prompts`` ok prompts with a 64 KB image each, in ``parts`` parts as that many rl-ingest tasks write
    them, and a rollouts JSONL with ``per_prompt`` responses per prompt (padded to about ``response_bytes``)."""
    from manifests.io import write_part

    ids = [f"{i:08d}" for i in range(n_prompts)]
    per = n_prompts // parts
    image = bytes(range(256)) * 256
    for k in range(parts):
        mine = ids[k * per:(k + 1) * per]
        m = len(mine)
        write_part({"prompt_id": mine, "source": ["s"] * m, "category": ["c"] * m, "question": ["<image>q"] * m,
                    "images": [[image]] * m, "ground_truth": ["A"] * m, "answer_type": ["choice"] * m,
                    "extra": ["{}"] * m, "status": ["ok"] * m, "error": [None] * m},
                   run / "rl-ingest" / "rl_prompts" / f"part-{k:05d}.parquet", "rl_prompts")
    data = run / "rollouts.jsonl"
    pad = "x" * response_bytes
    with open(data, "w") as f:
        for p in ids:
            for _ in range(per_prompt):
                f.write(json.dumps({"prompt_id": p, "response": f"{pad}<answer>A</answer>"}) + "\n")
    return data


def test_rollout_task_memory_follows_its_chunk_not_its_slice(tmp_path):
    """Two tasks over 512 and over 4,096 prompts (their 64 KB images inline, in parts of 256 as rl-ingest
    tasks write them; the file backend's 4 responses per prompt 8 KB each): a rollout task's slice grows 8×
    (16 → 128 MB of images, 8 → 64 MB of responses), its peak resident memory does not — it streams its
    prompts a chunk at a time (32 here), reads a chunk's responses back from the offsets it indexed, and
    writes each chunk as it goes, its part a row group at a time."""
    deltas = []
    for name, n in (("small", 512), ("large", 4096)):
        run = tmp_path / name
        data = _rollout_corpus(run, n, n // 256, response_bytes=8 << 10, per_prompt=4)
        assert main(["rollout", "--set", "backend=file", "--set", f"file={data}", "--set", "chunk_size=32",
                     "--run-dir", str(run), "--tasks", "2", "--workers", "2", "--quiet"]) == 0
        (run / "rollout" / "completions" / "finalized").unlink()
        deltas.append(_rank0_peak_mib("rollout", run, 2))
    print(f"VmHWM added by rollout rank 0, MiB: a 256-prompt slice {deltas[0]:.1f}; a 2,048-prompt slice "
          f"{deltas[1]:.1f}")
    assert deltas[1] - deltas[0] < 24, deltas


def test_export_streamed_in_small_row_groups_holds_the_same_rows(rl_run, tmp_path, monkeypatch):
    """``export`` writes a batch of prompts at a time: with batches of 2 its verl / ROLL files have many row
    groups but the same schema and rows, and its JSONL files the same bytes, as in one batch."""
    import shutil

    import rl_select.export as export

    run, _ = rl_run
    shutil.copytree(run, tmp_path / "r")
    shutil.rmtree(tmp_path / "r" / "export")
    monkeypatch.setattr(export, "PROMPT_BATCH", 2)
    assert main(["export", "--run-dir", str(tmp_path / "r"), "--quiet", "--set", "areal_shard_rows=3"]) == 0
    a, b = run / "export", tmp_path / "r" / "export"
    for f in sorted(a.rglob("*")):
        g = b / f.relative_to(a)
        if f.suffix == ".parquet":
            assert pq.read_schema(f) == pq.read_schema(g) and pq.read_table(f).equals(pq.read_table(g)), f
            if pq.ParquetFile(f).metadata.num_rows > 2:
                assert pq.ParquetFile(g).metadata.num_row_groups > 1
        elif f.is_file() and f.suffix in (".jsonl", ".png", ".jpg"):
            assert f.read_bytes() == g.read_bytes(), f
        elif f.name == "HANDOFF.md":
            assert f.read_text().replace(str(a), "") == g.read_text().replace(str(b), ""), f


def test_export_memory_follows_its_batch_not_the_kept_set(tmp_path):
    """512 and 4,096 kept prompts with their 64 KB images inline: the export's peak resident memory does not
    grow with the kept set — it streams the prompts a batch at a time into the verl file."""
    from manifests.io import write_part

    deltas = []
    for name, n in (("small", 512), ("large", 4096)):
        run = tmp_path / name
        _rollout_corpus(run, n, n // 256)
        ids = [f"{i:08d}" for i in range(n)]
        write_part({"prompt_id": ids, "source": ["s"] * n, "category": ["c"] * n, "n": [8] * n, "correct": [4] * n,
                    "pass_at_1": [0.5] * n, "pass_at_n": [1.0] * n, "gap": [0.5] * n, "mean_reward": [0.5] * n,
                    "pass_at_k": [None] * n, "kept": [True] * n, "reason": ["kept"] * n,
                    "split": ["stage1-answer-only"] * n}, run / "select" / "selection" / "part-00000.parquet",
                   "selection")
        assert main(["export", "--run-dir", str(run), "--quiet", "--set", "formats=[verl]"]) == 0
        assert pq.read_metadata(run / "export" / "verl" / "stage1-answer-only.parquet").num_rows == n
        deltas.append(_rank0_peak_mib("export", run, 1))
    print(f"VmHWM added by export, MiB: 512 kept prompts {deltas[0]:.1f}; 4,096 {deltas[1]:.1f}")
    assert deltas[1] - deltas[0] < 24, deltas
