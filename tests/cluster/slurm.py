"""A one-node Slurm cluster in a temporary folder, for the cluster tests: its own munge key and socket, its own
``slurm.conf`` (free ports, state, spool and log folders under the folder), slurmctld and slurmd started in
the foreground by this process and stopped by the pids it started. Debian's packages
(``scripts/install_slurm.sh``) provide the daemons; where they are missing or do not come up, ``start``
raises ``Unavailable`` with the reason, and the tests skip with it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")


class Unavailable(Exception):
    """Slurm cannot run here; the message says why (a test skips with it)."""


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _memory_mb() -> int:
    with open("/proc/meminfo") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return kb // 1024 // 2  # half the machine's: others share it


def _conf(root: Path, host: str, ports: list[int], cpus: int) -> str:
    return "\n".join([
        "ClusterName=qklabtest",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ports[0]}",
        f"SlurmdPort={ports[1]}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire: how long a requeued task waits before it may start again (default 120 s), which is also
        # how long the node may still hold the previous run's credential: a task started sooner is killed
        f"AuthInfo=socket={root / 'munge' / 'socket'},cred_expire=10",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SwitchType=switch/none",
        "ReturnToService=2",
        "JobRequeue=1",
        "KillWait=10",
        "MinJobAge=300",
        "SchedulerType=sched/builtin",
        "SchedulerParameters=sched_interval=2",
        "SlurmdParameters=config_overrides",
        "MaxArraySize=10001",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={_memory_mb()} State=UNKNOWN",
        "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


@dataclass
class SlurmCluster:
    root: Path
    cpus: int = 2
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """The environment a Slurm command of this cluster runs in (SLURM_CONF names its slurm.conf)."""
        return {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}

    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        p = subprocess.run(list(cmd), capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr.strip()}")
        return p

    def start(self, timeout: float = 60) -> SlurmCluster:
        missing = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
        if missing:
            raise Unavailable(f"no {', '.join(missing)}: scripts/install_slurm.sh installs Slurm (apt)")
        if os.geteuid() != 0:
            raise Unavailable("the test cluster's daemons run as root (SlurmdUser=root); run the tests as root")
        for d in ("munge", "state", "spool", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)  # munged: the socket's folders must be searchable by every user
        (self.root / "munge").chmod(0o755)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        host = socket.gethostname().split(".")[0]
        (self.root / "slurm.conf").write_text(_conf(self.root, host, _free_ports(2), self.cpus))
        m = self.root / "munge"
        self._spawn([_bin("munged"), "-F", "-f", f"--socket={m / 'socket'}", f"--key-file={key}",
                     f"--log-file={m / 'munged.log'}", f"--pid-file={m / 'munged.pid'}", f"--seed-file={m / 'seed'}"])
        self._wait(lambda: (m / "socket").exists(), timeout, "munged did not create its socket")
        self._spawn([_bin("slurmctld"), "-D", "-i"])
        self._wait(lambda: self.run("scontrol", "ping", check=False).stdout.count("UP") > 0, timeout,
                   "slurmctld did not answer")
        self._spawn([_bin("slurmd"), "-D"])
        self._wait(self._node_up, timeout, "slurmd did not register its node")
        return self

    def _node_up(self) -> bool:
        out = self.run("sinfo", "-h", "-o", "%t", check=False).stdout.split()
        return bool(out) and all(s.rstrip("*") in ("idle", "alloc", "mix") for s in out)

    def _spawn(self, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{Path(cmd[0]).name}.out", "ab")
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                           start_new_session=True))
        log.close()

    def _wait(self, ready, timeout: float, what: str) -> None:
        end = time.time() + timeout
        while time.time() < end:
            for p in self.procs:
                if p.poll() is not None:
                    raise Unavailable(f"{what}: {Path(p.args[0]).name} exited with code {p.returncode} "
                                      f"({self._tail(Path(p.args[0]).name)})")
            if ready():
                return
            time.sleep(0.2)
        raise Unavailable(f"{what} within {timeout:.0f} s ({self._tail('slurmctld')} {self._tail('slurmd')})")

    def _tail(self, name: str) -> str:
        texts = []
        for p in (self.root / "log" / f"{name}.log", self.root / "log" / f"{name}.out"):
            if p.is_file():
                texts += p.read_text(errors="replace").strip().splitlines()[-2:]
        return " | ".join(texts) or "no log"

    def stop(self) -> None:
        """Cancel what is left, then stop the daemons this cluster started (by their pids), slurmd first."""
        if self.procs:
            self.run("scancel", "--full", "-u", "root", check=False, timeout=10)
            end = time.time() + 30  # the tasks' processes are slurmstepd's, not ours: let Slurm end them
            while time.time() < end and self.run("squeue", "-h", check=False, timeout=10).stdout.strip():
                time.sleep(0.5)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()


def _bin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))
