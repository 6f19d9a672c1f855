"""A real cluster's own sbatch flags (``--account``, ``--qos``, ``--gres``, ``--gpus-per-task``, ``--constraint``,
``--sbatch-arg``): on every step's command line and ``ovpipe pretrain``'s, and written into every job of a step's
chain — map, reduce, apply, merge and a distributed step's one job alike."""
import json
import sys
from pathlib import Path

import pytest

from ovpipe.cli import build_parser, main, slurm_options
from ovpipe.executors.slurm import render_distributed_job, render_launch_script, render_single_job

FLAGS = ["--account=lab", "--qos=normal", "--gres=gpu:1", "--gpus-per-task=1", "--constraint=a100",
         "--sbatch-arg=--exclusive", "--sbatch-arg=--comment=ovpipe"]
LINES = ["#SBATCH --account=lab", "#SBATCH --qos=normal", "#SBATCH --gres=gpu:1", "#SBATCH --gpus-per-task=1",
         "#SBATCH --constraint=a100", "#SBATCH --exclusive", "#SBATCH --comment=ovpipe"]


def test_the_flags_reach_every_script_of_a_chain(tmp_path):
    args = build_parser().parse_args(["embed-images", "--run-dir", str(tmp_path), "--executor", "slurm", *FLAGS])
    opts = slurm_options(args)
    scripts = {"map": render_launch_script("embed-images", tmp_path, 4, [0, 1, 2, 3], 2, opts),
               "apply": render_launch_script("balance", tmp_path, 4, [0, 1], 2, opts, phase="apply"),
               "reduce": render_single_job("balance", tmp_path, "reduce", opts),
               "merge": render_single_job("balance", tmp_path, "merge", opts),
               "distributed": render_distributed_job("pretrain", tmp_path, opts)}
    for phase, text in scripts.items():
        header = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
        for line in LINES:
            assert header.count(line) == 1, (phase, line, header)


def test_pretrain_takes_the_same_flags(tmp_path):
    """``ovpipe pretrain --executor slurm --dry-run``: the stage's one job script carries them too."""
    rc = main(["pretrain", "--recipe", "tiny", "--stage", "1", "--run-dir", str(tmp_path), "--executor", "slurm",
               "--dry-run", "--gpus-per-node", "0", *FLAGS])
    scripts = list(tmp_path.glob("pretrain/stage-1/launch*.slurm"))
    assert rc == 0 and scripts, rc
    header = [ln for ln in scripts[0].read_text().splitlines() if ln.startswith("#SBATCH")]
    assert all(header.count(line) == 1 for line in LINES), header


def test_a_sbatch_arg_that_is_not_a_flag_is_a_usage_error(tmp_path):
    from ovpipe.cli import UsageError

    args = build_parser().parse_args(["ingest", "--run-dir", str(tmp_path), "--sbatch-arg=exclusive"])
    with pytest.raises(UsageError, match="--sbatch-arg 'exclusive'"):
        slurm_options(args)


@pytest.mark.slurm
def test_a_job_with_account_and_qos_runs_on_the_loopback_cluster(tmp_path, monkeypatch):
    """The loopback cluster keeps no accounting database (``AccountingStorageType=accounting_storage/none``), so
    sbatch takes any account and QOS: the job runs, and the flags are in each of its scripts."""
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from slurm_cluster import SlurmCluster
    from test_map_reduce import write_corpus

    here = Path(__file__).parent
    with SlurmCluster() as cluster:
        monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
        monkeypatch.setenv("PYTHONPATH", str(here))
        run = tmp_path / "run"
        write_corpus(run)
        assert main(["balance", "--run-dir", str(run), "--tasks", "2", "--executor", "slurm", "--wait", "--quiet",
                     "--account=lab", "--qos=normal", "--sbatch-arg=--comment=ovpipe"]) == 0
    sdir = run / "balance"
    rec = json.loads((sdir / "slurm_jobs.json").read_text())
    assert [j["phase"] for j in rec["chain"]] == ["map", "reduce", "apply", "merge"]
    for script in ("launch_script.slurm", "launch_reduce.slurm", "launch_apply.slurm", "launch_merge.slurm"):
        text = (sdir / script).read_text()
        assert "#SBATCH --account=lab" in text and "#SBATCH --qos=normal" in text, script
    assert (sdir / "completions" / "finalized").exists()
