"""EnginePool: an ipyparallel cluster with one engine per slot (a GPU, or a share of the CPUs).

Each slot's engine is its own engine set of one, because ipyparallel cannot stop a single engine
of a larger set (``Cluster.stop_engine`` raises) and forgets per-set environments on restart.
CUDA_VISIBLE_DEVICES is fixed at engine start, so a slot's GPU binding cannot change.
"""
from __future__ import annotations

import asyncio
import atexit
import os
import time
import uuid
from dataclasses import dataclass

import psutil

from .config import PoolConfig, UsageError
from .owner import get_owner
from .reaper import start_reaper, write_pidfile
from .registry import registry_dir

CONTROLLER_ARGS = ["--ping=500", "--nodb", "--log-level=ERROR"]


@dataclass
class Engine:
    """One engine process bound to one slot.

    Attributes:
        slot: slot number (with GPUs, the index into the pool's GPU list).
        device: "cpu" or "cuda:<physical GPU id>".
        engine_id: ipyparallel engine id; set_id: its engine set.
        pid: process id; started: wall time (s since the epoch) it registered.
    """

    slot: int
    device: str
    engine_id: int
    set_id: str
    pid: int
    started: float


def _engine_env(slot: int, gpu: int | None, threads: int) -> dict:
    return {
        "ELASTIC_JUPYTER_SLOT": str(slot),
        "CUDA_VISIBLE_DEVICES": "" if gpu is None else str(gpu),
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
        "GLOO_SOCKET_IFNAME": "lo",  # single-host pool: gloo stays on loopback
        "PYTHONUNBUFFERED": "1",
    }


