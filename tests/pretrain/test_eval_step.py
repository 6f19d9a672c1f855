"""``ovpipe eval``: lmms-eval's own CLI (its transformers 4.57, in its cache folder) over a tiny export and the
demo's local image-QA task folder writes the ``eval`` manifest, one row per task metric, that ``ovpipe sql``
queries and ``ovpipe report`` shows. Without an installable lmms-eval the step stops before any work and
says why, and the end-to-end test skips with pip's reason."""
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_lmms_eval import lmms_eval_site  # noqa: F401  (fixture)
from test_official_parity import exported  # noqa: F401  (fixture)


def _tasks(tmp_path: Path) -> Path:
    from demo.eval_tasks import write_demo_eval_tasks

    write_demo_eval_tasks(tmp_path / "demo-data")
    return tmp_path / "demo-data" / "eval-tasks"


def test_demo_task_folder_is_deterministic_and_relative(tmp_path):
    a, b = _tasks(tmp_path / "a"), _tasks(tmp_path / "b")
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    docs = [json.loads(line) for line in (a / "test.jsonl").read_text().splitlines()]
    assert len(docs) == 16 and all((a / d["image"]).is_file() and not Path(d["image"]).is_absolute() for d in docs)
    assert {d["answer"] for d in docs[1::2]} <= {"1", "2", "3", "4"}
    assert str(tmp_path) not in (a / "demo_vqa.yaml").read_text()


def test_eval_results_to_rows():
    from pretrain.evaluate import rows_from_results

    res = {"results": {"t": {"alias": "t", "exact_match,none": 0.25, "exact_match_stderr,none": 0.1,
                             "anls,none": "N/A", "anls_stderr,none": "N/A", "acc,strict": float("nan")}},
           "n-samples": {"t": {"original": 8, "effective": 4}}}
    rows = {(r["task"], r["metric"], r["filter"]): r for r in rows_from_results(res, ["t", "u"], "/m", "0.7.3")}
    assert set(rows) == {("t", "exact_match", "none"), ("t", "anls", "none"), ("t", "acc", "strict"), ("u", None, None)}
    assert (rows["t", "exact_match", "none"]["value"], rows["t", "exact_match", "none"]["stderr"]) == (0.25, 0.1)
    assert rows["t", "exact_match", "none"]["n_samples"] == 4 and rows["t", "exact_match", "none"]["status"] == "ok"
    assert [rows["t", m, f]["value"] for m, f in (("anls", "none"), ("acc", "strict"))] == [None, None]
    assert {rows["t", "anls", "none"]["status"], rows["t", "acc", "strict"]["status"]} == {"undefined"}
    assert rows["u", None, None]["status"] == "no_result"


def test_eval_config_names_the_bad_field(tmp_path):
    from ovpipe.config import ConfigError, load_config
    from pretrain.evaluate import EvalConfig

    with pytest.raises(ConfigError, match="model"):
        load_config(EvalConfig, None, {"tasks_dir": "x"})
    with pytest.raises(ConfigError, match="limit"):
        load_config(EvalConfig, None, {"model": "m", "tasks_dir": "x", "limit": 0})
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    cfg = load_config(EvalConfig, None, {"model": str(tmp_path / "m"), "tasks_dir": str(_tasks(tmp_path)),
                                         "tasks": ["mmstar"]})
    with pytest.raises(ValueError, match=r"tasks: \['mmstar'\] have no <task>.yaml"):
        cfg.check(tmp_path / "run")


def test_eval_stops_before_work_without_an_installable_lmms_eval(tmp_path, monkeypatch, capsys):
    from ovpipe.cli import main

    monkeypatch.setenv("OVPIPE_LMMS_EVAL_DIR", str(tmp_path / "cache"))   # nothing installed there
    monkeypatch.setenv("PIP_NO_INDEX", "1")                                # and no registry for pip
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    run = tmp_path / "run"
    assert main(["eval", "--run-dir", str(run), "--set", f"model={tmp_path / 'm'}",
                 "--set", f"tasks_dir={_tasks(tmp_path)}"]) == 2
    err = capsys.readouterr().err
    assert "cannot start: lmms-eval: could not pip-install lmms-eval from the package registry" in err
    assert not (run / "eval").exists() and not list((tmp_path / "cache").glob("*"))


@pytest.mark.slow
def test_eval_step_writes_the_eval_manifest_and_report_shows_it(exported, lmms_eval_site, tmp_path, capsys):
    from ovpipe.cli import main

    _, hf, _ = exported
    run = tmp_path / "run"
    assert main(["eval", "--run-dir", str(run), "--set", f"model={hf}", "--set", f"tasks_dir={_tasks(tmp_path)}",
                 "--set", "limit=4", "--quiet"]) == 0, capsys.readouterr().err
    rows = pq.read_table(run / "eval" / "eval" / "part-00000.parquet").to_pylist()
    results = json.loads(next((run / "eval" / "data" / "lmms-eval").rglob("*_results.json")).read_text())
    scores = results["results"]["demo_vqa"]
    metrics = {k.split(",")[0] for k in scores if "," in k and "_stderr" not in k}
    assert metrics == {"exact_match"} and [(r["task"], r["metric"]) for r in rows] == [("demo_vqa", "exact_match")]
    row = rows[0]
    assert row["value"] == scores["exact_match,none"] and 0 <= row["value"] <= 1 and row["status"] == "ok"
    assert row["n_samples"] == 4 and row["lmms_eval_version"] == "0.7.3" and row["model"] == str(hf.resolve())
    capsys.readouterr()
    assert main(["sql", str(run), "SELECT count(*) AS n FROM eval WHERE status = 'ok'", "--format", "csv"]) == 0
    assert capsys.readouterr().out.split() == ["n", "1"]
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "eval scores" in out and "demo_vqa" in out and "exact_match" in out
