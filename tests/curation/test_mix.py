"""``mix``: exact proportions, seeded draws, with/without replacement, shortfall, task-count
independence, config errors, the report — on small `samples` parts written in the test."""
from __future__ import annotations

import io
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from curation.mix import STEP, MixConfig, plan_mix, run, sample_keys
from manifests import read_manifest
from manifests.io import write_part
from ovpipe.cli import main
from ovpipe.config import ConfigError, load_config
from ovpipe.step import TaskContext

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo" / "mix.yaml"
# category → ok rows of the fixture (plus broken rows that must never be drawn)
CATEGORIES = {"counting": 90, "color": 60, "position": 40, "comparison": 12, "text": 25, "caption": 30}


def _row(sid: str, source: str, category: str, status: str = "ok", i: int = 0) -> dict:
    """A `samples` row with every column filled (a one-image, two-turn conversation)."""
    addr = {"file": f"/data/{source}/part-0.parquet", "container": "parquet", "offset": i, "size": 1000 + i,
            "column": "images", "index": 0, "format": "png", "width": 64, "height": 48}
    conv = [{"role": "user", "text": f"<image>\nHow many shapes? ({category})"},
            {"role": "assistant", "text": str(i % 7)}]
    return {"sample_id": sid, "source": source, "shard": addr["file"], "key": f"{source}-{i:06d}",
            "shard_format": "parquet", "offset": i, "size": 1000 + i, "image_format": "png",
            "width": 64, "height": 48, "caption": conv[1]["text"], "category": category, "n_images": 1,
            "images": [addr], "conversation": conv, "turns": 2,
            "turn_ratings": [("relevance", [4]), ("formatting", [5])],
            "status": status, "error": None if status == "ok" else f"{status} (made by the test)"}


def write_fixture(run: Path, seed: int = 0) -> list[dict]:
    """Two ingest step folders, three sources, in several parts; returns every row written."""
    rng = np.random.default_rng(seed)
    rows, i = [], 0
    for cat, n in CATEGORIES.items():
        for k in range(n + 3):  # 3 broken rows per category
            status = "ok" if k < n else ("corrupt_image", "duplicate", "image_mismatch")[k - n]
            source = ("llava", "finevision", "extra")[k % 3]
            rows.append(_row(f"{int(rng.integers(0, 2 ** 63)) * 2 + k % 2:016x}", source, cat, status, i))
            i += 1
    # One sample in two sources (two candidates), and one row ingested twice into the same source by
    # two ingest steps (the same output row: its copies add up).
    twin = rows[0]["sample_id"]
    rows.append({**_row(twin, "finevision" if rows[0]["source"] != "finevision" else "llava", "counting",
                        i=i)})
    rows.append({**rows[3], "key": "again"})
    by_folder = defaultdict(list)
    for r in rows:
        by_folder["ingest-b" if r["source"] == "extra" or r["key"] == "again" else "ingest-a"].append(r)
    for folder, rs in by_folder.items():
        for p, chunk in enumerate(np.array_split(np.arange(len(rs)), 2)):
            write_part([rs[j] for j in chunk], run / folder / "samples" / f"part-{p:05d}.parquet",
                       "samples", sort=True)
    return rows


def reference_mix(rows: list[dict], cfg: MixConfig) -> dict[tuple, int]:
    """The documented rule, spelled out row by row: (sample_id, source, category) → copies."""
    ok = [r for r in rows if r["status"] == "ok"]
    key = dict(zip([r["sample_id"] for r in ok], sample_keys([r["sample_id"] for r in ok], cfg.seed).tolist()))
    groups = defaultdict(list)
    for r in ok:
        groups[r[cfg.by]].append(r)
    plans = {p.group: p for p in plan_mix({g: len(v) for g, v in groups.items()}, cfg)}
    out: dict[tuple, int] = defaultdict(int)
    for g, rs in groups.items():
        rs = sorted(rs, key=lambda r: (key[r["sample_id"]], r["source"], r["category"]))
        for rank, r in enumerate(rs):
            c = plans[g].base + (rank < plans[g].extra)
            if c:
                out[(r["sample_id"], r["source"], r["category"])] += c
    return dict(out)


