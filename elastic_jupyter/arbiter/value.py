"""Slots by what they are worth: a second pass over the fair share for runs that report their
speed. Pure; no clock, no I/O.

The promise is a sharing incentive (Themis, Mahajan et al., NSDI 2020): no auto run progresses
slower than it would at its weighted fair share of slots. Above that, a slot goes where it adds
the most relative progress: the marginal gain of Optimus (Peng et al., EuroSys 2018), measured
as this run's speed rather than its goodput (Pollux, Qiao et al., OSDI 2021, also adapts the
batch size; we never change it, so progress per step is the same at every size).

1. Each auto run with a :class:`Speed` gives up the slots of its fair share that do not make it
   faster: it keeps the fewest slots (at least its min, and the slots pinned by the no-flap
   rule) at which its speed is at least its speed at its fair share.
2. Those slots, and any the fair share left free, go one at a time to the run whose next slot
   raises its speed the most, relatively, times its weight (a run without a speed counts as
   one that scales linearly), up to each run's max and its user's cap. A slot that would make
   no run faster stays free.

Runs that report no speed, or that scale alike, get exactly the fair share: if every run
scales linearly, step 1 gives up nothing and the fair share leaves nothing free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .speed import Speed


class Demand(Protocol):
    """What the value pass reads of a run's :class:`.fairshare.Demand`."""

    run: str
    user: str
    arrival: int
    min: int
    weight: float
    auto: bool
    pinned: int
    speed: Speed | None


@dataclass(frozen=True)
class Take:
    """A slot the value pass moved (an event of the arbiter's): `run` holds `to` slots instead of
    its fair share, and why."""

    run: str
    fair: int
    to: int
    why: str


def by_value(admitted: list[Demand], fair: dict[str, int], ceiling: dict[str, int],
             capacity: int, caps: dict[str, int]) -> tuple[dict[str, int], list[Take]]:
    """The targets after the value pass, and what it moved.

    Args:
        admitted: the runs admitted by the fair share (their speeds in ``Demand.speed``).
        fair: run -> its fair-share target (after the no-flap rule); ceiling: run -> the most
            it may hold; capacity: the slots runs may hold; caps: user -> most slots.
    Returns:
        (run -> target, the moves as :class:`Take`), the targets within capacity and caps.
    """
    if not any(d.auto and d.speed is not None for d in admitted):
        return dict(fair), []
    speed = {d.run: _speed_of(d) for d in admitted}
    targets = {d.run: _keep(d, fair[d.run]) if d.auto and d.speed is not None else fair[d.run]
               for d in admitted}
    per_user: dict[str, int] = {}
    for d in admitted:
        per_user[d.user] = per_user.get(d.user, 0) + targets[d.run]
    for _ in range(capacity - sum(targets.values())):
        best = _best(admitted, targets, ceiling, speed, per_user, caps)
        if best is None:
            break
        targets[best.run] += 1
        per_user[best.user] += 1
    takes = [Take(d.run, fair[d.run], targets[d.run], _why(d, fair[d.run], targets[d.run]))
             for d in admitted if targets[d.run] != fair[d.run]]
    return targets, takes


def _speed_of(d: Demand) -> Speed:
    """The run's speed; a run without one scales linearly (so it is filled as fair share does)."""
    return d.speed if d.speed is not None else Speed(((1, 1.0),))


def _keep(d: Demand, fair: int) -> int:
    """The fewest slots at which the run is as fast as at its fair share: at least its min and
    the slots of its fair share the no-flap rule pins."""
    assert d.speed is not None
    goal = d.speed.at(fair)
    n = min(fair, max(d.min, min(d.pinned, fair)))
    while n < fair and d.speed.at(n) < goal:
        n += 1
    return n


def _best(admitted: list[Demand], targets: dict[str, int], ceiling: dict[str, int],
          speed: dict[str, Speed], per_user: dict[str, int],
          caps: dict[str, int]) -> Demand | None:
    """The run whose next slot adds the most relative speed, weighted; None when no slot adds
    any. Ties go to the earlier arrival."""
    best, gain = None, 0.0
    for d in sorted(admitted, key=lambda d: d.arrival):
        n = targets[d.run]
        cap = caps.get(d.user)
        if n >= ceiling[d.run] or (cap is not None and per_user[d.user] >= cap):
            continue
        now = speed[d.run].at(n)
        g = d.weight * (speed[d.run].at(n + 1) / now - 1) if now > 0 else float("inf")
        if g > gain:
            best, gain = d, g
    return best


def _why(d: Demand, fair: int, to: int) -> str:
    s = _speed_of(d)
    verb = "gives up" if to < fair else "takes"
    return (f"{d.run} {verb} {abs(to - fair)} slot(s) of its fair share {fair}: "
            f"speed {s.at(fair):.3g} at {fair}, {s.at(to):.3g} at {to}")
