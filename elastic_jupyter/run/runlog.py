"""The run log: the only writer of a run's per-step records, its events and its log file.

Records arrive from rank 0's live stream and from each generation's result (:meth:`RunLog.merge`);
events come from the owner (resizes, faults, warnings, end states) and from rank 0 (checkpoints).
A resize's whole life is recorded here: :meth:`resize_started` when the generation ends for it,
and the ``resized`` event, with its latency, at the first completed step at the new size — the
one meaning of "done" that the chart, the widget and the side panel all show.

Written on the owner thread only; other threads read (``records_since`` tolerates a concurrent
rollback).
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any, Iterable, Protocol, cast

import numpy as np

from ..events import ROLL_BACKS, Event, EventKind


class RecordSink(Protocol):
    """Where the records and events also go (tensorboard.TensorBoardLog)."""

    def add_records(self, records: Iterable[dict]) -> None: ...

    def add_event(self, event: Event) -> None: ...

    def roll_back(self, step: int) -> None: ...

    def close(self) -> None: ...


class RunLog:
    """Records (step -> dict), events (list of dicts, in order) and ``<log_dir>/run.log``.

    A record is held as a tuple: its keys (one tuple shared by every record with the same
    keys), then its values; half a dict's size, which matters at a record a step for days
    (the readers get dicts).
    """

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.events: list[Event] = []
        self._records: dict[int, tuple] = {}  # step -> (keys, *values)
        self._keys: dict[tuple, tuple] = {}  # one tuple of each record shape's keys
        self._merged_upto = 0  # newest step merged from rank 0's stream
        self._complete_upto = 0  # newest step with no record missing before it
        self._event_keys: set = set()  # (kind, step) of every event, to skip repeats
        self._resize: dict | None = None  # the latest resize's life (see `resize`)
        self._resize_event: Event | None = None  # its "resize" event
        self.tensorboard: RecordSink | None = None  # a tensorboard.TensorBoardLog, once open

    # ------------------------------------------------------------------ reading (any thread)

    @property
    def step(self) -> int:
        """Newest recorded step (0 before the first)."""
        return max(self._records) if self._records else 0

    def record(self, step: int) -> dict:
        """The record of `step`, or {} if there is none."""
        held = self._records.get(step)
        return _as_dict(held) if held is not None else {}

    def history(self) -> list[dict]:
        return [_as_dict(r) for _, r in sorted(self._records.items())]

    def records_since(self, step: int) -> list[dict]:
        """Records after `step`, oldest first (cost: the new records only)."""
        records = self._records  # the owner thread may delete entries meanwhile (a rollback)
        found = (records.get(s) for s in range(step + 1, self.step + 1))
        return [_as_dict(r) for r in found if r is not None]

    def last_event(self, kind: EventKind | str) -> Event | None:
        return next((e for e in reversed(self.events) if e["kind"] == kind), None)

    @property
    def resize(self) -> dict | None:
        """The latest resize: from, to, requested_time, pending (True until the first step at
        the new size completed), step (while pending: the step after which the generation
        ended for it; then the first step at the new size), latency_s (s from request to that
        step; None while pending). None before the first resize."""
        return dict(self._resize) if self._resize is not None else None

    def engine_log(self, slot: int | None) -> str:
        """The log file of the engine on `slot` (its prints, warnings, tracebacks); a warm
        engine's (slot None) until it is bound to a slot."""
        return os.path.join(self.log_dir, "engine-warm.log" if slot is None
                            else f"engine-slot{slot}.log")

    # ------------------------------------------------------------------ writing (owner thread)

    def log(self, text: str) -> None:
        """Append a line to run.log (a lost line never stops training; events keep the record)."""
        try:
            os.makedirs(self.log_dir, exist_ok=True)
            with open(os.path.join(self.log_dir, "run.log"), "a") as f:
                f.write(f"{time.strftime('%H:%M:%S')} {text}\n")
        except OSError:
            pass

    def event(self, kind: EventKind | str, **fields: Any) -> Event:
        """Record an event at ``fields["step"]`` (default: the newest step) and log it; its
        kind is stored as the plain string. Raises ValueError for a kind EventKind lacks."""
        kind = EventKind(kind).value
        event = cast(Event, {"kind": kind, "step": fields.pop("step", self.step),
                             "time": time.time(), **fields})
        self.events.append(event)
        self._event_keys.add((kind, event["step"]))
        if self.tensorboard is not None:
            self.tensorboard.add_event(event)
        self.log(f"{kind} " + " ".join(f"{k}={v}" for k, v in event.items() if k != "kind"))
        return event

    def resize_started(self, step: int, old: int, new: int, requested_time: float,
                       scheduled: bool) -> None:
        """The generation ended after `step` to change the world size from `old` to `new`."""
        event = self.event(EventKind.RESIZE, step=step, requested_time=requested_time,
                           scheduled=scheduled, **{"from": old, "to": new})
        self._resize = {"from": old, "to": new, "step": step, "requested_time": requested_time,
                        "pending": True, "latency_s": None}
        self._resize_event = event

    def resize_settled(self, new: int) -> None:
        """The resize under way ends at `new` engines (fewer engines could start)."""
        if self._resize is not None and self._resize["pending"]:
            self._resize["to"] = new
            if self._resize_event is not None:
                self._resize_event["to"] = new

    def merge(self, data: Mapping[str, Any], complete: bool = False) -> None:
        """Take records and events streamed by rank 0 (repeats are skipped, unless the data
        is `complete`: a generation's result, engine.protocol.GenerationResult, fills any gap
        the live stream left). `data` holds "records" and "events" lists."""
        for event in data.get("events", ()):  # a sharded run's ranks went back to a step
            if event["kind"] in ROLL_BACKS and (key := (event["kind"], event["step"],
                                                        event.get("generation"))) \
                    not in self._event_keys:
                self._event_keys.add(key)  # another generation's may go back to the same step
                self.roll_back(event["step"])
                fields = dict(event)
                self.event(fields.pop("kind"), **fields)
        added = []
        for record in data.get("records", ()):
            if complete or record["step"] > self._merged_upto:
                added.append(_plain(record))
                self._hold(added[-1])
                self._merged_upto = max(self._merged_upto, record["step"])
        while self._complete_upto + 1 in self._records:
            self._complete_upto += 1
        if self.tensorboard is not None:
            self.tensorboard.add_records(added)
        self._finish_resize()
        for event in data.get("events", ()):
            if (event["kind"], event["step"]) not in self._event_keys:
                fields = dict(event)
                self.event(fields.pop("kind"), **fields)

    def _finish_resize(self) -> None:
        life = self._resize
        held = self._records.get(life["step"] + 1) if life and life["pending"] else None
        if life is not None and held is not None:  # the first step at the new size: done
            first = _as_dict(held)
            life.update(pending=False, latency_s=first["time"] - life["requested_time"],
                        step=first["step"])
            self.event(EventKind.RESIZED, step=first["step"], latency_s=life["latency_s"],
                       **{"from": life["from"], "to": life["to"]})

    def load(self, history: list[dict], upto: int) -> None:
        """Start from a checkpoint's history (a resumed run)."""
        for record in history:
            self._hold(_plain(record))
        self._merged_upto = self._complete_upto = upto

    def _hold(self, record: dict) -> None:
        keys = tuple(record)
        keys = self._keys.setdefault(keys, keys)
        self._records[record["step"]] = (keys, *record.values())

    def roll_back(self, step: int) -> None:
        """Forget records after `step` (a fault rolled the ranks back to it)."""
        for s in [s for s in self._records if s > step]:
            del self._records[s]
        self._merged_upto = min(self._merged_upto, step)
        self._complete_upto = min(self._complete_upto, step)
        if self.tensorboard is not None:
            self.tensorboard.roll_back(step)

    @property
    def complete_upto(self) -> int:
        """The newest step up to which every record is here (the live stream can skip one
        that arrives later, or, after a fault, from rank 0's history: Recovery asks for it)."""
        return self._complete_upto