def _mix(run: Path, *sets: str, tasks: int = 1) -> int:
    args = ["mix", "--run-dir", str(run), "--tasks", str(tasks), "--quiet", "--set", "inputs=[ingest-a, ingest-b]"]
    for s in sets:
        args += ["--set", s]
    return main(args)


def _manifest(run: Path) -> dict[tuple, int]:
    t = read_manifest(run, "mixed")
    return {(s, src, c): n for s, src, c, n in zip(*(t.column(k).to_pylist()
                                                     for k in ("sample_id", "source", "category", "copies")))}


def _bytes(run: Path) -> bytes:
    buf = io.BytesIO()
    pq.write_table(read_manifest(run, "mixed"), buf, compression="zstd")
    return buf.getvalue()


PROPS = "proportions={counting: 0.3, color: 0.25, position: 0.2, comparison: 0.15, text: 0.1}"


# --- the plan ----------------------------------------------------------------------------------


def test_targets_are_largest_remainder_and_sum_to_size():
    cfg = MixConfig(size=10, proportions={"a": 1, "b": 1, "c": 1})
    plans = {p.group: p for p in plan_mix({"a": 50, "b": 50, "c": 50}, cfg)}
    assert [plans[g].target for g in "abc"] == [4, 3, 3]          # ties of the remainder: by name
    cfg = MixConfig(size=600, proportions={"x": 0.3, "y": 0.7})
    plans = {p.group: p for p in plan_mix({"x": 7, "y": 1000}, cfg)}
    assert (plans["x"].target, plans["y"].target) == (180, 420)   # 600 × 0.3 is 180, not 179.99…
    assert (plans["x"].base, plans["x"].extra) == divmod(180, 7)
    cfg = MixConfig(size=1000, proportions={"x": 1, "y": 2, "z": 4})
    assert sum(p.target for p in plan_mix({"x": 3, "y": 3, "z": 3}, cfg)) == 1000


def test_unnamed_groups_get_zero_or_share_rest_by_their_size():
    avail = {"a": 100, "b": 30, "c": 10}
    plans = {p.group: p for p in plan_mix(avail, MixConfig(size=100, proportions={"a": 1.0}))}
    assert (plans["a"].target, plans["b"].target, plans["c"].target) == (100, 0, 0)
    plans = {p.group: p for p in plan_mix(avail, MixConfig(size=100, proportions={"a": 0.6}, rest=0.4))}
    assert (plans["a"].target, plans["b"].target, plans["c"].target) == (60, 30, 10)


def test_named_group_without_rows_is_an_error_listing_the_groups_found():
    with pytest.raises(ValueError) as e:
        plan_mix({"counting": 5, "color": 3}, MixConfig(size=10, proportions={"countin": 1.0, "color": 1.0}))
    assert "countin" in str(e.value) and "'counting': 5" in str(e.value) and "'color': 3" in str(e.value)


@pytest.mark.parametrize("data, field", [
    ({"size": 0, "proportions": {"a": 1}}, "size"),
    ({"size": 10, "proportions": {"a": -0.5}}, "proportions.a"),
    ({"size": 10, "proportions": {"a": 0.0}}, "proportions"),
    ({"size": 10}, "proportions"),
    ({"size": 10, "proportions": {"a": 1}, "rest": -1}, "rest"),
    ({"size": 10, "proportions": {"a": 1}, "inputs": []}, "inputs"),
    ({"size": 10, "proportions": {"a": 1}, "by": "shape"}, "by"),
    ({"proportions": {"a": 1}}, "size"),
])
def test_config_errors_name_the_field(data, field):
    with pytest.raises(ConfigError) as e:
        load_config(MixConfig, data)
    assert field in str(e.value)


# --- the step ----------------------------------------------------------------------------------


