"""``ovpipe summary``: each step once, with its figures, and no line that contradicts itself."""
import json

from ovpipe.summary import key_figures, run_summary


def _step(run, folder, step, counters):
    d = run / folder
    d.mkdir(parents=True)
    (d / "executor.json").write_text(json.dumps({"step": step}))
    (d / "stats.json").write_text(json.dumps({"counters": counters}))
    return d


def test_each_step_once_with_figures(tmp_path):
    run = tmp_path / "run"
    _step(run, "score", "score", {"rollouts": 352, "status/ok": 528, "status/timeout": 0})
    _step(run, "balance-report", "balance-report", {})
    d = _step(run, "pretrain/stage-1", "pretrain", {"steps": 3})
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": 5.0 - i, "samples": 4}) + "\n"
                                             for i in (1, 2, 3)))
    out = run_summary(run)
    assert "score: rollouts 352; rewards ok 528, other 0" in out            # reward rows, named as such
    assert "balance-report: done" in out and not any(ln.rstrip().endswith(":") for ln in out.splitlines())
    assert sum("stage-1" in ln or "stage 1:" in ln for ln in out.splitlines()) == 1, out
    assert "stage 1: 3 steps, loss 4.000 → 2.000" in out
    assert key_figures("lengths", {"samples": 2, "status/ok": 2}) == "samples 2; ok 2, other 0"
