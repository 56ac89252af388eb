"""The run's one door into its pool: engines started, bound and stopped on the pool's slots.

A training run (run/) changes the pool's engines all the time: it starts engines on free slots
as it grows, stops spares, binds warm engines, leaves a failing slot out. It does all of that
through an :class:`EngineSupply`, which the pool hands it (``EnginePool.supply``), and never by
reaching through the pool into its parts (a test holds that): so the pool's engine sets, slots,
launcher and lease stay the pool's to reshape, and what a run may do with them is this class's
list of methods. Nothing here decides anything: the run's membership (run/membership.py)
decides which engines to start and stop, and the pool's parts carry it out.
"""
from __future__ import annotations

import asyncio
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import PoolConfig
    from .engine_calls import EngineCalls
    from .engine_sets import EngineSets
    from .lease import SlotLease
    from .launchers import Launcher
    from .processes import Engine
    from .slots import Exclusion, Slots


class EngineSupply:
    """What a run may do with its pool's engines and slots (owner thread).

    Args:
        engine_sets: the pool's engines (pool.engine_sets.EngineSets).
        slots: the pool's slots (pool.slots.Slots).
        launcher: where the engines run (pool.launchers).
        lease: the machine's grant of slots in lease mode (pool.lease.SlotLease), else None.
        config: the pool's options (its bounds).
    """

    def __init__(self, engine_sets: EngineSets, slots: Slots, launcher: Launcher,
                 lease: SlotLease | None, config: PoolConfig):
        self._sets, self._slots, self._launcher, self._lease = engine_sets, slots, launcher, lease
        self._config = config

    # ---------------------------------------------------------------- bounds

    @property
    def min_size(self) -> int:
        """``--min``: the fewest engines the run trains on (below it, it waits or stops)."""
        return self._config.min_size

    @property
    def max_size(self) -> int:
        """``--max``: the most engines the run grows to."""
        return self._config.max_size

    # ---------------------------------------------------------------- where engines run

    @property
    def local(self) -> bool:
        """The engines run on this host (an engine starts in about a second), not as other
        hosts' processes or batch jobs (which may wait in a scheduler's queue)."""
        return self._launcher.local

    @property
    def address(self) -> str:
        """The address the engines reach this kernel on (loopback on one host)."""
        return self._launcher.address

    def preload(self, modules: list[str]) -> None:
        """A run's cell imported `modules` on an engine: engines started later may have them
        loaded already (the launcher's zygote)."""
        self._launcher.preload(modules)

    # ---------------------------------------------------------------- slots

    @property
    def lease(self) -> SlotLease | None:
        """Lease mode's grant from the machine's arbiter, which a run's size follows and asks
        (run/claim.py, run/sizing.py:LeasePolicy); None outside lease mode."""
        return self._lease

    @property
    def leased(self) -> bool:
        """Lease mode: the machine's arbiter grants the slots (it may grant one later)."""
        return self._lease is not None

    @property
    def auto(self) -> bool:
        """Auto mode: the run's size follows what the arbiter grants."""
        return self._lease is not None and bool(self._lease.demand["auto"])

    @property
    def usable(self) -> int:
        """Slots the run may use now: the pool's upper bound minus slots left out."""
        return self._slots.usable

    @property
    def excluded(self) -> dict[int, Exclusion]:
        """Slots left out now (an exclusion whose cooldown ended is not)."""
        return self._slots.excluded

    def startable(self) -> int:
        """Engines that can start now: free slots not left out (and granted, in lease mode)."""
        return self._slots.startable()

    def leaving(self) -> set[int]:
        """Slots the machine's arbiter wants back (lease mode; else none)."""
        return self._slots.leaving()

    def next_free(self, k: int) -> list[int]:
        """Up to `k` free slots an engine may start on, lowest first."""
        return self._slots.next_free(k)

    def starting(self, slots: list[int]) -> AbstractContextManager[None]:
        """Hold `slots` as taken while their engines start (a start's task runs later)."""
        return self._slots.starting(slots)

    def exclude(self, slot: int, reason: str, until: float | None) -> None:
        """Leave `slot` out of engine starts until `until` (wall time; None: for good)."""
        self._slots.exclude(slot, reason, until)

    # ---------------------------------------------------------------- engines

    @property
    def engines(self) -> list[Engine]:
        """The pool's engines, oldest first (every run's and none: members, spares, idle)."""
        return self._sets.engines

    @property
    def running(self) -> bool:
        """Whether the pool's controller runs (False once the pool stopped)."""
        return self._sets.running

    @property
    def calls(self) -> EngineCalls:
        """The calls the run makes on its engines (pool.engine_calls.EngineCalls)."""
        return self._sets.calls

    async def resize_idle(self, n: int) -> None:
        """Start or stop engines until `n` run, before the run trains on them."""
        await self._sets.resize(n)

    async def start(self, slots: list[int]) -> list[Engine]:
        """Start one engine on each of `slots`; returns them once registered. Raises as the
        launcher does (StartWithdrawn: a slot went back before its batch job ran)."""
        return await self._sets.add(len(slots), slots)

    async def start_warm(self) -> Engine:
        """Start an engine on no slot (no GPU yet), to be bound to one as the run grows."""
        return await self._sets.add_warm()

    async def bind(self, engine: Engine, slot: int) -> Engine:
        """Bind warm `engine` to free `slot`; returns it as the pool's engine there."""
        return await self._sets.bind(engine, slot)

    def stop(self, engines: list[Engine], grace: float = 5.0) -> asyncio.Task:
        """Stop `engines` in the background (SIGKILLed after `grace` s); await the returned
        task to wait until they are gone."""
        return self._sets.remove(engines, grace=grace)

    def alive(self, engine: Engine) -> bool:
        """Whether `engine` runs (pool.engine_sets.EngineSets.alive)."""
        return self._sets.alive(engine)
