"""Fair share: how many slots each run on the machine should hold. Pure; no clock, no I/O.

The arbiter calls :func:`allocate` whenever something changes (a run arrives, leaves or changes
its demand, a slot is freed or taken from outside) and hands each run its target. The rules:

- **Admission.** A run trains only once its ``min`` is free. Runs are admitted in arrival
  order (a run that holds slots was admitted before); one whose min does not fit waits in the
  queue, and so does every run behind it (first come, first served: a large min is never
  starved by small ones).
- **Never taken.** A run not in auto mode keeps what it holds; a manual grow takes free slots
  and slots auto runs hold above their fair share. No run is pushed below its min.
- **Weighted max-min fair share** over the rest (progressive filling: the next slot goes to
  the one with the least slots per weight that is below its ceiling; Bertsekas & Gallager,
  *Data Networks*, 2nd ed., sec. 6.5.2), in two levels as in Slurm's fair-share tree: first
  among users, by the admin's user weights, then among each user's runs, by their own
  weights. Starting more runs or raising a run's weight never gains a user more of the
  machine, and what one run of a user cannot take goes to that user's other runs. A
  per-user cap bounds what all of a user's runs hold.
- **No flapping.** A slot that moved less than the hold time ago is not taken again
  (``Demand.pinned``) unless a min needs it.
- **By value** (:mod:`.value`), for auto runs that report their speed: a run gives up the slots
  of its fair share that do not make it faster, and those slots go where they add the most
  relative speed; no auto run is slower than at its fair share.
- **Lending** (:mod:`.lending`): a pool idle for the admin's ``lend_s`` lends the slots of its
  target to auto runs that want more; it gets them back when it trains again.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .lending import lend
from .speed import Speed
from .value import Take, by_value


@dataclass(frozen=True)
class Demand:
    """One run's wish, as the arbiter knows it.

    Attributes:
        run: the run's id; user: its owner's user name; arrival: its queue order (smaller is
            earlier; any comparable number, the arbiter uses its arrival counter).
        min, max: bounds on its training slots (1 <= min <= max).
        weight: its weight among its user's runs (> 0).
        auto: auto mode: its target follows the fair share; else it asks for ``wanted``.
        wanted: the size a manual run asks for (ignored in auto mode).
        held: training slots it holds now (standby slots apart).
        pinned: how many of those moved to it less than the hold time ago.
        speed: its measured speed by world size (None: not reported; see :mod:`.value`).
        lends: it lends its slots now (an idle pool: :mod:`.lending`).
        lent: slots it lent that other runs still hold: they count as held when runs are
            admitted and in a manual run's floor, so they come back when it trains again.
    """

    run: str
    user: str
    arrival: int
    min: int = 1
    max: int = 1
    weight: float = 1.0
    auto: bool = False
    wanted: int = 0
    held: int = 0
    pinned: int = 0
    speed: Speed | None = None
    lends: bool = False
    lent: int = 0


@dataclass
class Allocation:
    """What :func:`allocate` decided.

    Attributes:
        targets: run -> training slots it should hold (absent for queued runs, which hold none).
        queue: runs waiting for their min, first in line first.
        fair: run -> its fair share before the no-flap rule (what the panel shows).
        takes: where the value pass moved slots off the fair share, and why.
        lent: lender -> slots of its target that went to runs that want more;
            borrowed: borrower -> how many of those it got.
    """

    targets: dict[str, int] = field(default_factory=dict)
    queue: list[str] = field(default_factory=list)
    fair: dict[str, int] = field(default_factory=dict)
    takes: list[Take] = field(default_factory=list)
    lent: dict[str, int] = field(default_factory=dict)
    borrowed: dict[str, int] = field(default_factory=dict)


def allocate(demands: list[Demand], capacity: int, caps: dict[str, int] | None = None,
             user_weights: dict[str, float] | None = None) -> Allocation:
    """The target of every run.

    Args:
        demands: every run on the machine.
        capacity: the slots runs may hold (the machine's, less those busy outside and those
            left out).
        caps: user -> most slots all that user's runs may hold (absent: no cap).
        user_weights: user -> weight (absent: 1).
    Returns:
        an :class:`Allocation`; the targets never sum above ``capacity`` unless runs that are
        never taken already hold more than it (slots lost to an outside process).
    """
    caps, user_weights = caps or {}, user_weights or {}
    admitted, queue = _admit(demands, capacity, caps)
    floor = _fit(admitted, {d.run: _floor(d) for d in admitted}, capacity)
    ceiling = {d.run: max(floor[d.run], _ceiling(d)) for d in admitted}
    fair = _fill(admitted, floor, ceiling, capacity, caps, user_weights)
    targets = _hold_pinned(admitted, fair, floor, ceiling, capacity)
    targets, takes = by_value(admitted, targets, ceiling, capacity, caps)
    targets, lent, borrowed = lend(admitted, targets, ceiling, caps, user_weights)
    return Allocation(targets=targets, queue=[d.run for d in queue], fair=fair, takes=takes,
                      lent=lent, borrowed=borrowed)


def _floor(d: Demand) -> int:
    """The least a run holds: its min, and for a manual run what it holds or lent (never taken)
    unless it asks for less."""
    return d.min if d.auto else max(d.min, min(d.held + d.lent, d.wanted))


def _ceiling(d: Demand) -> int:
    return d.max if d.auto else max(d.min, min(d.wanted, d.max))


def _admit(demands: list[Demand], capacity: int, caps: dict[str, int]):
    """(admitted, queued): holders first, then waiting runs in arrival order while their
    floors fit the machine and their user's cap. A run that waits for the machine holds up
    those behind it; one that waits for its own user's cap holds up nobody else."""
    # a lender's lent slots count as held: lending never costs it its place
    order = sorted(demands, key=lambda d: (d.held + d.lent == 0, d.arrival))
    admitted, queued, used, blocked = [], [], 0, False
    per_user: dict[str, int] = {}
    for d in order:
        need = _floor(d)
        cap = caps.get(d.user)
        fits_user = cap is None or per_user.get(d.user, 0) + need <= cap
        fits = not blocked and used + need <= capacity
        if d.held + d.lent > 0 or (fits and fits_user):
            admitted.append(d)
            used += need
            per_user[d.user] = per_user.get(d.user, 0) + need
        else:
            queued.append(d)
            blocked = blocked or not fits
    return admitted, queued


