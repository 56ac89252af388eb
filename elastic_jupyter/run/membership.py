"""Membership: the only writer of a run's members, spares and joining engines.

*Members* train, in rank order (rank 0 is the oldest survivor). *Spares* are engines that were
started and set up in the background — for a pending grow, or as ``--standby`` — so a grow
costs only forming the new group and one broadcast; a boot binds a warm engine
(:mod:`.warm_engines`, set up on no slot) before it starts one. *Joining* engines replace lost
ones at the next generation. Membership boots and trims engines, counts each slot's faults,
leaves out a slot that keeps failing and backs off restarting it.

The functions at the top are the decisions, pure so that they are tested without a cluster; the
:class:`Membership` class carries them out on the owner loop.
"""
from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from ..events import EventKind
from . import faults
from ..pool.engine_calls import remote_summary
from ..pool.launchers import StartWithdrawn
from ..pool.processes import kill
from ..owner import background
from .runlog import RunLog
from .warm_engines import WarmEngines

if TYPE_CHECKING:
    from ..pool.supply import EngineSupply
    from .sizing import Decision
    from ..pool.processes import Engine


MAX_BOOT_FAILURES = 3  # consecutive failed boots before a grow gives up


def _cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


# ---------------------------------------------------------------------- decisions (pure)

def plan_shrink(members: list, target: int, wanted: int, spares: int,
                leaving_slots: frozenset = frozenset()) -> tuple[list, list, list]:
    """Shrink to `target`: members on `leaving_slots` (slots the machine's arbiter wants back)
    leave first, then the youngest ranks (rank order is age order, so rank 0 and the state it
    broadcasts stay where they can; after a step every member holds that state); never fewer
    than `target` stay, on leaving slots if need be. Returns (staying, kept as spares,
    stopped): leavers are kept as spares while the run wants more engines set up (`wanted`,
    beside `spares` ready ones), except those on leaving slots."""
    must = [m for m in members if leaving_slots and m.slot in leaving_slots]
    rest = [m for m in members if m not in must]
    kept = rest[:target] + must[:max(0, target - len(rest))]
    staying = [m for m in members if m in kept]  # rank order
    leaving = rest[target:]
    room = max(0, wanted - target - spares)
    return staying, leaving[:room], [m for m in must if m not in kept] + leaving[room:]


def plan_trim(spares: list, wanted: int, members: int) -> tuple[list, list]:
    """(kept, stopped): ready spares beyond what the run wants set up are stopped, newest
    first (the oldest spares are the longest warmed up)."""
    keep = max(wanted - members, 0)
    return spares[:keep], spares[keep:]


def restart_delay(recent_faults: int) -> float:
    """Seconds to wait before restarting a slot with that many recent faults: 0, 0, 1, 2, 4...
    16."""
    return 0.0 if recent_faults <= 1 else min(2.0 ** (recent_faults - 2), 16.0)


def cooldown(exclusions: int, first: float | None = None, most: float | None = None) -> float:
    """Seconds a slot stays out the `exclusions`-th time it is left out: `first`, doubling each
    time, at most `most`. Horovod's elastic blacklist grew such a cooldown (v0.24,
    ``--blacklist-cooldown-range``, horovod/horovod#3319): a host that keeps failing is tried
    again ever more rarely instead of never. Defaults: ``faults.COOLDOWN``."""
    first = faults.COOLDOWN[0] if first is None else first
    most = faults.COOLDOWN[1] if most is None else most
    return min(first * 2.0 ** (exclusions - 1), most)


