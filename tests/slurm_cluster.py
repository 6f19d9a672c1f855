"""A real single-node Slurm on loopback for the Slurm executor tests.

``SlurmCluster`` writes a ``slurm.conf`` into a temp folder, starts a private ``munged``
(own key, socket, pid file), ``slurmctld -D`` and ``slurmd -D`` from that folder, waits for
the node to be idle, and stops every daemon by PID on exit. Everything listens on 127.0.0.1:
``SlurmctldHost=localhost(127.0.0.1)``, ``NodeAddr=127.0.0.1``,
``CommunicationParameters=NoInAddrAny,NoCtldInAddrAny``; job completion goes to a text file
(``jobcomp/filetxt``) rather than slurmdbd, which would listen on all addresses.
Client commands find the cluster through ``SLURM_CONF``.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    def __init__(self, cpus: int = 4):
        self.cpus = cpus
        self.dir = Path(tempfile.mkdtemp(prefix="ovpipe-slurm-"))
        self.procs: list[subprocess.Popen] = []
        self.env: dict[str, str] = {}

    # -- set-up -------------------------------------------------------------------------
    def _conf(self) -> str:
        d = self.dir
        return f"""\
ClusterName=ovpipetest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
AuthType=auth/munge
AuthInfo=socket={d}/munge/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobCompType=jobcomp/filetxt
JobCompLoc={d}/jobcomp.txt
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
MpiDefault=none
MessageTimeout=10
SlurmctldTimeout=10
SlurmdTimeout=10
InactiveLimit=0
KillWait=2
MinJobAge=30
NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""

    def _spawn(self, args: list[str], log: str) -> subprocess.Popen:
        p = subprocess.Popen(args, stdout=open(self.dir / log, "w"), stderr=subprocess.STDOUT,
                             cwd=self.dir, env={**os.environ, **self.env}, start_new_session=True)
        self.procs.append(p)
        return p

    def start(self, timeout_s: float = 60) -> "SlurmCluster":
        d = self.dir
        for sub in ("state", "spool", "munge"):
            (d / sub).mkdir()
        os.chmod(d / "munge", 0o711)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        (d / "slurm.conf").write_text(self._conf())
        self.env = {"SLURM_CONF": str(d / "slurm.conf")}
        self._spawn(["munged", "-F", "--force", f"--socket={d}/munge/munge.socket", f"--key-file={key}",
                     f"--pid-file={d}/munge/munged.pid", f"--log-file={d}/munge/munged.log",
                     f"--seed-file={d}/munge/munged.seed"], "munged.out")
        self._wait(lambda: (d / "munge" / "munge.socket").exists(), 10, "munged socket")
        self._spawn(["slurmctld", "-D", "-i", "-f", str(d / "slurm.conf")], "slurmctld.out")
        self._spawn(["slurmd", "-D", "-N", "localhost", "-f", str(d / "slurm.conf")], "slurmd.out")
        self._wait(self._node_idle, timeout_s, "node idle in sinfo")
        return self

    def _node_idle(self) -> bool:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[0]} exited with {p.returncode}:\n{self.logs()}")
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True,
                           env={**os.environ, **self.env})
        return r.returncode == 0 and r.stdout.strip().startswith("idle")

    def _wait(self, cond, timeout_s: float, what: str) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout_s:
            if cond():
                return
            time.sleep(0.2)
        raise TimeoutError(f"slurm test cluster: no {what} after {timeout_s}s\n{self.logs()}")

    def logs(self) -> str:
        files = sorted([*self.dir.glob("*.log"), *self.dir.glob("*.out"), *self.dir.glob("munge/*.log")])
        return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-1500:]}" for f in files)

    # -- tear-down ----------------------------------------------------------------------
    def stop(self) -> None:
        env = {**os.environ, **self.env}
        if self.procs and all(p.poll() is None for p in self.procs):
            # Cancel whatever is still queued so no job step outlives the daemons.
            subprocess.run(["scancel", "--full", "--partition=debug"], env=env, capture_output=True)
            t0 = time.time()
            while time.time() - t0 < 20:
                r = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True)
                if r.returncode != 0 or not r.stdout.strip():
                    break
                time.sleep(0.3)
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()
