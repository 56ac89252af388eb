"""Idle pools lend their slots: the last pass over the targets. Pure; no clock, no I/O.

A pool whose notebook has not trained for the admin's ``lend_s`` (a minute by default) and
whose user did not keep its slots (``--no-lend``) is a *lender*: the slots of its target go to
auto runs that want more than their target, one at a time to the one with the fewest slots
per weight (as the fair share fills), up to each run's ceiling and its user's cap; a run that
reports its speed borrows only a slot that makes it faster (:mod:`.value`). What nobody
borrows the lender keeps, with its engines up, so a start that finds its slots still there is
as fast as before.

When the lender trains again it is no longer a lender: the fair share gives its slots back, the
borrowers hand them over at their next step boundary and the lender's engines start on them.

Lending never admits a run: a lender's min stays counted when the fair share admits runs, so a
lent slot only ever lets a run that already trains grow above its own min, and the slot comes
back without breaking anyone's min.
"""
from __future__ import annotations

from typing import Protocol

from .speed import Speed


class Demand(Protocol):
    """What the lending pass reads of a run's :class:`.fairshare.Demand`."""

    run: str
    user: str
    arrival: int
    weight: float
    auto: bool
    lends: bool
    speed: Speed | None


def lend(admitted: list[Demand], targets: dict[str, int], ceiling: dict[str, int],
         caps: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """The targets after lenders lent what auto runs want, and how many slots each lent.

    Args:
        admitted: the admitted runs (``Demand.lends``: the run lends its slots now).
        targets: run -> target after the fair share (and the value pass); ceiling: run -> the
            most it may hold; caps: user -> the most slots all of a user's runs may hold.
    Returns:
        (run -> target, lender -> slots lent); the targets sum to what they summed to before,
        within each ceiling and cap. The latest lender lends first.
    """
    lenders = sorted((d for d in admitted if d.lends and targets[d.run] > 0),
                     key=lambda d: -d.arrival)
    if not lenders:
        return dict(targets), {}
    targets = dict(targets)
    per_user: dict[str, int] = {}
    for d in admitted:
        per_user[d.user] = per_user.get(d.user, 0) + targets[d.run]
    lent: dict[str, int] = {}
    for lender in lenders:
        while targets[lender.run] > 0:
            borrower = _borrower(admitted, targets, ceiling, per_user, caps, lender.user)
            if borrower is None:
                break
            targets[lender.run] -= 1
            targets[borrower.run] += 1
            per_user[lender.user] -= 1
            per_user[borrower.user] += 1
            lent[lender.run] = lent.get(lender.run, 0) + 1
    return targets, lent


def _borrower(admitted: list[Demand], targets: dict[str, int], ceiling: dict[str, int],
              per_user: dict[str, int], caps: dict[str, int], lender: str) -> Demand | None:
    """The auto run below its ceiling with the fewest slots per weight (the earlier arrival on a
    tie) whose user may hold one more slot (moving one within a user changes nothing) and,
    if it reports its speed, that one more slot makes faster."""
    def may(d: Demand) -> bool:
        cap = caps.get(d.user)
        n = targets[d.run]
        return ((cap is None or d.user == lender or per_user[d.user] < cap)
                and (d.speed is None or d.speed.at(n + 1) > d.speed.at(n)))
    open_ = [d for d in admitted
             if d.auto and not d.lends and targets[d.run] < ceiling[d.run] and may(d)]
    return min(open_, key=lambda d: (targets[d.run] / d.weight, d.arrival), default=None)
