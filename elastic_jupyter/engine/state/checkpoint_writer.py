"""The background writer of checkpoints: training does not wait for the disk.

The files it writes, and how, are engine.state.checkpoint's; a large state is serialized in a
process of the engine's own (engine.state.checkpoint_process), where it cannot stall training for
the interpreter lock.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Callable

from ...events import Event, EventKind
from ..protocol import TrainingState
from .checkpoint import write_checkpoint
from .checkpoint_process import Unsendable, WriterLost, WriterProcess
from .frozen import FrozenWeightsError
from .shared_memory import Arena

PROCESS_MIN_BYTES = 64 << 20  # staged state from which a write goes to the writer process
MAX_WRITER_LOSSES = 2  # writer processes lost in a row before the thread writes for good


def _notice(text: str) -> None:
    print(f"elastic-jupyter: {text}", file=sys.stderr, flush=True)  # to the engine's log


class CheckpointWriter:
    """Writes checkpoints in the background so training does not wait for the disk.

    ``submit`` takes a state already copied off the model (engine.state.training_state.capture);
    ``drain`` waits for pending writes and returns their outcomes as event dicts. A state staged in
    shared memory of at least `process_min_bytes` is written by a process of the engine's own
    (engine.state.checkpoint_process), where serializing it cannot stall training for the
    interpreter lock; a smaller one (which would not repay that process's start, about a torch
    import) on this writer's thread. So is a state the process does not take (one holding values
    other than plain data), one whose process was lost while writing it (the next starts another,
    up to MAX_WRITER_LOSSES in a row), and every state once the process cannot be started.
    """

    def __init__(self, folder: str, keep: int, before_write: Callable[[], None] | None = None,
                 process_min_bytes: int = PROCESS_MIN_BYTES):
        self.folder, self.keep, self._before_write = folder, keep, before_write
        self.process_min_bytes = process_min_bytes
        self._process: WriterProcess | None = WriterProcess()
        self._lost = 0  # writer processes lost in a row
        # the step of the last checkpoint written (its history is in the folder's file)
        self.saved_step: int | None = None
        self._queue: queue.Queue = queue.Queue()
        self._done: list[Event] = []
        self._lock = threading.Lock()
        self._fatal: FrozenWeightsError | None = None  # a write refused for the run's sake
        self._thread = threading.Thread(target=self._loop, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, state: TrainingState, ready: Callable[[], None] | None = None,
               arena: Arena | None = None) -> None:
        """Write `state` once ``ready()`` returned (copies still filling its buffers); `arena`
        is the engine.state.shared_memory.Arena its tensors were staged in, if any."""
        self._queue.put((state, time.time(), ready, arena))

    def close(self) -> None:
        """Finish pending writes, then end the thread and the writer process (the thread holds
        the run's objects through `before_write` until then)."""
        self._queue.put((None, None, None, None))
        self._thread.join()

    def _loop(self) -> None:
        while True:
            state, queued, ready, arena = self._queue.get()
            if state is None:
                if self._process is not None:  # from this thread: the process dies with it
                    self._process.close()
                self._queue.task_done()
                return
            step = state["progress"]["step"]
            try:
                if ready is not None:
                    ready()
                if self._before_write is not None:
                    self._before_write()
                record = self._write(state, arena)
                self.saved_step = step
                event: Event = {"kind": EventKind.CHECKPOINT.value, "step": step,
                                "path": record["path"], "bytes": record["bytes"],
                                "seconds": time.time() - queued}
            except Exception as e:
                event = {"kind": EventKind.CHECKPOINT_FAILED.value, "step": step,
                         "message": str(e)}
                if isinstance(e, FrozenWeightsError):
                    self._fatal = e
            state = None  # not held while idle (a run's last state holds its live tensors)
            with self._lock:
                self._done.append(event)
            self._queue.task_done()

    def _write(self, state: TrainingState, arena: Arena | None) -> dict:
        if self._process is not None and arena is not None \
                and arena.nbytes() >= self.process_min_bytes:
            try:
                record = self._process.write(self.folder, self.keep, state, arena)
                self._lost = 0
                return record
            except Unsendable:  # written below, where the check names what is not plain data
                pass
            except (WriterLost, OSError) as e:  # the buffers are intact: write them here
                self._lost += 1
                if isinstance(e, OSError) or self._lost == MAX_WRITER_LOSSES:
                    self._process = None
                _notice(f"{e}; checkpoint {state['progress']['step']} is written on the "
                        "engine's thread" + ("" if self._process else ", and the next ones too"))
        return write_checkpoint(self.folder, state, self.keep)

    def raise_fatal(self) -> None:
        """Raise the error that refused a write and must end the run (frozen weights that
        changed: engine.state.frozen), if one did."""
        if self._fatal is not None:
            raise self._fatal

    def take_events(self) -> list[Event]:
        """Outcomes finished since the last call (does not wait)."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def wait(self) -> None:
        """Wait for every submitted write (their outcomes stay for :meth:`take_events`)."""
        self._queue.join()

    def drain(self) -> list[Event]:
        """Wait for every submitted write, then return the outcomes not yet taken."""
        self._queue.join()
        return self.take_events()
