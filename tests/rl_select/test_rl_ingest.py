"""rl-ingest adapters: verl, ROLL, generic JSONL with image paths; per-row errors."""
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from manifests import read_manifest
from ovpipe.cli import main


def png(color):
    b = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(b, format="PNG")
    return b.getvalue()


def ingest(run, path, layout, *extra):
    assert main(["rl-ingest", "--set", f"inputs=['{path}']", "--set", f"layout={layout}", "--run-dir", str(run),
                 "--quiet", *extra]) == 0
    return sorted(read_manifest(run, "rl_prompts").to_pylist(), key=lambda r: r["question"])


def test_verl_layout(tmp_path):
    rows = [{"data_source": "mathvista", "ability": "math",
             "prompt": [{"role": "user", "content": "<image>How many dots?"}],
             "images": [{"bytes": png("red")}], "reward_model": {"style": "rule", "ground_truth": "3"},
             "extra_info": {"index": 0}},
            {"data_source": "mathvista", "ability": "math",
             "prompt": [{"role": "user", "content": "<image><image>Which is larger?"}],
             "images": [{"bytes": png("red")}], "reward_model": {"style": "rule", "ground_truth": "A"},
             "extra_info": {"index": 1}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "verl.parquet")
    got = ingest(tmp_path / "run", tmp_path / "verl.parquet", "verl")
    ok, bad = got[1], got[0]
    assert (ok["status"], ok["source"], ok["category"], ok["ground_truth"]) == ("ok", "mathvista", "math", "3")
    assert ok["images"] == [png("red")] and ok["answer_type"] == "math"     # style "rule" → default type
    assert json.loads(ok["extra"]) == {"index": 0}
    assert bad["status"] == "image_mismatch" and "2 <image>" in bad["error"]


def test_roll_layout_keeps_verifier_fields(tmp_path):
    boxes = [{"bbox_2d": [0, 0, 4, 4], "label": "cat"}]
    rows = [{"data_source": "refcoco", "ability": "grounding",
             "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find the cat."}]}],
             "images": [{"bytes": png("blue")}],
             "reward_model": {"style": "rule", "ground_truth": json.dumps(boxes), "accuracy_ratio": 0.9,
                              "format_ratio": 0.1, "verifier": "detection", "verifier_parm": "{}"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "roll.parquet")
    (p,) = ingest(tmp_path / "run", tmp_path / "roll.parquet", "roll")
    assert p["status"] == "ok" and p["answer_type"] == "detection" and p["question"] == "<image>Find the cat."
    assert json.loads(p["ground_truth"]) == boxes
    extra = json.loads(p["extra"])
    assert extra["accuracy_ratio"] == 0.9 and extra["format_ratio"] == 0.1 and extra["verifier"] == "detection"


