"""The pool's one contract with whoever trains on it: a :class:`Claimant` (a run, today).

The pool knows nothing of runs: it holds at most one claimant at a time, hands it a resize
while it is active, stops it before the pool stops, and notes the lease's events and warnings
on it (a run shows them in its events and chart).
"""
from __future__ import annotations

from typing import Any, Protocol


class RunMode(Protocol):
    """How a claimant trains (run.memory_bound's MemoryBound)."""

    @property
    def mode(self) -> str:
        """"replicated", or "sharded" and its memory bound: the pool's status shows it."""
        ...


class Claimant(Protocol):
    """Whoever holds the pool (``EnginePool.claim``): a ``TrainingRun``."""

    @property
    def memory(self) -> RunMode:
        """Its mode and memory bound."""
        ...

    @property
    def name(self) -> str:
        """How the pool's messages name it."""
        ...

    @property
    def active(self) -> bool:
        """Whether it still trains (a claimant that ended no longer keeps the pool busy)."""
        ...

    def resize(self, n: int, at_step: int | None = None) -> None:
        """The pool's resize while it is active: its request for world size `n`."""

    def stop(self) -> None:
        """Stop soon (returns at once); the pool stops after it."""

    def wait(self, timeout: float | None = None) -> str:
        """Block until it ended or `timeout` seconds passed; returns its state."""
        ...

    def speed(self) -> list[tuple[int, float]]:
        """(world size, samples per second) at each size it trained at recently (owner loop):
        what the pool reports to the machine's arbiter."""
        ...

    def note_event(self, kind: str, **fields: Any) -> None:
        """Record an event of the pool's (kind "slot" or "warning", with a ``message``) on
        the owner loop."""