def test_with_replacement_hits_targets_exactly_and_follows_the_rule(tmp_path):
    rows = write_fixture(tmp_path)
    assert _mix(tmp_path, "size=400", PROPS, "seed=5") == 0
    cfg = MixConfig(size=400, inputs=["ingest-a", "ingest-b"], seed=5,
                    proportions={"counting": 0.3, "color": 0.25, "position": 0.2, "comparison": 0.15, "text": 0.1})
    got = _manifest(tmp_path)
    assert got == reference_mix(rows, cfg)
    per_cat = defaultdict(int)
    for (_, _, cat), n in got.items():
        per_cat[cat] += n
    assert dict(per_cat) == {"counting": 120, "color": 100, "position": 80, "comparison": 60, "text": 40}
    assert "caption" not in per_cat                                # unnamed, rest = 0
    broken = {r["sample_id"] for r in rows if r["status"] != "ok"}
    assert not broken & {k[0] for k in got}
    # systematic: comparison has 12 rows for 60 copies → exactly 5 each; counting 92 rows for 120 → 1 or 2
    # (but for the row ingested twice, whose two rows add up)
    assert {n for (_, _, c), n in got.items() if c == "comparison"} == {5}
    again = rows[3]["sample_id"]
    assert {n for (s, _, c), n in got.items() if c == "counting" and s != again} == {1, 2}
    assert 2 <= got[(again, rows[3]["source"], "counting")] <= 4
    # the sample in two sources is two candidates; the row ingested twice into one source adds up
    twin = rows[0]["sample_id"]
    assert len({src for (s, src, _) in got if s == twin}) == 2
    stats = json.loads((tmp_path / "mix" / "stats.json").read_text())
    assert stats["counters"]["copies"] == 400 and stats["counters"]["shortfall"] == 0


def test_without_replacement_takes_smallest_keys_and_reports_the_shortfall(tmp_path):
    rows = write_fixture(tmp_path)
    assert _mix(tmp_path, "size=200", PROPS, "replacement=false", "seed=1") == 0
    got = _manifest(tmp_path)
    cfg = MixConfig(size=200, inputs=["ingest-a", "ingest-b"], replacement=False, seed=1,
                    proportions={"counting": 0.3, "color": 0.25, "position": 0.2, "comparison": 0.15, "text": 0.1})
    assert got == reference_mix(rows, cfg)
    counting = [r for r in rows if r["status"] == "ok" and r["category"] == "counting"]
    k = sample_keys([r["sample_id"] for r in counting], 1)
    smallest = {counting[i]["sample_id"] for i in np.argsort(k, kind="stable")[:60]}
    assert {s for (s, _, c) in got if c == "counting"} == smallest  # 200 × 0.3 = 60 smallest keys
    comparison = sum(n for (_, _, c), n in got.items() if c == "comparison")
    assert comparison == 12 and set(got.values()) <= {1, 2}      # 30 asked, 12 rows: all taken, once
    stats = json.loads((tmp_path / "mix" / "stats.json").read_text())
    assert stats["counters"]["shortfall"] == 18
    assert stats["info"]["shortfall_by_group"] == {"comparison": 18}
    report = (tmp_path / "mix" / "report.md").read_text()
    assert "Shortfall" in report and "comparison has 12 ok rows for a target of 30 (short 18)" in report


def test_seeded_draw_is_deterministic_and_seed_changes_it(tmp_path):
    runs = [tmp_path / n for n in ("a", "b", "c")]
    for r in runs:
        write_fixture(r)
    for r, seed in zip(runs, (3, 3, 4)):
        assert _mix(r, "size=150", PROPS, "replacement=false", f"seed={seed}") == 0
    assert _bytes(runs[0]) == _bytes(runs[1])
    assert set(_manifest(runs[0])) != set(_manifest(runs[2]))


