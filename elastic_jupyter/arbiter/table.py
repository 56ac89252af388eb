"""The slot table: the machine's slots, the runs that want them and the leases they hold.

One :class:`SlotTable` lives in the arbiter process, which serves every request on one thread;
it is the only writer of leases and demands, so no slot is ever leased twice. Every change is
saved to a state file before the request is answered (written aside and renamed), and a new
arbiter loads it: leases outlive an arbiter restart.

Leases are held by a run; a run is held by a process (its kernel), known by pid and start time
(a reused pid has another start time). When that process is gone the run and its leases go.

A run's training slots follow its target (:mod:`.fairshare`). A slot the run should give back
is named in ``give_back``; the run gives it back at its next step boundary (:meth:`release`).
Slots beyond the target are *standby*: leased only from slots nobody else wants, named in
``revoke`` as soon as someone does, and turned into training slots when the run's own target
grows.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

from .fairshare import Allocation, Demand, allocate
from .loans import Loans
from .machine_view import MachineView, machine_view
from .speed import Speed
from .state_file import StateFile

MAX_EVENTS = 50  # undelivered events kept per run
MAX_WEIGHT = 1e6  # a run's weight: finite, so shares per weight stay comparable


class ArbiterError(ValueError):
    """A request the arbiter refuses; the message says why and what to do."""


class UnknownRun(ArbiterError):
    """The run is not registered (the arbiter lost its state, or the run ended): register
    it again."""

    code = "unknown_run"  # how the reply tells the client, which raises this class again


@dataclass
class Run:
    """A run as the arbiter knows it (see :class:`~.fairshare.Demand` for the bounds)."""

    id: str
    name: str
    user: str
    uid: int
    pid: int
    start_time: float
    notebook: str
    arrival: int
    min: int
    max: int
    weight: float
    auto: bool
    wanted: int
    standby: int
    since: float
    active: float  # wall time it last said it trains (or registered, or waited for its min)
    engines: dict = field(default_factory=dict)  # slot (str) -> engine pid, as reported
    events: list = field(default_factory=list)  # not yet delivered
    training: bool = True  # as of its last poll: an auto run that does not train wants its min
    speed: list = field(default_factory=list)  # [[world size, speed], ...] as last reported
    lend: bool = True  # its slots may be lent while it does not train (--no-lend: False)


@dataclass
class Lease:
    """`slot` held by run `run` since `since` (wall time); `standby`: not training."""

    slot: int
    run: str
    since: float
    standby: bool = False


class SlotTable:
    """The machine's slots and leases.

    Args:
        slots: the machine's slot ids (GPU indices, or CPU slot numbers).
        path: the state file (loaded if present).
        cap: user -> the most slots all of that user's runs may hold (None: no cap).
        weights: user -> weight in the fair share (absent: 1).
        hold_s: a slot that moved is not taken again for this long (no flapping).
        idle_s: a run that has not trained for this long gives its slots back.
        lend_s: a run that has not trained for this long lends its slots (:mod:`.lending`).
        alive: (pid, start_time) -> whether that process still runs.
        by_value: give slots by the speeds runs report (arbiter/value.py); else fair share.
    """

    def __init__(self, slots: list[int], path: str | None, cap=None,
                 weights: dict | None = None, hold_s: float = 30.0, idle_s: float = 1800.0,
                 alive=None, by_value: bool = False, lend_s: float = 60.0):
        self.slots = list(slots)
        self.state_file = StateFile(path)
        self.cap = cap or (lambda user: None)
        self.weights = dict(weights or {})
        self.hold_s, self.idle_s, self.by_value, self.lend_s = hold_s, idle_s, by_value, lend_s
        self.alive = alive or (lambda pid, start: True)
        self.runs: dict[str, Run] = {}
        self.leases: dict[int, Lease] = {}
        self.outside: dict[int, str] = {}  # slot -> who holds it outside the arbiter
        self.allocation = Allocation()
        self._arrivals = 0
        self._freed: dict[int, tuple] = {}  # slot -> (run id, name) that gave it back, for events
        self._saved: tuple | None = None  # the fingerprint of what the state file holds
        self._told: dict[str, int] = {}  # run -> the target the value pass last told it of
        self.loans = Loans()  # which slot an idle pool lent to whom
        self._load()

    # ------------------------------------------------------------------ requests

    def register(self, uid: int, user: str, pid: int, start_time: float, run: str, *,
                 name: str = "", notebook: str = "", min: int = 1, max: int = 1,
                 weight: float = 1.0, auto: bool = False, wanted: int | None = None,
                 standby: int = 0, active: bool = True, engines: dict | None = None,
                 lend: bool = True, now: float | None = None) -> dict:
        """A run states (or restates) its demand, whether it trains and where its engines run
        (`active`, `engines` as in :meth:`poll`; a run registering again after the arbiter
        lost its state gets the free slots its engines run on first) and whether its slots
        may be lent while it does not train (`lend`). Returns its grant (:meth:`grant`).
        Raises ArbiterError for bounds that do not fit, or a run of another user."""
        now = time.time() if now is None else now
        _check_demand(min, max, weight, wanted, standby)
        cap = self.cap(user)
        if min > len(self.slots):
            raise ArbiterError(f"min {min} exceeds the machine's {len(self.slots)} slot(s)")
        if cap is not None and min > cap:
            raise ArbiterError(f"min {min} exceeds the {cap} slot(s) the machine's admin allows "
                               f"user {user}: ask for --min {cap} or less")
        entry = self.runs.get(run)
        if entry is not None:
            self._owned(entry, uid)
        else:
            self._arrivals += 1
            entry = self.runs[run] = Run(run, name, user, uid, pid, start_time, notebook,
                                         self._arrivals, min, max, weight, auto, min, 0, now,
                                         now)
        entry.pid, entry.start_time = pid, start_time  # the process that asks holds it
        entry.name, entry.notebook = name or entry.name, notebook or entry.notebook
        entry.min, entry.max, entry.weight, entry.auto = min, max, float(weight), bool(auto)
        entry.wanted = min if wanted is None else wanted
        entry.standby, entry.lend = standby, bool(lend)
        entry.active, entry.training = now, bool(active)
        if engines is not None:
            entry.engines = {str(k): int(v) for k, v in engines.items()}
        self._changed(now)
        return self.grant(run, now)

    def poll(self, uid: int, run: str, *, active: bool = True, engines: dict | None = None,
             speed: list | None = None, now: float | None = None) -> dict:
        """A run's regular look (every second or so): it says whether it trains, which
        engine runs on which slot and, once it has trained, its speed by world size
        (:meth:`.speed.Speed.parse`); returns its grant and its undelivered events.
        Raises ArbiterError for a speed that is not one."""
        now = time.time() if now is None else now
        entry = self._run(run, uid)
        if speed is not None:
            _check_speed(speed)
            entry.speed = speed
        if active:
            entry.active = now
        entry.training = active
        if engines is not None:
            entry.engines = {str(k): int(v) for k, v in engines.items()}
        self._changed(now)
        reply = self.grant(run, now)
        reply["events"], entry.events = entry.events, []
        return reply

    def release(self, uid: int, run: str, slots: list[int], now: float | None = None) -> dict:
        """`run` gives these slots back (its engines on them have stopped)."""
        now = time.time() if now is None else now
        entry = self._run(run, uid)
        if len(set(slots)) != len(slots):
            raise ArbiterError(f"slots {slots} name a slot twice")
        for slot in slots:
            lease = self.leases.get(slot)
            if lease is None or lease.run != entry.id:
                raise ArbiterError(f"slot {slot} is not held by run {entry.name or run!r}")
        for slot in slots:
            del self.leases[slot]
            self._freed[slot] = (entry.id, entry.name)
        self.loans.forget(slots)
        self._changed(now)
        return self.grant(run, now)

    def unregister(self, uid: int, run: str, now: float | None = None) -> None:
        """The run ended: every lease it holds is released."""
        self._drop(self._run(run, uid))
        self._changed(time.time() if now is None else now)

    def reap(self, now: float | None = None) -> list[str]:
        """Drop the runs whose process is gone; returns their ids. Called every half second."""
        gone = [r for r in self.runs.values() if not self.alive(r.pid, r.start_time)]
        for entry in gone:
            self._drop(entry)
        if gone:
            self._changed(time.time() if now is None else now)
        return [r.id for r in gone]

    def set_outside(self, outside: dict[int, str], now: float | None = None) -> None:
        """Slots busy with processes the arbiter did not place (slot -> who)."""
        if outside != self.outside:
            self.outside = dict(outside)
            self._changed(time.time() if now is None else now)

    # ------------------------------------------------------------------ answers

    def grant(self, run: str, now: float) -> dict:
        """What `run` holds and should do: ``target`` training slots, the ``slots`` it trains
        on and its ``standby`` slots, ``give_back`` (training slots to release at its next step
        boundary), ``revoke`` (standby slots to release now), ``queued`` (its place in the
        queue, 1 first, or None), ``grantable`` (the most it could get now) and ``lent`` (its
        slots other runs hold while it does not train: slot, to, user)."""
        entry = self.runs[run]
        mine = [lease for lease in self.leases.values() if lease.run == run]
        training = sorted(x.slot for x in mine if not x.standby)
        target = self.allocation.targets.get(run, 0)
        queue = self.allocation.queue
        return {"run": run, "target": target, "slots": training,
                "standby": sorted(x.slot for x in mine if x.standby),
                "give_back": self._give_back(entry, mine, target, now),
                "revoke": sorted(x.slot for x in mine if x.standby and self._revoked(x)),
                "queued": queue.index(run) + 1 if run in queue else None,
                "fair": self.allocation.fair.get(run, 0),
                "grantable": self._grantable(entry, now),
                "lent": [{"slot": slot, "to": self.runs[self.leases[slot].run].name,
                          "user": self.runs[self.leases[slot].run].user}
                         for slot in self.loans.of(run)]}

    def view(self, now: float | None = None) -> MachineView:
        """The machine: every slot with its holder, every run with its demand, target and
        reported speed (:func:`.machine_view.machine_view`)."""
        return machine_view(self, time.time() if now is None else now)

    # ------------------------------------------------------------------ decisions

    def _changed(self, now: float) -> None:
        """Recompute the targets and hand out free slots; save the state when a lease or a
        demand changed (before the reply that tells of it)."""
        self.allocation = allocate(self._demands(now), self._capacity(), self._caps(),
                                   self.weights)
        self._tell_takes()
        self._assign(now)
        self._settle_loans(now)
        saved = self._fingerprint()
        if saved != self._saved:
            self.state_file.save({"arrivals": self._arrivals,
                                  "runs": [asdict(r) for r in self.runs.values()],
                                  "leases": [asdict(x) for x in self.leases.values()],
                                  "loans": self.loans.saved()})
            self._saved = saved

    def _fingerprint(self) -> tuple:
        return (tuple(sorted((x.slot, x.run, x.standby) for x in self.leases.values())),
                tuple(sorted((r.id, r.pid, r.name, r.notebook, r.min, r.max, r.weight, r.auto,
                              r.wanted, r.standby, r.lend) for r in self.runs.values())))

    def _capacity(self) -> int:
        return len([s for s in self.slots if s not in self.outside])

    def _demands(self, now: float) -> list[Demand]:
        demands = []
        for r in self.runs.values():
            training = [x for x in self.leases.values() if x.run == r.id and not x.standby
                        and x.slot not in self.outside]
            idle = now - r.active > self.idle_s  # its pool gives every slot back
            ceiling = r.max if r.training or not r.auto else r.min  # nothing to train on more
            lent = len(self.loans.of(r.id))
            # a pool lends once it has held its slots (not while it waits for them), and goes
            # on lending while it does not train
            lends = (r.lend and not r.training and now - r.active > self.lend_s
                     and (bool(training) or lent > 0 or r.id in self.allocation.lent))
            demands.append(Demand(
                run=r.id, user=r.user, arrival=r.arrival, min=0 if idle else r.min,
                max=0 if idle else ceiling, weight=r.weight, auto=r.auto or idle,
                wanted=r.wanted, held=len(training),
                pinned=sum(1 for x in training if now - x.since < self.hold_s),
                speed=Speed.parse(r.speed) if r.auto and self.by_value else None,
                lends=lends, lent=lent))
        return demands

    def _assign(self, now: float) -> None:
        """Free slots go to runs below their target (earliest arrival first), a run's own
        standby slot first; then to standby wishes, from slots nobody else wants."""
        free = [s for s in self.slots if s not in self.leases and s not in self.outside]
        for r in sorted(self.runs.values(), key=lambda r: r.arrival):
            target = self.allocation.targets.get(r.id, 0)
            mine = [x for x in self.leases.values() if x.run == r.id]
            training = [x for x in mine if not x.standby and x.slot not in self.outside]
            standby = [x for x in mine if x.standby and x.slot not in self.outside]
            for lease in standby[:max(0, target - len(training))]:
                lease.standby, lease.since = False, now  # a standby engine joins: no move
                training.append(lease)
            free.sort(key=lambda s: str(s) not in r.engines)  # where its engines run, first
            while len(training) < target and free:
                slot = free.pop(0)
                giver = self._freed.pop(slot, None)
                training.append(self.leases.setdefault(slot, Lease(slot, r.id, now)))
                self._loan(r, slot, giver)
                self._event(r, slot, giver)
        if any(self._short(r) for r in self.runs.values()):
            return  # someone waits: no slot goes to a standby wish
        for r in sorted(self.runs.values(), key=lambda r: r.arrival):
            have = sum(1 for x in self.leases.values() if x.run == r.id and x.standby)
            while have < r.standby and free and r.id in self.allocation.targets:
                slot = free.pop(0)
                self.leases[slot] = Lease(slot, r.id, now, standby=True)
                have += 1

    def _short(self, r: Run) -> bool:
        held = sum(1 for x in self.leases.values() if x.run == r.id and not x.standby)
        return r.id in self.allocation.queue or held < self.allocation.targets.get(r.id, 0)

    def _revoked(self, lease: Lease) -> bool:
        """A standby slot goes first when any run waits for a slot and none is free."""
        free = [s for s in self.slots if s not in self.leases and s not in self.outside]
        return lease.slot in self.outside or (not free and any(
            self._short(r) for r in self.runs.values() if r.id != lease.run))

    def _give_back(self, entry: Run, mine: list[Lease], target: int, now: float) -> list[int]:
        """The training slots `entry` should release: slots busy outside first, then beyond its
        target those where none of its engines runs yet, then its newest (youngest engines;
        those that moved least recently among them when the no-flap rule keeps some)."""
        training = [x for x in mine if not x.standby]
        busy = [x.slot for x in training if x.slot in self.outside]
        rest = [x for x in training if x.slot not in self.outside]
        unpinned = sorted((x for x in rest if now - x.since >= self.hold_s),
                          key=lambda x: (-x.since, -x.slot))
        pinned = sorted((x for x in rest if now - x.since < self.hold_s),
                        key=lambda x: (x.since, -x.slot))
        order = sorted(unpinned + pinned, key=lambda x: str(x.slot) in entry.engines)  # stable
        return busy + [x.slot for x in order[:max(0, len(rest) - target)]]

    def _grantable(self, entry: Run, now: float) -> int:
        """The most slots `entry` could hold now if it asked for its max (for a slider)."""
        demands = [d if d.run != entry.id else replace(d, wanted=entry.max)
                   for d in self._demands(now)]
        return allocate(demands, self._capacity(), self._caps(),
                        self.weights).fair.get(entry.id, 0)

    def _caps(self) -> dict[str, int]:
        users = {r.user for r in self.runs.values()}
        return {u: c for u in users if (c := self.cap(u)) is not None}

    # ------------------------------------------------------------------ helpers

    def _run(self, run: str, uid: int) -> Run:
        entry = self.runs.get(run)
        if entry is None:
            raise UnknownRun(f"no run {run!r} is known to the arbiter: register it first "
                               "(its kernel may have been restarted)")
        self._owned(entry, uid)
        return entry

    @staticmethod
    def _owned(entry: Run, uid: int) -> None:
        if uid not in (0, entry.uid):
            raise ArbiterError(f"run {entry.name or entry.id!r} belongs to user {entry.user}: "
                               "only its owner (or root) may change it")

    def _drop(self, entry: Run) -> None:
        mine = [s for s, x in self.leases.items() if x.run == entry.id]
        for slot in mine:
            del self.leases[slot]
            self._freed[slot] = (entry.id, entry.name)
        self.loans.forget(mine, run=entry.id)
        del self.runs[entry.id]

    def _loan(self, r: Run, slot: int, giver: tuple | None) -> None:
        """`r` got `slot` from `giver`: a borrower's loan is recorded, a lender's comes back."""
        if self.loans.of(r.id):
            self.loans.returned(r.id, slot)
        elif (giver and giver[0] != r.id and giver[0] in self.allocation.lent
              and r.id in self.allocation.borrowed):
            self.loans.lent(slot, giver[0])

    def _settle_loans(self, now: float) -> None:
        """Loans last while the borrower holds the slot and the lender is not idle past
        idle_s; a run that waits in the queue or for its min starts its lending clock anew
        (it lends once it has held its slots for lend_s without training)."""
        self.loans.keep(lambda slot, lender: (
            lender in self.runs and slot in self.leases and self.leases[slot].run != lender
            and now - self.runs[lender].active <= self.idle_s))
        for r in self.runs.values():
            held = sum(1 for x in self.leases.values() if x.run == r.id and not x.standby)
            waits = held < r.min and not self.loans.of(r.id) and now - r.active <= self.idle_s
            if r.id in self.allocation.queue or waits:  # (idle past idle_s: it gave all back)
                r.active = now

    def _tell_takes(self) -> None:
        """Each run the value pass moves off its fair share hears why, once per change."""
        takes = {t.run: t for t in self.allocation.takes if t.run in self.runs}
        for run, take in takes.items():
            if self._told.get(run) != take.to:
                _note(self.runs[run], {"kind": "value", "why": take.why})
        self._told = {run: t.to for run, t in takes.items()}

    def _event(self, r: Run, slot: int, giver: tuple | None) -> None:
        """`r` grew into `slot`; the run that gave it up (if any, and not `r`) hears where it
        went."""
        _note(r, {"kind": "grew", "slot": slot, "from": giver[1] if giver else None})
        if giver and giver[0] in self.runs and giver[0] != r.id:
            _note(self.runs[giver[0]], {"kind": "gave", "slot": slot, "to": r.name})

    def _load(self) -> None:
        def parse(state: dict) -> tuple:
            return (int(state["arrivals"]), [Run(**r) for r in state["runs"]],
                    [Lease(**x) for x in state["leases"]], Loans(state.get("loans")))
        loaded = self.state_file.load(parse)
        if loaded is None:
            return
        self._arrivals, runs, leases, self.loans = loaded
        now = time.time()
        # when a run last trained is not saved at every poll: the idle clock starts anew,
        # past lend_s for a pool that did not train (a lender goes on lending)
        for r in runs:
            r.active = now - self.lend_s - 1e-3 if not r.training and (
                self.lend_s < self.idle_s) else now
        self.runs = {r.id: r for r in runs}
        self.leases = {x.slot: x for x in leases if x.slot in self.slots and x.run in self.runs}
        self._saved = self._fingerprint()
        self._changed(now)


def _check_demand(min, max, weight, wanted, standby) -> None:
    for label, v in (("min", min), ("max", max), ("standby", standby)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if label == "standby" else 1):
            raise ArbiterError(f"{label} must be a {'non-negative' if label == 'standby' else 'positive'}"
                               f" integer, got {v!r}")
    if min > max:
        raise ArbiterError(f"min {min} exceeds max {max}")
    check_weight(weight)
    if wanted is not None and (isinstance(wanted, bool) or not isinstance(wanted, int)
                               or not min <= wanted <= max):
        raise ArbiterError(f"the size asked for must be an integer in [{min}, {max}], "
                           f"got {wanted!r}")


def _note(r: Run, event: dict) -> None:
    """An event for `r`'s next poll (the newest MAX_EVENTS kept)."""
    r.events = (r.events + [event])[-MAX_EVENTS:]


def _check_speed(speed) -> None:
    try:
        Speed.parse(speed)
    except ValueError as e:
        raise ArbiterError(str(e)) from None


def check_weight(weight) -> None:
    """Raises ArbiterError unless `weight` is a number in (0, MAX_WEIGHT]."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (
            0 < weight <= MAX_WEIGHT):  # (NaN fails too)
        raise ArbiterError(f"weight must be a number in (0, {MAX_WEIGHT:g}], got {weight!r}")
