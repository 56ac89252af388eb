"""A run's speed by world size: measured where it trained, fitted between and beyond. Pure."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

MAX_SIZES = 1024  # world sizes a report may list


@dataclass(frozen=True)
class Speed:
    """A run's measured speed by world size, from its own records.

    Attributes:
        measured: (world size, speed) for each size it has trained at (its recent steps
            there), smallest size first. Any rate of its steps will do, as only ratios are
            compared: a run reports samples per second (its global batch is fixed, so that is
            its progress); the cluster simulator steps per second.

    Sizes not measured follow a step time of ``a + b / n`` (a fixed part, such as input or
    synchronisation, and a part that divides among the ranks), fitted by least squares to the
    measured sizes, with a, b >= 0; from one measured size, linear scaling (a = 0).
    """

    measured: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        if not self.measured or any(n < 1 or not (0 < s < math.inf) for n, s in self.measured):
            raise ValueError(f"a speed needs sizes >= 1 and speeds > 0, got {self.measured}")

    def at(self, n: int) -> float:
        """Steps per second at world size `n` (0 for no slot)."""
        if n <= 0:
            return 0.0
        for size, speed in self.measured:
            if size == n:
                return speed
        a, b = self._fit
        return 1.0 / (a + b / n)

    @functools.cached_property
    def _fit(self) -> tuple[float, float]:
        """(a, b) of the step time a + b / n, least squares over the measured sizes (fitted once:
        the arbiter asks at every look)."""
        xs = [1.0 / n for n, _ in self.measured]
        ys = [1.0 / s for _, s in self.measured]
        if len(set(xs)) < 2:
            return 0.0, ys[0] / xs[0]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        b = max(b, 0.0)
        a = max(my - b * mx, 0.0)
        if a == 0.0:  # the step time is all per-rank work: refit b alone
            b = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
        return a, b

    @classmethod
    def parse(cls, raw: object) -> Speed | None:
        """The speed a run reported over the wire: a list of [world size, speed] pairs (empty:
        none yet). Raises ValueError saying what was wrong."""
        if not isinstance(raw, list) or len(raw) > MAX_SIZES:
            raise ValueError(f"speed must be a list of at most {MAX_SIZES} [world size, speed] "
                             f"pairs, got {raw!r:.80}")
        pairs = []
        for pair in raw:
            if (not isinstance(pair, (list, tuple)) or len(pair) != 2
                    or isinstance(pair[0], bool) or not isinstance(pair[0], int)
                    or isinstance(pair[1], bool) or not isinstance(pair[1], (int, float))):
                raise ValueError(f"a speed is [world size, speed], got {pair!r:.80}")
            pairs.append((pair[0], float(pair[1])))
        return cls(tuple(sorted(pairs))) if pairs else None
