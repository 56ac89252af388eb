"""A pool's slots from the machine's arbiter: its lease, and the size policy that follows it.

A pool in *lease mode* (``--auto``, or any pool on a machine whose admin runs a shared arbiter)
starts engines only on slots the arbiter leased to it, and follows what the arbiter says:

- the arbiter's ``slots`` are the pool's training slots and ``standby`` its standby slots; an
  engine starts only on one of them;
- ``give_back`` names training slots to hand back at the next step boundary: the run shrinks
  (:class:`LeasePolicy` asks for the smaller size; the members on those slots leave) and the
  pool releases each slot once no engine of its own runs there;
- ``revoke`` names standby slots to hand back now: their spare engines stop at once;
- more ``slots`` than engines: the run grows into them (auto mode, or a manual request the
  arbiter granted).

The pool is what the arbiter knows as a "run": its engines outlive one training run, and a run
on it trains on the pool's slots. :class:`SlotLease` is the only writer of the pool's demand
and of the newest grant; it lives on the owner loop, and its calls to the arbiter run in a
worker thread so the loop never waits on them: a Unix socket round trip of about a
millisecond (up to ``START_TIMEOUT`` while the arbiter restarts), or, with the launcher's own
arbiter (:meth:`~.launchers.Launcher.arbiter`), ssh round trips to every host's arbiter or a
look at Slurm's queue (seconds when slurmctld is busy).
"""
from __future__ import annotations

import asyncio
import logging
import time

from ..arbiter.client import ArbiterClient
from ..arbiter.table import ArbiterError, UnknownRun
from ..config import UsageError
from ..run.sizing import SizePolicy, SizeRequest

POLL_S = 0.5  # seconds between the pool's looks at its grant (the arbiter reaps every 0.5 s)

log = logging.getLogger(__name__)


class SlotLease:
    """The pool's demand on the arbiter and the newest grant (owner loop).

    Args:
        pool_id: the id the arbiter knows the pool by (unique on the machine).
        demand: ``name``, ``notebook``, ``min``, ``max``, ``weight``, ``auto``, ``wanted``,
            ``standby``, as :meth:`arbiter.table.SlotTable.register` takes them.
        client: the arbiter's client (default: the machine's arbiter, started on demand).
    """

    def __init__(self, pool_id: str, demand: dict, client: ArbiterClient | None = None):
        self.id = pool_id
        self.demand = dict(demand)
        self.client = client or ArbiterClient()
        self.grant: dict = {}
        self.active = False  # whether a run trains on the pool (the pool's claim sets it)
        self.closed = False  # unregistered: no request registers the pool again
        self.engines: dict[str, int] = {}  # slot -> engine pid, as last reported
        self.events: list[dict] = []  # "grew"/"gave" events not yet shown
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
        """State the pool's demand (again); returns the grant. Raises ArbiterError."""
        return await self._call(self.client.register, self.id, active=self.active,
                                engines=self.engines, **self.demand)

    async def update(self, **changes) -> dict:
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

    async def poll(self, engines: dict[int, int]) -> dict:
        """The regular look: say whether the pool trains (an auto pool that does not wants
        only its min) and which engine (pid) runs on which slot; returns the grant. A pool the
        arbiter does not know (its state was lost) registers again, with its engines' slots."""
        self.engines = {str(k): v for k, v in engines.items()}
        try:
            return await self._call(self.client.poll, self.id, active=self.active,
                                    engines=self.engines)
        except UnknownRun:
            return await self.register()

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

    async def _call(self, fn, *args, **kwargs) -> dict:
        if self.closed:  # a late update (a run that ended after its pool stopped)
            return self.grant
        self._sent += 1
        number = self._sent
        reply = await asyncio.to_thread(fn, *args, **kwargs)
        self.events += reply.pop("events", [])
        if number > self._taken:  # replies overtaken by a newer one are stale
            self._taken, self.grant = number, reply
        return self.grant


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


class LeasePolicy(SizePolicy):
    """The size follows the pool's lease: the training slots it keeps (see module docstring).

    Asks for a size only when that number changes, so a user's request in between stands until
    the arbiter's grant moves again. The run's manual requests go to the arbiter as the pool's
    ``wanted`` and come back here once granted.
    """

    def __init__(self, lease: SlotLease, size: int):
        self.lease, self._last = lease, size

    def requests(self, step: int, now: float) -> list[SizeRequest]:
        wish = self.lease.kept
        if wish == self._last or wish < 1:
            return []
        self._last = wish
        return [SizeRequest(wish, time=time.time(), source="arbiter")]
