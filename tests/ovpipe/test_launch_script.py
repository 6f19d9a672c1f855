"""The Slurm launch script, checked without a cluster (the trap is run by bash for real)."""
import os
import signal
import subprocess
import time

from ovpipe.executors.slurm import SlurmOptions, compress_ranks, render_launch_script


def test_compress_ranks():
    assert compress_ranks([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert compress_ranks([2]) == "2"


def test_launch_script_content(tmp_path):
    s = render_launch_script("ingest", tmp_path, tasks=6, ranks=[0, 1, 2, 5], workers=2,
                             opts=SlurmOptions(partition="cpu", mem="4G", extra=["--qos=high"]),
                             python="/opt/py")
    lines = s.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert "#SBATCH --array=0-2,5%2" in lines
    assert "#SBATCH --signal=B:USR1@120" in lines and "#SBATCH --requeue" in lines
    assert "#SBATCH --partition=cpu" in lines and "#SBATCH --mem=4G" in lines and "#SBATCH --qos=high" in lines
    assert f"#SBATCH --output={tmp_path}/ingest/logs/slurm-%A_%a.out" in lines
    assert any(l.startswith("/opt/py -m ovpipe.cli _task ingest") and "--world-size 6" in l
               and '--rank "$((SLURM_ARRAY_TASK_ID + RANK_OFFSET))"' in l for l in lines)
    assert "RANK_OFFSET=0" in lines          # ranks below MaxArraySize: each array index is its rank
    assert "trap requeue USR1" in lines
    subprocess.run(["bash", "-n", "-c", s], check=True)  # valid bash


def test_usr1_trap_requeues_the_array_task(tmp_path):
    """Send SIGUSR1 to the batch shell as Slurm would: it stops the task and calls
    `scontrol requeue <array job>_<task>` (a fake scontrol on PATH records the call)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text(f"#!/bin/bash\necho \"$@\" > {tmp_path}/scontrol.args\n")
    fakepy = bindir / "fakepy"
    fakepy.write_text("#!/bin/bash\nexec sleep 30\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    script = tmp_path / "launch.slurm"
    script.write_text(render_launch_script("ingest", tmp_path, 4, [0, 1, 2, 3], 2, SlurmOptions(), python=str(fakepy)))
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "SLURM_ARRAY_JOB_ID": "77",
           "SLURM_ARRAY_TASK_ID": "3"}
    p = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    t0 = time.time()
    p.send_signal(signal.SIGUSR1)
    out, _ = p.communicate(timeout=10)
    assert time.time() - t0 < 5  # the sleeping task was stopped, not waited for
    assert p.returncode == 0
    assert "SIGUSR1: requeueing 77_3" in out
    assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "77_3"]


def test_three_phase_scripts_carry_their_afterok_dependency(tmp_path):
    from ovpipe.executors.slurm import render_single_job

    apply = render_launch_script("balance", tmp_path, tasks=4, ranks=[1, 3], workers=2, opts=SlurmOptions(),
                                 python="/opt/py", after=["42"], phase="apply")
    lines = apply.splitlines()
    assert "#SBATCH --dependency=afterok:42" in lines and "#SBATCH --kill-on-invalid-dep=yes" in lines
    assert "#SBATCH --array=1,3%2" in lines and "#SBATCH --job-name=ovpipe-balance-apply" in lines
    assert any(l.startswith("/opt/py -m ovpipe.cli _task balance") and "--phase apply" in l for l in lines)
    reduce = render_single_job("balance", tmp_path, "reduce", SlurmOptions(mem="8G"), python="/opt/py", after=["41"])
    assert "#SBATCH --dependency=afterok:41" in reduce.splitlines() and "#SBATCH --mem=8G" in reduce.splitlines()
    assert reduce.rstrip().endswith("--name balance --phase reduce")
    merge = render_single_job("balance", tmp_path, "merge", SlurmOptions(), python="/opt/py", after=["43"])
    assert "#SBATCH --dependency=afterok:43" in merge.splitlines() and "--phase" not in merge
    no_deps = render_launch_script("balance", tmp_path, 4, [0, 1, 2, 3], 2, SlurmOptions(), python="/opt/py")
    assert "--dependency" not in no_deps and "--phase" not in no_deps     # a map array with nothing upstream
    for s in (apply, reduce, merge, no_deps):
        subprocess.run(["bash", "-n", "-c", s], check=True)
