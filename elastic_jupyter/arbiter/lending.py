"""Idle pools lend their slots: the last pass over the targets. Pure; no clock, no I/O.

A pool whose notebook has not trained for the admin's ``lend_s`` (a minute by default) and
whose user did not keep its slots (``--no-lend``) is a *lender*: the slots of its target go to
auto runs that want more than their target, one at a time to the one with the fewest slots
per weight (as the fair share fills: first among users, by their weights, then among a user's
runs), up to each run's ceiling and its user's cap; a run that
reports its speed borrows only a slot that makes it faster (:mod:`.value`). What nobody
borrows the lender keeps, with its engines up, so a start that finds its slots still there is
as fast as before.

When the lender trains again it is no longer a lender: the fair share gives its slots back, the
borrowers hand them over at their next step boundary and the lender's engines start on them.

Lending never admits a run: a lender's lent slots count as held when the fair share admits
runs (``Demand.lent``), so a lent slot only ever lets a run that is admitted grow above its
own min, and the lender keeps its place. An idle auto pool's target is its min and a manual
pool's floor counts its lent slots too, so what a lender lent all comes back when it trains
again, at the borrowers' next step boundary (a floor overrides the hold time).
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
    pinned: int
    lends: bool
    speed: Speed | None


def lend(admitted: list[Demand], targets: dict[str, int], ceiling: dict[str, int],
         caps: dict[str, int], user_weights: dict[str, float]
         ) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """The targets after lenders lent what auto runs want.

    Args:
        admitted: the admitted runs (``Demand.lends``: the run lends its slots now).
        targets: run -> target after the fair share (and the value pass); ceiling: run -> the
            most it may hold; caps: user -> the most slots all of a user's runs may hold;
            user_weights: user -> weight (absent: 1).
    Returns:
        (run -> target, lender -> slots lent, borrower -> slots borrowed); the targets sum to
        what they summed to before, within each ceiling and cap. The latest lender lends
        first; a slot that moved to a lender less than the hold time ago is not lent.
    """
    lenders = sorted((d for d in admitted if d.lends and targets[d.run] > d.pinned),
                     key=lambda d: -d.arrival)
    targets = dict(targets)
    lent: dict[str, int] = {}
    borrowed: dict[str, int] = {}
    if not lenders:
        return targets, lent, borrowed
    per_user: dict[str, int] = {}
    for d in admitted:
        per_user[d.user] = per_user.get(d.user, 0) + targets[d.run]
    for lender in lenders:
        while targets[lender.run] > lender.pinned:
            borrower = _borrower(admitted, targets, ceiling, per_user, caps, user_weights,
                                 lender.user)
            if borrower is None:
                break
            targets[lender.run] -= 1
            targets[borrower.run] += 1
            per_user[lender.user] -= 1
            per_user[borrower.user] += 1
            lent[lender.run] = lent.get(lender.run, 0) + 1
            borrowed[borrower.run] = borrowed.get(borrower.run, 0) + 1
    return targets, lent, borrowed


def _borrower(admitted: list[Demand], targets: dict[str, int], ceiling: dict[str, int],
              per_user: dict[str, int], caps: dict[str, int], user_weights: dict[str, float],
              lender: str) -> Demand | None:
    """As the fair share fills, in two levels: the user with the fewest slots per user weight
    among those with a run that may borrow, then that user's run with the fewest slots per run
    weight (the earlier arrival on a tie). A run may borrow while below its ceiling, in auto
    mode, not lending itself, its user under their cap (a slot moving within one user changes
    nothing) and, if it reports its speed, made faster by one more slot."""
    def may(d: Demand) -> bool:
        cap = caps.get(d.user)
        n = targets[d.run]
        return (d.auto and not d.lends and n < ceiling[d.run]
                and (cap is None or d.user == lender or per_user[d.user] < cap)
                and (d.speed is None or d.speed.at(n + 1) > d.speed.at(n)))
    open_ = [d for d in admitted if may(d)]
    if not open_:
        return None
    first = {d.user: min(x.arrival for x in open_ if x.user == d.user) for d in open_}
    user = min(first, key=lambda u: (per_user[u] / user_weights.get(u, 1.0), first[u]))
    return min((d for d in open_ if d.user == user),
               key=lambda d: (targets[d.run] / d.weight, d.arrival))
