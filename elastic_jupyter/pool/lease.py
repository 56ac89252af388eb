"""A pool's slots from the machine's arbiter: its lease, and the follower of its grants.

A pool in *lease mode* (``--auto``, or any pool on a machine whose admin runs a shared arbiter)
starts engines only on slots the arbiter leased to it, and follows what the arbiter says:

- the arbiter's ``slots`` are the pool's training slots and ``standby`` its standby slots; an
  engine starts only on one of them;
- ``give_back`` names training slots to hand back at the next step boundary: the run shrinks
  (its size policy, run.sizing.LeasePolicy, asks for the smaller size; the members on those
  slots leave) and the pool releases each slot once no engine of its own runs there;
- ``revoke`` names standby slots to hand back now: their spare engines stop at once;
- more ``slots`` than engines: the run grows into them (auto mode, or a manual request the
  arbiter granted).

The pool is what the arbiter knows as a "run": its engines outlive one training run, and a run
on it trains on the pool's slots. :class:`SlotLease` is the only writer of the pool's demand
and of the newest grant; it lives on the owner loop, and its calls to the arbiter run in a
worker thread so the loop never waits on them: a Unix socket round trip of about a
millisecond (up to ``START_TIMEOUT`` while the arbiter restarts), or, with the launcher's own
arbiter (:meth:`~.launchers.Launcher.arbiter`), ssh round trips to every host's arbiter or a
look at Slurm's queue (seconds when slurmctld is busy). :class:`LeaseFollower` takes the
grant every ``POLL_S``: while no run trains, it starts and stops the pool's engines to match
it; while one trains, the run follows it at step boundaries.
"""
from __future__ import annotations

import asyncio
import logging
import os
import uuid
from typing import Any, Callable

from ..arbiter.client import ArbiterClient, arbiter_configured
from ..arbiter.table import ArbiterError, UnknownRun, check_weight
from ..config import PoolConfig, UsageError
from ..events import EventKind
from ..owner import background
from .claimant import Claimant
from .engine_sets import EngineSets
from .launchers import Arbiter, Launcher, StartWithdrawn

POLL_S = 0.5  # seconds between the pool's looks at its grant (the arbiter reaps every 0.5 s)
RETRY_S = 5.0  # after a failed look at the grant (or engine start), wait this long
KEPT_EVENTS = 50  # slot events an unclaimed pool keeps for the run that claims it next

log = logging.getLogger(__name__)