def test_one_and_three_tasks_give_byte_identical_manifests(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for r in (a, b):
        write_fixture(r)
    # size 333 with replacement: every group has a key cutoff (extra > 0) that the ranks must agree on
    assert _mix(a, "size=333", PROPS, "rest=0.05", tasks=1) == 0
    assert _mix(b, "size=333", PROPS, "rest=0.05", tasks=3) == 0
    assert len(list((b / "mix" / "mixed").glob("part-*.parquet"))) == 3
    assert _bytes(a) == _bytes(b)
    assert sum(_manifest(a).values()) == 333


def test_cutoff_inside_rows_of_one_sample(tmp_path):
    """The `extra` copies run out among rows sharing the cutoff key (one sample in two sources, and
    ingested twice into one): the split follows (source, category), ties add up in one output row."""
    ids = [f"{i:016x}" for i in range(1, 40)]
    keys = sample_keys(ids, 0)
    first, second = (ids[i] for i in np.argsort(keys)[:2])
    rows = [_row(first, "llava", "counting", i=0), _row(first, "llava", "counting", i=1),
            _row(first, "finevision", "counting", i=2), _row(second, "llava", "counting", i=3)]
    for size, want in [(1, {(first, "finevision", "counting"): 1}),
                       (2, {(first, "finevision", "counting"): 1, (first, "llava", "counting"): 1}),
                       (3, {(first, "finevision", "counting"): 1, (first, "llava", "counting"): 2}),
                       (6, {(first, "finevision", "counting"): 2, (first, "llava", "counting"): 3,
                            (second, "llava", "counting"): 1})]:
        for tasks in (1, 2):
            run_dir = tmp_path / f"s{size}t{tasks}"
            write_part(rows[:2] + rows[3:], run_dir / "ingest-a" / "samples" / "part-00000.parquet", "samples")
            write_part(rows[2:3], run_dir / "ingest-b" / "samples" / "part-00000.parquet", "samples")
            assert _mix(run_dir, f"size={size}", "proportions={counting: 1}", tasks=tasks) == 0
            assert _manifest(run_dir) == want, (size, tasks)


def test_missing_group_fails_at_task_time_naming_the_groups(tmp_path):
    write_fixture(tmp_path)
    cfg = MixConfig(size=10, inputs=["ingest-a", "ingest-b"], proportions={"colour": 1.0})
    with pytest.raises(ValueError) as e:
        run(cfg, TaskContext.for_step(STEP, cfg, tmp_path))
    assert "colour" in str(e.value) and "'color': 60" in str(e.value)
    with pytest.raises(FileNotFoundError, match="mix.inputs"):
        nope = MixConfig(size=10, inputs=["ingest-nope"], proportions={"a": 1.0})
        run(nope, TaskContext.for_step(STEP, nope, tmp_path))


def test_cli_with_the_demo_config_writes_report_png_and_canned_query(tmp_path):
    from manifests.catalog import run_report

    import yaml

    rows = write_fixture(tmp_path)
    # the fixture holds the instruction categories, not the demo's answer-only set (answer_color / answer_count)
    props = {k: v for k, v in yaml.safe_load(DEMO_CONFIG.read_text())["proportions"].items()
             if not k.startswith("answer_")}
    sets = {"inputs": ["ingest-a", "ingest-b"], "size": 300, "proportions": props}
    rc = main(["mix", "--config", str(DEMO_CONFIG), "--set", "inputs=[ingest-a, ingest-b]", "--set", "size=300",
               "--set", f"proportions={props}", "--run-dir", str(tmp_path), "--tasks", "2", "--quiet"])
    assert rc == 0
    cfg = load_config(MixConfig, DEMO_CONFIG, sets)
    assert _manifest(tmp_path) == reference_mix(rows, cfg)
    report = (tmp_path / "mix" / "report.md").read_text()
    for cat in ("counting", "color", "position", "comparison", "text", "caption"):
        assert f"| {cat} |" in report
    assert "| counting | 92 |" in report                           # ok rows: 90 + the twin + the re-ingested row
    png = (tmp_path / "mix" / "proportions.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    titles = {t: rel.fetchall() for t, rel in run_report(tmp_path)}
    mix_rows = titles["mix proportions"]
    assert sum(r[4] for r in mix_rows) == 300 and {r[0] for r in mix_rows} == {"mix"}   # per step folder


def test_by_source_with_rest(tmp_path):
    rows = write_fixture(tmp_path)
    assert _mix(tmp_path, "by=source", "size=120", "proportions={llava: 0.5}", "rest=0.5", "seed=2", tasks=2) == 0
    cfg = MixConfig(size=120, inputs=["ingest-a", "ingest-b"], by="source", proportions={"llava": 0.5}, rest=0.5,
                    seed=2)
    got = _manifest(tmp_path)
    assert got == reference_mix(rows, cfg)
    per_source = defaultdict(int)
    for (_, src, _), n in got.items():
        per_source[src] += n
    # rest 0.5 is shared by finevision (86 ok rows) and extra (85) in proportion to their rows:
    # 60 × 86/171 = 30.18 → 30, 60 × 85/171 = 29.82 → 30
    assert (per_source["llava"], per_source["finevision"], per_source["extra"]) == (60, 30, 30)
