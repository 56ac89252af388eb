"""Sizing: pure decisions about a run's world size. No engines, no I/O, no clock of its own.

Every wish for a size is a :class:`SizeRequest` from some :class:`SizePolicy` — the user (the
slider, the REST API, ``run.resize``), a schedule (``--resize-at``), and later an autoscaler or a
scheduler's preemption. The :class:`Sizer` turns them into the decisions the generation driver
acts on: the requested size (the newest immediate request wins; a scheduled one takes effect
exactly after its step), the step after which the current generation should end, and how many
engines the run wants set up (members plus ready spares).

The :class:`Sizer` is the only writer of the requested size, the schedule and the stop request.
"""
from __future__ import annotations

import abc
import bisect
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..pool.lease import SlotLease

# requests closer than this are one (a slider's drag, whatever front end sends it): no engine
# boots, and no generation ends, for a size overridden a moment later. The one coalescing window
# of a resize; the front ends only debounce their slider.
COALESCE_S = 0.15


@dataclass(frozen=True)
class SizeRequest:
    """A wish for world size `size`, now (`at_step` None) or exactly after step `at_step`.

    `time` is the wall time (s since the epoch) the wish was made: a resize's latency is
    measured from it. `source` names the policy ("user", "schedule", ...).
    """

    size: int
    at_step: int | None = None
    time: float = 0.0
    source: str = "user"


class SizePolicy(abc.ABC):
    """A source of size requests.

    The generation driver calls :meth:`requests` at every look at a running generation (every
    ``driver.POLL`` s), at each step boundary and whenever a request is queued, and feeds what
    it returns to the run's :class:`Sizer`. A policy that reacts to the outside world (free
    GPUs, a preemption notice) decides here and returns a request only when its wish changes
    (requests reset the coalescing window); one driven by calls (:class:`UserRequests`) hands
    over what was queued.
    """

    @abc.abstractmethod
    def requests(self, step: int, now: float) -> list[SizeRequest]:
        """The requests made since the last call (`step`: the newest completed step)."""


class UserRequests(SizePolicy):
    """Requests from the user (slider, REST API, ``run.resize``), queued on the owner thread."""

    def __init__(self):
        self._queue: list[SizeRequest] = []

    def add(self, request: SizeRequest) -> None:
        self._queue.append(request)

    def requests(self, step: int, now: float) -> list[SizeRequest]:
        queued, self._queue = self._queue, []
        return queued


class Schedule(SizePolicy):
    """Resizes fixed before training starts: (at_step, size) pairs."""

    def __init__(self, pairs: list[tuple[int, int]]):
        self._pending = [SizeRequest(size, at_step=at, source="schedule") for at, size in pairs]

    def requests(self, step: int, now: float) -> list[SizeRequest]:
        pending, self._pending = self._pending, []
        return pending


