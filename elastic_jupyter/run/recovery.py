"""Recovery: from a faulted generation back to one consistent state on every member.

When a generation ends with a fault (faults.classify), :meth:`Recovery.recover` drops the lost
engines, waits for replacements if fewer than ``--min`` survive, and names the engines that
must receive the survivors' state by broadcast in the next generation. The survivors need no
rollback: a step is applied only once every rank voted (engine.group.vote), so they all hold the
same committed step and the fault loses at most the step in flight. An engine that had not loaded
the state it was being sent is no survivor (``holds_state``); with no survivor the newest
checkpoint is loaded. A survivor that dies meanwhile is dropped and the look retried. When no
recovery is possible it raises :class:`BelowMinimum` or ``RuntimeError``; the driver ends
the run.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..events import EventKind
from . import faults
from ..engine.state import checkpoint as ckpt
from ..engine.sharded import checkpoint_parts as sharded_checkpoint
from .membership import Membership
from .runlog import RunLog
from .sizing import Sizer

if TYPE_CHECKING:
    from ..pool.engine_calls import EngineCalls
    from ..pool.supply import EngineSupply
    from ..pool.processes import Engine


class BelowMinimum(Exception):
    """Fewer than --min engines and no replacement started in time."""


class RepeatedFailure(Exception):
    """A failure with no engine lost came back the same after a retry: the run ends with it.

    Attributes: engine (one of the ranks that raised it), error (its remote error)."""

    def __init__(self, engine: Engine, error: BaseException):
        super().__init__(str(error))
        self.engine, self.error = engine, error


class Recovery:
    """Args: membership, calls (EngineCalls), log (RunLog), sizer, supply (the pool's engines,
    slots and bounds: pool.supply), checkpoint_dir, standby (engines kept set up besides the
    members), poll (s between looks while waiting)."""

    def __init__(self, membership: Membership, calls: EngineCalls, log: RunLog, sizer: Sizer,
                 supply: EngineSupply, checkpoint_dir: str, standby: int,
                 poll: float):
        self.membership, self.calls, self.log = membership, calls, log
        self.sizer, self.supply = sizer, supply
        self.checkpoint_dir, self.standby, self.poll = checkpoint_dir, standby, poll
        self._restored_step = 0
        self._faults_without_progress = 0
        self._last_signature: frozenset | None = None  # the last fault's (Outcome.signature)

    async def recover(self, outcome: faults.Outcome) -> set:
        """Recover from `outcome` (a faulted generation); returns the engine ids that receive
        the state by broadcast in the next generation. Raises BelowMinimum, or RuntimeError
        when the run keeps failing without progress."""
        self._check_repeated(outcome)
        members = self.membership
        members.drop(outcome.lost)
        self.sizer.set_usable(self.supply.usable)
        self._count_fault()
        members.boot(self.sizer.engines_wanted(self.standby))
        await self.wait_for_minimum()
        fault_step, target, newcomers = await self._roll_back_survivors()
        self._restored_step = target
        self.log.roll_back(target)
        # records the live stream had not delivered before the fault (also any it skipped)
        self.log.merge({"records": await self.calls.history_since(
            members.members[0], self.log.complete_upto)}, complete=True)
        self.log.event(EventKind.FAULT, step=fault_step, rolled_back_to=target,
                       lost_steps=fault_step - target, lost_slots=[e.slot for e in outcome.lost],
                       hung_slots=[e.slot for e in outcome.hung],
                       world_size=len(members.members))
        return newcomers

    def _check_repeated(self, outcome: faults.Outcome) -> None:
        """Raise RepeatedFailure when `outcome` failed as the last fault did, with no step
        made since and no engine lost either time (a local error taken for a peer's)."""
        signature = outcome.signature()
        if signature is not None and signature == self._last_signature \
                and self.log.step <= self._restored_step:
            raise RepeatedFailure(*outcome.collective[0])
        self._last_signature = signature

    def _count_fault(self) -> None:
        if self.log.step > self._restored_step:
            self._faults_without_progress = 0
        self._faults_without_progress += 1
        if self._faults_without_progress > faults.MAX_SLOT_FAULTS * max(1, self.supply.max_size):
            raise RuntimeError("the run keeps failing without making progress; see run.logs()")

    async def resume(self) -> set:
        """After members left without a fault (a drain): wait for replacements below --min,
        then name the engines that receive the state (survivors keep theirs; with none left,
        the newest checkpoint, which the drain wrote, is loaded)."""
        await self.wait_for_minimum()
        _, _, newcomers = await self._roll_back_survivors()
        return newcomers

    async def wait_for_minimum(self) -> None:
        """With fewer than --min survivors, wait (visibly) for replacements to join; a stop
        request ends the wait (BelowMinimum: the run stops)."""
        needed = max(self.supply.min_size, 1) - len(self.membership.members)
        if needed <= 0:
            return
        self.log.event(EventKind.WARNING, message=f"{len(self.membership.members)} engine(s) left, "
                       f"below the minimum {self.supply.min_size}: waiting up to "
                       f"{faults.MIN_WAIT_TIMEOUT:.0f} s for replacements")
        deadline = time.monotonic() + faults.MIN_WAIT_TIMEOUT
        if not await self.membership.wait_for_joiners(
                needed, self.sizer.engines_wanted(self.standby), deadline, self.poll,
                stopped=lambda: self.sizer.stop_requested):
            if self.sizer.stop_requested:
                raise BelowMinimum("stopped while waiting for replacements below --min "
                                   f"{self.supply.min_size}")
            why = ("no slot is left to start one on (see the slot events)"
                   if self.membership.hopeless() else
                   f"no replacement started within {faults.MIN_WAIT_TIMEOUT:.0f} s")
            raise BelowMinimum(f"stopped: fewer than --min {self.supply.min_size} engines and "
                               f"{why}; resume later with --resume")

    async def _roll_back_survivors(self) -> tuple[int, int, set]:
        """roll_back, dropping engines that die meanwhile (a fault during recovery)."""
        while True:
            try:
                return await self.roll_back()
            except Exception:
                if not self.membership.drop_dead():
                    raise
                await self.wait_for_minimum()

    async def roll_back(self) -> tuple[int, int, set]:
        """Bring every member to one consistent state; returns (step the fault hit, step
        restored, engine ids to receive it by broadcast). The survivors hold the same
        committed step (engine.group.vote), which stays as it is; without survivors, the newest
        checkpoint is loaded on rank 0."""
        survivors = list(self.membership.members)
        held = await self.calls.progress(survivors) if survivors else []
        joining = self.membership.admit_joining()  # after the look: a retry must not count them
        # an engine the fault caught while it received the state holds part of it: it
        # receives the state again (engine.group.state_transfer's `into`)
        receivers = {e.engine_id for e, h in zip(survivors, held)
                     if not h["holds_state"]} | {e.engine_id for e in joining}
        held = [h for h in held if h["holds_state"]]
        if held:
            steps = {h["step"] for h in held}
            if len(steps) == 1:
                step = steps.pop()
                return step + any(h["in_flight"] for h in held), step, receivers
            # the vote rules this out; should it happen, a checkpoint is still consistent
            self.log.event(EventKind.WARNING,
                           message=f"survivors disagree on the step ({sorted(steps)})")
            reached = max(steps)
        else:
            reached = self.log.step
        if ckpt.latest_checkpoint(self.checkpoint_dir) is None \
                and sharded_checkpoint.latest(self.checkpoint_dir) is None:
            raise RuntimeError("the engines that held the run's state were lost before its "
                               "first checkpoint; start the run again")
        members = self.membership.members
        loaded = await self.calls.load_state(members[0], self.checkpoint_dir)
        self.log.event(EventKind.WARNING, step=loaded["progress"]["step"], message=f"no survivor "
                       f"holds the run's state: restored {loaded['path']}")
        return reached, loaded["progress"]["step"], {e.engine_id for e in members[1:]}