class SlotHealth:
    """Faults and failed starts per slot in this run, and what they decide.

    A slot with ``limit`` faults within ``window`` seconds is left out for a cooldown that
    doubles with each time it was left out (:func:`cooldown`); its faults are then forgotten,
    so it comes back with a clean count. A slot whose engine failed to start
    ``start_limit`` times in a row is left out for good: nothing that trains ran there.
    Times are the caller's clock (seconds); the decisions are pure. Defaults: ``faults``'
    MAX_SLOT_FAULTS, FAULT_WINDOW and MAX_START_FAILURES, read when it is made.
    """

    def __init__(self, limit: int | None = None, window: float | None = None,
                 start_limit: int | None = None):
        self.limit = faults.MAX_SLOT_FAULTS if limit is None else limit
        self.window = faults.FAULT_WINDOW if window is None else window
        self.start_limit = faults.MAX_START_FAILURES if start_limit is None else start_limit
        self.recent: dict[int, list[float]] = {}  # slot -> times of its faults in the window
        self.exclusions: dict[int, int] = {}  # slot -> times it was left out
        self.failed_starts: dict[int, int] = {}  # slot -> failed starts in a row

    def record_fault(self, slot: int, now: float) -> float | None:
        """Count a fault of `slot` at `now`; returns the cooldown (s) when the slot is to be
        left out now, else None."""
        times = [t for t in self.recent.get(slot, []) if now - t < self.window] + [now]
        if len(times) < self.limit:
            self.recent[slot] = times
            return None
        self.recent[slot] = []
        self.exclusions[slot] = self.exclusions.get(slot, 0) + 1
        return cooldown(self.exclusions[slot])

    def record_start(self, slot: int, ok: bool) -> bool:
        """Count a start on `slot`; True when it failed ``start_limit`` times in a row (leave
        the slot out for good)."""
        self.failed_starts[slot] = 0 if ok else self.failed_starts.get(slot, 0) + 1
        return self.failed_starts[slot] == self.start_limit

    def delay(self, slot: int | None, now: float) -> float:
        """Seconds to wait before restarting `slot` (its recent faults back it off)."""
        if slot is None:
            return 0.0
        return restart_delay(sum(now - t < self.window for t in self.recent.get(slot, [])))


# ---------------------------------------------------------------------- carrying them out

