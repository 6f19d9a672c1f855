"""The loopback Slurm the tests start: the same cluster `make slurm-up` starts for users
(``ovpipe.executors.slurm_cluster``), here in a temp folder for the life of a test module; and how a test starts a
requeued job without waiting out Slurm's hold on it."""
import subprocess
import time

from ovpipe.executors.slurm_cluster import SlurmCluster, missing_binaries

__all__ = ["SlurmCluster", "missing_binaries", "release_requeued"]


def release_requeued(job: str, env: dict, timeout: float = 120, info=lambda: "") -> None:
    """Start requeued ``job`` now, as an operator would with ``scontrol update StartTime=now``, instead of after
    the hold slurmctld puts on it (BeginTime = the old run's end + cred_expire, ~2 min) — but only once that hold
    is set (squeue shows ``PENDING BeginTime``: the old run has finished completing) and 2 s after it: slurmd
    refuses a launch in the second the old run's credential was revoked ("Killing non-startable batch JobId=…:
    Job credential revoked"; the job then fails and whatever is afterok on it is cancelled). Pulling the start
    forward earlier, while the old run was still completing, flaked both requeue tests under the suite's load."""
    t0 = time.time()
    while not subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], env=env, capture_output=True,
                             text=True).stdout.startswith("PENDING BeginTime"):
        if time.time() - t0 > timeout:
            raise TimeoutError(f"requeued job {job} not held after {timeout}s\n{info()}")
        time.sleep(0.5)
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, capture_output=True)