def test_generic_jsonl_with_paths_and_bad_rows(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png("green"))
    rows = [{"question": "Color?", "answer": "green", "images": ["img/a.png"], "answer_type": "string",
             "source": "colors", "category": "perception"},
            {"question": "<image>Color?", "answer": "green", "images": ["img/missing.png"]},
            {"question": "", "answer": "1"},
            {"question": "1+1?", "answer": None},
            {"question": "<image> and <image>?", "answer": "x", "images": ["img/a.png"]}]
    with open(tmp_path / "p.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    got = ingest(tmp_path / "run", tmp_path / "p.jsonl", "generic")
    statuses = sorted(r["status"] for r in got)
    assert statuses == ["bad_image", "empty_question", "image_mismatch", "missing_ground_truth", "ok"]
    ok = next(r for r in got if r["status"] == "ok")
    assert ok["question"] == "<image>Color?" and ok["images"] == [png("green")]   # placeholder added
    assert (ok["source"], ok["category"], ok["answer_type"]) == ("colors", "perception", "string")


def test_duplicates_within_and_across_parts_first_part_row_stays(tmp_path):
    """The first (part, row) of each prompt_id stays, every later copy — in its own part or another — is a
    ``duplicate``, counted once; a rerun of the finalize changes nothing."""
    import json as _json

    from manifests.io import manifest_files
    from ovpipe.executors.task import finalize_step

    qs = ["1+1?", "2+2?", "3+3?", "4+4?", "5+5?"]
    for f in range(4):      # file f repeats some questions of the others and one of its own
        rows = [{"question": qs[(f + i) % 5], "answer": "x"} for i in range(3)] + [{"question": qs[f], "answer": "x"}]
        (tmp_path / f"set{f}.jsonl").write_text("".join(_json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    assert main(["rl-ingest", "--set", f"inputs=['{tmp_path}/*.jsonl']", "--set", "source=s", "--run-dir", str(run),
                 "--quiet", "--tasks", "3"]) == 0
    parts = manifest_files(run, "rl_prompts")
    assert len(parts) == 3
    seen, n_dup = set(), 0
    for p in parts:
        for r in pq.read_table(p).to_pylist():
            assert (r["status"] == "duplicate") == (r["prompt_id"] in seen), (p.name, r)
            n_dup += r["prompt_id"] in seen
            seen.add(r["prompt_id"])
    assert len(seen) == 5 and n_dup == 16 - 5
    stats = _json.loads((run / "rl-ingest" / "stats.json").read_text())["counters"]
    assert stats["duplicates"] == n_dup
    before = [p.read_bytes() for p in parts]
    (run / "rl-ingest" / "completions" / "finalized").unlink()
    (run / "rl-ingest" / "stats" / "finalize.json").unlink()
    assert finalize_step("rl-ingest", run)["counters"].get("duplicates", 0) == 0   # already marked: none new
    assert [p.read_bytes() for p in parts] == before


def test_duplicates_marked_across_files(tmp_path):
    rows = [{"problem": "<image>2+2?", "answer": "4", "images": [{"bytes": png("red")}]}]
    for name in ("a", "b"):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{name}.parquet")
    assert main(["rl-ingest", "--set", f"inputs=['{tmp_path}/*.parquet']", "--set", "layout=geometry3k",
                 "--run-dir", str(tmp_path / "run"), "--quiet", "--tasks", "2"]) == 0
    st = sorted(r["status"] for r in read_manifest(tmp_path / "run", "rl_prompts").to_pylist())
    assert st == ["duplicate", "ok"]


def test_a_line_that_is_not_json_is_a_bad_row_and_json_arrays_read(tmp_path):
    """rl-ingest reads JSON through ingest's parsers (``manifests.sources``): a broken JSONL line is a
    ``bad_row`` row naming the JSON error (the task goes on), a ``.json`` file is one array of records, and
    a chat part ingest refuses is refused here too."""
    good = {"question": "1+1?", "answer": "2"}
    (tmp_path / "p.jsonl").write_text(json.dumps(good) + "\n{not json\n")
    got = ingest(tmp_path / "a", tmp_path / "p.jsonl", "generic")
    assert sorted(r["status"] for r in got) == ["bad_row", "ok"]
    assert "not valid JSON" in next(r for r in got if r["status"] == "bad_row")["error"]
    (tmp_path / "p.json").write_text(json.dumps([good, {"question": "2+2?", "answer": "4"}]))
    assert [r["status"] for r in ingest(tmp_path / "b", tmp_path / "p.json", "generic")] == ["ok", "ok"]
    rows = [{"data_source": "s", "ability": "math", "prompt": [{"role": "user", "content": [{"type": "video"}]}],
             "reward_model": {"style": "rule", "ground_truth": "1"}}]
    (tmp_path / "v.jsonl").write_text(json.dumps(rows[0]) + "\n")
    (bad,) = ingest(tmp_path / "c", tmp_path / "v.jsonl", "verl")
    assert bad["status"] == "bad_row" and "messages[0].content[0]" in bad["error"]


def test_spilled_runs_and_the_streamed_dedupe_give_the_bytes_of_one_sort(tmp_path, monkeypatch):
    """A task's rows are spilled as sorted runs and merged into its part, and the duplicate marking rewrites a
    part a batch at a time: with a run every 7 rows (row groups of 7) the parts are the bytes of the
    default (one run) — the rows of one sort, ties (repeats within a file) in input order."""
    import ovpipe.shuffle as shuffle
    import rl_select.ingest as rl_ingest
    from manifests.io import manifest_files

    for f in range(2):
        rows = [{"problem": f"<image>{i % 37} + {f}?", "answer": str(i % 37 % 5),
                 "images": [{"bytes": png((i % 37 * 6, f * 100, 0))}]} for i in range(120)]
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"set{f}.parquet")

    def parts(name, tasks):
        run = tmp_path / name
        assert main(["rl-ingest", "--set", f"inputs=['{tmp_path}/*.parquet']", "--set", "layout=geometry3k",
                     "--set", "source=s", "--run-dir", str(run), "--quiet", "--tasks", str(tasks),
                     "--workers", "1"]) == 0
        assert not (run / "rl-ingest" / "spill").exists() or not any((run / "rl-ingest" / "spill").rglob("*.parquet"))
        return [p.read_bytes() for p in manifest_files(run, "rl_prompts")], read_manifest(run, "rl_prompts")

    whole, table = parts("whole", 1)
    statuses = table.column("status").to_pylist()
    assert statuses.count("ok") == 2 * 37 and statuses.count("duplicate") == 2 * (120 - 37)
    whole2, _ = parts("whole2", 2)
    monkeypatch.setattr(rl_ingest, "SPILL_ROWS", 7)
    monkeypatch.setattr(shuffle, "SPILL_BYTES", 1)
    assert parts("spilled", 1)[0] == whole
    assert parts("spilled2", 2)[0] == whole2
    monkeypatch.setattr(shuffle, "MERGE_FAN_IN", 2)          # ≈ 34 runs per task, merged 2 at a time in levels
    assert parts("levels", 1)[0] == whole
    assert parts("levels2", 2)[0] == whole2
    assert not list((tmp_path / "levels" / "rl-ingest").glob(".merge-*"))


RL_MEASURE = r"""
import json, sys, shutil
from pathlib import Path
import numpy, pyarrow, pyarrow.parquet, pyarrow.compute, xxhash, PIL.Image   # not the task's memory
import rl_select.ingest, manifests.io, ovpipe.executors.task, ovpipe.shuffle
from ovpipe.cli import main
from ovpipe.mapreduce import vmhwm_bytes

inp, run = sys.argv[1], Path(sys.argv[2])
ovpipe.shuffle.SPILL_BYTES = 1        # a run every 64 prompts (1 MB): the inputs make 8 and 64 runs
ovpipe.shuffle.MERGE_FAN_IN = int(sys.argv[3])
base = vmhwm_bytes()
assert main(["rl-ingest", "--set", f"inputs=['{inp}']", "--set", "layout=geometry3k", "--set", "source=s",
             "--run-dir", str(run), "--quiet", "--tasks", "1", "--workers", "1"]) == 0
print(json.dumps({"delta": vmhwm_bytes() - base}))
"""


def test_rl_ingest_merge_memory_follows_its_fan_in_not_its_runs(tmp_path):
    """One task over 512 and over 4,096 prompts with a 16 KB image each, spilled every 64 prompts: 8 and 64
    sorted runs. Merged ``MERGE_FAN_IN`` (here 4) at a time, a level of larger runs first, the 64 runs cost a
    fraction of one merge of them all, which holds a batch of every run."""
    import subprocess
    import sys

    import numpy as np

    rng = np.random.default_rng(0)
    b = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (72, 72, 3), dtype=np.uint8)).save(b, format="PNG")
    peak = {}
    for n, fan_in in ((512, 4), (4096, 4), (4096, 64)):
        src = tmp_path / f"in{n}.parquet"
        pq.write_table(pa.table({"problem": [f"<image>question {i}?" for i in range(n)], "answer": ["1"] * n,
                                 "images": [[{"bytes": b.getvalue()}]] * n}), src, row_group_size=64)
        r = subprocess.run([sys.executable, "-c", RL_MEASURE, str(src), str(tmp_path / f"run{n}-{fan_in}"), str(fan_in)],
                           capture_output=True, text=True, cwd=Path(__file__).parents[2])
        assert r.returncode == 0, r.stderr[-3000:]
        peak[n, fan_in] = json.loads(r.stdout.strip().splitlines()[-1])["delta"] / 2 ** 20
    print("VmHWM added by rl-ingest, MiB:", {f"{n} prompts, fan-in {f}": round(v, 1) for (n, f), v in peak.items()})
    assert peak[4096, 4] < peak[4096, 64] - 64, peak
    assert peak[4096, 4] - peak[512, 4] < 48, peak
