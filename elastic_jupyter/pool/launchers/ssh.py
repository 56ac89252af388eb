"""SSH's launcher: a slot is (host, index); each engine is started over ssh.

ipyparallel's ``SSHEngineSetLauncher`` starts it, in the same Python environment (a shared file
system), with its start in a worker thread so the owner loop never waits on ssh.
"""
from __future__ import annotations

import asyncio
import shutil
import sys
from typing import Any, Callable

from ...arbiter.hosts import HostArbiters
from ...config import UsageError
from ...config.environment import OWNER_ADDRESS
from .base import Launcher, listen_address


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

    def __init__(self, hosts: str | dict[str, int] | None = None, python: str | None = None,
                 gpus_per_engine: int = 0, cpus_per_engine: int = 1,
                 interface: str | None = None, ssh_args: tuple = ()):
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
        self.address = listen_address(interface, lambda: first)

    def cluster_options(self, folder: str) -> dict[str, Any]:
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

    def engine_env(self) -> dict[str, str]:
        return {OWNER_ADDRESS.name: self.address}

    def start_options(self, slot: int) -> dict[str, Any]:
        host, index = self.slots[slot]
        env = {"CUDA_VISIBLE_DEVICES": str(index) if self.gpus_per_engine else ""}
        if self.gpus_per_engine:  # GPU i as nvidia-smi and the host's arbiter number it
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        return {"engines": {host: 1}, "environment": env}

    def arbiter(self, own_jobs: Callable[[], list[str]]) -> HostArbiters:
        """Each host's arbiter grants its own slots (:mod:`.arbiter.hosts`), through a relay
        started over ssh with the hosts' Python."""
        return HostArbiters(self.hosts, lambda host: [
            "ssh", "-o", "BatchMode=yes", *self.ssh_args, host, self.python, "-m",
            "elastic_jupyter.arbiter.relay"])

    def host_of(self, slot: int) -> str:
        return self.slots[slot][0].rsplit("@", 1)[-1]

    def describe(self) -> str:
        return "hosts " + ", ".join(f"{h} ({n} slot{'s' * (n > 1)})" for h, n in self.hosts.items())


_THREADED_SSH: type | None = None  # ipyparallel's launcher class, built once


def _threaded_ssh_launcher() -> type:
    """ipyparallel's SSH engine-set launcher, with its start in a worker thread: a start is
    several ssh round trips and remote Python starts (seconds), which would freeze the owner
    loop, and with it the training the loop watches. Its engines' watcher threads end quietly
    when their host cannot be reached any more (a lost host is the pool's fault to handle, not
    an exception in a thread)."""
    global _THREADED_SSH
    if _THREADED_SSH is None:
        from ipyparallel.cluster.launcher import SSHEngineLauncher, SSHEngineSetLauncher

        class QuietSSHEngineLauncher(SSHEngineLauncher):
            def __init__(self, **kwargs: Any) -> None:
                super().__init__(**kwargs)
                self.loop = self.parent.loop  # the owner's, not the worker thread's

            def wait_one(self, timeout: float) -> Any:
                try:
                    return super().wait_one(timeout)
                except TimeoutError:  # still running
                    raise
                except Exception:  # noqa: BLE001 -- ssh failed: nothing left to wait for
                    return None

        class ThreadedSSHEngineSetLauncher(SSHEngineSetLauncher):
            launcher_class = QuietSSHEngineLauncher

            def start(self, n: int) -> Any:
                self.loop  # noqa: B018 -- resolved here, on the owner loop's thread
                return asyncio.get_running_loop().run_in_executor(None, super().start, n)

        _THREADED_SSH = ThreadedSSHEngineSetLauncher
    return _THREADED_SSH


def _parse_hosts(hosts: str | dict[str, int] | None) -> dict[str, int]:
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
