"""What a start prints while the pool waits for its slots: its place in the machine's queue (lease
mode), the runs its idle pool lent slots to, and its engine jobs that wait in a batch
scheduler's queue."""
from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Coroutine, TypeVar

from ..owner import Owner
from .launchers import Job
from .lease import POLL_S, SlotLease

T = TypeVar("T")


class QueuePrinter:
    """Waits for the owner loop on behalf of a blocking call, printing where the pool waits.

    Args:
        owner: the owner thread that runs the pool's coroutines.
        lease: the pool's lease (None outside lease mode): its place in the machine's queue.
        queued: returns slot -> batch job of the pool's engines waiting in a scheduler's queue.
        min_size: the slots a start waits for (named in the line it prints).
    """

    def __init__(self, owner: Owner, lease: SlotLease | None,
                 queued: Callable[[], dict[int, Job]], min_size: int):
        self.owner, self.lease, self.queued, self.min_size = owner, lease, queued, min_size

    def wait(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the owner loop and return its result (as ``Owner.call``), printing a
        line each time the pool's place in the queue or its waiting jobs change. Raises what
        `coro` raises; RuntimeError on the owner thread (waiting there would deadlock)."""
        if self.owner.in_owner_thread():
            coro.close()
            raise RuntimeError("waiting on the owner thread would deadlock; await instead")
        future = self.owner.submit(coro)
        shown: int | None = None
        jobs: dict[int, Job] = {}
        lent_shown = False
        while True:
            try:
                concurrent.futures.wait([future], timeout=POLL_S)
                if future.done():
                    return future.result()
            except BaseException:  # interrupted: the start is cancelled and cleans up
                future.cancel()
                raise
            place = self.lease.queued if self.lease is not None else None
            if place != shown and place is not None:
                print(f"Waiting for {self.min_size} slot(s): place {place} in the machine's "
                      "queue (%elastic_pool status shows who holds the slots)", flush=True)
            shown = place
            lent = self.lease.grant.get("lent", []) if self.lease is not None else []
            if lent and not lent_shown:
                print("Waiting for the slot(s) this pool lent while idle: " + ", ".join(
                    f"slot {x['slot']} from {x['to']} ({x['user']})" for x in lent)
                    + ", back at that run's next step boundary", flush=True)
            lent_shown = lent_shown or bool(lent)
            if (now := self.queued()) != jobs:
                jobs = now
                if jobs:
                    print("Waiting in the queue: " + "; ".join(
                        f"slot {slot}: {job}" for slot, job in sorted(jobs.items())), flush=True)
