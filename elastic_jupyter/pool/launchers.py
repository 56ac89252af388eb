"""Launchers: where a pool's engines run — this host, other hosts over SSH, or Slurm jobs.

The seam between :class:`~.pool.EnginePool` and ipyparallel's own launcher classes: the pool
starts each slot's engine as an engine set of one (pool.py says why), and a :class:`Launcher`
says which ipyparallel engine-set launcher starts it and what differs by place: the address
the controller and the rendezvous store bind to (loopback for this host; the interface that
reaches the other hosts otherwise, never all interfaces), the engines' environment, how long a
start may wait (a batch job may wait in the scheduler's queue for as long as it takes) and
whether the pool can end an engine's process itself.

SSH (:class:`SSHLauncher`): a slot is (host, index); each engine is started over ssh by
ipyparallel's ``SSHEngineSetLauncher``, in the same Python environment (a shared file system).

Slurm (:class:`SlurmLauncher`): one batch job per engine, through ipyparallel's
``SlurmEngineSetLauncher`` with our batch template. A grow submits jobs and the run grows when
Slurm starts them; a rank that left exits (its job ends with it). Slurm's SIGTERM ahead of a
kill (``scancel --signal=TERM``, preemption with a grace time, the time limit through
``--signal=TERM@grace``) drains the engine at the next step boundary (engine.drain).
"""
from __future__ import annotations

import abc
import asyncio
import inspect
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

from ..arbiter.hosts import HostArbiters
from ..arbiter.slurm import SlurmArbiter
from ..config import UsageError
from ..engine.interface import address_of, address_towards, interface_of

LOOPBACK = "127.0.0.1"


_WAITING = ("PENDING", "CONFIGURING", "REQUEUED", "SUSPENDED")
_LIVE = _WAITING + ("RUNNING", "COMPLETING")


@dataclass(frozen=True)
class Job:
    """An engine's batch job as its scheduler reports it: Slurm's job id, state and reason
    (such as ``PENDING``, ``Resources``; state "" when Slurm no longer knows it) and the file
    its output goes to."""

    job_id: str
    state: str
    reason: str
    output: str = ""

    @property
    def waiting(self) -> bool:
        """In the scheduler's queue: not running yet."""
        return self.state in _WAITING

    @property
    def ended(self) -> bool:
        return self.state not in _LIVE

    def why_ended(self) -> str:
        return (f"Slurm job {self.job_id} ended ({self.state or 'gone'}) before its engine "
                f"registered: {_tail(self.output)}")

    def __str__(self) -> str:
        return f"job {self.job_id} {self.state.lower()} ({self.reason})"


class StartWithdrawn(Exception):
    """An engine's start was given up: its slot went back to the arbiter (Slurm wants it for
    a waiting job) while the engine's job still waited in the queue. Not a fault of the slot."""