class EnginePool:
    """A resizable pool of engines, owned by this process's owner thread.

    Args:
        n: engines to start (default: the number of GPUs, or 2 without GPUs).
        min_size, max_size: bounds for resizes (default 1 and the number of GPUs, or 4).
        gpus: "all", "none" or a list of GPU ids such as "0,2".
        engine_timeout: seconds to wait for a new engine to register.
    Raises:
        UsageError: bounds that do not fit (n outside [min, max], more engines than GPUs).
    """

    def __init__(self, n: int | None = None, min_size: int | None = None,
                 max_size: int | None = None, gpus: str = "all", engine_timeout: float = 60.0):
        self.config = PoolConfig.resolve(n, min_size, max_size, gpus, engine_timeout)
        self.owner = get_owner()
        self.engines: list[Engine] = []  # oldest first
        self.cluster = None
        self.client = None
        self.run = None
        self._stopping: set = set()  # background tasks stopping removed engines
        self.excluded_slots: dict[int, str] = {}  # slot -> why it is left out
        self._pidfile = None

    # properties --------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.engines)

    @property
    def min_size(self) -> int:
        return self.config.min_size

    @property
    def max_size(self) -> int:
        return self.config.max_size

    @property
    def backend(self) -> str:
        return "nccl" if self.config.gpus else "gloo"

    @property
    def running(self) -> bool:
        return self.cluster is not None

    def check_size(self, n) -> int:
        """Validate a requested size; returns it as int or raises UsageError saying the bounds."""
        if isinstance(n, bool) or not isinstance(n, int):
            try:
                if isinstance(n, str) and n.strip().lstrip("-").isdigit():
                    n = int(n)
                else:
                    raise ValueError
            except ValueError:
                raise UsageError(f"pool size must be an integer in this pool's bounds "
                                 f"[{self.min_size}, {self.max_size}], got {n!r}") from None
        if not self.min_size <= n <= self.max_size:
            raise UsageError(f"pool size {n} is outside this pool's bounds [{self.min_size}, "
                             f"{self.max_size}]; choose a size in range or start a pool with "
                             "other --min/--max")
        return n

    # public, any thread ------------------------------------------------------------------------

    def start(self) -> "EnginePool":
        """Start the controller and the first ``n`` engines; returns self when all registered."""
        self.owner.call(self._start())
        return self

    def resize(self, n: int, at_step: int | None = None):
        """Change the number of engines. During a run this is the run's resize request."""
        n = self.check_size(n)
        if self.run is not None and self.run.active:
            return self.run.resize(n, at_step=at_step)
        if at_step is not None:
            raise UsageError("at_step needs a running training run")
        self.owner.call(self._resize_idle(n))

    def stop(self) -> None:
        """Stop every engine and the controller (a running run is stopped first)."""
        if self.run is not None and self.run.active:
            self.run.stop()
            self.run.wait(timeout=60)
        self.owner.call(self._stop())

    def status(self) -> dict:
        return {"running": self.running, "size": self.size, "min": self.min_size,
                "max": self.max_size, "backend": self.backend,
                "excluded_slots": dict(self.excluded_slots),
                "engines": [vars(e).copy() for e in self.engines],
                "run": self.run.name if self.run is not None and self.run.active else None}

    def __repr__(self) -> str:
        return (f"<EnginePool size={self.size} bounds=[{self.min_size}, {self.max_size}] "
                f"backend={self.backend}>")

    # owner thread ------------------------------------------------------------------------------

    async def _start(self) -> None:
        if self.cluster is not None:
            return
        import ipyparallel as ipp
        self.cluster = ipp.Cluster(n=0, cluster_id=f"elastic-{uuid.uuid4().hex[:8]}",
                                   controller_args=list(CONTROLLER_ARGS), log_level=40)
        await self.cluster.start_controller()
        self._pidfile = os.path.join(registry_dir(), f"pool-{self.cluster.cluster_id}.pids")
        self._update_pidfile()
        start_reaper(self._pidfile)
        atexit.register(self._shutdown_at_exit)
        self.client = await self.cluster.connect_client()
        await self.add_engines(self.config.n)

    def _update_pidfile(self) -> None:
        """Tell the reaper which processes to end if this process dies without stopping us."""
        if self._pidfile is not None:
            write_pidfile(self._pidfile, [self.cluster.controller.pid] +
                          [e.pid for e in self.engines])

    def _shutdown_at_exit(self) -> None:
        """Graceful kernel shutdown: stop the run (it writes a checkpoint), then the pool."""
        try:
            if self.running:
                self.stop()
        except Exception:
            pass  # the reaper still ends what is left

    async def _resize_idle(self, n: int) -> None:
        if n > self.size:
            await self.add_engines(n - self.size)
        elif n < self.size:
            await self.remove_engines(self.engines[n:])

    async def _stop(self) -> None:
        if self.cluster is None:
            return
        await asyncio.gather(*self._stopping, return_exceptions=True)
        try:
            await self.cluster.stop_cluster()
        finally:
            if self._pidfile is not None and os.path.exists(self._pidfile):
                os.unlink(self._pidfile)  # the reaper exits
            self._pidfile = None
            if self.client is not None:
                self.client.close()
            self.cluster = self.client = None
            self.engines = []

    @property
    def usable_slots(self) -> int:
        return self.max_size - len(self.excluded_slots)

    def exclude_slot(self, slot: int, reason: str) -> None:
        """Leave `slot` out of future engine starts (it keeps failing)."""
        self.excluded_slots[slot] = reason

    def next_free_slot(self) -> int | None:
        """The slot the next started engine gets (None if every slot is taken)."""
        try:
            return self._free_slots(1)[0]
        except UsageError:
            return None

    def _free_slots(self, k: int) -> list[int]:
        used = {e.slot for e in self.engines} | set(self.excluded_slots)
        free = [s for s in range(self.max_size) if s not in used]
        if len(free) < k:
            raise UsageError(f"no free slot: the pool has {self.max_size} slots")
        return free[:k]

    async def add_engines(self, k: int) -> list[Engine]:
        """Start `k` engines on free slots (concurrently) and wait until they registered."""
        if k <= 0:
            return []
        slots = self._free_slots(k)
        known = set(self.client.ids)
        set_ids = {}
        for slot in slots:
            gpu = self.config.gpus[slot] if self.config.gpus else None
            threads = self.config.threads_per_engine
            # a fresh dict each time: start_engines mutates the one it is given
            set_ids[slot] = await self.cluster.start_engines(
                1, environment=_engine_env(slot, gpu, threads))
        deadline = time.monotonic() + self.config.engine_timeout
        while len(set(self.client.ids) - known) < k:
            if time.monotonic() > deadline:
                await asyncio.gather(*(self.cluster.stop_engines(s) for s in set_ids.values()),
                                     return_exceptions=True)
                raise RuntimeError(f"{k} engine(s) did not register within "
                                   f"{self.config.engine_timeout:.0f} s; the machine may be "
                                   "overloaded (raise engine_timeout)")
            await asyncio.sleep(0.05)
        new = sorted(set(self.client.ids) - known)
        from .engine import entrypoints
        ar = self.client[new].apply_async(_init_from_env, entrypoints.init_engine)
        infos = await asyncio.wrap_future(ar)
        engines = []
        for engine_id, info in zip(new, infos):
            device = info["device"]
            engines.append(Engine(slot=info["slot"], device=device, engine_id=engine_id,
                                  set_id=set_ids[info["slot"]], pid=info["pid"],
                                  started=time.time()))
        self.engines.extend(sorted(engines, key=lambda e: e.slot))
        self._update_pidfile()
        return engines

    def remove_engines(self, engines: list[Engine]) -> asyncio.Task:
        """Forget these engines now and stop them (each is its own engine set) in the
        background; await the returned task to wait until they are gone."""
        for e in engines:
            self.engines.remove(e)
        self._update_pidfile()
        task = asyncio.ensure_future(self._stop_engines(engines))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)
        return task

    async def _stop_engines(self, engines: list[Engine]) -> None:
        # ipyparallel's stop waits for the process with a blocking join, which would freeze
        # the owner loop for seconds: end the processes here first, then let it clean up.
        await _terminate([e.pid for e in engines])
        await asyncio.gather(*(self.cluster.stop_engines(e.set_id) for e in engines),
                             return_exceptions=True)
        for e in engines:
            await self._wait_unregistered(e.engine_id)

    async def _wait_unregistered(self, engine_id: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while engine_id in self.client.ids and time.monotonic() < deadline:
            await asyncio.sleep(0.02)


async def _terminate(pids: list[int], grace: float = 5.0) -> None:
    """SIGTERM the processes, SIGKILL those still alive after `grace` seconds; never blocks
    the event loop."""
    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            proc.terminate()
            procs.append(proc)
        except psutil.Error:
            pass
    deadline = time.monotonic() + grace
    while procs:
        procs = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if procs and time.monotonic() > deadline:
            for p in procs:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            deadline = float("inf")
        await asyncio.sleep(0.02)


def _init_from_env(init_engine):
    import os
    import torch
    slot = int(os.environ["ELASTIC_JUPYTER_SLOT"])
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    device = f"cuda:{gpu}" if gpu and torch.cuda.is_available() else "cpu"
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    return init_engine(slot, device, threads)
