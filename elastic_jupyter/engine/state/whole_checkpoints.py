"""Rank 0's checkpoints of the whole training state, copied off the model and written beside
training.

A replicated run's rank 0 holds the whole state, so it alone writes each checkpoint: it copies
the state into reused CPU buffers (training_state.Staging; the step waits for the copy only)
and hands the copy to the background writer (checkpoint_writer.CheckpointWriter). The next
copy reuses those buffers, so it waits for the write before; a step that changes the tensors
waits for copies still running. A sharded run writes none of these: each rank writes its part
(engine.sharded.part_writer), and :class:`WholeCheckpoints` is built without a writer (its
calls do nothing, and every step's history is "saved").

This module owns that pairing so the Worker (one optimizer step) and the generation (one
generation's loop) only say when: ``write`` at a checkpoint that is due, ``events`` after each
step, ``drain`` at the generation's end.
"""
from __future__ import annotations

from typing import Callable

from ...events import Event
from ..protocol import TrainingState
from .checkpoint_writer import CheckpointWriter
from .training_state import Staging

# capture(copy_tensors, staging): the training state as plain data (Worker.capture)
Capture = Callable[[bool, Staging], TrainingState]


class WholeCheckpoints:
    """Rank 0's whole-state checkpoints: the reused copy buffers and their writer.

    Args:
        writer: the background writer (None: this run writes no whole checkpoint, because
            it has no folder or each rank writes its part).
    """

    def __init__(self, writer: CheckpointWriter | None):
        self._writer = writer
        self.staging = Staging()  # the copies of the state, reused from one write to the next

    @property
    def writes(self) -> bool:
        """Whether this run's rank 0 writes whole checkpoints."""
        return self._writer is not None

    @property
    def saved_step(self) -> int | None:
        """The step of the last checkpoint written on this timeline (None: none yet)."""
        return None if self._writer is None else self._writer.saved_step

    def write(self, capture: Capture, last: bool, pending: dict | None = None) -> None:
        """Copy the state (``capture``) and write it in the background. The copy waits for
        the write before (it reuses the buffers); the `last` step's state changes no more
        (the generation waits for the write), so it is not copied. `pending`: the record of
        a step whose evaluation is still to do (the checkpoint before the final
        evaluation: a failing evaluation loses no training). Does nothing without a writer."""
        if self._writer is None:
            return
        self._writer.wait()
        state = capture(not last, self.staging)
        if pending is not None:
            state["pending"] = dict(pending)
        self._writer.submit(state, ready=self.staging.ready,
                            arena=None if last else self.staging.arena)

    def wait_for_copies(self) -> None:
        """Before the tensors change (a step's update, a restore): copies still running end."""
        self.staging.wait()

    def events(self) -> list[Event]:
        """Writes finished since the last call (does not wait); raises the error that refused
        a write and must end the run (frozen weights that changed)."""
        if self._writer is None:
            return []
        events = self._writer.take_events()
        self._writer.raise_fatal()
        return events

    def drain(self) -> list[Event]:
        """At a generation's end: wait for every write, then return their outcomes (raises as
        :meth:`events`)."""
        if self._writer is None:
            return []
        events = self._writer.drain()
        self._writer.raise_fatal()
        return events

    def wait(self) -> None:
        """Wait for every write submitted (before an error is told: that state is on disk)."""
        if self._writer is not None:
            self._writer.wait()

    def forget_saved(self) -> None:
        """A restored state may be of another timeline: what was written before counts not."""
        if self._writer is not None:
            self._writer.saved_step = None

    def history_needed_after(self, step: int, every: int) -> int:
        """The step after which the records at `step` are not yet all in the checkpoint
        folder's history file (engine.state.history): any rank may become rank 0 and write
        the next checkpoint, so each keeps those up to the checkpoint before the newest
        periodic one, or the last written if older; without periodic checkpoints the final
        one holds every record (`every`: the run's ``--checkpoint-every``, 0: none). `step`
        itself where no whole checkpoint is written."""
        if self._writer is None:
            return step
        kept = max(0, (step // every - 1) * every) if every else 0
        if self._writer.saved_step is not None:
            kept = min(kept, self._writer.saved_step)
        return kept

    def close(self) -> None:
        """Finish the writes and end the writer (the run left this engine)."""
        if self._writer is not None:
            self._writer.close()
