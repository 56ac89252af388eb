"""The machine as the arbiter shows it (its ``view`` op): every slot with its holder, every run
with its demand, target, reported speed and loans. Read-only over the slot table."""
from __future__ import annotations

from typing import Any, Protocol, TypedDict

from .fairshare import Allocation
from .loans import Loans


class Lender(TypedDict):
    name: str
    user: str


class Holder(TypedDict, total=False):
    """Who holds a slot. A Slurm pool's own view names only run, name, engine_pid, standby."""

    run: str  # the run's id
    name: str
    user: str
    notebook: str | None
    since: float  # wall time it took the slot
    standby: bool  # held for a standby engine, not a rank
    engine_pid: int | None
    lent_by: Lender | None  # the pool whose slot it borrowed


class _SlotCore(TypedDict):
    slot: int
    holder: Holder | None
    outside: str | None  # a process the arbiter did not place uses it


class SlotView(_SlotCore, total=False):
    host: str  # over ssh hosts: the host it is on
    util: float  # GPU use in percent, where the provider reads it
    memory_mib: float


class RunView(TypedDict):
    """One run as the arbiter sees it."""

    run: str
    name: str
    user: str
    notebook: str | None
    since: float
    min: int
    max: int
    weight: float
    auto: bool
    wanted: int
    target: int
    speed: Any  # its reported samples/s by world size, [[size, samples/s], ...]
    lend: bool
    lent: int  # slots it lent
    queued: int | None  # place in the machine's queue
    held: int  # slots it trains on


class _MachineCore(TypedDict):
    slots: list[SlotView]
    runs: list[RunView]
    time: float


class MachineView(_MachineCore, total=False):
    """The machine's ``view``: from the arbiter (``hold_s``), across ssh hosts (``kind``:
    "gpu" or "cpu"), or a Slurm pool's (``scheduler``: kind, partition and what its last look
    at the partition saw)."""

    hold_s: float
    kind: str
    scheduler: dict[str, Any]


class Table(Protocol):
    """What the view reads of the :class:`~.table.SlotTable`."""

    slots: list[int]
    leases: dict[int, Any]
    runs: dict[str, Any]
    outside: dict[int, str]
    allocation: Allocation
    loans: Loans
    hold_s: float


def machine_view(table: Table, now: float) -> MachineView:
    """Slots (holder: run, name, user, notebook, since, standby, engine pid, the lender whose
    slot it is; or busy outside) and runs (demand, target, queue place, slots held, speed,
    whether they lend and how many slots they lent), runs in arrival order."""
    slots: list[SlotView] = []
    for slot in table.slots:
        lease = table.leases.get(slot)
        holder: Holder | None = None
        if lease is not None:
            r = table.runs[lease.run]
            lender = table.runs.get(table.loans.lender(slot) or "")
            holder = {"run": r.id, "name": r.name, "user": r.user, "notebook": r.notebook,
                      "since": lease.since, "standby": lease.standby,
                      "engine_pid": r.engines.get(str(slot)),
                      "lent_by": None if lender is None else {
                          "name": lender.name, "user": lender.user}}
        slots.append({"slot": slot, "holder": holder, "outside": table.outside.get(slot)})
    allocation = table.allocation
    runs: list[RunView] = [{"run": r.id, "name": r.name, "user": r.user, "notebook": r.notebook,
             "since": r.since, "min": r.min, "max": r.max, "weight": r.weight, "auto": r.auto,
             "wanted": r.wanted, "target": allocation.targets.get(r.id, 0),
             "speed": r.speed, "lend": r.lend, "lent": len(table.loans.of(r.id)),
             "queued": (allocation.queue.index(r.id) + 1
                        if r.id in allocation.queue else None),
             "held": sum(1 for x in table.leases.values() if x.run == r.id and not x.standby)}
            for r in sorted(table.runs.values(), key=lambda r: r.arrival)]
    return {"slots": slots, "runs": runs, "hold_s": table.hold_s, "time": now}
