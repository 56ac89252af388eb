"""A run's per-step history as columns: the shared data model of the dashboard and run.plot().

Columns are float64 arrays aligned on ``step``; a value a step lacks (an evaluation metric
between evaluations) is NaN.
"""
from __future__ import annotations

import math

import numpy as np

BASE_COLUMNS = ("step", "epoch", "loss", "world_size", "samples_per_s", "time")


def column_names(records: list[dict]) -> list[str]:
    """BASE_COLUMNS, then every other numeric field (extra and val_* metrics) in first-seen order."""
    names = list(BASE_COLUMNS)
    for record in records:
        for key, value in record.items():
            if key not in names and key != "lr" and isinstance(value, (int, float)):
                names.append(key)
    return names


def columns(records: list[dict], names: list[str]) -> dict[str, np.ndarray]:
    """``{name: float64 array of len(records)}``; missing values are NaN."""
    return {name: np.array([_number(r.get(name)) for r in records], dtype=np.float64)
            for name in names}


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan


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
    stay visible, as in min/max decimation), the first row of every epoch (its boundary stays
    exact) and every row carrying a metric that is otherwise NaN (evaluations are rare and all
    kept); the last row is always kept.
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
    epoch = cols["epoch"]
    keep.update(np.flatnonzero(np.diff(epoch) != 0) + 1)
    for name, values in cols.items():
        if name.startswith("val_"):
            keep.update(np.flatnonzero(~np.isnan(values)))
    return np.array(sorted(keep))