class SlotLease:
    """The pool's demand on the arbiter and the newest grant (owner loop).

    Args:
        pool_id: the id the arbiter knows the pool by (unique on the machine).
        demand: ``name``, ``notebook``, ``min``, ``max``, ``weight``, ``auto``, ``wanted``,
            ``standby``, as :meth:`arbiter.table.SlotTable.register` takes them.
        client: the arbiter's client (default: the machine's arbiter, started on demand).
    """

    def __init__(self, pool_id: str, demand: dict, client: Arbiter | None = None):
        self.id = pool_id
        self.demand = dict(demand)
        self.client: Arbiter = client or ArbiterClient()
        self.grant: dict = {}
        self.active = False  # whether a run trains on the pool (the pool's claim sets it)
        self.closed = False  # unregistered: no request registers the pool again
        self.engines: dict[str, int] = {}  # slot -> engine pid, as last reported
        self.events: list[dict] = []  # "grew"/"gave"/"value" events not yet shown
        self._speed_taken = True  # the arbiter takes the run's speed (an older one does not)
        self._sent = self._taken = 0  # request numbers: a late reply never overwrites a newer

    # ---------------------------------------------------------------- what the grant says

    @property
    def slots(self) -> list[int]:
        """Training slots leased to the pool."""
        return list(self.grant.get("slots", []))

    @property
    def leased(self) -> list[int]:
        """Every slot leased to the pool: training slots first, then standby slots."""
        return self.slots + list(self.grant.get("standby", []))

    @property
    def leaving(self) -> set[int]:
        """Slots to hand back: training slots at the next step boundary, standby slots now."""
        return set(self.grant.get("give_back", [])) | set(self.grant.get("revoke", []))

    @property
    def kept(self) -> int:
        """Training slots the pool keeps: the size it should train at."""
        return len(set(self.slots) - self.leaving)

    @property
    def queued(self) -> int | None:
        """The pool's place in the machine's queue (1: next), or None when admitted."""
        return self.grant.get("queued")

    @property
    def grantable(self) -> int:
        """The most training slots the arbiter could grant the pool now (a slider's range)."""
        return self.grant.get("grantable", 0)

    # ---------------------------------------------------------------- requests

    async def register(self) -> dict:
        """State the pool's demand (again); returns the grant. Raises ArbiterError. An arbiter
        of an earlier release, which never lends, is asked without ``lend``."""
        try:
            return await self._call(self.client.register, self.id, active=self.active,
                                    engines=self.engines, **self.demand)
        except ArbiterError as e:
            if "lend" not in self.demand or "unknown: lend" not in str(e):
                raise
            del self.demand["lend"]
            return await self.register()

    async def update(self, **changes: Any) -> dict:
        """Change the demand (``auto``, ``weight``, ``wanted``, ``standby``, ``name``...);
        returns the grant. Raises UsageError, with the demand unchanged, when the arbiter
        refuses it."""
        before = dict(self.demand)
        self.demand.update(changes)
        try:
            return await self.register()
        except ArbiterError as e:
            self.demand = before
            raise UsageError(str(e)) from None

    async def poll(self, engines: dict[int, int],
                   speed: list[tuple[int, float]] | None = None) -> dict:
        """The regular look: say whether the pool trains (an auto pool that does not wants
        only its min), which engine (pid) runs on which slot and the run's speed by world size
        (for the arbiter's value pass); returns the grant. A pool the arbiter does not know
        (its state was lost) registers again, with its engines' slots. An arbiter of an
        earlier release, which takes no speed, is asked without it from then on."""
        self.engines = {str(k): v for k, v in engines.items()}
        extra = {"speed": speed} if speed and self._speed_taken else {}
        try:
            return await self._call(self.client.poll, self.id, active=self.active,
                                    engines=self.engines, **extra)
        except UnknownRun:
            return await self.register()
        except ArbiterError as e:
            if not extra or "unknown: speed" not in str(e):
                raise
            self._speed_taken = False
            return await self.poll(engines)

    async def release(self, slots: list[int]) -> dict:
        """Hand back `slots` (no engine of the pool runs there any more)."""
        return await self._call(self.client.release, self.id, slots)

    async def close(self) -> None:
        """The pool stopped: every lease goes back (a gone arbiter reaps it within 2 s)."""
        self.closed = True
        try:
            await asyncio.to_thread(self.client.unregister, self.id)
        except Exception as e:  # noqa: BLE001 -- also at interpreter exit (no new threads)
            log.warning("elastic_jupyter: could not hand the pool's slots back (the arbiter "
                        "frees them within 2 s of the kernel's exit): %s", e)

    async def free_slots(self) -> int:
        """Slots of the machine nobody holds or uses now (0 when the arbiter does not say)."""
        try:
            view = await asyncio.to_thread(self.client.view)
        except ArbiterError:
            return 0
        return sum(1 for s in view.get("slots", [])
                   if s.get("holder") is None and not s.get("outside"))

    async def _call(self, fn: Callable[..., dict], *args: Any, **kwargs: Any) -> dict:
        if self.closed:  # a late update (a run that ended after its pool stopped)
            return self.grant
        self._sent += 1
        number = self._sent
        reply = await asyncio.to_thread(fn, *args, **kwargs)
        self.events += reply.pop("events", [])
        if number > self._taken:  # replies overtaken by a newer one are stale
            self._taken, self.grant = number, reply
        return self.grant


def pool_lease(config: PoolConfig, launcher: Launcher, jobs: Callable[[], list[str]],
               auto: bool, weight: float, arbiter: bool | None, gpus: str, name: str,
               notebook: str | None, lend: bool = True) -> SlotLease | None:
    """The lease of a new pool (EnginePool's arguments), or None when it does not take its
    slots from an arbiter; `jobs` returns the pool's batch jobs (a Slurm auto pool's own).
    A pool that keeps its slots says ``lend: false`` (only then: an arbiter of an earlier
    release, which never lends, would refuse the word).
    Raises UsageError: ``auto`` without the arbiter, a refused weight, a GPU list in lease
    mode, or ``auto`` where the launcher's arbiter refuses it."""
    if arbiter is None:
        arbiter = auto or arbiter_configured()
    if not arbiter:
        if auto:
            raise UsageError("auto mode needs the machine's arbiter: leave arbiter unset")
        return None
    check_weight_usage(weight)
    client = launcher.arbiter(jobs)  # None: this machine's arbiter
    if client is None and (gpus not in ("all", "none")
                           or (gpus == "none" and PoolConfig.gpu_count())):
        raise UsageError(f"--gpus {gpus}: in lease mode the machine's arbiter places the "
                         "engines on its slots; give --gpus all, or start the pool without "
                         "the arbiter (--no-arbiter, EnginePool(arbiter=False))")
    return SlotLease(f"pool-{uuid.uuid4().hex}", dict(
        name=name or "pool", notebook=notebook or os.environ.get("JPY_SESSION_NAME", ""),
        min=config.min_size, max=config.max_size, weight=weight, auto=auto, wanted=config.n,
        standby=0, **({} if lend else {"lend": False})), client)


