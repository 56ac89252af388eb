"""Warm engines: an auto run's engines set up on no slot, so its growth starts none.

Growing into a slot the machine's arbiter grants costs, cold, an engine start, torch's import
and the cell (about 7-10 s on this machine, more on a loaded one). A *warm* engine did all of
that before the grant, on no slot: the cell ran and the model was built on the host, no GPU
visible, and the run's rendezvous is connected. When a slot is granted, the engine is bound to
it (engine.entrypoints.bind_slot: the thread count, on a GPU slot the device the cell's objects
then move to) and joins at the next step boundary. It holds no slot, so the arbiter and other
users see none taken; it costs host memory (about one engine's: shown by
``%elastic_pool status`` and in the run's log) and is not kept when the host lacks twice that.
:class:`WarmEngines` is the only writer of a run's warm engines (owner loop).
"""
from __future__ import annotations

import asyncio
import collections
import time
from typing import TYPE_CHECKING, Awaitable, Callable

import psutil

from ..events import EventKind
from ..owner import background
from ..pool.engine_calls import remote_summary
from ..pool.processes import rss
from .faults import is_engine_death
from .runlog import RunLog

if TYPE_CHECKING:
    from ..pool.supply import EngineSupply
    from ..pool.processes import Engine

MiB = 2**20


def room_for(need: int, available: int) -> str | None:
    """Why a warm engine needing `need` bytes is not kept with `available` bytes of host memory
    free (it must leave as much again), or None when it fits."""
    if available >= 2 * need:
        return None
    return (f"no warm engine: it would take about {need / MiB:.0f} MiB of host memory and "
            f"{available / MiB:.0f} MiB are available (it keeps as much again free); growth "
            "starts engines cold")


class IdleCores:
    """How many of the host's cores were idle over about the last `window` seconds (psutil's
    system-wide CPU times, sampled at each call). A warm engine is speculative work: its start
    (mostly one core's imports) waits for an idle core so that it never slows the starts and
    steps of engines that train or are about to. (System-wide: a container's CPU quota is not
    seen, so a throttled container may look idle.)"""

    def __init__(self, window: float = 2.0):
        self.window = window
        self._samples: collections.deque = collections.deque()  # (monotonic s, idle core-s)

    def __call__(self) -> float:
        now, times = time.monotonic(), psutil.cpu_times()
        self._samples.append((now, times.idle + getattr(times, "iowait", 0.0)))
        while now - self._samples[0][0] > self.window:
            self._samples.popleft()
        then, idle_then = self._samples[0]
        if now - then < self.window / 2:  # too short a window to tell: count it busy
            return 0.0
        return (self._samples[-1][1] - idle_then) / (now - then)

    def enough(self) -> bool:
        """At least one core idle (half the host's on a host of one)."""
        return self() >= min(1.0, (psutil.cpu_count() or 1) / 2)


class WarmEngines:
    """A run's warm engines (this host's pools only: an engine on another host or in a batch
    job is placed with its slot).

    Args:
        supply: the pool's engines (pool.supply: starts, binds and stops them).
        log: the RunLog (a line when one is ready, warnings as events).
        prepare: ``async prepare(engines)`` sets new engines up for the run (runs the cell,
            connects the rendezvous); raises on failure.
    """

    def __init__(self, supply: EngineSupply, log: RunLog,
                 prepare: Callable[[list[Engine]], Awaitable[None]]):
        self.supply, self.log, self._prepare = supply, log, prepare
        self.ready: list[Engine] = []
        self._starting: asyncio.Task | None = None
        self._off: str | None = None  # why this run keeps none any more (said once)
        self.idle_cores = IdleCores()

    def keep(self, n: int, start: bool = True) -> None:
        """Keep `n` warm engines set up: start one in the background when fewer are ready or
        starting (and `start`), stop those beyond `n`. Call at every look at the run (the
        driver does)."""
        supply = self.supply
        if dead := [e for e in self.ready if not supply.alive(e)]:
            self.ready = [e for e in self.ready if e not in dead]
            supply.stop(dead)
            self.log.log(f"warm engine(s) {[e.pid for e in dead]} died; another is set up")
        if len(self.ready) > n:
            extra, self.ready = self.ready[n:], self.ready[:n]
            supply.stop(extra)
        starting = self._starting is not None and not self._starting.done()
        if (starting or not start or len(self.ready) >= n or self._off
                or not self.supply.local or not self.idle_cores.enough()):
            return
        if why := self._no_room():
            self._turn_off(why)
            return
        self._starting = background(self._start(), self._failed)

    def _no_room(self) -> str | None:
        sizes = [rss(e.pid) for e in self.supply.engines if e.local]
        return room_for(max(sizes, default=0), psutil.virtual_memory().available)

    async def _start(self) -> None:
        t0 = time.time()
        engine = await self.supply.start_warm()
        try:
            await self._prepare([engine])
        except BaseException:
            await self.supply.stop([engine])
            raise
        self.ready.append(engine)
        self.log.log(f"warm engine ready in {time.time() - t0:.1f} s (pid {engine.pid}, "
                     f"{rss(engine.pid) / MiB:.0f} MiB of host memory, no slot)")

    def _failed(self, message: str) -> None:
        self._turn_off(f"a warm engine failed to set up ({message}); growth starts engines "
                       "cold")

    def _turn_off(self, why: str) -> None:
        self._off = why
        self.log.event(EventKind.WARNING, message=why)

    async def bind(self, slots: list[int]) -> list[Engine]:
        """Bind ready warm engines to free `slots`, one each while any is ready; returns them as
        the pool's engines there. One that died is dropped (the next :meth:`keep` sets up
        another); one that refuses its bind is stopped, and the run keeps none from then on
        (an event says why)."""
        bound: list[Engine] = []
        for slot in slots:
            if not self.ready:
                break
            engine = self.ready.pop(0)
            try:
                bound.append(await self.supply.bind(engine, slot))
            except Exception as e:
                if is_engine_death(e) or not self.supply.alive(engine):  # another comes
                    self.log.log(f"warm engine {engine.pid} died before its bind")
                    continue
                self._turn_off(f"a warm engine could not be bound to slot {slot} "
                               f"({remote_summary(e)}); growth starts engines cold")
                break
        return bound

    async def release(self) -> None:
        """Stop the warm engines (the run ended), waiting for a start under way first."""
        if self._starting is not None:
            self._starting.cancel()
            await asyncio.gather(self._starting, return_exceptions=True)
        ready, self.ready = self.ready, []  # a cancelled start removed its own engine
        if ready:  # set up on no slot, nothing of the run: no grace (the run's end waits)
            await self.supply.stop(ready, grace=0)
