"""The kinds of a run's events, declared once.

An event is a dict ``{"kind", "step", "time", ...}`` in the run's log (run.runlog.RunLog), in
``run.events``, on the wire to the dashboard and the side panel, and in TensorBoard. The
kernel's owners and the engines (whose events reach the run's log through the generation's
result) name a kind by a member of :class:`EventKind`; the run's log refuses any other. The
front end's chart draws the kinds of :data:`DRAWN` (labextension/src/chart/lossChart.ts;
tests/test_events.py holds the two together).

This module imports only the standard library: engines read it too.
"""
from __future__ import annotations

import enum
from typing import TypedDict


class EventKind(str, enum.Enum):
    """What happened; a ``str`` (its value) on the wire, in the log and in comparisons
    (``event["kind"] == "fault"``)."""

    START = "start"  # training started (resumed_from: the checkpoint, or None)
    RESIZE = "resize"  # a resize was requested (from, to, requested_time)
    RESIZED = "resized"  # the new world size trains (latency_s since the request)
    CHECKPOINT = "checkpoint"  # a checkpoint was written (path)
    CHECKPOINT_FAILED = "checkpoint_failed"  # writing one failed (message); training goes on
    FAULT = "fault"  # ranks were lost (rolled_back_to: the step training resumes after)
    ROLLBACK = "rollback"  # sharded state went back to its replicas' step
    FALLBACK = "fallback"  # sharded state came back from a checkpoint (path)
    DRAIN = "drain"  # a scheduler told a rank to go; it left at a step boundary
    SLOT = "slot"  # the machine's arbiter moved a slot (message)
    STATE_SENT = "state_sent"  # newcomers received the training state (bytes, seconds)
    REPLICAS = "replicas"  # sharded parts were copied to their partners (bytes)
    STREAMS = "streams"  # a generation's streams resumed or were read again
    MICRO_BATCHES = "micro_batches"  # how steps are cut (the measured pass cost)
    FROZEN = "frozen"  # the frozen weights each engine keeps (message)
    WARNING = "warning"  # something the user should know (message); training goes on
    ERROR = "error"  # the run failed (message)
    FINISHED = "finished"  # training ended after its last step
    STOPPED = "stopped"  # training was stopped (by the user, or below --min)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# ranks that went back to an event's `step`
ROLL_BACKS = frozenset({EventKind.ROLLBACK, EventKind.FALLBACK})
# the kinds the dashboard sends as markers, and those its chart and run.plot() draw as lines
MARKED = (EventKind.RESIZE, EventKind.RESIZED, EventKind.FAULT, EventKind.CHECKPOINT,
          EventKind.CHECKPOINT_FAILED, EventKind.WARNING, EventKind.ERROR, EventKind.FINISHED,
          EventKind.STOPPED, EventKind.SLOT, EventKind.DRAIN)
DRAWN = frozenset({EventKind.RESIZED, EventKind.FAULT, EventKind.CHECKPOINT, EventKind.SLOT,
                   EventKind.DRAIN})


# One event as the run's log holds it and every view receives it: "kind" (an EventKind's
# value) and "step" always, "time" (seconds since the epoch) once logged, and the fields of its
# kind (the comments at EventKind). Plain data: JSON on the wire, in the run's log files and in
# TensorBoard. (The functional form: "from" is a keyword.)
Event = TypedDict("Event", {
    "kind": str, "step": int, "time": float, "message": str, "world_size": int, "path": str,
    "bytes": int, "from": int, "to": int, "latency_s": float | None,
    "rolled_back_to": int | None, "resumed_from": str | None, "generation": int,
    "sharded": bool, "scheduled": bool, "requested_time": float, "slot": int,
    "lost_steps": int, "lost_slots": list[int], "hung_slots": list[int], "seconds": float,
    "frozen_bytes": int, "host_bytes": int, "streams": int, "resumed": list[int],
    "reread": list[int], "micro_batches": int, "floor": int, "pass_cost": float | None,
    "tensor_bytes": int,
}, total=False)
