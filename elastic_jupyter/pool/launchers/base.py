"""The Launcher base: where a pool's engines run (this host, other hosts, batch jobs).

The seam between :class:`~elastic_jupyter.pool.pool.EnginePool` and ipyparallel's own launcher
classes: the pool starts each slot's engine as an engine set of one (engine_sets.py says why),
and a :class:`Launcher` says which ipyparallel engine-set launcher starts it and what differs by
place: the address the controller and the rendezvous store bind to (loopback for this host;
the interface that reaches the other hosts otherwise, never all interfaces), the engines'
environment, how long a start may wait (a batch job may wait in the scheduler's queue for as
long as it takes), whether the pool can end an engine's process itself, and who leases an auto
pool its slots (an :class:`Arbiter`). Each launcher lives in its own module beside this base
(local.py, ssh.py, slurm.py).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from ...arbiter.machine_view import MachineView
from ...config import UsageError
from ...engine.group.network_interface import address_of, address_towards, interface_of

LOOPBACK = "127.0.0.1"


_WAITING = ("PENDING", "CONFIGURING", "REQUEUED", "SUSPENDED")
_LIVE = _WAITING + ("RUNNING", "COMPLETING")


class Arbiter(Protocol):
    """Who leases a pool its slots, as the pool's lease calls it (arbiter.client.ArbiterClient:
    the machine's; arbiter.hosts.HostArbiters; arbiter.slurm.SlurmArbiter). Each call returns
    the pool's grant (a dict, see arbiter.table) and raises arbiter.table.ArbiterError."""

    def register(self, run: str, **demand: Any) -> dict: ...

    def poll(self, run: str, active: bool = True, engines: dict | None = None,
             speed: list | None = None) -> dict: ...

    def release(self, run: str, slots: list[int]) -> dict: ...

    def unregister(self, run: str) -> None: ...

    def view(self) -> MachineView: ...


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

    def cluster_options(self, folder: str) -> dict[str, Any]:
        """Keyword arguments for ``ipyparallel.Cluster`` (`folder`: the pool's private folder,
        for batch scripts)."""
        return {}

    def open(self, threads: int) -> None:
        """The pool starts (before its controller); its engines run `threads` threads each."""

    def preload(self, modules: list[str]) -> None:
        """A run's cell imported `modules` (in that order) on an engine: engines this launcher
        starts later may have them loaded already."""

    async def ready(self) -> None:
        """Before each engine start: wait until it can start without blocking the loop."""

    def close(self) -> None:
        """The pool has stopped (after its engines)."""

    def engine_env(self) -> dict[str, str]:
        """Environment every engine gets besides its slot's."""
        return {"GLOO_SOCKET_IFNAME": "lo"}  # single host: gloo stays on loopback

    def start_options(self, slot: int) -> dict[str, Any]:
        """Keyword arguments of ``Cluster.start_engines`` for `slot`'s engine set, and the
        slot's own environment under "environment"."""
        return {}

    def host_of(self, slot: int) -> str | None:
        """The host `slot`'s engine runs on, when the launcher places it (else None)."""
        return None

    async def jobs(self, engine_sets: dict[str, Any]) -> dict[str, Job] | None:
        """The batch jobs of engine sets (id -> ipyparallel launcher), for launchers of batch
        jobs (else none; None when the scheduler did not answer): a job that waits in the
        queue does not count against the engine's start timeout, and one that ended before
        its engine registered failed the start."""
        return {}

    def arbiter(self, own_jobs: Callable[[], list[str]]) -> Arbiter | None:
        """Who leases an auto pool its slots: None for the machine's arbiter (this host's
        slots), else the launcher's own.
        `own_jobs` returns the pool's batch job ids. Raises UsageError where auto mode is not
        built for this launcher."""
        raise UsageError(f"--auto is not built for --launcher {self.kind} yet: give the pool's "
                         "size (-n) and resize it by hand")

    def describe(self) -> str:
        return "this host"


def listen_address(interface: str | None, default_peer: Callable[[], str]) -> str:
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


def _tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()[-4000:]
    except OSError:
        return "(no output)"
    return " | ".join(text.strip().splitlines()[-lines:]) or "(no output)"
