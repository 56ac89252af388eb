"""When the run's LR scheduler steps, and with which value.

Every torch scheduler steps once per optimizer step, except ReduceLROnPlateau, which needs a
metric: with ``--plateau-metric val_<name>`` it steps at each evaluation with that validation
metric; without, once per epoch with the epoch's mean training loss (the mean over its
samples). Every rank steps with the same value (losses and metrics are reduced across ranks),
so the learning rate stays the same everywhere; the scheduler's state goes into broadcasts and
checkpoints like any scheduler's.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

from typing import Any, Protocol, Sized

from torch.optim.lr_scheduler import ReduceLROnPlateau

from ...config.run import RunConfig
from ..state.history import History
from ..state.training_state import Progress
from .objects import SetupError


class Worker(Protocol):
    """What the scheduler's stepping reads of the engine's Worker (engine.worker.Worker)."""

    @property
    def config(self) -> RunConfig: ...
    @property
    def lr_scheduler(self) -> Any: ...
    @property
    def dataset(self) -> Sized: ...
    @property
    def progress(self) -> Progress: ...
    @property
    def history(self) -> History: ...


def check(scheduler: Any, metric: str | None, evaluates: bool) -> None:
    """Raise SetupError when ``--plateau-metric`` `metric` cannot work with the cell's
    `scheduler` (its lr_scheduler) or without an evaluation (`evaluates`: an eval_dataset)."""
    if not metric:
        return
    if not isinstance(scheduler, ReduceLROnPlateau):
        kind = type(scheduler).__name__ if scheduler is not None else "none"
        raise SetupError(f"--plateau-metric {metric} is for a ReduceLROnPlateau lr_scheduler; "
                         f"the cell's lr_scheduler is {kind}")
    if not evaluates:
        raise SetupError(f"--plateau-metric {metric} needs an evaluation: define eval_dataset "
                         "and metric_fn(model, batch) in the cell")


def step_lr_scheduler(worker: Worker, record: dict) -> None:
    """Step `worker`'s scheduler after the optimizer step of `record`, once `record` holds that
    step's evaluation (if any) and is in ``worker.history``.

    Raises ValueError when the evaluation lacks the ``--plateau-metric`` (naming those it has).
    """
    scheduler = worker.lr_scheduler
    if scheduler is None:
        return
    if not isinstance(scheduler, ReduceLROnPlateau):
        scheduler.step()
        return
    metric = worker.config.plateau_metric
    if metric:
        evaluated = sorted(k for k in record if k.startswith("val_"))
        if evaluated and metric not in record:
            raise ValueError(f"--plateau-metric {metric}: the evaluation gives "
                             f"{', '.join(evaluated)}")
        if evaluated:
            scheduler.step(record[metric])
    elif worker.progress.epoch != record["epoch"]:  # this step ended an epoch
        scheduler.step(epoch_mean_loss(worker.history.records, record["epoch"],
                                       len(worker.dataset), worker.config.global_batch))


def epoch_mean_loss(history: list[dict], epoch: int, samples: int, global_batch: int) -> float:
    """Mean training loss over `epoch`, from its records at the end of `history`: each step's
    loss weighted by what it is a mean over — its ``items`` when loss_fn returned MeanOver,
    else its samples (every step but the last consumed `global_batch`, the last the rest of
    the epoch's `samples`)."""
    records = []
    for record in reversed(history):
        if record["epoch"] != epoch:
            break
        records.append(record)
    records.reverse()
    sizes = [global_batch] * (len(records) - 1) + [samples - global_batch * (len(records) - 1)]
    weights = [r.get("items", size) for r, size in zip(records, sizes)]
    return sum(r["loss"] * w for r, w in zip(records, weights)) / sum(weights)
