"""What one forward/backward pass costs beyond its samples: the input of the micro-batch cut.

A rank's step takes about ``passes * a + samples * c`` seconds: every pass has a fixed cost
``a`` (Python, kernel launches, the optimizer hooks, collating) and every sample a cost ``c``.
The pass cost ``P = a / c`` says the same in samples: a pass costs as much as P more samples.
engine.data.batching cuts a step into more micro-batches only while the extra passes keep the step
within 1.1 x an even split's time; with P = 0 (a large model, where samples dominate) that is
the split in samples alone, with a large P (a small model on a fast device) fewer, larger
micro-batches.

P is measured once per run, on rank 0, from a few passes over the first step's samples, and is
part of the run's state, so every rank, every later generation and a resume cut steps alike.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import math
import time
from typing import Callable

MAX_PASS_COST = 4096.0  # a pass that costs no more with more samples: as good as infinite
REPEATS = 2  # timed passes per size; the fastest counts (noise only ever adds time)
# a pass this long is its samples' time: its fixed cost (milliseconds) is nothing beside it
LONG_PASS_S = 0.5


def measure_pass_cost(run_pass: Callable[[int], None], small: int, large: int,
                      repeats: int = REPEATS) -> float:
    """P in samples (see the module docstring), from timing ``run_pass(size)`` (one forward and
    backward pass over `size` samples, finished when it returns) at two sizes.

    Each size runs once untimed first (first calls allocate memory and pick kernels); when
    that pass over `large` samples takes LONG_PASS_S or more, P is 0 without more passes.
    Raises ValueError unless ``0 < small < large``.
    """
    if not 0 < small < large:
        raise ValueError(f"need 0 < small < large, got {small} and {large}")
    run_pass(small)
    start = time.perf_counter()
    run_pass(large)
    if time.perf_counter() - start >= LONG_PASS_S:
        return 0.0  # samples dominate; peers wait meanwhile, within their collective timeout
    best = {small: math.inf, large: math.inf}
    for _ in range(repeats):
        for size in (small, large):  # interleaved: a slow moment of the machine hits both
            start = time.perf_counter()
            run_pass(size)
            best[size] = min(best[size], time.perf_counter() - start)
    return pass_cost_from(best[small], best[large], small, large)


def pass_cost_from(t_small: float, t_large: float, small: int, large: int) -> float:
    """P from the time (s) of a pass over `small` and over `large` samples, rounded to a power
    of two (0 below 1) so that runs of one model on one machine measure the same value, and
    cut their steps alike, nearly always; at most :data:`MAX_PASS_COST`."""
    per_sample = (t_large - t_small) / (large - small)
    if per_sample <= 0:
        return MAX_PASS_COST
    cost = t_small / per_sample - small
    if cost < 1:
        return 0.0
    return min(MAX_PASS_COST, 2.0 ** round(math.log2(cost)))
