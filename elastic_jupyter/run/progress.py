"""What ``run.wait(progress=True)`` prints: each event once, as it happens, and a line for each
new step it sees (loss, world size, throughput) about twice a second."""
from __future__ import annotations

import threading
import time
from typing import Callable

from .runlog import RunLog, describe_event


class ProgressPrinter:
    """Prints a run's progress from its `log`; `total_steps()` is the run's length, read at each
    line (it is known once the run's setup measured the data, maybe after the wait began)."""

    def __init__(self, log: RunLog, total_steps: Callable[[], int]):
        self.log, self.total_steps = log, total_steps
        self._printed_events = 0
        self._printed_step = -1

    def follow(self, done: threading.Event, timeout: float | None, progress: bool) -> bool:
        """Block until `done` is set or `timeout` seconds pass, printing the progress about
        twice a second when `progress`; returns False when interrupted (the kernel's stop
        button), True otherwise."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not done.is_set():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                done.wait(min(left, 0.5) if left is not None else 0.5)
                if progress:
                    self.print_new()
        except KeyboardInterrupt:
            return False
        return True

    def print_new(self) -> None:
        """Print the events since the last call, then the newest step if it is new."""
        self.print_events()
        step = self.log.step
        if step and step != self._printed_step:
            print(self._line(step), flush=True)
            self._printed_step = step

    def print_events(self) -> None:
        """Print the events since the last call (those worth a line)."""
        events = self.log.events
        for event in events[self._printed_events:]:
            line = describe_event(event)
            if line:
                print(line, flush=True)
        self._printed_events = len(events)

    def _line(self, step: int) -> str:
        r = self.log.record(step)
        vals = " ".join(f"{k} {v:.4f}" for k, v in r.items() if k.startswith("val_"))
        return (f"step {r['step']:>5}/{self.total_steps()}  epoch {r['epoch']}  "
                f"loss {r['loss']:.4f}  world size {r['world_size']}  "
                f"{r['samples_per_s']:.0f} samples/s  {vals}")
