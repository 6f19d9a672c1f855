"""A real Slurm on loopback, one node or several: for trying the Slurm executor on a laptop (``make slurm-up``,
``SLURM_NODES=2``) and for the Slurm tests (the same class, as a context manager).

Several nodes are several ``slurmd -N nodeK`` on 127.0.0.1, each with its own port, spool folder, pid file
and log (``%n`` in slurm.conf); Debian's Slurm runs them as they are. A job over two of them is a real
two-node allocation: ``srun`` starts a task on each, ``SLURM_JOB_NODELIST`` names both, and the first node's
``NodeAddr`` is where its ranks meet.

``SlurmCluster`` writes a ``slurm.conf`` into its folder, starts a private ``munged`` (own key,
socket, pid file), ``slurmctld -D`` and ``slurmd -D`` from that folder, waits for the node to be idle,
and records the daemons' PIDs in ``pids.json``; ``stop`` cancels what is still queued and stops each
daemon by its PID. Everything listens on 127.0.0.1: ``SlurmctldHost=localhost(127.0.0.1)``,
``NodeAddr=127.0.0.1``, ``CommunicationParameters=NoInAddrAny,NoCtldInAddrAny``; job completion goes to a
text file (``jobcomp/filetxt``) rather than slurmdbd, which would listen on all addresses.
Client commands (``sbatch``, ``squeue``, ``ovpipe --executor slurm``) find the cluster through
``SLURM_CONF``.

    python -m ovpipe.executors.slurm_cluster up --dir DIR     # prints: export SLURM_CONF=DIR/slurm.conf
    python -m ovpipe.executors.slurm_cluster status --dir DIR
    python -m ovpipe.executors.slurm_cluster down --dir DIR
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "scancel", "srun")
DAEMONS = ("munged", "slurmctld", "slurmd")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_alive(pid: int, name: str) -> bool:
    """``pid`` is a live (not zombie) process whose command line names ``name`` — never signal a PID
    that the kernel has since given to another program."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        state = next((ln.split()[1] for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ln.startswith("State:")), "?")
    except (OSError, IndexError):
        return False
    return Path(cmd).name == name and state != "Z"


