"""The Slurm executor against a real slurmctld/slurmd on 127.0.0.1 (tests/slurm_cluster.py)."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from slurm_cluster import SlurmCluster, release_requeued  # noqa: E402

from manifests import read_manifest  # noqa: E402
from manifests.io import write_table  # noqa: E402
from ovpipe.cli import main  # noqa: E402

pytestmark = pytest.mark.slurm      # skips, or fails under CI=true, without Slurm (tests/conftest.py NEEDS)

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def slurm():
    with SlurmCluster() as cluster:
        yield cluster


@pytest.fixture
def slurm_env(slurm, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    monkeypatch.setenv("OVPIPE_EXTRA_STEPS", "count-ok=slurm_steps:COUNT,sleepy=slurm_steps:SLEEPY,numbers=slurm_steps:NUMBERS")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    sys.path.insert(0, str(HERE))
    yield slurm
    sys.path.remove(str(HERE))


def _ingest(demo, run, *extra):
    return main(["ingest", "--set", f'inputs=["{demo}/shards/*.tar"]', "--set", "source=demo",
                 "--run-dir", str(run), "--tasks", "4", "--workers", "2", "--quiet", *extra])


def _merged(run, tmp):
    out = tmp / f"{run.name}.parquet"
    write_table(read_manifest(run, "samples"), out)
    return out.read_bytes()


def test_array_over_4_ranks_then_rerun_one(slurm_env, demo_corpus, tmp_path):
    """`ingest` (map array → reduce → apply array → merge) gives a local run's bytes; then a plain step's
    4-rank array with one rank lost resubmits only that rank."""
    import json

    run, ref = tmp_path / "run", tmp_path / "ref"
    assert _ingest(demo_corpus, ref) == 0                                 # local reference
    t0 = time.time()
    assert _ingest(demo_corpus, run, "--executor", "slurm", "--wait") == 0
    took = time.time() - t0
    sdir = run / "ingest"
    assert sorted(p.name for p in (sdir / "completions").iterdir()) == [
        "00000", "00001", "00002", "00003", "apply-00000", "apply-00001", "apply-00002", "apply-00003",
        "finalized", "reduced"]
    assert "#SBATCH --array=0-3%2" in (sdir / "launch_script.slurm").read_text()
    assert [j["phase"] for j in json.loads((sdir / "slurm_jobs.json").read_text())["chain"]] == [
        "map", "reduce", "apply", "merge"]
    assert '"samples": 200' in (sdir / "stats.json").read_text()
    assert list((sdir / "logs").glob("slurm-*_3.out"))
    assert _merged(run, tmp_path) == _merged(ref, tmp_path)

    count = ["count-ok", "--run-dir", str(run), "--executor", "slurm", "--tasks", "4", "--workers", "2",
             "--wait", "--quiet"]
    assert main(count) == 0
    cdir = run / "count-ok"
    (cdir / "completions" / "00002").unlink()
    logs = {r: (cdir / "logs" / f"task_{r:05d}.log").stat().st_mtime_ns for r in range(4)}
    assert main(count) == 0
    assert "#SBATCH --array=2%2" in (cdir / "launch_script.slurm").read_text()
    now = {r: (cdir / "logs" / f"task_{r:05d}.log").stat().st_mtime_ns for r in range(4)}
    assert [r for r in range(4) if now[r] != logs[r]] == [2]
    assert (cdir / "completions" / "finalized").exists()
    assert json.loads((cdir / "stats.json").read_text())["counters"]["ok"] == 195
    print(f"ingest on Slurm, 4-rank arrays + reduce + merge: {took:.1f} s")


def test_next_step_chains_with_afterok(slurm_env, demo_corpus, tmp_path):
    run = tmp_path / "run"
    assert _ingest(demo_corpus, run, "--executor", "slurm") == 0           # no --wait: still queued
    ingest_jobs = (run / "ingest" / "slurm_jobs.json").read_text()
    assert main(["count-ok", "--run-dir", str(run), "--executor", "slurm", "--tasks", "2", "--wait", "--quiet"]) == 0
    import json

    merge_id = json.loads(ingest_jobs)["merge"]
    rec = json.loads((run / "count-ok" / "slurm_jobs.json").read_text())
    assert rec["array"]
    # the array waited for ingest's merge job, and it saw the complete samples manifest
    assert json.loads((run / "count-ok" / "stats.json").read_text())["counters"]["ok"] == 195
    assert (run / "ingest" / "completions" / "finalized").exists()
    assert merge_id


def test_sigusr1_requeues_a_running_task(slurm_env, tmp_path):
    run = tmp_path / "run"
    flag = tmp_path / "flag"
    assert main(["sleepy", "--run-dir", str(run), "--executor", "slurm", "--set", f"flag={flag}",
                 "--quiet"]) == 0
    import json

    job = json.loads((run / "sleepy" / "slurm_jobs.json").read_text())["array"]
    env = {**os.environ}
    t0 = time.time()
    while not flag.exists():
        # a job start-up and the task's Python imports: past 30 s on the 2-core machine under the suite's load
        assert time.time() - t0 < 120, "array task never started"
        time.sleep(0.2)
    time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", "--batch", f"{job}_0"], check=True, env=env)
    release_requeued(f"{job}_0", env, info=slurm_env.logs)
    t0 = time.time()
    while not (run / "sleepy" / "completions" / "finalized").exists():
        # the requeued task's second run, then the merge job afterok on it (a Python start each): past 120 s under
        # the suite's load on 2 cores (the loop ends as soon as the step is finalized); a failed run ends it at once
        task = subprocess.run(["scontrol", "-o", "show", "job", f"{job}_0"], capture_output=True, text=True,
                              env=env).stdout
        if time.time() - t0 > 300 or any(f"JobState={s} " in task for s in ("FAILED", "CANCELLED", "NODE_FAIL")):
            show = subprocess.run(["scontrol", "show", "job", str(job)], capture_output=True, text=True, env=env)
            pytest.fail(f"requeued task did not finish\n{task}\n{show.stdout}\n{slurm_env.logs()[-6000:]}")
        time.sleep(0.5)
    out = "".join(p.read_text() for p in (run / "sleepy" / "logs").glob("slurm-*_0.out"))
    assert "SIGUSR1: requeueing" in out
    assert json.loads((run / "sleepy" / "stats.json").read_text())["counters"]["second_run"] == 1


def test_three_phase_step_chains_map_reduce_apply_with_afterok(slurm_env, tmp_path, capsys):
    """`balance` (map → reduce → apply): a map array, a reduce job afterok on it, an apply array afterok
    on the reduce, the merge job afterok on the apply array — in the launch scripts, slurm_jobs.json and
    `ovpipe status` — and the same bytes as a local run."""
    import json

    from test_map_reduce import merged_bytes, write_corpus

    run, ref = tmp_path / "run", tmp_path / "ref"
    write_corpus(run)
    write_corpus(ref)
    assert main(["balance", "--run-dir", str(ref), "--tasks", "3", "--quiet"]) == 0
    assert main(["balance", "--run-dir", str(run), "--tasks", "3", "--workers", "2", "--executor", "slurm",
                 "--wait", "--quiet"]) == 0
    sdir = run / "balance"
    rec = json.loads((sdir / "slurm_jobs.json").read_text())
    chain = [(j["phase"], j["after"]) for j in rec["chain"]]
    assert chain == [("map", []), ("reduce", [rec["array"]]), ("apply", [rec["reduce"]]), ("merge", [rec["apply"]])]
    assert "#SBATCH --array=0-2%2" in (sdir / "launch_script.slurm").read_text()
    assert f"#SBATCH --dependency=afterok:{rec['array']}" in (sdir / "launch_reduce.slurm").read_text()
    apply_script = (sdir / "launch_apply.slurm").read_text()
    assert f"#SBATCH --dependency=afterok:{rec['reduce']}" in apply_script and "--phase apply" in apply_script
    assert f"#SBATCH --dependency=afterok:{rec['apply']}" in (sdir / "launch_merge.slurm").read_text()
    assert merged_bytes(run, tmp_path) == merged_bytes(ref, tmp_path)
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert (f"slurm: map {rec['array']} done 3/3 → reduce {rec['reduce']} done (afterok:{rec['array']}) → "
            f"apply {rec['apply']} done 3/3 (afterok:{rec['reduce']}) → merge {rec['merge']} done "
            f"(afterok:{rec['apply']})") in out
    assert re.search(r"├ reduce +done\n +└ apply +3/3 ", out)

    # one apply rank lost: the rerun submits only an apply array over it and the merge job
    (sdir / "completions" / "apply-00001").unlink()
    assert main(["balance", "--run-dir", str(run), "--tasks", "3", "--executor", "slurm", "--wait", "--quiet"]) == 0
    rec = json.loads((sdir / "slurm_jobs.json").read_text())
    assert [j["phase"] for j in rec["chain"]] == ["apply", "merge"] and rec["apply_ranks"] == [1]
    assert "#SBATCH --array=1%1" in (sdir / "launch_apply.slurm").read_text()
    assert merged_bytes(run, tmp_path) == merged_bytes(ref, tmp_path)


def test_reduce_first_step_chains_reduce_apply_merge_without_a_map_array(slurm_env, tmp_path, capsys):
    """A reduce-first step (``Step(reduce=..., apply=...)``, no ``run``): the chain is reduce job → apply
    array afterok on it → merge afterok on the apply array, with no map array submitted; a lost apply
    rank is resubmitted alone (apply → merge), the reduce not redone."""
    import pyarrow.parquet as pq

    run = tmp_path / "run"
    args = ["numbers", "--run-dir", str(run), "--tasks", "3", "--workers", "2", "--set", "n=10",
            "--executor", "slurm", "--wait", "--quiet"]
    assert main(args) == 0
    sdir = run / "numbers"
    rec = json.loads((sdir / "slurm_jobs.json").read_text())
    assert [(j["phase"], j["after"]) for j in rec["chain"]] == [
        ("reduce", []), ("apply", [rec["reduce"]]), ("merge", [rec["apply"]])]
    assert rec["array"] is None and rec["ranks"] == [] and not (sdir / "launch_script.slurm").exists()
    assert "--dependency" not in (sdir / "launch_reduce.slurm").read_text()
    assert f"#SBATCH --dependency=afterok:{rec['reduce']}" in (sdir / "launch_apply.slurm").read_text()
    parts = sorted((sdir / "numbers").glob("part-*.parquet"))
    assert [pq.read_table(p).column("x").to_pylist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert (f"slurm: reduce {rec['reduce']} done → apply {rec['apply']} done 3/3 (afterok:{rec['reduce']}) → "
            f"merge {rec['merge']} done (afterok:{rec['apply']})") in out
    assert re.search(r"└ reduce first +done", out)

    reduced = (sdir / "completions" / "reduced").stat().st_mtime_ns
    (sdir / "completions" / "apply-00001").unlink()
    assert main(args) == 0
    rec = json.loads((sdir / "slurm_jobs.json").read_text())
    assert [j["phase"] for j in rec["chain"]] == ["apply", "merge"] and rec["apply_ranks"] == [1]
    assert (sdir / "completions" / "reduced").stat().st_mtime_ns == reduced


def test_wait_fails_naming_the_failed_rank_and_its_logs(slurm_env, demo_corpus, tmp_path, monkeypatch, capsys):
    """A rank that raises: `--wait` ends with exit 1 naming the rank, its traceback's last line and its logs;
    the merge job, afterok on the array, is cancelled; `ovpipe status` shows the chain failed and exits 1."""
    import json

    run = tmp_path / "run"
    assert _ingest(demo_corpus, run) == 0
    monkeypatch.setenv("OVPIPE_FAIL_RANKS", "count-ok:1")       # exported to the jobs by sbatch
    rc = main(["count-ok", "--run-dir", str(run), "--executor", "slurm", "--tasks", "2", "--wait"])
    err = capsys.readouterr().err
    assert rc == 1
    rec = json.loads((run / "count-ok" / "slurm_jobs.json").read_text())
    logs = run.resolve() / "count-ok" / "logs"
    assert f"map job {rec['array']}: rank 1 failed" in err
    assert f"rank 1: RuntimeError" in err and str(logs / "task_00001.log") in err
    assert str(logs / f"slurm-{rec['array']}_1.out") in err
    assert f"merge job {rec['merge']} failed (CANCELLED" in err      # cancelled: its afterok can never be met
    assert f"map {rec['array']} running" in err          # the progress lines came first
    assert main(["status", str(run)]) == 1
    out = capsys.readouterr().out
    assert f"slurm: map {rec['array']} failed 1/2" in out and f"merge {rec['merge']} failed" in out


def test_cluster_up_down_by_pid_leaves_no_daemon(tmp_path, capsys):
    """`make slurm-up` / `make slurm-down`: the CLI starts the three daemons detached, prints SLURM_CONF,
    and `down` stops each by its recorded PID."""
    from ovpipe.executors.slurm_cluster import main as cluster_main, _proc_alive

    d = tmp_path / "cluster"
    assert cluster_main(["up", "--dir", str(d), "--cpus", "2"]) == 0
    assert capsys.readouterr().out.strip() == f"export SLURM_CONF={d.resolve()}/slurm.conf"
    pids = json.loads((d / "pids.json").read_text())
    try:
        assert sorted(pids) == ["munged", "slurmctld", "slurmd"] and all(_proc_alive(p, n) for n, p in pids.items())
        assert cluster_main(["up", "--dir", str(d)]) == 1                 # one cluster per folder
    finally:
        assert cluster_main(["down", "--dir", str(d)]) == 0
    assert not any(_proc_alive(p, n) for n, p in pids.items())
    assert not d.exists()
    assert cluster_main(["status", "--dir", str(d)]) == 1


def test_balanced_pack_order_on_slurm_is_the_local_one(slurm_env, tmp_path):
    """``pack`` with balanced steps (its reduce orders the packs for DP 4 × 2 micro-batches) as Slurm jobs
    over 3 apply ranks writes the same ``packs`` bytes as one local task."""
    import numpy as np

    from manifests.io import write_part

    rng = np.random.default_rng(0)
    n = 3000
    ids = [f"{(i * 2654435761) % (1 << 63):016x}" for i in range(1, n + 1)]
    img = rng.integers(0, 4, n)
    L = rng.integers(20, 500, n) + 66 * img
    rows = {"sample_id": ids, "source": ["s"] * n, "text_tokens": L - 66 * img, "image_tokens": 66 * img,
            "total_tokens": L, "target_tokens": L // 2, "turns_kept": [2] * n, "images": img,
            "vit_sq": img * 257 ** 2, "status": ["ok"] * n, "error": [None] * n, "source_sample_id": ids}
    out = {}
    for executor, tasks in (("local", 1), ("slurm", 3)):
        run = tmp_path / executor
        write_part(rows, run / "lengths" / "lengths" / "part-00000.parquet", "lengths", sort=True)
        (run / "lengths" / "config.json").write_text(json.dumps({"tokenizer": "unused", "seq_len": 1024}))
        assert main(["pack", "--run-dir", str(run), "--tasks", str(tasks), "--executor", executor, "--quiet",
                     "--set", "seq_len=1024", "--set", "write_shards=false", "--set", "balance_dp=4",
                     "--set", "balance_grad_accum=2", *(["--wait"] if executor == "slurm" else [])]) == 0
        write_table(read_manifest(run, "packs"), tmp_path / f"{executor}.parquet")
        out[executor] = (tmp_path / f"{executor}.parquet").read_bytes()
        info = json.loads((run / "pack" / "stats.json").read_text())["info"]
        assert info["straggler_loss_after"] < info["straggler_loss_before"]
    assert out["local"] == out["slurm"]
