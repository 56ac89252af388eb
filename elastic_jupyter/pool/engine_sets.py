"""Engine sets: the pool's ipyparallel cluster and client, and which engines it has.

EngineSets starts the controller and engines, binds warm ones, and forgets removed ones at
once; their processes are then ended in the background by :mod:`.engine_stops`.

Each slot's engine is its own engine set of one, because ipyparallel cannot stop a single engine
of a larger set (``Cluster.stop_engine`` raises) and forgets per-set environments on restart.
CUDA_VISIBLE_DEVICES is fixed once CUDA initialises: a slot's engine gets its GPU at start; a
warm engine starts with none and is bound to one before CUDA's first use. Where the
engines run (this host, other hosts over ssh, Slurm jobs) is the pool's
:class:`~.launchers.Launcher`. A new engine says which set started it (its environment), so
starts under way at once tell their engines apart, and one of a start that failed is never
taken for a new one. The reaper (:mod:`.reaper`) ends what is listed in the pid file should
the kernel die without stopping the pool.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import time
import uuid
from typing import Any

import psutil

from ..config import PoolConfig
from ..config.environment import ENGINE_SET, SLOT
from ..engine.entrypoints import versions
from ..host import own_folder, runtime_folder
from .arrivals import Arrivals
from .engine_calls import EngineCalls
from .engine_stops import STOP_GRACE, EngineStops
from .launchers import Job, Launcher, StartWithdrawn
from .processes import (Engine, alive, signal_all, terminate, with_descendants,
                        processes)
from .reaper import Reaper
from .slots import Slots

CONTROLLER_ARGS = ["--ping=500", "--nodb", "--log-level=ERROR"]

log = logging.getLogger(__name__)


def _engine_env(slot: int | None, gpu: int | None, threads: int, leased: bool,
                launcher: Launcher) -> dict:
    env = {
        SLOT.name: "" if slot is None else str(slot),  # "": a warm engine
        "CUDA_VISIBLE_DEVICES": "" if gpu is None else str(gpu),
        # torch.cuda.is_available() asks NVML, not CUDA, whose first use fixes the visible
        # devices for good: a warm engine is bound to its GPU later (engine.entrypoints)
        "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
    }
    env.update(launcher.engine_env())
    if leased:  # the arbiter's GPU ids are NVML's, by PCI bus; CUDA's are by speed unless told
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return env


def check_versions(infos: list[dict]) -> None:
    """Refuse engines whose Python, torch or elastic-jupyter differ from this kernel's: they
    would fail later in a state transfer or a pickled call, far from the cause. Raises
    RuntimeError naming the first engine's host and what differs."""
    mine = versions()
    for info in infos:
        theirs = info.get("versions", {})  # an older engine sends none
        diff = [f"{k} {theirs.get(k, 'unknown')} (this kernel: {mine[k]})" for k in mine
                if theirs.get(k) != mine[k]]
        if diff:
            raise RuntimeError(f"the engine on {info['host']} runs {', '.join(diff)}: install "
                               "the same versions where the engines run (a shared environment "
                               "is simplest)")


def _gpu_of(config: PoolConfig, lease_mode: bool, slot: int | None) -> int | None:
    """The GPU of `slot` (in lease mode the machine's index; None: no GPU, or no slot)."""
    if slot is None or not config.gpus:
        return None
    return slot if lease_mode else config.gpus[slot]


