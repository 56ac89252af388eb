"""Slot accounting: which slots an engine may start on now.

A slot is a place for one engine (a GPU, a share of the CPUs, a host's index, a batch job).
A slot is *used* while its engine runs, *busy* while one starts or stops there, *starting*
while one starts (never handed out twice), and *left out* (:class:`Exclusion`) after faults
or failed starts, for a cooldown or for good: a run's Membership decides
(membership.SlotHealth). In lease mode only the slots the machine's arbiter leased count, less
those it wants back. :class:`Slots` is the only writer of these sets (owner loop).
"""
from __future__ import annotations

import collections
import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Protocol

from ..config import UsageError


@dataclass(frozen=True)
class Exclusion:
    """Why a slot is left out of engine starts, and until when.

    Attributes:
        reason: one line, such as "3 faults within 60 s".
        until: wall time (s since the epoch) the slot comes back; None: it stays out.
    """

    reason: str
    until: float | None = None

    def describe(self, now: float) -> str:
        if self.until is None:
            return f"{self.reason}; stays out"
        return f"{self.reason}; back in {max(0.0, self.until - now):.0f} s"


def free_slots(max_size: int, used: set, excluded: set, k: int) -> list[int]:
    """The `k` slots the next engines take: the lowest that are neither used nor left out.
    Raises UsageError when fewer are free."""
    free = [s for s in range(max_size) if s not in used and s not in excluded]
    if len(free) < k:
        raise UsageError(f"no free slot: the pool has {max_size} slots"
                         + (f", {len(excluded)} left out" if excluded else ""))
    return free[:k]


class Grant(Protocol):
    """What slot accounting reads of the pool's lease (:class:`~.lease.SlotLease`)."""

    @property
    def leased(self) -> list[int]: ...

    @property
    def leaving(self) -> set[int]: ...


class Slots:
    """The pool's slots: used, busy, starting, left out, and in lease mode leased (owner loop).

    Args:
        max_size: the pool's --max: slots are 0 .. max_size - 1 outside lease mode.
        lease: the pool's lease (None outside lease mode): only its slots count.
        in_use: returns the slots of the pool's engines now.
    """

    def __init__(self, max_size: int, lease: Grant | None, in_use: Callable[[], set[int]]):
        self.max_size, self.lease, self._in_use = max_size, lease, in_use
        self._exclusions: dict[int, Exclusion] = {}  # slot -> why and until when it is out
        self._starting: set[int] = set()  # slots of engines starting (never handed out twice)
        self._stopping: collections.Counter[int] = collections.Counter()  # engines stopping

    @property
    def lease_mode(self) -> bool:
        """Whether the slots are the machine's, leased by its arbiter."""
        return self.lease is not None

    @property
    def excluded(self) -> dict[int, Exclusion]:
        """Slots left out now (an exclusion whose cooldown ended is not)."""
        now = time.time()
        return {slot: x for slot, x in self._exclusions.items()
                if x.until is None or x.until > now}

    @property
    def usable(self) -> int:
        """Slots not left out: the most engines the pool could run."""
        return self.max_size - len(self.excluded)

    @property
    def busy(self) -> set[int]:
        """Slots whose engine starts or stops now."""
        return self._starting | set(self._stopping)

    def exclude(self, slot: int, reason: str, until: float | None = None) -> None:
        """Leave `slot` out of engine starts until the wall time `until` (None: for good)."""
        self._exclusions[slot] = Exclusion(reason, until)

    def readmit(self, slot: int) -> None:
        """Take `slot` back now."""
        self._exclusions.pop(slot, None)

    def leaving(self) -> set[int]:
        """Slots whose engines should go (lease mode; else none): those the arbiter wants
        back, and any no longer leased to the pool (the arbiter lost its state and leased
        others)."""
        if self.lease is None:
            return set()
        leased = set(self.lease.leased)
        return self.lease.leaving | {s for s in self._in_use() if s not in leased}

    def startable(self) -> int:
        """How many engines could start now: on free slots (lease mode: leased slots that no
        engine uses and the arbiter does not want back)."""
        if self.lease is None:  # a slot whose engine still starts is not free
            taken = self._in_use() | self._starting
            return self.usable - len(taken - set(self.excluded))
        return len(self._free_leased())

    def next_free(self, k: int) -> list[int]:
        """The slots the next `k` started engines get (fewer when fewer are free)."""
        for n in range(k, 0, -1):
            try:
                return self.free(n)
            except UsageError:
                continue
        return []

    def free(self, k: int) -> list[int]:
        """The `k` slots the next engines take. Raises UsageError when fewer are free."""
        if self.lease is not None:
            free = self._free_leased()
            if len(free) < k:
                raise UsageError(f"no free slot: the arbiter leased this pool "
                                 f"{len(self.lease.leased)} slot(s), {len(free)} free")
            return free[:k]
        # starts under way (a run's boots of batch jobs run side by side) keep their slots
        return free_slots(self.max_size, self._in_use() | self._starting,
                          set(self.excluded), k)

    def _free_leased(self) -> list[int]:
        assert self.lease is not None
        used = self._in_use() | self.busy | set(self.excluded)
        leaving = self.leaving()
        return [s for s in self.lease.leased if s not in used and s not in leaving]

    @contextlib.contextmanager
    def starting(self, slots: list[int]) -> Iterator[None]:
        """Engines start on `slots` within this block: busy and not free meanwhile."""
        self._starting.update(slots)
        try:
            yield
        finally:
            self._starting.difference_update(slots)

    def stopping(self, slots: Iterable[int]) -> None:
        """Engines stop on `slots` from now until :meth:`stopped` (once each: a slot whose
        engine stopped may start and stop another meanwhile, each counted)."""
        self._stopping.update(slots)

    def stopped(self, slots: Iterable[int]) -> None:
        self._stopping.subtract(slots)
        self._stopping = +self._stopping  # drop the slots no engine stops on any more
