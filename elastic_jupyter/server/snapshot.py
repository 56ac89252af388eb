"""RunSnapshot: the one description of a run that every view renders.

The REST model of the server extension (and its control channel), the dashboard widget's
``status`` trait, the text summary of plain-text front ends and the model of a run whose kernel
is gone are all a :class:`RunSnapshot`; the TypeScript side has the matching ``RunSnapshot``
type (labextension/src/common/snapshot.ts). Wire model (JSON, :meth:`RunSnapshot.as_dict`):

=================  ===========================================================================
id, name           registry id (None before registration), run name
notebook           notebook path, when known
state              created, starting, training, resizing, finished, failed, stopped; the server adds
                   lost (kernel gone) and unresponsive (kernel alive, run silent)
step, total_steps  newest completed step; the run's length in steps (None when unknown)
epoch              epoch of the newest step
world_size         ranks training now; requested_size: the size asked for (newest wins)
min_size, max_size the pool's bounds; backend: gloo or nccl
loss, recent_loss  newest loss; up to 60 sampled losses for a sparkline (finite or None)
samples_per_s      mean of the last 10 steps; eta_s: seconds left at the recent pace
error              why the run failed or cannot be reached, else None
checkpoint_dir     folder of its checkpoints; checkpoints: [{file, path, step, bytes, time}]
last_checkpoint    path of the newest checkpoint written by this run, else None
log_dir            folder of the run's and engines' logs
slots              devices of the members ("cpu", "cuda:<id>")
lease              None, or the pool's lease from the machine's arbiter: {auto, weight, slots,
                   standby, target, queued, grantable} (EnginePool.lease_status)
queued             engines waiting in a scheduler's queue, one line each, such as
                   "slot 2: job 41 pending (Resources)" (Slurm's state and reason)
excluded           slots left out of engine starts: [{slot, reason, until}], until the wall
                   time (s since the epoch) the slot comes back, None when it stays out
resize             the latest resize's life: {from, to, step, requested_time, pending,
                   latency_s}; pending until the first completed step at the new size (the
                   one "done" for the chart, the widget and the panel), None before any
kernel_id, started the kernel that runs it and when it started (s since the epoch)
=================  ===========================================================================
"""
from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass, field
from typing import Any

from ..events import EventKind
from . import series
from ..engine.state.checkpoint import list_checkpoints

SPARKLINE_POINTS = 60


class RunState(str, enum.Enum):
    """A run's state; a ``str`` (its value) on the wire and in comparisons (``== "training"``).

    The run's driver moves it created -> starting -> training (<-> resizing) -> finished,
    failed or stopped; the server side adds lost and unresponsive for a run that no longer
    answers (:func:`of_entry`).
    """

    CREATED = "created"
    STARTING = "starting"
    TRAINING = "training"
    RESIZING = "resizing"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"  # the kernel that ran it is gone
    UNRESPONSIVE = "unresponsive"  # its kernel lives, the run does not answer

    def __str__(self) -> str:  # the value, as the wire shows it (Enum's says "RunState.X")
        return str(self.value)

    def __format__(self, spec: str) -> str:  # f-strings too, on every Python version
        return format(str(self.value), spec)


ACTIVE_STATES = (RunState.STARTING, RunState.TRAINING, RunState.RESIZING)
TRAINING_STATES = (RunState.TRAINING, RunState.RESIZING)  # a resize request is taken
FINAL_STATES = (RunState.FINISHED, RunState.FAILED, RunState.STOPPED)


@dataclass(frozen=True)
class RunSnapshot:
    """A run at one moment; plain data (see the module's wire model)."""

    name: str
    state: str
    checkpoint_dir: str
    id: str | None = None
    notebook: str | None = None
    step: int = 0
    total_steps: int | None = None
    epoch: int | None = None
    world_size: int = 0
    requested_size: int = 0
    min_size: int | None = None
    max_size: int | None = None
    backend: str | None = None
    loss: float | None = None
    recent_loss: list = field(default_factory=list)
    samples_per_s: float | None = None
    eta_s: float | None = None
    error: str | None = None
    checkpoints: list = field(default_factory=list)
    last_checkpoint: str | None = None
    log_dir: str | None = None
    slots: list = field(default_factory=list)
    lease: dict | None = None  # pool.status.LeaseStatus (server/ reads no pool/ module)
    queued: list = field(default_factory=list)
    excluded: list = field(default_factory=list)
    resize: dict | None = None
    kernel_id: str | None = None
    started: float | None = None
    # where the training state lives: "replicated" (every rank), "sharded" (--shard: each rank
    # its rows); run.run_mode's name
    state_mode: str = "replicated"

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    def as_dict(self) -> dict:
        """JSON-safe (non-finite floats become None)."""
        out = dataclasses.asdict(self)
        for key in ("loss", "samples_per_s", "eta_s"):
            out[key] = series.finite(out[key])
        out["recent_loss"] = [series.finite(v) for v in out["recent_loss"]]
        return out

    def summary(self) -> str:
        """One-line text summary (plus the error), for plain-text front ends."""
        loss = f"{self.loss:.4f}" if self.loss is not None else "-"
        text = (f"run {self.name!r}: {self.state}, step {self.step}/{self.total_steps}, "
                f"world size {self.world_size}{_mode_note(self.state_mode)}, "
                f"loss {loss}")
        return text + (f"\n{self.error}" if self.error else "")


