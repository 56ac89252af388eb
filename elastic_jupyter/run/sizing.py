"""Sizing: pure decisions about a run's world size. No engines, no I/O, no clock of its own.

Every wish for a size is a :class:`SizeRequest` from some :class:`SizePolicy` — the user (the
slider, the REST API, ``run.resize``), a schedule (``--resize-at``), and later an autoscaler or a
scheduler's preemption. The :class:`Sizer` turns them into decisions: at each of the driver's
looks at a running generation it takes what the driver sees (a :class:`Look`) and returns one
frozen :class:`Decision` — the size the run heads for, the step after which the generation ends,
how many engines to keep set up, whether to boot and trim now — which the driver executes; at
the generation's end :meth:`Sizer.due` applies the size due (a :class:`Change`). The requested
size follows the newest immediate request; a scheduled one takes effect exactly after its step.

The growth policy (when a grow ends the generation, by how many engines it grows, how many it
keeps set up) lives here and nowhere else. The :class:`Sizer` is the only writer of its
attributes (a test holds that): the requested size, the schedule, the usable slots and the
stop request.

The shape of a decision as a value follows Ray Train v2's scaling policies
(``ray/train/v2/_internal/execution/scaling_policy/``), whose ``make_decision_*`` return a
``ScalingDecision`` the controller executes.
"""
from __future__ import annotations

import abc
import bisect
import time
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class Look:
    """What the driver sees of its run at one look, the input of :meth:`Sizer.look`.

    Attributes:
        step: the newest completed step.
        world_size: the members training now.
        ready_spares: engines set up outside the group, ready to join.
        usable: slots the run may use now (the pool's upper bound minus slots left out).
        grow_in_parts: a grow takes the engines that are up as they come rather than all at
            once: batch jobs may wait in a scheduler's queue without bound, and an auto run
            takes what the machine's arbiter grants (auto mode may be turned on at any time).
        gave_up: engines failed to start too often: ask for no more than `world_size`.
        swappable: members sit on slots the machine's arbiter wants back, and ready spares can
            take them over at a step boundary.
        training: the run is training (engines may be booted for it).
        now: monotonic seconds (requests coalesce by it).
    """

    step: int
    world_size: int
    ready_spares: int
    usable: int
    grow_in_parts: bool
    gave_up: bool
    swappable: bool
    training: bool
    now: float


@dataclass(frozen=True)
class Decision:
    """One look's decision, which the driver executes; the run log records it when it differs
    from the one before (`requests` aside, which are logged as they come).

    Attributes:
        target: the size the run heads for now.
        end_at: the step after which the running generation ends (0: after the current step;
            None: train on).
        size_after: the size once the generation ends after `end_at` (scheduled resizes due by
            then count); `target` when the generation trains on.
        wanted: engines to keep set up, members and ready spares: boot up to it, trim beyond.
        boot: boot and trim to `wanted` at this look; False while requests still come in a
            burst (no engine boots for a size a slider overrides a moment later) or once the
            run stopped training.
        swap: the generation ends only to move ranks off slots the machine's arbiter wants
            back (the size stays).
        stop: a stop was requested: the run ends after the current step.
        leavers: the ranks named to go when the generation ends (a sharded run's hand their
            rows over first); the sizer decides how many, the driver's membership which
            (:meth:`with_leavers`).
        requests: the requests this look took.
    """

    target: int
    end_at: int | None
    size_after: int
    wanted: int
    boot: bool
    swap: bool
    stop: bool
    leavers: tuple[int, ...] = ()
    requests: tuple[SizeRequest, ...] = field(default=(), compare=False)

    def with_leavers(self, leavers: list[int]) -> Decision:
        """This decision with the ranks that go named (the membership's choice)."""
        return Decision(self.target, self.end_at, self.size_after, self.wanted, self.boot,
                        self.swap, self.stop, tuple(leavers), self.requests)

    def describe(self) -> str:
        """One line for the run log."""
        end = {None: "train on", 0: "after this step"}.get(self.end_at, f"after {self.end_at}")
        return (f"sizing: target {self.target}, end {end}, then {self.size_after}, "
                f"{self.wanted} set up{', boot' if self.boot else ''}"
                f"{', swap' if self.swap else ''}{', stop' if self.stop else ''}"
                f"{f', leavers {list(self.leavers)}' if self.leavers else ''}")


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
        `grow_in_parts`: as :class:`Look` has it, until the first look."""
        self.requested, self.min_size, self.usable = size, min_size, usable
        self._grow_in_parts = grow_in_parts

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

    def look(self, policies: list[SizePolicy], look: Look, standby: int) -> Decision:
        """The decision of one look at a running generation (or at the run's setup): take the
        policies' new requests, then decide from what the driver sees (`look`) with `standby`
        engines kept set up besides the members. Call on the owner loop at every look and
        when a request is queued; the driver executes what it returns."""
        requests = tuple(self.take(policies, look.step, look.now))
        self.usable = look.usable
        self._grow_in_parts = look.grow_in_parts
        if look.gave_up:
            self.stop_growing_at(look.world_size)
        end_at = self.end_at(look.world_size, look.ready_spares, look.now)
        swap = end_at is None and look.swappable
        if swap:
            end_at = 0
        return Decision(
            target=self.target, end_at=end_at,
            size_after=self.target if end_at is None else self.target_after(end_at),
            wanted=self.engines_wanted(standby), boot=self.settled(look.now) and look.training,
            swap=swap, stop=self.stop_requested, requests=requests)

    def reachable(self, target: int, world_size: int, ready_spares: int, scheduled: bool
                  ) -> int:
        """The size a step boundary grows to when `target` is due: all of it where the run
        grows at once, or where the resize was `scheduled` (exact: the ranks wait for its
        engines); else `world_size` plus the `ready_spares`, the rest when they are up."""
        if self._grow_in_parts and not scheduled and target > world_size:
            return min(target, world_size + ready_spares)
        return target

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
                missing > 0 and ready_spares and self._grow_in_parts):
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