def check_weight_usage(weight: float) -> None:
    """Raises UsageError for a weight the arbiter refuses (outside (0, 1e6])."""
    try:
        check_weight(weight)
    except ArbiterError as e:
        raise UsageError(str(e)) from None


def describe_slot_event(event: dict, kind: str) -> str:
    """A grant's event as one line: "grew into GPU 3 (freed by run X)", "gave GPU 2 to run Y";
    a scheduler's (Slurm's) says why: "gave slot 2 back: Slurm job(s) 41 wait for resources"."""
    where = f"{'GPU' if kind == 'gpu' else 'slot'} {event['slot']}"
    if "why" in event:
        verb = "grew into" if event["kind"] == "grew" else "gave back"
        return f"{verb} {where}: {event['why']}"
    if event["kind"] == "grew":
        return f"grew into {where}" + (f" (freed by run {event['from']})" if event.get("from")
                                       else "")
    return f"gave {where} to run {event['to']}"


class LeaseFollower:
    """Follows the lease's grants with the pool's engines (owner loop, from the pool's start to
    its stop): every POLL_S it tells the arbiter what runs where and takes its grant; while no
    run trains it starts and stops engines to match it (a run follows it at step boundaries);
    slots to give back go back once no engine of the pool runs there.

    Args:
        lease: the pool's lease; engine_sets: the pool's engines (and its slots).
        claimant: returns who holds the pool now (None: idle); it notes the grant's events.
        kind: "gpu" or "cpu": how the events name a slot.
    """

    def __init__(self, lease: SlotLease, engine_sets: EngineSets,
                 claimant: Callable[[], Claimant | None], kind: str):
        self.lease, self.engine_sets, self.slots = lease, engine_sets, engine_sets.slots
        self._claimant, self._kind = claimant, kind
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = background(self._follow(), self.warn)

    async def stop(self) -> None:
        """Stop following (first, as the pool stops: it must start no engine from now on)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _follow(self) -> None:
        failing = None
        while self.engine_sets.running:
            try:
                claimant = self._claimant()
                await self.lease.poll({e.slot: e.pid for e in self.engine_sets.engines
                                       if e.slot is not None},
                                      claimant.speed() if claimant is not None else None)
                self._show_events()
                if self._claimant() is None:
                    await self._follow_idle()
                await self._release_unused()
                failing = None
            except Exception as e:  # the arbiter restarts, or an engine did not start:
                if str(e) != failing:  # the pool keeps what it holds and tries again
                    self.warn(f"{type(e).__name__}: {e}")
                failing = str(e)
                await asyncio.sleep(RETRY_S)
            await asyncio.sleep(POLL_S)

    async def _follow_idle(self) -> None:
        async with self.engine_sets.resizing:
            if self._claimant() is not None:
                return  # a run claimed the pool meanwhile: it follows the lease from now
            leaving = [e for e in self.engine_sets.engines if e.slot in self.slots.leaving()]
            if leaving:
                self.engine_sets.remove(leaving)
            missing = min(self.lease.kept - len(self.engine_sets.engines),
                          self.slots.startable())
            if missing > 0:
                try:
                    await self.engine_sets.add(missing)
                except StartWithdrawn:
                    pass  # the slot went back; the next look follows the grant again

    async def _release_unused(self) -> None:
        """Give back the slots the arbiter asks for (and, while idle, standby slots) that no
        engine of the pool runs on, starts on or still stops on."""
        used = {e.slot for e in self.engine_sets.engines} | self.slots.busy
        unused = self.lease.leaving
        if self._claimant() is None:
            unused |= set(self.lease.grant.get("standby", []))
        unused -= used
        if unused:
            await self.lease.release(sorted(unused))

    def _show_events(self) -> None:
        """The arbiter's events ("grew into", "gave", and why its value pass moved slots) go to
        the claimant's events (its chart). While no run claims the pool they wait (the newest
        KEPT_EVENTS of them): the slots a pool took as it started belong on the chart of the
        run that then starts on it, however the two race."""
        if (claimant := self._claimant()) is None:
            del self.lease.events[:-KEPT_EVENTS]
            return
        events, self.lease.events = self.lease.events, []
        for event in events:
            if event["kind"] == "value":  # the arbiter's value pass moved slots: why
                claimant.note_event(EventKind.SLOT, message=f"by value: {event['why']}")
            else:
                claimant.note_event(EventKind.SLOT, slot=event["slot"],
                                    message=describe_slot_event(event, self._kind))

    def warn(self, message: str) -> None:
        """A failed look at the arbiter (or a request to it): logged, and noted on the
        claimant."""
        log.warning("elastic_jupyter: the slot arbiter: %s", message)
        if (claimant := self._claimant()) is not None:
            claimant.note_event(EventKind.WARNING, message=f"the slot arbiter: {message}")
