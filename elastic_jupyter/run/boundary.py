"""Boundary: what changes in a run's membership between two generations.

A generation ends at a step boundary (engine.generation) for one of three reasons, and each
asks the membership for something different before the next generation forms:

- a size is due (a request, a schedule entry, the arbiter's lease): :meth:`Boundary.plan`
  reads it from the sizer, lets go a sharded run's ranks that handed their rows over, and
  says whether a resize follows; :meth:`Boundary.resize` carries it out (a shrink stops or
  keeps the youngest ranks, a grow takes set-up spares or waits for them);
- ranks were told to go by their scheduler (engine.group.drain): :meth:`Boundary.drain` drops
  them, :meth:`Boundary.after_drain` starts their replacements;
- nothing but slots the machine's arbiter wants back: the plan swaps ranks off them.

The Driver (driver.py) calls these in its recovery loop and writes the run's state around them
(RESIZING while a resize is carried out); the engines themselves are Membership's
(membership.py), the decision of the size the Sizer's (sizing.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..events import EventKind
from .membership import Membership
from .runlog import RunLog
from .sizing import Change, Sizer

if TYPE_CHECKING:
    from ..pool.engine_calls import EngineCalls
    from ..pool.processes import Engine
    from .final_state import FinalState
    from .recovery import Recovery
    from .run_mode import RunMode


@dataclass(frozen=True)
class Resize:
    """A change of the world size due after `step`, from `world_size` to `target` engines;
    `change` is the sizer's (when it was asked for, whether a schedule entry fell due)."""

    step: int
    world_size: int
    target: int
    change: Change


@dataclass(frozen=True)
class BoundaryPlan:
    """What a step boundary does: a `resize` to carry out, or none, with the engine ids that
    join the next generation without one (`newcomers`: ranks swapped off slots the arbiter
    wants back)."""

    resize: Resize | None
    newcomers: frozenset[int] = frozenset()


class Boundary:
    """The membership changes at a run's generation boundaries (owner loop).

    Args:
        membership: the run's engines; sizer: the size due; log: the run's log (resize and
            drain events); mode: where the state lives (a sharded run's ranks hand over before
            they leave); recovery: resumes after a drain; final: writes the checkpoint when
            every rank drains; calls: reads that checkpoint's state; standby: ``--standby``;
            poll: seconds between looks while a grow waits for spares.
    """

    def __init__(self, membership: Membership, sizer: Sizer, log: RunLog, mode: RunMode,
                 recovery: Recovery, final: FinalState, calls: EngineCalls, standby: int,
                 poll: float):
        self.membership, self.sizer, self.log, self.mode = membership, sizer, log, mode
        self.recovery, self.final, self.calls = recovery, final, calls
        self.standby, self.poll = standby, poll

    def _wanted(self) -> int:
        return self.sizer.engines_wanted(self.standby)

    # ---------------------------------------------------------------- a size due

    def plan(self, step: int, handed_over: list[Engine]) -> BoundaryPlan:
        """The size due after `step`, and what it asks for. A sharded run's members that
        `handed_over` their rows leave now, and no other: the rest of a shrink (a request
        since) goes at the next step boundary, where the driver names them. Takes no new
        request: the last look decided this boundary, and the next generation's first look
        takes what came since. Where the size stays, ranks on slots the arbiter wants back
        are swapped for spares, and the plan has no resize."""
        change = self.sizer.due(step, self.log.record(step).get("time", time.time()))
        if handed_over:  # exactly they leave, and a shrink is done where nothing joins
            self._let_go(step, change, handed_over)
        W = len(self.membership.members)
        target = self.sizer.reachable(  # a sharded shrink: named, at the next step
            self.mode.size_now(change.target, W), W, len(self.membership.spares),
            change.scheduled)
        if target != W:
            return BoundaryPlan(Resize(step, W, target, change))
        newcomers = self.mode.swap(self.membership)  # sharded: handed over above
        if newcomers:
            self.log.event(EventKind.SLOT, message=f"moved {len(newcomers)} rank(s) off "
                           "slot(s) the machine's arbiter wants back")
        self.membership.trim(self._wanted())
        return BoundaryPlan(None, frozenset(e.engine_id for e in newcomers))

    def _let_go(self, step: int, change: Change, handed_over: list[Engine]) -> None:
        """A sharded run's members that handed their rows over after `step` leave; where the
        size `change` adds none back, that was the resize."""
        membership = self.membership
        membership.let_go(handed_over, self._wanted())
        W = len(membership.members)
        if change.target <= W:
            self.log.resize_started(step, W + len(handed_over), W,
                                    change.requested_time or time.time(), change.scheduled)
            self.log.resize_settled(W)

    async def resize(self, resize: Resize) -> set[int]:
        """Carry out `resize`; returns the engine ids that join. A grow that cannot reach its
        target (no free slot, failed starts) trains on at the size reached, with a warning,
        and the sizer stops growing there."""
        membership, W, target = self.membership, resize.world_size, resize.target
        self.log.resize_started(resize.step, W, target,
                                resize.change.requested_time or time.time(),
                                resize.change.scheduled)
        newcomers = []
        if target < W:
            membership.shrink(target, self._wanted(), frozenset(membership.leaving()))
        else:
            newcomers = await membership.grow(target, self.poll)
            if (reached := len(membership.members)) < target:
                self.sizer.stop_growing_at(reached)
                why = (f"after {membership.boot_failures} failed starts" if membership.gave_up
                       else "no slot is free (see the slot events)")
                self.log.event(EventKind.WARNING, message=f"could not grow to {target} engines "
                               f"{why}; training goes on with {reached}")
            self.log.resize_settled(len(membership.members))
        membership.trim(self._wanted())
        membership.boot(self._wanted())  # standby engines used by this grow are replaced
        return {e.engine_id for e in newcomers}

    # ---------------------------------------------------------------- ranks told to go

    async def drain(self, drained: tuple[tuple[Engine, float], ...]) -> None:
        """Ranks told to go (`drained`: (engine, wall time of its SIGTERM)) left the group
        after the last step, with every other rank: drop them and end their engines (their
        jobs). Should every rank go, the state is first written to a checkpoint, from which
        the replacements start."""
        if not drained:
            return
        members = self.membership.members
        if len(drained) == len(members):
            await self.final.write_checkpoint(await self.calls.training_state(members[0]))
        self.membership.drain([engine for engine, _ in drained])
        W, now = len(self.membership.members), time.time()
        for engine, asked in drained:
            self.log.event(EventKind.DRAIN, slot=engine.slot, world_size=W,
                           drain_s=round(now - asked, 3),
                           message=f"slot {engine.slot} drained (told to go by its scheduler)"
                           f" {now - asked:.2f} s after the signal; world size {W}")

    async def after_drain(self) -> set[int]:
        """After a drain: start replacements (the sizer still wants the size) and train on at
        the smaller size until they are up, or below --min wait for them. Returns the engine
        ids that receive the state."""
        self.membership.boot(self._wanted())
        return await self.recovery.resume()