class Launcher(abc.ABC):
    """Where a pool's engines run. Subclasses set ``kind`` and ``local``.

    Attributes:
        kind: "local", "ssh" or "slurm", as ``--launcher`` names it.
        local: engines are this user's processes on this host: the pool signals them itself.
        address: the IPv4 address the controller and the rendezvous store listen on.
        gpus_per_engine: GPUs each engine is given where it runs (0: the pool places GPUs,
            or none); cpus_per_engine: its CPU threads (None: the pool decides).
        slot_count: how many slots the launcher has (None: the pool's --max decides).
    """

    kind: str
    local: bool
    address: str = LOOPBACK
    gpus_per_engine: int = 0
    cpus_per_engine: int | None = None
    slot_count: int | None = None

    def cluster_options(self, folder: str) -> dict:
        """Keyword arguments for ``ipyparallel.Cluster`` (`folder`: the pool's private folder,
        for batch scripts)."""
        return {}

    def engine_env(self) -> dict:
        """Environment every engine gets besides its slot's."""
        return {"GLOO_SOCKET_IFNAME": "lo"}  # single host: gloo stays on loopback

    def start_options(self, slot: int) -> dict:
        """Keyword arguments of ``Cluster.start_engines`` for `slot`'s engine set, and the
        slot's own environment under "environment"."""
        return {}

    def host_of(self, slot: int) -> str | None:
        """The host `slot`'s engine runs on, when the launcher places it (else None)."""
        return None

    async def jobs(self, engine_sets: dict) -> dict[str, Job] | None:
        """The batch jobs of engine sets (id -> ipyparallel launcher), for launchers of batch
        jobs (else none; None when the scheduler did not answer): a job that waits in the
        queue does not count against the engine's start timeout, and one that ended before
        its engine registered failed the start."""
        return {}

    def arbiter(self, own_jobs):
        """Who leases an auto pool its slots: None for the machine's arbiter (this host's
        slots), else an object with :class:`~.arbiter.client.ArbiterClient`'s calls.
        `own_jobs` returns the pool's batch job ids. Raises UsageError where auto mode is not
        built for this launcher."""
        raise UsageError(f"--auto is not built for --launcher {self.kind} yet: give the pool's "
                         "size (-n) and resize it by hand")

    def describe(self) -> str:
        return "this host"


class LocalLauncher(Launcher):
    """Engines are processes of this host (ipyparallel's ``LocalEngineSetLauncher``)."""

    kind, local = "local", True

    def arbiter(self, own_jobs):
        return None


SLURM_TEMPLATE = """#!/bin/sh
#SBATCH --export=ALL
#SBATCH --job-name=ipengine-{{cluster_id}}
#SBATCH --ntasks=1
#SBATCH --output={{output_file}}
{options}
# Slurm's SIGTERM (preemption, the time limit) reaches the engine, which drains at its next
# step boundary; the batch shell must outlive it, or the job would end with the shell.
trap : TERM
srun --cpus-per-task={cpus} {{program_and_args}}
"""