class LeasePolicy(SizePolicy):
    """The size follows the pool's lease: the training slots it keeps (pool.lease).

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


@dataclass(frozen=True)
class Change:
    """The size decided at a step boundary: `target` engines; `requested_time` is when the
    wish was made (None: no wish to time); `scheduled` when a schedule entry fell due."""

    target: int
    requested_time: float | None
    scheduled: bool


class Sizer:
    """The run's size decisions.

    Args:
        size: the starting world size (also the first requested size).
        min_size: the pool's lower bound (a run waits for replacements below it).
        usable: slots the run may use (the pool's upper bound minus excluded slots).
    """

    def __init__(self, size: int = 0, min_size: int = 1, usable: int = 1):
        self.begin(size, min_size, usable)
        self.stop_requested = False
        self._schedule: list[tuple[int, int]] = []  # (at_step, size), soonest first
        self._request_time: float | None = None  # of the newest immediate request not yet met
        self._last_request = float("-inf")  # monotonic time of the newest request
        self._burst = False  # the newest request came within COALESCE_S of the one before

    # ------------------------------------------------------------------ inputs

    def begin(self, size: int, min_size: int, usable: int, grow_in_parts: bool = False) -> None:
        """The run starts at `size` within [min_size, usable] (once its pool is known).
        `grow_in_parts`: a grow takes the engines that are ready as they come (engines whose
        start may wait without bound, such as batch jobs in a scheduler's queue, or an auto
        run's) rather than all at once; the driver keeps it current (auto mode may change)."""
        self.requested, self.min_size, self.usable = size, min_size, usable
        self.grow_in_parts = grow_in_parts

    def submit(self, request: SizeRequest, now: float) -> None:
        """Take a request (`now`: monotonic seconds, for coalescing). An immediate request
        replaces the requested size (newest wins); a scheduled one joins the schedule as
        given (the run validated it) and is bounded when it falls due."""
        if request.at_step is None:
            self.requested = self._bounded(request.size)
            self._request_time = request.time
        else:
            bisect.insort(self._schedule, (request.at_step, request.size))
        if now != self._last_request:  # requests taken together are one already
            self._burst = not self.settled(now)
        self._last_request = now

    def _bounded(self, size: int) -> int:
        return max(1, size)

    @property
    def target(self) -> int:
        """The size the run heads for now: the requested size within the usable slots (a
        slot left out for a cooldown lowers it until the slot is back)."""
        return max(1, min(self.requested, self.usable))

    def target_after(self, end_at: int) -> int:
        """The size the run heads for once the generation ends after step `end_at` (0: the
        current step): the last scheduled size due by then, else :attr:`target`. Changes
        nothing (:meth:`due` applies it)."""
        due = [size for at_step, size in self._schedule if end_at and at_step <= end_at]
        return max(1, min(self._bounded(due[-1]), self.usable)) if due else self.target

    def take(self, policies: list[SizePolicy], step: int, now: float) -> list[SizeRequest]:
        """Submit every policy's new requests; returns them."""
        new = [r for p in policies for r in p.requests(step, now)]
        for request in new:
            self.submit(request, now)
        return new

    def stop(self) -> None:
        """The run should stop after the current step."""
        self.stop_requested = True

    def set_usable(self, usable: int) -> None:
        """The slots the run may use now (fewer while slots are left out): the target follows;
        the requested size is kept, so the run grows back when they return."""
        self.usable = usable

    def stop_growing_at(self, reached: int) -> None:
        """Growing stopped at `reached` engines (engines failed to start): ask for no more."""
        self.requested = min(self.requested, reached)

    # ------------------------------------------------------------------ decisions

    @property
    def schedule(self) -> list[tuple[int, int]]:
        """Pending scheduled resizes as (at_step, size), soonest first."""
        return list(self._schedule)

    def settled(self, now: float) -> bool:
        """No request for COALESCE_S: a boot now serves the newest wish, not an overridden one."""
        return now - self._last_request >= COALESCE_S

    def end_at(self, world_size: int, ready_spares: int, now: float | None = None) -> int | None:
        """The step after which the running generation should end: 0 for "after the current
        step" (stop, a shrink, or a grow whose engines are ready), the next scheduled step,
        or None (keep training). A grow waits until all its engines are ready, unless the run
        grows in parts. At monotonic time `now`, requests still coming in a burst (each
        within COALESCE_S of the last) change nothing until they settled: a lone request acts
        at once."""
        if self.stop_requested:
            return 0
        if now is not None and self._burst and not self.settled(now):
            return self._schedule[0][0] if self._schedule else None
        missing = self.target - world_size
        if missing < 0 or 0 < missing <= ready_spares or (
                missing > 0 and ready_spares and self.grow_in_parts):
            return 0
        return self._schedule[0][0] if self._schedule else None

    def engines_wanted(self, standby: int) -> int:
        """Engines to keep set up (members and ready spares): the largest size requested now
        or scheduled, at least the minimum, plus `standby`, within the usable slots."""
        wanted = max([self.target, self.min_size] + [size for _, size in self._schedule])
        return min(wanted + standby, self.usable)

    def due(self, step: int, step_time: float) -> Change:
        """The size to train at after `step` (which ended at wall time `step_time`): scheduled
        resizes up to `step` fall due. An immediate request is timed from when it was made, a
        scheduled resize from the end of its step; each time is used once."""
        requested_time, self._request_time = self._request_time, None
        scheduled = False
        while self._schedule and self._schedule[0][0] <= step:
            self.requested = self._bounded(self._schedule.pop(0)[1])
            scheduled = True
        if scheduled:
            requested_time = step_time
        return Change(self.target, requested_time, scheduled)
