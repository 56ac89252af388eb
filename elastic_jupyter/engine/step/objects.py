"""The objects a run's cell (or setup function) defines, checked before anything uses them.

A cell must define ``model``, ``optimizer``, ``dataset`` and ``loss_fn(model, batch)``; the
dataset is map-style, or iterable with ``shard(num_shards, index)`` (engine.data.stream_split: then
``len(dataset)`` or the cell's ``dataset_length`` says an epoch's samples, else the run needs
``--steps``); several optimizers are a dict {name: optimizer} with ``loss_fn`` a dict of losses
of the same names (engine.step.optimizers). It may define ``lr_scheduler``, ``collate_fn``,
``worker_init_fn``, ``eval_dataset`` with ``metric_fn(model, batch)``, ``min_micro_batch``,
``after_step``, ``extra_state`` and ``shard_fn(model, mesh)``. A mistake in their kinds is a
:class:`SetupError` naming what to change.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...config.run import RunConfig
from ..data.stream_split import Streams, declared_length, is_iterable_dataset
from .optimizers import NamedOptimizers, OptimizersError, Substep, schedulers, substeps

REQUIRED = ("model", "optimizer", "dataset", "loss_fn")


class SetupError(RuntimeError):
    """The run's cell or setup function did not produce a usable training setup."""


