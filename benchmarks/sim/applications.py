"""What a simulated job's application costs and gains, read from the Pollux study's measurements
(benchmarks/data/pollux/traces; README there says what each file holds).

The model is the one the Pollux paper's simulator uses, so that its published results can be
reproduced: a step's time by placement and local batch (measured where the placement was run,
interpolated over node count, GPU count and local batch where not); the statistical
efficiency of a batch size from the gradient's noise scale (McCandlish et al., *An Empirical
Model of Large-Batch Training*, 2018), as Pollux does; an epoch ends once the job's progress
(iterations weighted by that efficiency) reaches what the measured runs had made by then.
"""
from __future__ import annotations

import csv
import functools
import math
import pathlib
from dataclasses import dataclass

import numpy as np
from scipy.interpolate import LinearNDInterpolator

TRACES = pathlib.Path(__file__).resolve().parent.parent / "data" / "pollux" / "traces"

# Epochs each application trains for, and yolov3's largest local batch that fits a GPU: the
# settings of the Pollux study's simulator (its jobs train a fixed number of epochs).
EPOCHS = {"bert": 2, "cifar10": 100, "ncf": 10, "imagenet": 90, "deepspeech2": 80, "yolov3": 50}
MAX_LOCAL_BATCH = {"yolov3": 8}
MAX_NODES_MEASURED = 16  # the scalability traces' largest node count


def _rows(path: pathlib.Path) -> list[dict[str, float]]:
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


@dataclass(frozen=True)
class Epochs:
    """One validated batch size's run, by epoch (index 0 is the first epoch's end)."""

    progress: np.ndarray  # efficiency-weighted iterations so far
    grad_sqr: np.ndarray
    grad_var: np.ndarray


class Application:
    """One application of the study: its step times, its batch-size efficiency, its epochs.

    Args:
        name: a folder of benchmarks/data/pollux/traces (bert, cifar10, deepspeech2, imagenet,
            ncf, yolov3).
    Attributes:
        init_batch: the smallest validated batch size (efficiency 1 by definition);
        max_batch: the largest validated; min_local_batch, max_local_batch: the local batch
        sizes measured (a GPU's memory bounds the largest); epochs: epochs a job trains.
    """

    def __init__(self, name: str):
        folder = TRACES / name
        self.name = name
        self.validation: dict[int, Epochs] = {}
        for path in sorted(folder.glob("validation-*.csv")):
            rows = _rows(path)
            self.validation[int(path.stem.split("-")[1])] = Epochs(
                *(np.array([r[k] for r in rows]) for k in ("progress", "grad_sqr", "grad_var")))
        self.validation = dict(sorted(self.validation.items()))
        self._placements: dict[int, list[tuple[float, float, float]]] = {}
        measured = _rows(folder / "placements.csv")
        for r in measured:
            self._placements.setdefault(int(r["placement"]), []).append(
                (r["local_bsz"], r["step_time"], r["sync_time"]))
        for rows in self._placements.values():
            rows.sort()
        self._measured, self._scalability = measured, _rows(folder / "scalability.csv")
        self.init_batch, self.max_batch = min(self.validation), max(self.validation)
        local = [r["local_bsz"] for r in measured]
        self.min_local_batch = int(min(local))
        self.max_local_batch = MAX_LOCAL_BATCH.get(name, int(max(local)))
        self.epochs = EPOCHS[name]

    # ------------------------------------------------------------------ progress

    @functools.cache
    def progress_at(self, epoch: int) -> float:
        """The progress at which `epoch` epochs are done (the least any validated run needed)."""
        if epoch == 0:
            return 0.0
        return min(float(e.progress[epoch - 1]) for e in self.validation.values())

    @functools.cache
    def gain(self, batch: int, epoch: int) -> float:
        """Progress per step at `batch` samples during `epoch`, relative to a step of
        init_batch: between 1 (all signal) and batch / init_batch (all noise)."""
        sqr, var = self._grad_stats(batch, epoch)
        scale = batch / self.init_batch
        return (var + sqr) / (var / scale + sqr)

    def _grad_stats(self, batch: int, epoch: int) -> tuple[float, float]:
        """The gradient's statistics at `batch` (linear between the validated sizes around it)."""
        sizes = list(self.validation)
        lower = max((b for b in sizes if b <= batch), default=None)
        upper = min((b for b in sizes if b >= batch), default=None)
        if lower is None or upper is None:
            raise ValueError(f"{self.name}: batch {batch} outside the validated sizes {sizes}")
        lo, up = self.validation[lower], self.validation[upper]
        if lower == upper:
            return float(lo.grad_sqr[epoch]), float(lo.grad_var[epoch])
        w = (batch - lower) / (upper - lower)
        return (float((1 - w) * lo.grad_sqr[epoch] + w * up.grad_sqr[epoch]),
                float((1 - w) * lo.grad_var[epoch] + w * up.grad_var[epoch]))

    # ------------------------------------------------------------------ speed

    @functools.cache
    def step_time(self, placement: tuple[int, ...], local_batch: int) -> tuple[float, float]:
        """(step, sync) seconds of one micro-batch step of `local_batch` samples per GPU on
        `placement` (GPUs per node): measured where that placement was run, else interpolated
        over (nodes, GPUs, local batch) among every measurement."""
        placement = tuple(n for n in placement if n)
        # a placement is measured once in its smallest rotation
        key = int("".join(map(str, min(placement[i:] + placement[:i]
                                        for i in range(len(placement))))))
        if key in self._placements:
            rows = self._placements[key]
            xs = [r[0] for r in rows]
            return (float(np.interp(local_batch, xs, [r[1] for r in rows])),
                    float(np.interp(local_batch, xs, [r[2] for r in rows])))
        nodes = min(len(placement), MAX_NODES_MEASURED)
        step, sync = self._interpolator()([nodes, sum(placement), local_batch])[0]
        if math.isnan(step):
            raise ValueError(f"{self.name}: no step time for {placement} at {local_batch}")
        return float(step), float(sync)

    @functools.cache
    def _interpolator(self) -> LinearNDInterpolator:
        """Over the measured placements (their mean by node count, GPU count and local batch)
        and the scalability runs."""
        groups: dict[tuple[float, float, float], list[tuple[float, float]]] = {}
        for r in self._measured:
            placement = str(int(r["placement"]))
            key = (len(placement), sum(map(int, placement)), r["local_bsz"])
            groups.setdefault(key, []).append((r["step_time"], r["sync_time"]))
        points = [k for k in groups] + [
            (r["num_nodes"], r["num_replicas"], r["local_bsz"]) for r in self._scalability]
        values = [tuple(np.mean(v, axis=0)) for v in groups.values()] + [
            (r["step_time"], r["sync_time"]) for r in self._scalability]
        return LinearNDInterpolator(np.array(points), np.array(values))


@functools.cache
def application(name: str) -> Application:
    return Application(name)