class EngineSets:
    """The pool's engine processes: the controller, one engine set per engine (owner loop).

    Args:
        launcher: where the engines run; config: the pool's bounds, GPUs, threads and start
            timeout; slots: the pool's slot accounting (engines start on its free slots).

    Attributes:
        engines: the engines, oldest first; cluster, client: ipyparallel's (None while not
            running); calls: the typed calls into the engines.
        queued: slot -> its engine's batch job, not running yet; replaced, never changed in
            place: other threads read it (the cell printing the queue, views).
    """

    def __init__(self, launcher: Launcher, config: PoolConfig, slots: Slots):
        self.launcher, self.config, self.slots = launcher, config, slots
        self.engines: list[Engine] = []  # oldest first
        self.cluster: Any = None
        self.client: Any = None
        self.calls = EngineCalls(lambda: self.client)
        self.queued: dict[int, Job] = {}
        self.resizing = asyncio.Lock()  # held by an idle resize and the lease's follower
        # the engines removed and still stopping, in the background
        self._stops = EngineStops(lambda: self.cluster, lambda: self.client, slots)
        self._folder: str | None = None  # the pool's private folder (batch scripts)
        self._reaper = Reaper()
        self.warm: list[Engine] = []  # engines set up without a slot (run/warm_engines.py)
        self._arrivals = Arrivals(lambda: self.client, self.calls.engine_set)

    @property
    def running(self) -> bool:
        return self.cluster is not None

    @property
    def stopping(self) -> bool:
        """Whether removed engines are still stopping (pool.engine_stops)."""
        return self._stops.busy

    @property
    def pidfile(self) -> str | None:
        """The file the reaper reads (None while not running)."""
        return self._reaper.pidfile

    async def start(self) -> None:
        """Start the controller, the reaper and the client (no engine yet)."""
        import ipyparallel as ipp
        cluster_id = f"elastic-{uuid.uuid4().hex[:8]}"
        self._folder = own_folder(os.path.join(runtime_folder(), f"pool-{cluster_id}"))
        self.launcher.open(self.config.threads_per_engine)
        self.cluster = ipp.Cluster(n=0, cluster_id=cluster_id,
                                   controller_args=list(CONTROLLER_ARGS), log_level=40,
                                   **self.launcher.cluster_options(self._folder))
        await self.cluster.start_controller()
        self._reaper.start(os.path.join(runtime_folder(), f"pool-{cluster_id}.pids"),
                           [self.cluster.controller.pid])
        self.client = await self.cluster.connect_client()

    def _update_pidfile(self) -> None:
        """Tell the reaper which processes to end if this process dies without stopping us."""
        if self.cluster is None:  # stopped: nothing is left to list
            return
        self._reaper.list([self.cluster.controller.pid] +
                          [e.pid for e in self.engines + self.warm if e.local], self.jobs())

    def jobs(self) -> list[str]:
        """Batch jobs of this pool's engines (running or queued): the reaper cancels them.
        Also called from the lease's worker thread (a Slurm auto pool's own jobs)."""
        cluster = self.cluster
        sets = list(cluster.engines.values()) if cluster is not None else []  # one GIL step
        return [s.job_id for s in sets if getattr(s, "job_id", "")]

    async def resize(self, n: int) -> None:
        """Start or stop engines until `n` run (no run trains meanwhile). In lease mode the
        engines on slots the arbiter wants back stop first, and a grow waits (up to a few
        seconds) for leased slots whose engines are still stopping."""
        async with self.resizing:
            size = len(self.engines)
            if n > size:
                await self._wait_startable(n - size)
                await self.add(n - size)
            elif n < size:
                leaving = self.slots.leaving()
                order = ([e for e in self.engines if e.slot not in leaving]
                         + [e for e in self.engines if e.slot in leaving])
                await self.remove(order[n:])

    async def _wait_startable(self, k: int, timeout: float = 5 * STOP_GRACE) -> None:
        deadline = time.monotonic() + timeout
        while (self.slots.lease_mode and self.slots.startable() < k and self.slots.busy
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)

    # ---------------------------------------------------------------- starting engines

    async def add(self, k: int, slots: list[int] | None = None) -> list[Engine]:
        """Start `k` engines on free slots (concurrently; on `slots` when given, as
        :meth:`.Slots.next_free` named them) and wait until they registered. Raises
        UsageError without free slots, RuntimeError for engines that did not register or
        run other versions, StartWithdrawn (see :meth:`_wait_registered`)."""
        if k <= 0:
            return []
        slots = slots or self.slots.free(k)
        with self.slots.starting(slots):
            engines = await self._start_engines(list(slots))
        self.engines.extend(sorted(engines, key=lambda e: e.slot or 0))
        self._update_pidfile()
        return engines

    async def add_warm_many(self, n: int) -> list[Engine]:
        """`n` warm engines (:meth:`add_warm`), started side by side. Raises the first
        failure; those that started stay listed and stop with the pool."""
        started = await asyncio.gather(*(self.add_warm() for _ in range(n)),
                                       return_exceptions=True)
        if failed := [e for e in started if isinstance(e, BaseException)]:
            raise failed[0]
        return [e for e in started if isinstance(e, Engine)]

    async def add_warm(self) -> Engine:
        """Start an engine on no slot (a *warm* engine, this host only: run/warm_engines.py)
        and wait until it registered; it is none of the pool's engines until :meth:`bind`.
        Raises as :meth:`add`."""
        [engine] = await self._start_engines([None])
        self.warm.append(engine)
        self._update_pidfile()
        return engine

    async def bind(self, engine: Engine, slot: int) -> Engine:
        """Bind the warm `engine` to the free `slot` (:meth:`.Slots.next_free` named it);
        returns it as the pool's engine there. Raises the engine's error (it is then stopped)."""
        try:
            with self.slots.starting([slot]):
                gpu = _gpu_of(self.config, self.slots.lease_mode, slot)
                info = await self.calls.bind_slot(engine, slot, gpu,
                                                  self.config.threads_per_engine)
        except BaseException:
            self.remove([engine])
            raise
        self.warm.remove(engine)
        bound = dataclasses.replace(engine, slot=slot, device=info["device"])
        self.engines.append(bound)
        return bound

    async def _start_set(self, slot: int | None, set_id: str) -> None:
        """Start `slot`'s engine set of one (None: a warm engine), as `set_id` (its engine
        says it: :mod:`.arrivals`)."""
        gpu = _gpu_of(self.config, self.slots.lease_mode, slot)
        await self.launcher.ready()  # first: it may change the launcher's engine_env
        options = self.launcher.start_options(slot) if slot is not None else {}
        # a fresh dict each time: start_engines mutates the one it is given
        env = _engine_env(slot, gpu, self.config.threads_per_engine,
                          self.slots.lease_mode and self.launcher.local, self.launcher)
        env.update(options.pop("environment", {}), **{ENGINE_SET.name: set_id})
        await self.cluster.start_engines(1, engine_set_id=set_id, environment=env, **options)

    async def _start_engines(self, slots: list[int | None]) -> list[Engine]:
        set_ids = {slot: f"s{'warm' if slot is None else slot}-{uuid.uuid4().hex[:8]}"
                   for slot in slots}
        try:
            # side by side: an SSH start takes seconds of round trips (in a worker thread)
            started = await asyncio.gather(*(self._start_set(s, i) for s, i in set_ids.items()),
                                           return_exceptions=True)
            self._update_pidfile()  # batch jobs: cancelled should this process die meanwhile
            if failed := [e for e in started if isinstance(e, BaseException)]:
                raise failed[0]
            new = await self._wait_registered(set_ids)
            infos = await self.calls.init_engines(new)
            check_versions(infos)
        except BaseException:  # failed, timed out, refused or cancelled: nothing stays
            await self._forget_sets(set(set_ids.values()))
            raise
        finally:
            self.queued = {s: q for s, q in self.queued.items() if s not in slots}
        engines = []
        for engine_id, info in zip(new, infos):
            slot = info["slot"]
            host = slot is not None and self.launcher.host_of(slot) or info["host"]
            job = getattr(self.cluster.engines.get(set_ids[slot]), "job_id", None)  # a batch's
            engines.append(Engine(slot=slot, device=info["device"], engine_id=engine_id,
                                  set_id=set_ids[slot], pid=info["pid"], started=time.time(),
                                  host=host, local=self.launcher.local,
                                  job_id=str(job or "")))
        return engines

    async def _forget_sets(self, set_ids: set[str]) -> None:
        """Stop engine sets of a start that failed (each on its own: one that cannot be
        stopped must not keep the others), and never take their engines for new ones."""
        self._arrivals.forget(set_ids)  # an engine of theirs that registers later is shut down
        await self._stops.stop_sets(set_ids)

    async def _wait_registered(self, set_ids: dict[int | None, str]) -> list[int]:
        """Wait until the engine of each set in `set_ids` (slot -> set id) registered; returns
        their engine ids. A batch job's engine gets ``engine_timeout`` from when its job left
        the scheduler's queue. Raises RuntimeError when one timed out or its job ended,
        StartWithdrawn when the arbiter wants a slot back while its job still waits."""
        k, timeout = len(set_ids), self.config.engine_timeout
        deadline, next_look = time.monotonic() + timeout, 0.0
        wanted = set(set_ids.values())
        known = self._arrivals.look  # the engines not in the pool yet, by their set
        while len(mine := [i for i, s in known(e.engine_id for e in self.engines + self.warm)
                           .items() if s in wanted]) < k:
            now = time.monotonic()
            if not self.launcher.local and now >= next_look:  # a batch system: ask it
                next_look = now + 1.0
                jobs = await self.launcher.jobs(
                    {s: self.cluster.engines[s] for s in set_ids.values()})
                if jobs is None:  # the scheduler did not answer: ask again later
                    continue
                if ended := [j.why_ended() for j in jobs.values() if j.ended]:
                    raise RuntimeError("; ".join(ended))
                waiting = {slot: jobs[s] for slot, s in set_ids.items()  # warm: this host's
                           if slot is not None and s in jobs and jobs[s].waiting}
                if back := set(waiting) & self.slots.leaving():
                    raise StartWithdrawn(f"slot(s) {sorted(back)} given back while their "
                                         "job waited in the queue: job cancelled")
                self.queued = {**{s: q for s, q in self.queued.items() if s not in set_ids},
                               **waiting}
                if waiting:
                    deadline = now + timeout
            if now > deadline:
                raise RuntimeError(f"{k} engine(s) did not register within {timeout:.0f} s; "
                                   "the machine may be overloaded (raise engine_timeout)")
            await asyncio.sleep(0.05)
        return sorted(mine)

    # ---------------------------------------------------------------- stopping engines

    def remove(self, engines: list[Engine], grace: float = 5.0) -> asyncio.Task:
        """Forget these engines now and stop them (each its own engine set) in the background,
        SIGKILLed after `grace` s; await the returned task to wait until they are gone."""
        for e in engines:
            (self.warm if e in self.warm else self.engines).remove(e)
            self._arrivals.gone(e.engine_id)  # still registered a while: no new arrival
        self._update_pidfile()
        # the processes now (psutil then checks that a pid was not reused before signalling)
        return self._stops.start(engines, processes([e.pid for e in engines if e.local]), grace)

    def alive(self, engine: Engine) -> bool:
        """Whether `engine` runs: its process on this host; another host's while the
        controller counts it (it drops an engine whose nanny reports it dead or whose
        heartbeats stop)."""
        if engine.local:
            return alive(engine)
        return self.client is not None and engine.engine_id in self.client.ids

    async def stop(self) -> None:
        """End every engine, the controller and the reaper, at once and without blocking the
        loop; then forget the cluster. Call once nothing starts engines any more."""
        # removals in flight: their engines need no grace either, then the tasks finish
        # quickly and report their own errors
        await self._stops.finish_now()
        # We end every process ourselves, at once and without blocking the loop: ipyparallel's
        # stop joins each launcher's wait thread in turn, blocking this loop for each engine's
        # SIGTERM grace, and knows nothing of the nannies, which outlive their engine by seconds
        # once the controller is gone. Engines get SIGKILL: they hold nothing by now (the run
        # has stopped and drained its checkpoint writes). Other hosts' engines are asked to
        # exit; batch jobs still queued are cancelled (below).
        await self._stops.shut_down_remote([e for e in self.engines if not e.local])
        engines = with_descendants([e.pid for e in self.engines + self.warm if e.local])
        signal_all(engines, psutil.Process.kill)
        others = [self.cluster.controller.pid]  # with its schedulers
        if self._reaper.pid is not None:
            others.append(self._reaper.pid)  # nothing is left for it to watch
        try:
            await terminate(engines + with_descendants(others), grace=STOP_GRACE)
            try:
                await self._stops.stop_sets(list(self.cluster.engines))  # ssh, queued jobs
                await self.cluster.stop_cluster()  # now only its bookkeeping: state, files, logs
            except Exception as e:
                log.warning("elastic_jupyter: ipyparallel's cleanup after stopping the pool "
                            "failed: %s: %s", type(e).__name__, e)
        finally:
            self._forget()

    def _forget(self) -> None:
        """Forget the cluster (its pid file, folder, reaper, client, engines)."""
        self._reaper.close()
        self.launcher.close()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
        if self.client is not None:
            self.client.close()
        self.cluster = self.client = None
        self.engines = []
        self.warm = []
        self._arrivals.clear()