class Membership:
    """Members, spares and joining engines of one run (owner thread).

    Args:
        supply: the pool's engines and slots (pool.supply: starts, stops, leaves out).
        log: the RunLog (warnings as events).
        prepare: ``async prepare(engines)`` sets new engines up for the run (runs the cell,
            connects the rendezvous); raises on failure.
    """

    def __init__(self, supply: EngineSupply, log: RunLog,
                 prepare: Callable[[list[Engine]], Awaitable[None]]):
        self.supply, self.log, self._prepare = supply, log, prepare
        self.members: list[Engine] = []
        self.spares: list[Engine] = []
        self.joining: list[Engine] = []
        self.health = SlotHealth()
        self._left_out: set[int] = set()  # slots this run left out for a cooldown
        self.warm = WarmEngines(supply, log, prepare)  # set up on no slot: bound as it grows
        self.boot_failures = 0
        self._booting: asyncio.Task | None = None
        self._released = False  # the run ended: starts still waiting their turn start none

    @property
    def gave_up(self) -> bool:
        """Engines failed to start MAX_BOOT_FAILURES times in a row: no more boots."""
        return self.boot_failures >= MAX_BOOT_FAILURES

    def hopeless(self) -> bool:
        """No engine can come: no boot is under way, no slot is free, and every slot left out
        stays out (a cooldown that ends gives one back; in lease mode the arbiter may grant
        one later)."""
        supply = self.supply
        return not self.booting() and not supply.leased and supply.startable() <= 0 and all(
            x.until is None for x in supply.excluded.values())

    def start_with(self, engines: list) -> None:
        self.members = list(engines)

    def in_parts(self) -> bool:
        """Whether a grow takes engines as each is ready rather than all at once: batch jobs
        start when their scheduler says, and an auto run takes what the arbiter grants as it
        comes (on this host a slot trains seconds sooner than if it waited for the others)."""
        return not self.supply.local or self.supply.auto

    def booting(self) -> bool:
        """An engine start for members or spares is under way."""
        return self._booting is not None and not self._booting.done()

    # ---------------------------------------------------------------- spares

    def boot(self, wanted: int) -> None:
        """Start engines in the background until `wanted` are set up (members and spares).
        One boot at a time; call again when it ended (the driver does at every look)."""
        if self.booting():
            return
        self._booting = None
        staying = self._staying()  # members on slots to give back get swapped
        missing = min(wanted - len(staying) - len(self.spares), self.supply.startable())
        if missing > 0 and not self.gave_up:
            self._booting = background(self._boot(missing),
                                       lambda e: self.log.event(EventKind.WARNING,
                                                                message=f"boot: {e}"))

    def follow(self, decision: Decision, warm: int, max_size: int) -> None:
        """Carry out the engines' part of a look's `decision` (sizing.Decision): spares on
        slots the machine's arbiter wants back stop; once requests settled, engines boot and
        trim to what it wants; `warm` engines stay set up on no slot. A new warm engine would
        slow a boot under way, and one for a size the boot reaches anyway (`max_size`) is not
        needed: it starts when neither holds."""
        if leaving := self.leaving():
            self.stop_spares(leaving)
        if decision.boot:
            self.boot(decision.wanted)
            self.trim(decision.wanted)
        self.warm.keep(warm, not self.booting() and decision.wanted < max_size)

    def trim(self, wanted: int) -> None:
        """Stop ready spares that no pending request or standby needs any more."""
        self.spares, extra = plan_trim(self.spares, wanted, len(self._staying()))
        if extra:
            self.supply.stop(extra)

    def leaving(self) -> set:
        """Slots the machine's arbiter wants back (lease mode; else none)."""
        return self.supply.leaving()

    def _staying(self) -> list:
        leaving = self.leaving()  # once: it is computed from the pool's engines and grant
        return [m for m in self.members if m.slot not in leaving]

    def swappable(self) -> bool:
        """A member is on a slot to give back and a spare is ready elsewhere: the next step
        boundary can swap them without changing the size."""
        leaving = self.leaving()
        return any(m.slot in leaving for m in self.members) and any(
            s.slot not in leaving for s in self.spares)

    def leavers(self, target: int, wanted: int) -> list[int]:
        """The ranks that go at a change to `target` members (a sharded run names them to its
        ranks, which hand their rows over first): :func:`plan_shrink`'s choice, or those
        :meth:`swap` moves off slots the arbiter wants back."""
        if target < len(self.members):
            staying = plan_shrink(self.members, target, wanted, len(self.spares),
                                  frozenset(self.leaving()))[0]
        elif self.swappable():
            staying = [m for m in self.members if m not in self.swap_plan()]
        else:
            return []
        return [rank for rank, m in enumerate(self.members) if m not in staying]

    def let_go(self, gone: list, wanted: int) -> None:
        """Members that handed their rows over (a sharded run's shrink or swap) leave: kept as
        spares while the run wants more engines set up (not those on slots the arbiter wants
        back), else stopped."""
        leaving = self.leaving()
        self.members = [m for m in self.members if m not in gone]
        room = max(0, wanted - len(self.members) - len(self.spares))
        kept = [m for m in gone if m.slot not in leaving][:room]
        self.spares += kept
        self.supply.stop([m for m in gone if m not in kept])

    def swap_plan(self) -> list:
        """The members :meth:`swap` would move off slots the arbiter wants back (as many as
        ready spares elsewhere)."""
        leaving = self.leaving()
        gone = [m for m in self.members if m.slot in leaving]
        return gone[:len([s for s in self.spares if s.slot not in leaving])]

    def swap(self) -> list:
        """Members on slots to give back leave for ready spares (the newcomers, youngest
        ranks); returns the newcomers. The leavers left the group already."""
        leaving = self.leaving()
        gone = self.swap_plan()
        ready = [s for s in self.spares if s.slot not in leaving][:len(gone)]
        self.members = [m for m in self.members if m not in gone] + ready
        self.spares = [s for s in self.spares if s not in ready]
        self.supply.stop(gone)
        return ready

    def stop_spares(self, slots: set) -> None:
        """Stop the spares on `slots` now (the machine's arbiter wants those slots back)."""
        gone = [e for e in self.spares if e.slot in slots]
        if gone:
            self.spares = [e for e in self.spares if e not in gone]
            self.supply.stop(gone)

    async def _boot(self, k: int) -> None:
        if self.warm.ready:  # bound to a free slot: no engine starts
            t0 = time.time()
            free = self.supply.next_free(min(k, len(self.warm.ready)))
            bound = await self.warm.bind([s for s in free if not self.health.delay(s, t0)])
            self.spares.extend(bound)
            k -= len(bound)
            if bound:
                self.log.log(f"{len(bound)} warm engine(s) bound in {time.time() - t0:.2f} s")
        if k <= 0:
            return
        if not self.in_parts():
            outcomes = [await self._boot_together(k)]
        elif not self.supply.local:  # each batch job starts when its scheduler says
            outcomes = await asyncio.gather(*(self._boot_together(1) for _ in range(k)))
        else:  # a start is mostly one core's work: more at once would make each later
            gate = asyncio.Semaphore(_cores())
            outcomes = await asyncio.gather(*(self._boot_one(gate) for _ in range(k)))
        self._count(outcomes)

    async def _boot_one(self, gate: asyncio.Semaphore) -> bool | None:
        async with gate:
            # the run may have ended while this start waited its turn; side by side starts
            # fail for the host's reasons (load, memory), not their slot's
            return None if self._released else await self._boot_together(1, blame=False)

    def _count(self, outcomes: list[bool | None]) -> None:
        """A boot whose starts all failed counts as one failed boot; one that readied an
        engine ends the run of failures."""
        if True in outcomes:
            self.boot_failures = 0
        elif False in outcomes:
            self.boot_failures += 1
            if self.gave_up:
                self.log.event(EventKind.WARNING, message=f"gave up growing after "
                               f"{MAX_BOOT_FAILURES} failed boots in a row")

    async def _boot_together(self, k: int, blame: bool = True) -> bool | None:
        """Start up to `k` engines together on free slots and set them up as spares: True
        when they are ready, False when they failed (an event says why), None when none
        started (no slot, or the arbiter took theirs back meanwhile). A lone start that
        fails counts against its slot when `blame`."""
        first = next(iter(self.supply.next_free(1)), None)
        await asyncio.sleep(self.health.delay(first, time.time()))  # back off a bad slot
        slots = self.supply.next_free(k)
        if not slots:
            return None
        t0 = time.time()
        try:
            with self.supply.starting(slots):  # taken now: the start's task runs later
                started, engines = await self._unless_given_back(
                    slots, self.supply.start(slots))
        except StartWithdrawn as e:  # the slot went back before its job ran: no failure
            self.log.log(str(e))
            return None
        except Exception as e:  # reported as an event; the run trains on
            self.log.event(EventKind.WARNING,
                           message=f"could not start {len(slots)} engine(s): {e}")
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            # engines started together fail together: only a lone start blames its slot
            for slot in slots if len(slots) == 1 and blame else ():
                if self.health.record_start(slot, ok=False):
                    self._leave_out(slot, f"its engine failed to start "
                                    f"{self.health.start_limit} times in a row: {why}", None)
            return False
        if not started:
            return None
        for slot in slots:
            self.health.record_start(slot, ok=True)
        try:
            ready, _ = await self._unless_given_back(slots, self._prepare(engines))
        except asyncio.CancelledError:  # the run ended meanwhile (release)
            await self.supply.stop(engines)
            raise
        except Exception as e:
            await self.supply.stop(engines)
            self.log.event(EventKind.WARNING, message=f"new engines failed to set up: "
                           f"{remote_summary(e)}")
            return False
        if not ready:
            self.supply.stop(engines, grace=0)  # no state of the run is there
            return None
        self.spares.extend(engines)
        self.log.log(f"{k} engine(s) ready in {time.time() - t0:.2f} s")
        return True

    async def _unless_given_back(self, slots: list[int], work: Awaitable) -> tuple[bool, Any]:
        """Await `work` (starting engines on `slots`, or setting them up) and return (True,
        its result); raises as `work`. When the arbiter wants one of `slots` back meanwhile
        (it changed its mind while they started), cancel it (a cancelled start stops its
        engines) and return (False, None): on this host the slot goes within a look, not
        after an engine start, the cell and a step boundary. A batch job's start is left to
        its own rule (:class:`~elastic_jupyter.pool.launchers.StartWithdrawn`)."""
        task, local = asyncio.ensure_future(work), self.supply.local
        try:
            while not task.done() and not (local and (back := set(slots) & self.leaving())):
                await asyncio.wait([task], timeout=0.05)
            if task.done():
                return True, task.result()
        finally:
            task.cancel()  # when the caller was cancelled, or the slot went back
        await asyncio.gather(task, return_exceptions=True)
        self.log.log(f"slot(s) {sorted(back)} given back while their engine started")
        return False, None

    # ---------------------------------------------------------------- resizes

    def shrink(self, target: int, wanted: int, leaving_slots: frozenset = frozenset()) -> None:
        """Leave `target` members; leavers left the group already (kept as spares or stopped;
        see :func:`plan_shrink`)."""
        self.members, kept, stopped = plan_shrink(self.members, target, wanted,
                                                  len(self.spares), leaving_slots)
        self.spares += kept
        self.supply.stop(stopped)

    async def grow(self, target: int, poll: float) -> list:
        """Add ready spares until `target` members, waiting for boots still under way (the
        ranks wait too). Returns the newcomers; fewer when engines failed to start."""
        while (len(self.spares) < target - len(self.members) and not self.gave_up
               and not self.hopeless()):
            self.boot(target)
            await asyncio.sleep(poll)
        newcomers = self.spares[:target - len(self.members)]
        self.spares = self.spares[len(newcomers):]
        self.members += newcomers
        return newcomers

    def drain(self, engines: list) -> None:
        """Members their scheduler told to go left the group with the others: forget them and
        end their engines (a batch job ends). Not a fault: their slots count none."""
        self.members = [m for m in self.members if m not in engines]
        self.supply.stop(engines)

    # ---------------------------------------------------------------- faults

    def drop(self, lost: list) -> None:
        """Forget lost engines (dead or hung: they are killed), count their slots' faults and
        leave out a slot that keeps failing, for a cooldown (SlotHealth)."""
        for engine in lost:
            kill(engine)
        self.members = [m for m in self.members if m not in lost]
        self.supply.stop(lost)
        now = time.time()
        for engine in lost:
            if (pause := self.health.record_fault(engine.slot, now)) is not None:
                h = self.health
                self._leave_out(engine.slot, f"{h.limit} faults within {h.window:.0f} s",
                                now + pause)

    def _leave_out(self, slot: int, reason: str, until: float | None) -> None:
        """Leave `slot` out of engine starts until `until` (wall time; None: for good)."""
        self.supply.exclude(slot, reason, until)
        self._left_out.add(slot)
        back = "it stays out" if until is None else f"back in {until - time.time():.0f} s"
        self.log.event(EventKind.SLOT, slot=slot, until=until,
                       message=f"slot {slot} left out: {reason}; {back}")

    def readmit(self) -> None:
        """Announce the slots this run left out whose cooldown ended (usable again)."""
        back = {slot for slot in self._left_out if slot not in self.supply.excluded}
        for slot in sorted(back):
            self.log.event(EventKind.SLOT, slot=slot, message=f"slot {slot} is back after its "
                           "cooldown")
        self._left_out -= back

    def drop_dead(self) -> bool:
        """Drop members whose process died (a fault during recovery); True if any did."""
        dead = [m for m in self.members if not self.supply.alive(m)]
        if dead:
            self.members = [m for m in self.members if m not in dead]
            self.supply.stop(dead)
        return bool(dead)

    async def wait_for_joiners(self, needed: int, wanted: int, deadline: float,
                               poll: float, stopped=lambda: False) -> bool:
        """Wait until `needed` spares are ready and move them to joining; False if the
        monotonic `deadline` passed, engines keep failing to start, none can come any more
        (:meth:`hopeless`) or `stopped()` says the run was told to stop."""
        while len(self.spares) < needed:
            if time.monotonic() > deadline or self.gave_up or stopped() or self.hopeless():
                return False
            # `wanted` was capped to the usable slots: a slot whose cooldown ends counts too
            self.boot(max(wanted, len(self.members) + needed))
            await asyncio.sleep(poll)
        self.joining, self.spares = self.spares[:needed], self.spares[needed:]
        return True

    def admit_joining(self) -> list:
        """Joining engines become the youngest members; returns them."""
        joining, self.joining = self.joining, []
        self.members += joining
        return joining

    # ---------------------------------------------------------------- end

    async def release(self) -> None:
        """Stop the spares (waiting for a boot under way first, or cancelling one whose engine
        jobs may wait in a scheduler's queue for hours); members stay in the pool."""
        self._released = True
        if self._booting is not None:
            if not self.supply.local:
                self._booting.cancel()
            await asyncio.gather(self._booting, return_exceptions=True)
        spares, self.spares = self.spares + self.joining, []
        self.joining = []
        try:
            if spares:  # nothing of the run is on them: no grace (the run's end waits)
                await self.supply.stop(spares, grace=0)
        finally:
            await self.warm.release()