def of_run(run: Any, run_id: str | None) -> RunSnapshot:
    """Snapshot of a live run.run.TrainingRun (any thread; reads only; typed Any: server/
    imports nothing of run/, which stands above it)."""
    log, step = run.log, run.step
    recent = log.records_since(max(0, step - 20))
    last = recent[-1] if recent else {}
    eta = None
    if len(recent) >= 2 and run.total_steps and run.active:
        per_step = (recent[-1]["time"] - recent[0]["time"]) / (recent[-1]["step"] - recent[0]["step"])
        eta = per_step * (run.total_steps - step)
    sampled = log.records_since(max(0, step - 10 * SPARKLINE_POINTS))[::10][-SPARKLINE_POINTS:]
    checkpoint = log.last_event(EventKind.CHECKPOINT)
    pool = run.pool
    return RunSnapshot(
        id=run_id, name=run.name, notebook=run.notebook,
        state=run.state,
        step=step, total_steps=run.total_steps, epoch=last.get("epoch"),
        world_size=run.world_size, requested_size=run.requested_size,
        min_size=pool.config.min_size, max_size=pool.config.max_size, backend=pool.backend,
        loss=last.get("loss"), recent_loss=[r["loss"] for r in sampled],
        samples_per_s=(sum(r["samples_per_s"] for r in recent[-10:]) / len(recent[-10:])
                       if recent else None),
        eta_s=eta, error=run.error, checkpoint_dir=run.checkpoint_dir,
        checkpoints=run.checkpoints, last_checkpoint=checkpoint["path"] if checkpoint else None,
        log_dir=run.log_dir, slots=[m.device for m in run.members],
        lease=pool.lease_status(), resize=log.resize,
        queued=[f"slot {slot}: {job}" for slot, job in sorted(pool.engine_sets.queued.items())],
        excluded=[{"slot": slot, **vars(x)} for slot, x in sorted(pool.slots.excluded.items())],
        state_mode=run.mode.name)


def _mode_note(state_mode: str) -> str:
    """The summary's note of a state mode other than the usual one."""
    return "" if state_mode == "replicated" else f" ({state_mode})"


def last_snapshot(entry: dict) -> dict:
    """The snapshot a registry entry recorded (entries of version 0.1 held state and step)."""
    return entry.get("snapshot") or {"state": entry.get("state"), "step": entry.get("step")}


def of_entry(entry: dict) -> RunSnapshot:
    """Snapshot of a run that does not answer, from its registry entry (the last state it
    recorded there) and its checkpoint folder: its final state if it ended, else
    "unresponsive" while its kernel process lives, else "lost"."""
    checkpoints = list_checkpoints(entry["checkpoint_dir"])
    last = last_snapshot(entry)
    if last.get("state") in FINAL_STATES:
        known = {f.name for f in dataclasses.fields(RunSnapshot)}
        # entries of 0.1.0 said "sharded": true or false
        mode = {"state_mode": "sharded"} if last.get("sharded") else {}
        return RunSnapshot(**{**{k: v for k, v in last.items() if k in known}, **mode,
                              "checkpoints": checkpoints})
    state = RunState.UNRESPONSIVE if entry["live"] else RunState.LOST
    step = max([last.get("step") or 0] + [c["step"] for c in checkpoints])
    if state == RunState.UNRESPONSIVE:
        error = ("its kernel runs but the run does not answer on its control channel; "
                 "the notebook's own dashboard can still reach it")
    else:
        error = "the kernel that ran it is gone" + (
            f"; continue from the checkpoint at step {checkpoints[-1]['step']} with "
            f"%%elastic_train --name {entry['name']} --resume (same cell and options)"
            if checkpoints else "; it wrote no checkpoint, so it must start again")
    return RunSnapshot(name=entry["name"], state=state, step=step, checkpoints=checkpoints,
                       checkpoint_dir=entry["checkpoint_dir"], id=entry.get("id"),
                       notebook=entry.get("notebook"), total_steps=last.get("total_steps"),
                       loss=last.get("loss"), log_dir=os.path.join(entry["checkpoint_dir"], "logs"),
                       error=error)
