"""A run's speed by world size, read from its own records: what its pool tells the machine's
arbiter, which gives slots by what they add (arbiter/value.py)."""
from __future__ import annotations

import collections
import statistics

from .runlog import RunLog

WINDOW = 20  # the recent steps at a size that make its speed
MIN_STEPS = 3  # a size with fewer (the first after a resize left out) is not reported


class SpeedMeter:
    """The median samples per second of the last WINDOW steps at each world size the run has
    trained at (the first step at a new size left out: it may carry the resize's cost). Reads
    only the records added since its last call (owner loop)."""

    def __init__(self, log: RunLog):
        self.log = log
        self._seen = 0  # newest step read
        self._size = 0  # world size of that step
        self._recent: dict[int, collections.deque] = {}

    def speeds(self) -> list[tuple[int, float]]:
        """(world size, samples per second) for each size with MIN_STEPS steps, smallest first."""
        for record in self.log.records_since(self._seen):
            size = record["world_size"]
            if size == self._size:
                self._recent.setdefault(size, collections.deque(maxlen=WINDOW)).append(
                    record["samples_per_s"])
            self._seen, self._size = record["step"], size
        return [(n, statistics.median(d)) for n, d in sorted(self._recent.items())
                if len(d) >= MIN_STEPS]