class SlurmLauncher(Launcher):
    """Engines are Slurm batch jobs, one per slot.

    Args:
        partition, account, time: ``sbatch --partition --account --time`` (unset: Slurm's
            defaults). `time` in Slurm's formats, such as ``30`` (minutes) or ``1-00:00:00``.
        gpus_per_engine: GPUs each engine's job asks for (``--gpus-per-task``); 0 for CPU
            engines (gloo), else the pool uses nccl.
        cpus_per_engine: ``--cpus-per-task`` (also the engine's torch threads).
        grace: seconds before the time limit when Slurm sends SIGTERM (``--signal``): the
            engine drains and a replacement job is queued.
        interface: the network interface the controller and the rendezvous listen on (the
            engines' hosts must reach it). Default: the one on the route to slurmctld.
        options: more ``#SBATCH`` options, one per item, such as ``--qos=debug``.
    Raises:
        UsageError: no Slurm commands on PATH, an unknown interface, one without an IPv4
            address, or ``0.0.0.0`` (every interface).
    """

    kind, local = "slurm", False

    def __init__(self, partition: str | None = None, account: str | None = None,
                 time: str | None = None, gpus_per_engine: int = 0, cpus_per_engine: int = 1,
                 grace: int = 60, interface: str | None = None, options: tuple = ()):
        for command in ("sbatch", "squeue", "scancel", "scontrol"):
            if shutil.which(command) is None:
                raise UsageError(f"--launcher slurm needs Slurm's {command} on PATH: run on a "
                                 "Slurm login node, or load Slurm's module first")
        for label, value in (("--gpus-per-engine", gpus_per_engine),
                             ("--cpus-per-engine", cpus_per_engine), ("--grace", grace)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(f"{label} must be an integer >= 0, got {value!r}")
        self.partition, self.account, self.time = partition, account, time
        self.gpus_per_engine, self.cpus_per_engine = gpus_per_engine, max(1, cpus_per_engine)
        self.grace, self.options = grace, tuple(options)
        self.address = _listen_address(interface, _slurmctld_host)

    def batch_options(self) -> list[str]:
        """The ``#SBATCH`` lines of an engine's job."""
        opts = [f"--cpus-per-task={self.cpus_per_engine}", f"--signal=TERM@{self.grace}"]
        for flag, value in (("--partition", self.partition), ("--account", self.account),
                            ("--time", self.time)):
            if value:
                opts.append(f"{flag}={value}")
        if self.gpus_per_engine:
            opts.append(f"--gpus-per-task={self.gpus_per_engine}")
        return [f"#SBATCH {o}" for o in opts + list(self.options)]

    def cluster_options(self, folder: str) -> dict:
        from traitlets.config import Config
        # braces are the template's fields: any in an option are literal
        options = "\n".join(self.batch_options()).replace("{", "{{").replace("}", "}}")
        config = Config()
        config.SlurmEngineSetLauncher.batch_template = SLURM_TEMPLATE.format(
            options=options, cpus=self.cpus_per_engine)  # some Slurms' srun does not inherit it
        # ipyparallel writes the script into the kernel's folder (the notebook's) by default
        config.SlurmEngineSetLauncher.batch_file_name = f"{folder}/slurm_engine.sbatch"
        return {"engine_launcher_class": "slurm", "controller_ip": self.address,
                "config": config}

    def engine_env(self) -> dict:
        env = {"ELASTIC_JUPYTER_OWNER_ADDRESS": self.address}
        if not self.gpus_per_engine:  # Slurm sets it for a job with GPUs
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    async def jobs(self, engine_sets: dict) -> dict[str, Job] | None:
        known = await _squeue([s.job_id for s in engine_sets.values() if s.job_id])
        if known is None:
            return None
        return {set_id: Job(s.job_id, *known.get(s.job_id, ("", "")), output=s.output_file)
                for set_id, s in engine_sets.items() if s.job_id}

    def arbiter(self, own_jobs):
        """Slurm decides: the pool grows while the partition is idle and gives back when
        other jobs wait (:mod:`.arbiter.slurm`). Raises UsageError where Slurm hides other
        users' jobs (``PrivateData=jobs``): nobody would be seen waiting."""
        if re.search(r"^PrivateData\s*=.*\bjobs\b", _scontrol_config(), re.M):
            raise UsageError("this Slurm hides other users' jobs (PrivateData=jobs), so an auto "
                             "pool could not see who waits for its resources: give the pool's "
                             "size (-n) and resize it by hand")
        return SlurmArbiter(self.partition, self.cpus_per_engine, self.gpus_per_engine,
                            own_jobs)

    def describe(self) -> str:
        where = f"partition {self.partition}" if self.partition else "the default partition"
        return f"Slurm jobs in {where}"


class SSHLauncher(Launcher):
    """Engines are processes of other hosts, started over ssh; a slot is (host, index).

    Args:
        hosts: "gpu1:4,gpu2:4" (``user@host:slots``; slots default to 1) or a dict host ->
            slots. Slots are numbered across hosts in this order.
        python: the Python on the hosts (default: this kernel's, for a shared environment).
        gpus_per_engine: 0 for CPU engines (gloo), or 1: slot i of a host gets its GPU i
            (in PCI bus order, as nvidia-smi numbers them).
        cpus_per_engine: each engine's torch threads (1).
        interface: as for Slurm; default: the one on the route to the first host.
        ssh_args: more ssh options, such as ``("-i", "~/.ssh/cluster_key")``.
    Raises:
        UsageError: no ssh on PATH, hosts that do not parse, or a refused interface.
    """

    kind, local = "ssh", False

    def __init__(self, hosts=None, python: str | None = None, gpus_per_engine: int = 0,
                 cpus_per_engine: int = 1, interface: str | None = None,
                 ssh_args: tuple = ()):
        if shutil.which("ssh") is None:
            raise UsageError("--launcher ssh needs ssh on PATH")
        if gpus_per_engine not in (0, 1):
            raise UsageError(f"--gpus-per-engine with --launcher ssh is 0 or 1, got "
                             f"{gpus_per_engine!r}")
        self.hosts = _parse_hosts(hosts)
        self.slots = [(host, i) for host, n in self.hosts.items() for i in range(n)]
        self.slot_count = len(self.slots)
        self.python = python or sys.executable
        self.gpus_per_engine, self.cpus_per_engine = gpus_per_engine, max(1, cpus_per_engine)
        self.ssh_args = list(ssh_args)
        first = next(iter(self.hosts)).rsplit("@", 1)[-1]
        self.address = _listen_address(interface, lambda: first)

    def cluster_options(self, folder: str) -> dict:
        from traitlets.config import Config
        config = Config()
        for cls in (config.SSHEngineSetLauncher, config.SSHEngineLauncher):
            cls.remote_python = self.python
            cls.ssh_args = list(self.ssh_args)
            cls.scp_args = list(self.ssh_args)  # scp fetches an engine's output
        # the controller's connection info reaches the engine in its environment
        # ($IPP_CONNECTION_INFO): no connection files are copied to the hosts
        config.SSHEngineLauncher.to_send = []
        return {"engine_launcher_class": _threaded_ssh_launcher(),
                "controller_ip": self.address, "config": config}

    def engine_env(self) -> dict:
        return {"ELASTIC_JUPYTER_OWNER_ADDRESS": self.address}

    def start_options(self, slot: int) -> dict:
        host, index = self.slots[slot]
        env = {"CUDA_VISIBLE_DEVICES": str(index) if self.gpus_per_engine else ""}
        if self.gpus_per_engine:  # GPU i as nvidia-smi and the host's arbiter number it
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        return {"engines": {host: 1}, "environment": env}

    def arbiter(self, own_jobs):
        """Each host's arbiter grants its own slots (:mod:`.arbiter.hosts`), through a relay
        started over ssh with the hosts' Python."""
        return HostArbiters(self.hosts, lambda host: [
            "ssh", "-o", "BatchMode=yes", *self.ssh_args, host, self.python, "-m",
            "elastic_jupyter.arbiter.relay"])

    def host_of(self, slot: int) -> str:
        return self.slots[slot][0].rsplit("@", 1)[-1]

    def describe(self) -> str:
        return "hosts " + ", ".join(f"{h} ({n} slot{'s' * (n > 1)})" for h, n in self.hosts.items())


_THREADED_SSH = None


def _threaded_ssh_launcher():
    """ipyparallel's SSH engine-set launcher, with its start in a worker thread: a start is
    several ssh round trips and remote Python starts (seconds), which would freeze the owner
    loop, and with it the training the loop watches. Its engines' watcher threads end quietly
    when their host cannot be reached any more (a lost host is the pool's fault to handle, not
    an exception in a thread)."""
    global _THREADED_SSH
    if _THREADED_SSH is None:
        from ipyparallel.cluster.launcher import SSHEngineLauncher, SSHEngineSetLauncher

        class QuietSSHEngineLauncher(SSHEngineLauncher):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.loop = self.parent.loop  # the owner's, not the worker thread's

            def wait_one(self, timeout):
                try:
                    return super().wait_one(timeout)
                except TimeoutError:  # still running
                    raise
                except Exception:  # noqa: BLE001 -- ssh failed: nothing left to wait for
                    return None

        class ThreadedSSHEngineSetLauncher(SSHEngineSetLauncher):
            launcher_class = QuietSSHEngineLauncher

            def start(self, n):
                self.loop  # noqa: B018 -- resolved here, on the owner loop's thread
                return asyncio.get_running_loop().run_in_executor(None, super().start, n)

        _THREADED_SSH = ThreadedSSHEngineSetLauncher
    return _THREADED_SSH


def _parse_hosts(hosts) -> dict[str, int]:
    if isinstance(hosts, dict):
        parsed = dict(hosts)
    else:
        parsed = {}
        for item in filter(None, (h.strip() for h in str(hosts or "").split(","))):
            host, _, count = item.rpartition(":") if ":" in item else (item, "", "1")
            try:
                parsed[host] = int(count)
            except ValueError:
                parsed = {}
                break
    if not parsed or any(not h or not isinstance(n, int) or n < 1 for h, n in parsed.items()):
        raise UsageError(f"--hosts takes host:slots pairs like gpu1:4,gpu2:4; got {hosts!r}")
    return parsed


def make_launcher(kind: str = "local", **options) -> Launcher:
    """The launcher ``--launcher KIND`` names, with its options (see each class). Raises
    UsageError for an unknown kind or options a kind does not take."""
    classes = {"local": LocalLauncher, "ssh": SSHLauncher, "slurm": SlurmLauncher}
    if kind not in classes:
        raise UsageError(f"--launcher takes local, ssh or slurm, got {kind!r}")
    given = {k: v for k, v in options.items() if v is not None}
    unknown = set(given) - set(inspect.signature(classes[kind]).parameters)
    if unknown:
        raise UsageError(f"--launcher {kind} takes none of "
                         f"{', '.join('--' + k.replace('_', '-') for k in sorted(unknown))}")
    return classes[kind](**given)


# ---------------------------------------------------------------------- helpers

def _listen_address(interface: str | None, default_peer) -> str:
    """The IPv4 address to listen on: `interface`'s, or the one on the route to
    `default_peer()`. Raises UsageError for every interface (0.0.0.0) or an unknown one."""
    if interface in ("0.0.0.0", "*", "all"):
        raise UsageError("--interface must name one interface: the rendezvous store has no "
                         "authentication, so the pool never listens on all of them")
    if interface:
        address = address_of(interface) or (interface if interface_of(interface) else None)
        if address is None:
            raise UsageError(f"--interface {interface}: no such interface with an IPv4 "
                             "address on this host (`ip -4 addr` lists them)")
        return address
    peer = default_peer()
    try:
        return address_towards(peer)
    except OSError as e:
        raise UsageError(f"no route to {peer} ({e}): name the interface the engines' hosts "
                         "reach with --interface") from None


def _scontrol_config() -> str:
    """``scontrol show config``. Raises UsageError when Slurm does not answer."""
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                         timeout=30)
    if out.returncode:
        raise UsageError(f"Slurm does not answer (scontrol show config: "
                         f"{out.stderr.strip() or out.returncode})")
    return out.stdout


