"""A run's per-step history as columns: the shared data model of the dashboard and run.plot().

Columns are float64 arrays aligned on ``step``; a value a step lacks (an evaluation metric
between evaluations) is NaN.
"""
from __future__ import annotations

import array
import bisect
import math

import numpy as np

BASE_COLUMNS = ("step", "epoch", "loss", "world_size", "samples_per_s", "time")
MAX_EPOCH_LINES = 50  # more epoch boundaries than this are not drawn (they would grey a plot)


def column_names(records: list[dict]) -> list[str]:
    """BASE_COLUMNS, then every other numeric field (extra and val_* metrics) in first-seen order;
    not the learning rates (``lr``, and ``lr_1``... of further param groups)."""
    names = list(BASE_COLUMNS)
    for record in records:
        for key, value in record.items():
            if key not in names and not is_lr(key) and isinstance(value, (int, float)):
                names.append(key)
    return names


def is_lr(key: str) -> bool:
    """Whether a record's field is a learning rate: ``lr`` (the first param group's) or
    ``lr_<k>`` (param group k's, k >= 1)."""
    return key == "lr" or key.startswith("lr_") and key[3:].isdigit()


def columns(records: list[dict], names: list[str]) -> dict[str, np.ndarray]:
    """``{name: float64 array of len(records)}``; missing values are NaN."""
    return {name: np.array([_number(r.get(name)) for r in records], dtype=np.float64)
            for name in names}


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan


def finite(value):
    """`value`, or None where JSON could not carry it (NaN, infinity: a diverged loss)."""
    return value if not isinstance(value, float) or math.isfinite(value) else None


class ColumnStore:
    """A growing history held as float64 columns (``array('d')``: 8 bytes a value), appended
    row batch by row batch and truncated by step after a rollback; steps ascend."""

    def __init__(self):
        self.names = list(BASE_COLUMNS)
        self.data = {name: array.array("d") for name in self.names}

    def __len__(self) -> int:
        return len(self.data["step"])

    def add(self, rows: list[dict]) -> None:
        for name in column_names(rows):
            if name not in self.data:
                self.names.append(name)
                self.data[name] = array.array("d", [math.nan]) * len(self)
        for name in self.names:
            self.data[name].extend(_number(r.get(name)) for r in rows)

    def truncate(self, step: int) -> None:
        """Drop the rows after `step`."""
        keep = bisect.bisect_right(self.data["step"], step)
        for col in self.data.values():
            del col[keep:]

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: np.frombuffer(self.data[name], dtype=np.float64) for name in self.names}


def ema(values: np.ndarray, weight: float) -> np.ndarray:
    """Debiased exponential moving average, as TensorBoard's scalar smoothing draws it.

    ``s_t = weight * s_{t-1} + (1 - weight) * x_t``, divided by ``1 - weight**n`` (n = values
    seen so far) so the start is not pulled towards zero (the bias correction of Adam, Kingma &
    Ba 2015). NaNs are skipped and stay NaN. ``weight`` is in [0, 1); 0 returns the values.
    """
    if not 0 <= weight < 1:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    out = np.full(len(values), np.nan)
    acc, n = 0.0, 0
    for i, x in enumerate(values):
        if math.isnan(x):
            continue
        n += 1
        acc = weight * acc + (1 - weight) * x
        out[i] = acc / (1 - weight ** n)
    return out


def decimate(cols: dict[str, np.ndarray], max_points: int) -> np.ndarray:
    """Indices of the rows to keep so that at most about `max_points` rows remain.

    Per bucket of consecutive rows it keeps the rows with the lowest and highest loss (spikes
    stay visible, as in min/max decimation), the first row of every epoch while there are at
    most MAX_EPOCH_LINES epochs (their boundaries stay exact) and every evaluation row while
    evaluations are sparse (at most a quarter of `max_points`); the last row is always kept.
    """
    n = len(cols["step"])
    if n <= max_points:
        return np.arange(n)
    keep = {n - 1}
    size = max(1, math.ceil(2 * n / max_points))
    loss = np.where(np.isnan(cols["loss"]), np.inf, cols["loss"])
    for start in range(0, n, size):
        chunk = loss[start:start + size]
        keep.add(start + int(np.argmin(chunk)))
        keep.add(start + int(np.argmax(np.where(np.isinf(chunk), -np.inf, chunk))))
    starts = np.flatnonzero(np.diff(cols["epoch"]) != 0) + 1
    if len(starts) <= MAX_EPOCH_LINES:
        keep.update(starts)
    for name, values in cols.items():
        evaluated = np.flatnonzero(~np.isnan(values)) if name.startswith("val_") else ()
        if len(evaluated) <= max_points // 4:
            keep.update(evaluated)
    return np.array(sorted(keep))