@dataclass
class CellObjects:
    """The cell's objects (see the module docstring); ``collate_fn`` is torch's default
    collation when the cell gives none, ``extra_state`` {} (more training state to keep: an
    EMA of the weights, {name: object with state_dict()}). One instance is shared by the
    Worker and the owners it hands it to, so all of them see one model."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    dataset: Any
    loss_fn: Callable | dict  # with several optimizers, {name: loss_fn} (substeps hold each)
    lr_scheduler: Any = None
    collate_fn: Callable = torch.utils.data.default_collate
    worker_init_fn: Callable | None = None
    eval_dataset: Any = None
    metric_fn: Callable | None = None
    min_micro_batch: int | None = None  # the cell's floor, if declared
    after_step: Callable | None = None  # called after each committed step
    extra_state: dict = dataclasses.field(default_factory=dict)
    shard_fn: Callable | None = None  # shard_fn(model, mesh) under shard=True
    # (engine.sharded.resizable_model)
    # each optimizer's part of a step, in order (engine.step.optimizers): one for a single optimizer
    substeps: list[Substep] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, namespace: dict, config: RunConfig) -> CellObjects:
        """The objects of the cell's `namespace`, checked for a run of `config`; an iterable
        dataset becomes its :class:`~.streams.Streams`. Raises SetupError naming the first
        mistake."""
        missing = [name for name in REQUIRED if name not in namespace]
        if missing:
            raise SetupError(
                f"the cell did not define {', '.join(missing)}: it must define "
                "model, optimizer, dataset and loss_fn(model, batch)")
        try:  # several optimizers: named, each with its loss (engine.step.optimizers)
            optimizer, lr_scheduler, substeps = _optimizers(namespace, config)
        except OptimizersError as e:
            raise SetupError(str(e)) from None
        objects = cls(
            namespace["model"], optimizer, namespace["dataset"],
            namespace["loss_fn"], lr_scheduler,
            namespace.get("collate_fn") or torch.utils.data.default_collate,
            namespace.get("worker_init_fn"), namespace.get("eval_dataset"),
            namespace.get("metric_fn"), namespace.get("min_micro_batch"),
            namespace.get("after_step"), namespace.get("extra_state") or {},
            namespace.get("shard_fn"), substeps)
        if is_iterable_dataset(objects.dataset):
            objects.dataset = _streams(objects.dataset, namespace, config)
        objects._check(config.global_batch)
        return objects

    def _check(self, global_batch: int) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise SetupError(f"model must be a torch.nn.Module, got {type(self.model).__name__}")
        if not isinstance(self.optimizer, (torch.optim.Optimizer, NamedOptimizers)):
            raise SetupError(
                f"optimizer must be a torch.optim.Optimizer, got {type(self.optimizer).__name__} "
                "(several optimizers: a dict {name: optimizer}, with loss_fn a dict of losses)")
        if not all(callable(sub.loss_fn) for sub in self.substeps):
            raise SetupError("loss_fn must be a function loss_fn(model, batch) -> loss")
        try:
            n = len(self.dataset)
        except TypeError:
            raise SetupError("dataset must be a torch Dataset: map-style (with __len__ and "
                             "__getitem__) or iterable (with shard(num_shards, index))") from None
        if n < global_batch:
            raise SetupError(f"dataset has {n} samples, fewer than the global batch "
                             f"{global_batch}: lower --global-batch")
        if self.eval_dataset is not None and is_iterable_dataset(self.eval_dataset):
            raise SetupError("eval_dataset must be map-style (with __len__ and __getitem__): "
                             "an evaluation reads each of its samples once, split over the "
                             "ranks; take a fixed part of the stream into a list")
        self._check_extra_state()
        floor = self.min_micro_batch
        if floor is not None and (isinstance(floor, bool) or not isinstance(floor, int)
                                  or floor < 1):
            raise SetupError(f"min_micro_batch must be a positive integer (the fewest samples "
                             f"a micro-batch may hold), got {floor!r}")
        if self.eval_dataset is not None and self.metric_fn is None:
            raise SetupError("eval_dataset is defined but metric_fn(model, batch) -> dict is not")

    def _check_extra_state(self) -> None:
        if self.after_step is not None and not callable(self.after_step):
            raise SetupError("after_step must be a function after_step(model, optimizer, step)")
        extra = self.extra_state
        if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
            raise SetupError("extra_state must be a dict {name: object}, such as "
                             "{'ema': ema}, got " + type(extra).__name__)
        for name, obj in extra.items():
            if name == "model":
                raise SetupError("extra_state cannot be named 'model': run.state_dict() and "
                                 "export() name the model so; choose another name")
            if not (callable(getattr(obj, "state_dict", None))
                    and callable(getattr(obj, "load_state_dict", None))):
                raise SetupError(f"extra_state[{name!r}] is a {type(obj).__name__}, which has "
                                 "no state_dict() and load_state_dict(): give a torch.nn.Module "
                                 "(an EMA of the weights) or an object with both")

    def use_sync_batchnorm(self, config: RunConfig, device: torch.device) -> None:
        """Replace the model by one with BatchNorm statistics over the whole global batch
        instead of each micro-batch (torch's SyncBatchNorm). Raises SetupError where that
        cannot work."""
        if device.type != "cuda":
            raise SetupError("--sync-batchnorm needs GPU slots: torch's SyncBatchNorm runs only "
                             "on CUDA. Plain BatchNorm needs no conversion for results "
                             "independent of the world size: its statistics are per "
                             "micro-batch, combined in micro-batch order")
        n, B, most = len(self.dataset), config.global_batch, config.pool_max_size
        if B < most:
            raise SetupError(f"--sync-batchnorm needs a sample on every rank at every step "
                             f"(SyncBatchNorm is a collective): raise --global-batch {B} to at "
                             f"least the pool's --max {most}")
        if 0 < n % B < most and not config.drop_last:
            raise SetupError(
                f"--sync-batchnorm needs a sample on every rank at every step (SyncBatchNorm is a "
                f"collective), but the last step of each epoch holds {n % B} samples, fewer than "
                f"the pool's --max {most}: choose a --global-batch that divides the dataset size "
                f"{n} or leaves a remainder of at least {most}")
        # the converted layers keep the same Parameter objects, so the optimizer still holds them
        self.model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(self.model)


def _optimizers(namespace: dict, config: RunConfig) -> tuple[Any, Any, list[Substep]]:
    """(optimizer, lr_scheduler, sub-steps) of the cell: its own for one optimizer, their
    named wrappers for several (engine.step.optimizers). Raises OptimizersError."""
    optimizer, lr_scheduler = namespace["optimizer"], namespace.get("lr_scheduler")
    steps = substeps(optimizer, namespace["loss_fn"])
    if steps[0].name is None:
        if isinstance(lr_scheduler, dict):
            raise OptimizersError("lr_scheduler is a dict of schedulers but optimizer is one "
                                  "optimizer: give its scheduler itself")
        return optimizer, lr_scheduler, steps
    if config.precision == "fp16":
        raise OptimizersError("--precision fp16 scales one optimizer's gradients: with several "
                              "optimizers use bf16 (no gradient scaling) or float32")
    return NamedOptimizers(optimizer), schedulers(lr_scheduler, optimizer), steps


def _streams(dataset, namespace: dict, config: RunConfig) -> Streams:
    """The cell's iterable `dataset` as the run's streams (engine.data.stream_split); raises
    SetupError for one that cannot be split into streams or whose run has no length."""
    name = type(dataset).__name__
    if not callable(getattr(dataset, "shard", None)):
        raise SetupError(
            f"dataset is an iterable {name} without a shard protocol: a run reads an iterable "
            "dataset as disjoint streams, stream i of n being dataset.shard(num_shards=n, "
            "index=i) (as datasets.IterableDataset.shard). Give it such a method (for example "
            "one that takes every n-th of its files, from the i-th), or use a map-style "
            "dataset")
    length = declared_length(dataset, namespace)
    if length is None and not config.steps:
        raise SetupError(f"dataset is an iterable {name} of unknown length: give --steps N, "
                         "or declare dataset_length = the samples of one epoch in the cell "
                         "(then --epochs counts epochs, and every stream is read again in each)")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int)
                               or length < 1):
        raise SetupError(f"dataset_length must be a positive integer (the samples of one "
                         f"epoch), got {length!r}")
    count = config.pool_max_size  # each rank at the pool's largest size reads one stream
    shards = getattr(dataset, "num_shards", None)  # a datasets.IterableDataset's files
    if isinstance(shards, int) and 0 < shards < count:
        count = shards  # datasets splits by files: no more streams than files
    streams = Streams(dataset, count, length, config.global_batch, bool(config.drop_last),
                      seed=config.seed)
    try:
        streams.check()
    except ValueError as e:
        raise SetupError(str(e)) from None
    return streams


class CellAttribute:
    """A Worker attribute that is the cell's object of the same name (``worker.model`` is
    ``worker.objects.model``, read and written): the Worker and the owners it hands the
    objects to (evaluation, trials, the cut) see one value."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, worker: Any, owner: type | None = None) -> Any:
        return self if worker is None else getattr(worker.objects, self.name)

    def __set__(self, worker: Any, value: Any) -> None:
        setattr(worker.objects, self.name, value)
