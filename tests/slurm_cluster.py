"""A real one-machine Slurm cluster for tests and benchmarks: munged, slurmctld and slurmd from
Debian's ``slurm-wlm`` and ``munge``, with a generated configuration in a private folder, on
loopback ports of its own. CPU-only; it starts in seconds.

Two partitions: ``batch`` (the default) and ``urgent``, whose jobs preempt ``batch`` jobs
(``PreemptType=preempt/partition_prio``, ``PreemptMode=CANCEL``) after a grace time in which
the preempted job's steps get SIGTERM.

Needs root (slurmd runs jobs as their users) and the packages; :func:`available` says why not.
``SLURM_CONF`` is set in this process's environment while the cluster runs, so the Slurm
commands (and ipyparallel's Slurm launcher, and kernels started meanwhile) talk to it.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

import psutil

from service import Service

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol")
GRACE_S = 10  # preemption: seconds between SIGTERM and SIGKILL


def available() -> str | None:
    """None when a test cluster can run here, else why not (`make test` installs Slurm as
    root; a cluster of our own needs root, for slurmd starts jobs as their users)."""
    if os.geteuid() != 0:
        return "a test Slurm cluster needs root (slurmd starts jobs as their users)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CONFIG = """ClusterName=ejtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmUser=root
SlurmdUser=root
MpiDefault=none
JobCompType=jobcomp/filetxt
JobCompLoc={dir}/jobcomp.txt
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=5
MinJobAge=60
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=16000 State=UNKNOWN
PartitionName=batch Nodes={host} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime={grace}
PartitionName=urgent Nodes={host} MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""


class SlurmCluster(Service):
    """Start with ``with SlurmCluster(cpus=4) as slurm:``; `cpus` is how many one-CPU engine
    jobs can run at once (Slurm is told so; the machine may have fewer cores)."""

    def __init__(self, cpus: int = 4):
        self.cpus = cpus
        self.dir = tempfile.mkdtemp(prefix="ej-slurm-")
        os.chmod(self.dir, 0o755)  # munged: its socket's folder must be reachable by all
        self.conf = os.path.join(self.dir, "slurm.conf")
        self._old_conf = None
        self._started = time.time()

    def start(self) -> None:
        missing = [d for d in DAEMONS if shutil.which(d) is None]
        if missing:
            raise RuntimeError(f"Slurm is not installed ({', '.join(missing)} missing): "
                               "apt-get install slurm-wlm munge (make test does)")
        d = self.dir
        for sub in ("state", "spool"):
            os.makedirs(os.path.join(d, sub))
        key = os.path.join(d, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        subprocess.run(["munged", "--force", f"--key-file={key}", f"--socket={d}/munge.sock",
                        f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
                        f"--seed-file={d}/munged.seed"], check=True, timeout=30)
        with open(self.conf, "w") as f:
            f.write(CONFIG.format(host=socket.gethostname(), ctld_port=_free_port(),
                                  d_port=_free_port(), dir=d, cpus=self.cpus, grace=GRACE_S))
        self._old_conf = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = self.conf
        subprocess.run(["slurmctld", "-i"], check=True, timeout=30)
        subprocess.run(["slurmd"], check=True, timeout=30)
        self._wait_idle()

    def _cancel_jobs(self, timeout: float = 15.0) -> None:
        """Cancel every job and wait (bounded) until none runs."""
        if not os.path.exists(os.path.join(self.dir, "slurmctld.pid")):
            return
        try:
            subprocess.run(["scancel", "--full", *[j["id"] for j in self.jobs()]],
                           capture_output=True, timeout=30)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and any(
                    j["state"] in ("RUNNING", "COMPLETING", "PENDING") for j in self.jobs()):
                time.sleep(0.2)
        except (subprocess.SubprocessError, OSError):
            pass  # the daemons are stopped next, and what is left is killed

    def _wait_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
            if out.stdout.strip() == "idle":
                return
            time.sleep(0.2)
        raise RuntimeError(f"the test Slurm did not come up: sinfo says {out.stdout.strip()!r} "
                           f"{out.stderr.strip()!r}; logs in {self.dir}")

    def jobs(self, state: str = "all") -> list[dict]:
        """Jobs Slurm knows: [{"id", "name", "state", "reason", "partition"}]."""
        out = subprocess.run(["squeue", "-h", "-t", state, "-o", "%i|%j|%T|%r|%P"],
                             capture_output=True, text=True, check=True).stdout
        return [dict(zip(("id", "name", "state", "reason", "partition"), line.split("|")))
                for line in out.splitlines()]

    def stop(self) -> None:
        self._cancel_jobs()
        for pidfile in ("slurmd.pid", "slurmctld.pid", "munged.pid"):
            path = os.path.join(self.dir, pidfile)
            try:
                with open(path) as f:
                    pid = int(f.read().strip())
            except (OSError, ValueError):
                continue
            _kill_and_wait(pid)
        # what is left of jobs: slurmstepd (its name shows no folder) and what it started
        for proc in psutil.process_iter(["name", "cmdline", "create_time"]):
            info = proc.info
            if info["create_time"] >= self._started and (
                    (info["name"] or "").startswith("slurmstepd")
                    or self.dir in " ".join(info["cmdline"] or [])):
                for p in [proc] + _children(proc):
                    try:
                        p.kill()
                    except psutil.Error:
                        pass
        if self._old_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = self._old_conf
        shutil.rmtree(self.dir, ignore_errors=True)


def _children(proc: psutil.Process) -> list:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def _kill_and_wait(pid: int, timeout: float = 10.0) -> None:
    try:
        os.kill(pid, 15)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass
