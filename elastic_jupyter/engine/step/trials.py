"""The user's functions tried once at setup, so a mistake shows before the training does.

The run calls some of the cell's functions only later: ``metric_fn`` first at the final
evaluation, the lr scheduler's step after the first step. :class:`SetupTrials` calls each once
on a small batch at setup and turns its error into a SetupError naming the function; nothing
they change stays.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import copy
import warnings

import torch
from torch.optim.lr_scheduler import ReduceLROnPlateau

from ...config.run import RunConfig
from ..data.batching import BatchPlan
from ..data.map_pipeline import pass_batches
from ..data.randomness import host_generator_state, set_host_generator_state
from ..data.to_device import to_device
from .evaluation import EVAL_EPOCH, evaluation_mode
from .losses import floats, read_metrics, weighted
from .objects import CellObjects, SetupError

TRIAL_SAMPLES = 4  # samples each user function is tried on at setup


class SetupTrials:
    """The cell's later-called functions, tried at setup (:meth:`run`).

    Args:
        config: the run's options (seed, plateau_metric).
        objects: the cell's objects.
        plan: the run's batch plan (the first step's samples).
        device: where the model runs.
        model_runs: whether the trials may run the model (not a sharded run's on a GPU, whose
            trained parameters wait on the host for the first mesh: its ``metric_fn`` is
            first called at the first evaluation; engine.modes.state_mode).
    """

    def __init__(self, config: RunConfig, objects: CellObjects, plan: BatchPlan,
                 device: torch.device, model_runs: bool = True):
        self.config, self.objects, self.plan, self.device = config, objects, plan, device
        self.model_runs = model_runs  # the state mode's model_runs_at_setup

    def run(self) -> None:
        """Call, once at setup, the functions the run calls later, on a small batch, so that a
        mistake in one shows now as a SetupError rather than after the training (a typo in
        ``metric_fn``, first called at the final evaluation): the dataset and ``collate_fn`` on
        the first step's first samples, the lr scheduler's step, and ``metric_fn`` on the first
        samples of ``eval_dataset`` (evaluation mode, no gradients), whose names must hold
        ``--plateau-metric`` (not for a sharded run on a GPU: see the class).

        Nothing they change stays: the parameters (nothing steps, no gradient is taken),
        buffers and layer modes (put back), the random generators (torch's, Python's,
        numpy's), the scheduler's state and the optimizer's param groups (its learning rates,
        momenta) are as before. Raises SetupError naming
        the function, from its error (the engine traceback shows the cell's line).
        """
        cuda = [torch.cuda.current_device()] if self.device.type == "cuda" else []
        host = host_generator_state()
        try:
            with torch.random.fork_rng(devices=cuda, device_type="cuda"):
                self._try_collate()
                self._try_scheduler()
                if self.model_runs:
                    self._try_metric_fn()
        finally:
            set_host_generator_state(host)

    def _try_collate(self) -> None:
        cell = self.objects
        first = self.plan.batch(0, 0)[:TRIAL_SAMPLES].tolist()
        try:
            next(pass_batches(cell.dataset, [[(0, i) for i in first]], self.config.seed, 0,
                              cell.collate_fn, cell.worker_init_fn, pin_memory=False))
        except Exception as e:
            raise SetupError(
                f"reading {len(first)} training samples and collating them (dataset[i], "
                f"collate_fn), tried at setup, failed: {type(e).__name__}: {e}") from e

    def _try_scheduler(self) -> None:
        scheduler = self.objects.lr_scheduler
        if scheduler is None:
            return
        try:
            saved = copy.deepcopy(scheduler.state_dict())
        except Exception:  # noqa: BLE001 -- a state it cannot copy cannot be put back: no trial
            return
        # each group's values as they are (the objects, and a copy of a tensor's value: a
        # scheduler may set a tensor lr in place)
        groups = [{k: (v, v.clone() if torch.is_tensor(v) else copy.deepcopy(v))
                   for k, v in group.items() if k != "params"}
                  for group in self.objects.optimizer.param_groups]
        try:
            with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()"
                warnings.simplefilter("ignore")
                if isinstance(scheduler, ReduceLROnPlateau):
                    scheduler.step(0.0)
                else:
                    scheduler.step()
        except Exception as e:
            raise SetupError(f"the lr_scheduler's step, tried at setup, failed: "
                             f"{type(e).__name__}: {e}") from e
        finally:
            scheduler.load_state_dict(saved)
            self._put_back(groups)

    def _put_back(self, groups: list[dict]) -> None:
        """The optimizer's param groups as `groups` ({key: (object, value)}) held them."""
        for group, values in zip(self.objects.optimizer.param_groups, groups):
            for k in [k for k in group if k != "params" and k not in values]:
                del group[k]
            for k, (obj, value) in values.items():
                if torch.is_tensor(obj):
                    with torch.no_grad():
                        obj.copy_(value)
                    group[k] = obj
                else:
                    group[k] = value

    def _try_metric_fn(self) -> None:
        cell = self.objects
        if cell.eval_dataset is None or len(cell.eval_dataset) == 0:
            return
        assert cell.metric_fn is not None  # objects.CellObjects checks it with eval_dataset
        samples = min(len(cell.eval_dataset), TRIAL_SAMPLES)
        try:
            with evaluation_mode(cell.model):
                batch = next(pass_batches(
                    cell.eval_dataset, [[(EVAL_EPOCH, i) for i in range(samples)]],
                    self.config.seed, 0, cell.collate_fn, cell.worker_init_fn,
                    pin_memory=False))
                out = cell.metric_fn(cell.model, to_device(batch, self.device))
                metrics = read_metrics(out, samples)
                floats([weighted(x, 1.0) for pair in metrics.values() for x in pair])
        except Exception as e:
            raise SetupError(f"metric_fn, tried at setup on the first {samples} samples of "
                             f"eval_dataset, failed: {type(e).__name__}: {e}") from e
        metric = self.config.plateau_metric
        if metric and metric not in {f"val_{name}" for name in metrics}:
            raise SetupError(f"--plateau-metric {metric}: metric_fn, tried at setup, gives "
                             f"{', '.join(sorted(f'val_{n}' for n in metrics)) or 'nothing'}")
