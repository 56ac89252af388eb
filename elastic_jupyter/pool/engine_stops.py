"""Engine stops: ending engine processes without blocking the owner loop.

An engine ends in up to three ways at once, and each must be quick: this host's engine gets
SIGTERM, then SIGKILL after a grace (:func:`.processes.terminate`); another host's engine is
asked to exit through the controller, which costs no ssh round trip and no connection timeout
for a lost host; what is left is ipyparallel's stop of the engine set (an ssh kill, a
``scancel``). ipyparallel's own stop joins each launcher's wait thread, which would freeze the
loop for the grace of every engine, so it runs last, when only its bookkeeping is left. A slot
is free again once its engine is gone (:meth:`.Slots.stopped`), before the bookkeeping.

:class:`EngineStops` runs those stops in the background for :class:`.EngineSets`, which
decides which engines go and forgets them first.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import psutil

from .processes import Engine, children, signal_all, terminate
from .slots import Slots

# Seconds the controller gets to exit on SIGTERM (it takes ~0.4 s and removes its connection
# files) before SIGKILL, and a removed engine's nanny after its engine is gone.
STOP_GRACE = 1.0

log = logging.getLogger(__name__)


class EngineStops:
    """The engine stops under way (owner loop).

    Args:
        cluster, client: ipyparallel's Cluster and Client now (None once the pool stopped:
            a stop then skips what the pool's own stop cleaned up).
        slots: told when a slot's engine starts and finishes stopping.
    """

    def __init__(self, cluster: Callable[[], Any], client: Callable[[], Any], slots: Slots):
        self._cluster, self._client, self._slots = cluster, client, slots
        self._tasks: set[asyncio.Future] = set()  # background tasks stopping engines
        self._processes: set[psutil.Process] = set()  # the engines those tasks stop

    @property
    def busy(self) -> bool:
        """Whether engines are still stopping."""
        return bool(self._processes)

    def start(self, engines: list[Engine], procs: list[psutil.Process],
              grace: float) -> asyncio.Task:
        """Stop `engines` (this host's as `procs`, taken when they were forgotten: psutil
        then checks a pid was not reused) in the background, SIGKILLed after `grace` s;
        await the returned task to wait until they are gone. It never raises: a failure is
        logged in one line."""
        self._processes.update(procs)
        self._slots.stopping(e.slot for e in engines if e.slot is not None)
        task = asyncio.ensure_future(self._stop(engines, procs, grace))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def finish_now(self) -> None:
        """Kill what the stops under way still wait for and wait until they ended (the pool
        stops: the nannies, still alive, tell the controller at once)."""
        signal_all(list(self._processes), psutil.Process.kill)
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _stop(self, engines: list[Engine], procs: list[psutil.Process],
                    grace: float) -> None:
        # a background task nobody may await: it reports its failure here, in one line,
        # rather than leaving asyncio to print "Task exception was never retrieved"
        freed: set[int] = set()  # slots freed once their engine was gone
        try:
            await self._end(engines, procs, grace, freed)
        except Exception as err:
            log.warning("elastic_jupyter: stopping the engine(s) of slot %s failed: %s: %s",
                        ", ".join(str(e.slot) for e in engines), type(err).__name__, err)
        finally:
            self._processes.difference_update(procs)
            self._slots.stopped(s for e in engines
                                if (s := e.slot) is not None and s not in freed)

    async def _end(self, engines: list[Engine], procs: list[psutil.Process], grace: float,
                   freed: set[int]) -> None:
        if self._cluster() is not None:
            await self.shut_down_remote([e for e in engines if not e.local])
        nannies = [c for p in procs for c in children(p)]
        await terminate(procs, grace)
        freed.update(e.slot for e in engines if e.local and e.slot is not None)
        self._slots.stopped(freed)
        if self._cluster() is not None:  # else the pool stopped meanwhile and cleaned up
            await self.stop_sets([e.set_id for e in engines])
            for e in engines:
                await self._wait_unregistered(e.engine_id)
        # each nanny has told the controller its engine is gone; without a controller it
        # would linger for seconds
        await terminate(nannies, grace=STOP_GRACE)

    async def shut_down_remote(self, engines: list[Engine]) -> None:
        """Ask other hosts' engines to exit, through the controller, and forget the engine
        sets of those that did: ipyparallel's stop then reaches out only to engines that did
        not (ssh kill, scancel). An engine's batch job ends with its engine."""
        client = self._client()
        if not engines or client is None:
            return
        ids = [e.engine_id for e in engines if e.engine_id in client.ids]
        if ids:
            client.shutdown(targets=ids, hub=False, block=False)
        deadline = time.monotonic() + 5 * STOP_GRACE
        while set(ids) & set(client.ids) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        cluster = self._cluster()
        for e in engines:
            if e.engine_id not in client.ids and cluster is not None:
                cluster.engines.pop(e.set_id, None)

    async def stop_sets(self, set_ids: Any) -> None:
        """ipyparallel's stop of these engine sets, each on its own (one that cannot be
        reached, a lost host, must not leave the others' stops pending), then forgotten: a
        stop that failed is not tried again when the Cluster is collected."""
        cluster = self._cluster()
        sets = [s for s in set_ids if s in cluster.engines]
        await asyncio.gather(*(cluster.stop_engines(s) for s in sets), return_exceptions=True)
        for s in sets:
            cluster.engines.pop(s, None)

    async def _wait_unregistered(self, engine_id: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while ((client := self._client()) is not None and engine_id in client.ids
               and time.monotonic() < deadline):
            await asyncio.sleep(0.02)