def _slurmctld_host() -> str:
    """The address (or name) of the first slurmctld in Slurm's configuration."""
    m = re.search(r"^SlurmctldHost\[0\]\s*=\s*([^\s(]+)(?:\(([^)]+)\))?", _scontrol_config(),
                  re.M)
    if not m:
        raise UsageError("Slurm's configuration names no SlurmctldHost: give --interface")
    return m.group(2) or m.group(1)


async def _squeue(job_ids: list[str]) -> dict[str, tuple[str, str]] | None:
    """job id -> (state, reason) for those Slurm still knows; None when squeue failed (a busy
    slurmctld: no answer is not an answer that the jobs are gone)."""
    if not job_ids:
        return {}
    proc = await asyncio.create_subprocess_exec(
        "squeue", "-h", "-t", "all", "-o", "%i|%T|%r", "-j", ",".join(job_ids),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    out, _ = await proc.communicate()
    if proc.returncode:
        return None
    jobs = {}
    for line in out.decode().splitlines():
        job_id, state, reason = (line.split("|") + ["", ""])[:3]
        jobs[job_id.strip()] = (state.strip(), reason.strip())
    return jobs


def _tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()[-4000:]
    except OSError:
        return "(no output)"
    return " | ".join(text.strip().splitlines()[-lines:]) or "(no output)"
