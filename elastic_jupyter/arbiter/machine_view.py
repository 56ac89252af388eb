"""The machine as the arbiter shows it (its ``view`` op): every slot with its holder, every run
with its demand, target, reported speed and loans. Read-only over the slot table."""
from __future__ import annotations

from typing import Any, Protocol

from .fairshare import Allocation
from .loans import Loans


class Table(Protocol):
    """What the view reads of the :class:`~.table.SlotTable`."""

    slots: list[int]
    leases: dict[int, Any]
    runs: dict[str, Any]
    outside: dict[int, str]
    allocation: Allocation
    loans: Loans
    hold_s: float


def machine_view(table: Table, now: float) -> dict:
    """Slots (holder: run, name, user, notebook, since, standby, engine pid, the lender whose
    slot it is; or busy outside) and runs (demand, target, queue place, slots held, speed,
    whether they lend and how many slots they lent), runs in arrival order."""
    slots = []
    for slot in table.slots:
        lease = table.leases.get(slot)
        holder = None
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
    runs = [{"run": r.id, "name": r.name, "user": r.user, "notebook": r.notebook,
             "since": r.since, "min": r.min, "max": r.max, "weight": r.weight, "auto": r.auto,
             "wanted": r.wanted, "target": allocation.targets.get(r.id, 0),
             "speed": r.speed, "lend": r.lend, "lent": len(table.loans.of(r.id)),
             "queued": (allocation.queue.index(r.id) + 1
                        if r.id in allocation.queue else None),
             "held": sum(1 for x in table.leases.values() if x.run == r.id and not x.standby)}
            for r in sorted(table.runs.values(), key=lambda r: r.arrival)]
    return {"slots": slots, "runs": runs, "hold_s": table.hold_s, "time": now}