def _fit(admitted: list[Demand], floor: dict[str, int], capacity: int) -> dict[str, int]:
    """Floors that exceed the slots (a holder's min with slots lost to an outside process)
    come down, latest arrival first, to what each run holds: nobody is promised a slot that
    does not exist."""
    over = sum(floor.values()) - capacity
    for d in sorted(admitted, key=lambda d: -d.arrival):
        if over <= 0:
            break
        cut = min(over, max(0, floor[d.run] - d.held))
        floor[d.run] -= cut
        over -= cut
    return floor


def _fill(admitted: list[Demand], floor: dict[str, int], ceiling: dict[str, int],
          capacity: int, caps: dict[str, int], user_weights: dict[str, float]) -> dict[str, int]:
    """Progressive filling from the floors, in two levels: the slots left go one at a time
    to the user with the fewest per weight below their ceiling (their cap, or what their runs
    can take), then each user's slots to that user's runs the same way by run weight. Ties go
    to whoever holds more (so no slot moves for nothing), then to the earlier arrival."""
    runs: dict[str, list[Demand]] = {}
    for d in admitted:
        runs.setdefault(d.user, []).append(d)
    held = {u: sum(d.held for d in ds) for u, ds in runs.items()}
    first = {u: min(d.arrival for d in ds) for u, ds in runs.items()}
    weight = {u: user_weights.get(u, 1.0) for u in runs}
    top = {u: min(caps.get(u, capacity), sum(ceiling[d.run] for d in ds))
           for u, ds in runs.items()}
    users = {u: sum(floor[d.run] for d in ds) for u, ds in runs.items()}
    _progressive(users, top, weight, held, first, capacity - sum(users.values()))
    share = dict(floor)
    for u, ds in runs.items():
        _progressive(share, {d.run: ceiling[d.run] for d in ds},
                     {d.run: d.weight for d in ds}, {d.run: d.held for d in ds},
                     {d.run: d.arrival for d in ds}, users[u] - sum(floor[d.run] for d in ds))
    return share


def _progressive(share: dict, top: dict, weight: dict, held: dict, arrival: dict,
                 slots: int) -> None:
    """Give `slots` one at a time to the key of `top` with the least share per weight that is
    below its top (in place)."""
    for _ in range(max(0, slots)):
        open_ = [k for k in top if share[k] < top[k]]
        if not open_:
            return
        k = min(open_, key=lambda k: (share[k] / weight[k], share[k] >= held[k], arrival[k]))
        share[k] += 1


def _hold_pinned(admitted: list[Demand], fair: dict[str, int], floor: dict[str, int],
                 ceiling: dict[str, int], capacity: int) -> dict[str, int]:
    """The no-flap rule: a run above its fair share keeps its pinned slots, unless the free
    slots and the unpinned ones given up do not cover the floors of runs below them."""
    targets = dict(fair)
    # the pinned slots a run above its share would have to give (its unpinned ones go first)
    # (a run above its own ceiling gives that excess back whatever the pins)
    kept = {d.run: max(0, min(d.held, ceiling[d.run]) - fair[d.run] - (d.held - d.pinned))
            for d in admitted if fair[d.run] < d.held}
    kept = {run: k for run, k in kept.items() if k > 0}
    if not kept:
        return targets
    free = capacity - sum(d.held for d in admitted)
    given = sum(d.held - fair[d.run] - kept[d.run] for d in admitted if d.run in kept)
    short = sum(max(0, floor[d.run] - d.held) for d in admitted)
    must = max(0, short - max(free, 0) - given)  # pinned slots the floors still need
    for d in sorted((d for d in admitted if d.run in kept), key=lambda d: -d.arrival):
        take = min(must, kept[d.run])
        must -= take
        targets[d.run] = fair[d.run] + kept[d.run] - take
    # growers get no more than is left: the sum of targets stays within capacity
    over = sum(targets.values()) - capacity
    for d in sorted(admitted, key=lambda d: -d.arrival):
        if over <= 0:
            break
        cut = min(over, max(0, targets[d.run] - max(d.held, floor[d.run])))
        targets[d.run] -= cut
        over -= cut
    return targets