class SlurmCluster:
    """A loopback cluster in ``dir`` (a new temp folder if None). ``cpus`` is what slurmd announces
    (``SlurmdParameters=config_overrides``), so a 2-core laptop can hold a few array tasks at once.
    ``max_array_size`` is slurm.conf's ``MaxArraySize`` (Slurm's default 1001 when None): the tests lower it to
    make a few ranks span several arrays."""

    def __init__(self, dir: Path | str | None = None, cpus: int = 4, memory_mb: int = 2000, nodes: int = 1,
                 max_array_size: int | None = None):
        self.max_array_size = max_array_size
        self.nodes = nodes
        self.cpus = cpus
        self.memory_mb = memory_mb
        self._own_dir = dir is None
        self.dir = Path(tempfile.mkdtemp(prefix="ovpipe-slurm-") if dir is None else dir).resolve()
        self.procs: list[subprocess.Popen] = []
        self.env: dict[str, str] = {"SLURM_CONF": str(self.dir / "slurm.conf")}

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    # -- set-up -------------------------------------------------------------------------
    @property
    def node_names(self) -> list[str]:
        """``localhost`` for one node; ``node1``.. ``nodeN`` for several, every one a slurmd on 127.0.0.1 with its
        own port, spool folder, pid file and log (``%n`` in slurm.conf)."""
        return ["localhost"] if self.nodes == 1 else [f"node{i + 1}" for i in range(self.nodes)]

    def _conf(self) -> str:
        d = self.dir
        self._ports = [_free_port() for _ in self.node_names]
        nodes = "\n".join(f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname=localhost Port={port} CPUs={self.cpus} "
                          f"RealMemory={self.memory_mb} State=UNKNOWN" for n, port in zip(self.node_names, self._ports))
        limits = "" if self.max_array_size is None else f"MaxArraySize={self.max_array_size}\n"
        return f"""\
ClusterName=ovpipe
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={self._ports[0]}
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
AuthType=auth/munge
AuthInfo=socket={d}/munge/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
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
{limits}{nodes}
PartitionName=debug Nodes={",".join(self.node_names)} Default=YES MaxTime=INFINITE State=UP
"""

    def _spawn(self, args: list[str], log: str) -> subprocess.Popen:
        # A new session: the daemons outlive `make slurm-up`, and a Ctrl-C in the terminal does not reach them.
        with open(self.dir / log, "w") as out:
            p = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 cwd=self.dir, env={**os.environ, **self.env}, start_new_session=True)
        self.procs.append(p)
        self._save_pids()
        return p

    def _save_pids(self) -> None:
        # one key per daemon: "slurmd" for the first node's, "slurmd@node2" for another's
        pids = {}
        for p in self.procs:
            name = Path(p.args[0]).name
            pids[name if name not in pids else f"{name}@{p.args[p.args.index('-N') + 1]}"] = p.pid
        from manifests.io import atomic_write

        with atomic_write(self.dir / "pids.json") as tmp:
            tmp.write_text(json.dumps(pids, indent=1))

    def pids(self) -> dict[str, int]:
        try:
            return json.loads((self.dir / "pids.json").read_text())
        except (OSError, ValueError):
            return {}

    def running(self) -> dict[str, int]:
        """The daemons of ``pids.json`` that are still alive."""
        return {n: pid for n, pid in self.pids().items() if _proc_alive(pid, n.split("@")[0])}

    def start(self, timeout_s: float = 60) -> "SlurmCluster":
        missing = missing_binaries()
        if missing:
            raise RuntimeError(f"Slurm is not installed ({', '.join(missing)} missing): run scripts/install_slurm.sh")
        live = self.running()
        if live:
            raise RuntimeError(f"a cluster already runs from {self.dir} (pids {live}); stop it first")
        d = self.dir
        d.mkdir(parents=True, exist_ok=True)
        for sub in ("state", "spool", "munge"):
            shutil.rmtree(d / sub, ignore_errors=True)
            (d / sub).mkdir()
        for n in self.node_names:
            (d / "spool" / n).mkdir()
        os.chmod(d / "munge", 0o711)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.conf.write_text(self._conf())
        self._spawn(["munged", "-F", "--force", f"--socket={d}/munge/munge.socket", f"--key-file={key}",
                     f"--pid-file={d}/munge/munged.pid", f"--log-file={d}/munge/munged.log",
                     f"--seed-file={d}/munge/munged.seed"], "munged.out")
        self._wait(lambda: (d / "munge" / "munge.socket").exists(), 10, "munged socket")
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
        for n in self.node_names:
            self._spawn(["slurmd", "-D", "-N", n, "-f", str(self.conf)], f"slurmd-{n}.out")
        self._wait(self._node_idle, timeout_s, "node idle in sinfo")
        return self

    def _node_idle(self) -> bool:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[0]} exited with {p.returncode}:\n{self.logs()}")
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True,
                           env={**os.environ, **self.env})
        states = r.stdout.split()
        return r.returncode == 0 and len(states) == len(self.node_names) and all(s.startswith("idle") for s in states)

    def _wait(self, cond, timeout_s: float, what: str) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout_s:
            if cond():
                return
            time.sleep(0.2)
        raise TimeoutError(f"loopback slurm: no {what} after {timeout_s}s\n{self.logs()}")

    def logs(self) -> str:
        files = sorted([*self.dir.glob("*.log"), *self.dir.glob("*.out"), *self.dir.glob("munge/*.log")])
        return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-1500:]}" for f in files)

    # -- tear-down ----------------------------------------------------------------------
    def stop(self, remove: bool | None = None) -> list[str]:
        """Cancel every job, wait for the queue to drain, then SIGTERM each daemon by its PID (SIGKILL
        after 10 s). Removes the folder when this object made it (or ``remove``). Returns what it stopped."""
        env = {**os.environ, **self.env}
        live = self.running()
        if {"slurmctld", "slurmd", "munged"} <= set(live):
            # Cancel whatever is still queued so no job step outlives the daemons.
            subprocess.run(["scancel", "--full", "--partition=debug"], env=env, capture_output=True)
            t0 = time.time()
            while time.time() - t0 < 20:
                r = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True)
                if r.returncode != 0 or not r.stdout.strip():
                    break
                time.sleep(0.3)
        stopped = []
        order = [n for d in reversed(DAEMONS) for n in sorted(live) if n.split("@")[0] == d]
        for key in order:                  # slurmd(s), slurmctld, then munged, which both authenticate with
            pid, name = live[key], key.split("@")[0]
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            own = next((p for p in self.procs if p.pid == pid), None)
            t0 = time.time()
            while _proc_alive(pid, name) and time.time() - t0 < 10:
                if own is not None:
                    own.poll()     # reap our own child, so it does not linger as a zombie
                time.sleep(0.1)
            if _proc_alive(pid, name):
                os.kill(pid, signal.SIGKILL)
            if own is not None:
                own.wait()
            stopped.append(f"{key} (pid {pid})")
        self.procs.clear()
        (self.dir / "pids.json").unlink(missing_ok=True)
        if self._own_dir if remove is None else remove:
            shutil.rmtree(self.dir, ignore_errors=True)
        return stopped

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ovpipe.executors.slurm_cluster",
                                 description="a Slurm on 127.0.0.1 (private munge, slurmctld, one slurmd per node)")
    ap.add_argument("action", choices=["up", "down", "status"])
    ap.add_argument("--dir", required=True, help="the cluster's folder: slurm.conf, state, logs, pids.json")
    ap.add_argument("--cpus", type=int, default=max(4, os.cpu_count() or 1),
                    help="CPUs each slurmd announces (default: max(4, this machine's))")
    ap.add_argument("--nodes", type=int, default=1, help="slurmd nodes, all on 127.0.0.1 (node1..nodeN when > 1)")
    a = ap.parse_args(argv)
    c = SlurmCluster(Path(a.dir), cpus=a.cpus, nodes=a.nodes)
    if a.action == "up":
        try:
            c.start()
        except (RuntimeError, TimeoutError) as e:
            print(f"slurm-up: {e}", file=sys.stderr)
            if not str(e).startswith("a cluster already runs"):
                c.stop(remove=False)
            return 1
        pids = ", ".join(f"{n} {p}" for n, p in c.pids().items())
        print(f"loopback slurm up in {c.dir} ({pids}); {a.nodes} node(s) idle, {a.cpus} CPUs each on 127.0.0.1",
              file=sys.stderr)
        print(f"export SLURM_CONF={c.conf}")
        return 0
    if a.action == "status":
        live = c.running()
        print(f"{c.dir}: " + (", ".join(f"{n} {p}" for n, p in live.items()) if live else "no daemon running"))
        return 0 if live else 1
    stopped = c.stop(remove=True)
    print(f"slurm-down: stopped {', '.join(stopped) if stopped else 'nothing (no daemon was running)'}; "
          f"removed {c.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
