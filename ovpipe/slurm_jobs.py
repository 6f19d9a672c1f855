"""What the Slurm queue says about a job: the one ``squeue`` call the run folder (an input step whose
merge job is still queued) and the Slurm executor (an earlier submit still live) both ask."""
from __future__ import annotations

import subprocess


def job_active(job_id: str) -> bool:
    """Whether ``job_id`` is queued or running; False where there is no ``squeue`` (no cluster here)."""
    try:
        res = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%i"], capture_output=True, text=True)
    except OSError:
        return False
    return res.returncode == 0 and bool(res.stdout.strip())