def _plain(record: dict) -> dict:
    """A copy of the record with numpy numbers (a numpy learning rate lands in "lr") as Python
    ones, so every view can send it as JSON, and its keys interned: each message from rank 0
    unpickles its own copy of every key, which the records kept from it would otherwise hold
    (as much again as the values, per record, at a few records per message)."""
    return {sys.intern(k) if type(k) is str else k: v.item() if isinstance(v, np.generic) else v
            for k, v in record.items()}


def _as_dict(held: tuple) -> dict:
    return dict(zip(held[0], held[1:]))


def describe_event(event: Event) -> str | None:
    """One human-readable line for an event (None for events not worth a line)."""
    kind, step = event["kind"], event["step"]
    if kind == EventKind.RESIZE:
        how = "scheduled" if event.get("scheduled") else "requested"
        return f"[step {step}] resize {event['from']} -> {event['to']} ({how})"
    if kind == EventKind.RESIZED:
        return (f"[step {step}] world size is now {event['to']}: resize took "
                f"{event['latency_s']:.3f} s (request to first step at the new size)")
    if kind == EventKind.CHECKPOINT:
        return f"[step {step}] checkpoint {event['path']} ({event['bytes'] / 1e6:.2f} MB)"
    if kind == EventKind.FAULT:
        lost = ", ".join([f"slot {s} (lost)" for s in event.get("lost_slots", ())] +
                         [f"slot {s} (hung)" for s in event.get("hung_slots", ())]) or "none"
        return (f"[step {step}] fault: engines {lost}; rolled back to step "
                f"{event['rolled_back_to']} ({event['lost_steps']} step(s) lost), training goes "
                f"on at world size {event['world_size']}")
    if kind == EventKind.CHECKPOINT_FAILED:
        return f"[step {step}] WARNING checkpoint not written: {event['message']}"
    if kind in _ONE_LINERS:
        extra = event.get("message") or f"world size {event.get('world_size')}"
        return f"[step {step}] {kind}: {extra}"
    return None


# the events describe_event shows as their message (or the world size)
_ONE_LINERS = frozenset({EventKind.ERROR, EventKind.WARNING, EventKind.FINISHED,
                         EventKind.STOPPED, EventKind.START, EventKind.MICRO_BATCHES,
                         EventKind.SLOT, EventKind.DRAIN, EventKind.FROZEN, *ROLL_BACKS})
