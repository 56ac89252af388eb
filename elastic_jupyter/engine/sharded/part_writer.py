"""One rank's sharded checkpoint writes, beside training: a rank does not wait for its disk.

Each rank writes its part from the host copy its partner replica refresh made at the same step
(engine.sharded.replicas), which nothing changes until the next refresh; rank 0 then waits for every
rank's marker and commits the checkpoint (engine.sharded.checkpoint_parts). No collective runs on
the writer's thread: the process group stays the training thread's. torch.distributed.checkpoint's
``async_save`` also writes beside training, but its metadata is pickled
(engine.sharded.checkpoint_parts says why that is refused).

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Callable

from ...events import Event, EventKind
from ..state.checkpoint import CheckpointError


class PartWriter:
    """Writes this rank's checkpoint parts on a thread, one checkpoint at a time.

    Attributes:
        saved_step: the newest step whose write ended well on this rank (on rank 0: whose
            checkpoint was committed), None before.
    """

    def __init__(self):
        self.saved_step: int | None = None
        self._thread: threading.Thread | None = None
        self._abort = threading.Event()
        self._events: list[Event] = []
        self._reads: object = None  # what the write in progress reads (its host copies)
        self._lock = threading.Lock()  # the writer's thread appends, the training thread takes

    def submit(self, step: int, write: Callable[[threading.Event], Event | None],
               reads: object) -> None:
        """Start ``write(abort)``, this rank's write of step `step` (it returns rank 0's event,
        else None, and raises CheckpointError), once the write before it ended. `reads`: the
        host copies it reads (:meth:`reads`)."""
        self.wait()
        self._reads = reads
        self._abort = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(step, write, self._abort,
                                                                time.time()),
                                        name=f"sharded-checkpoint-{step}", daemon=True)
        self._thread.start()

    def _run(self, step: int, write: Callable[[threading.Event], Event | None],
             abort: threading.Event, start: float) -> None:
        try:
            event = write(abort)
        except CheckpointError as e:
            event = {"kind": EventKind.CHECKPOINT_FAILED.value, "step": step, "message": str(e)}
        except Exception as e:  # noqa: BLE001 -- the run goes on; the owner is told
            print(f"elastic-jupyter: checkpoint {step} failed: {e!r}", file=sys.stderr)
            event = {"kind": EventKind.CHECKPOINT_FAILED.value, "step": step,
                     "message": f"{type(e).__name__}: {e}"}
        else:
            self.saved_step = step
            if event is not None:
                event["seconds"] = round(time.time() - start, 3)
        if event is not None:
            with self._lock:
                self._events.append(event)

    def reads(self, copies: object) -> bool:
        """Whether a write in progress reads `copies` (their buffers must not be reused)."""
        return copies is not None and copies is self._reads and self._thread is not None \
            and self._thread.is_alive()

    def wait(self) -> None:
        """Until the write in progress (if any) ended."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def abort(self) -> None:
        """A peer failed: rank 0 stops waiting for markers that may never come (that
        checkpoint stays unfinished, never read). A part being written is finished."""
        self._abort.set()

    def take_events(self) -> list[Event]:
        """The events of the writes that ended since the last call (rank 0's ``checkpoint``
        and every rank's ``checkpoint_failed``)."""
        with self._lock:
            taken, self._events = self._events, []
        return taken
