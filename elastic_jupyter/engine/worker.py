"""One engine's share of a run: the user's objects, their state, one optimizer step.

The Worker holds the model, optimizer and dataset the cell defined, captures and restores their
state (for broadcasts and checkpoints), and runs one optimizer step or an evaluation with every
rank of the current process group. A step is a transaction: its update is applied only after
every rank voted that its reduction succeeded (engine.group.vote); a step that fails before leaves
the model, optimizer and BatchNorm statistics as it found them, so after a fault the survivors
simply go on, and no copy of the state is kept. Forming the group and looping over steps is
engine.generation's job; the calls the owner makes are in engine.entrypoints.

The Worker keeps the step loop and hands the rest to owners of their own: the cell's objects
are checked by engine.step.objects, the cut chosen and recorded by engine.step.cut_choice, each
micro-batch weighted by engine.step.weighting, the input pipeline run by engine.data.map_pipeline,
the evaluation done by engine.step.evaluation and the setup's trials by engine.step.trials,
rank 0's checkpoints copied and written by engine.state.whole_checkpoints, and which records a
rank keeps decided by engine.state.history.

The update is the mean gradient of the global batch B whatever the world size
(engine.step.weighting; the last step of an epoch has fewer samples than B: there B is that step's
sample count). Gradients are summed as torch's DDP sums them (engine.group.reduce).

This module imports nothing from IPython or the UI: it runs the same way from a script.
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import ReduceLROnPlateau

from ..config.run import RunConfig
from ..events import Event
from .data.batching import BatchPlan, Cut, steps_per_epoch
from .data.map_pipeline import input_pipeline
from .data.randomness import host_generators_kept, micro_batch_stream
from .data.stream_split import Streams
from .data.to_device import to_device
from .faultpoints import fault_point
from .group.reduce import LayoutError
from .group.vote import Vote
from .modes.factory import state_mode
from .notes import after_step_note, micro_batch_note
from .protocol import TrainingState
from .sharded.lifecycle import is_pad, pad_source
from .state import training_state as state_mod
from .state.checkpoint import unloadable
from .state.frozen import FrozenWeights
from .state.history import History
from .state.whole_checkpoints import WholeCheckpoints
from .step.cut_choice import CutChoice
from .step.evaluation import Evaluation
from .step.losses import floats, weighted
from .step.objects import CellAttribute, CellObjects, SetupError
from .step.optimizers import Substep, check_resumed, learning_rates, optimized, owners
from .step.precision import Precision, PrecisionError
from .step import schedulers
from .step.running_stats import RunningStats
from .step.trials import SetupTrials
from .step.weighting import StepWeights

__all__ = ["SetupError", "Worker"]  # SetupError is engine.step.objects'; the Worker raises it too


def _step_record(p: state_mod.Progress, epoch: int, losses: dict[str, list[float]], lrs: dict,
                 world_size: int, samples: int, seconds: float, weights: StepWeights) -> dict:
    """The history record of committed step ``p.step`` of epoch `epoch`: its loss and extra
    metrics (`losses`: [loss, *extras] by optimizer name, "" for the cell's only one; with
    several, ``loss`` and the extras are the first's, ``loss_<name>`` each one's), learning
    rates, world size and speed."""
    first = next(iter(losses.values()))
    record = {"step": p.step, "epoch": epoch, "loss": first[0], **lrs,
              "world_size": world_size, "samples_per_s": samples / max(seconds, 1e-9),
              "time": time.time()}
    record.update({f"loss_{name}": values[0] for name, values in losses.items() if name})
    record.update(zip(p.metric_names, first[1:]))
    if weights.mean_over:  # what the step's loss is a mean over (an epoch's mean weighs it)
        record["items"] = int(round(weights.items))
    return record


def _place_extra_state(extra: dict, device: torch.device) -> None:
    """Move the cell's extra modules to the model's device: an EMA updates from the model where
    it is, unless it says where it lives (timm's ModelEmaV3(device="cpu"))."""
    for obj in extra.values():
        if isinstance(obj, torch.nn.Module) and getattr(obj, "device", None) is None:
            obj.to(device)


def _add_metrics(p: state_mod.Progress, sub: Substep, first: bool, metrics: dict, weight,
                 extras: list) -> list:
    """`extras` with a pass's extra `metrics` added, weighted by `weight`; the first pass that
    gives any names the run's (``p.metric_names``). Raises ValueError for a later sub-step's
    loss_fn that gives metrics (a record has the first optimizer's only)."""
    if not first:
        if metrics:
            raise ValueError(f"loss_fn[{sub.name!r}] returned extra metrics: with several "
                             "optimizers only the first one's loss_fn may")
        return extras
    if metrics and not p.metric_names:
        p.metric_names, extras = sorted(metrics), [0.0 for _ in metrics]
    return [e + weighted(metrics[name], weight) for e, name in zip(extras, p.metric_names)]


class Worker:
    """One engine's share of a run: the user's objects plus the run's progress.

    Args:
        objects: namespace produced by the cell or setup function (engine.step.objects: must hold
            ``model``, ``optimizer``, ``dataset`` and ``loss_fn(model, batch)``).
        config: the run's options (config.RunConfig, or the plain dict the kernel sends,
            ``RunConfig.as_dict()``).
        device: torch device string this engine trains on ("cpu" or "cuda").
        slot: the engine's slot (fault points match it against armed slots), None outside a pool.
        frozen_digests: the frozen weights' digests, when taken before (engine.state.frozen).
    Raises SetupError when the objects or options cannot make a run.
    """

    @property
    def config(self) -> RunConfig:
        """The run's options; the state mode reads the same (set both, as tests do to turn
        on an option the setup refuses on this machine)."""
        return self._config

    @config.setter
    def config(self, value: RunConfig) -> None:
        self._config = value
        if "mode" in vars(self):
            self.mode.config = value

    # the cell's objects (engine.step.objects), shared with the owners this Worker hands them to
    model, optimizer, dataset = CellAttribute(), CellAttribute(), CellAttribute()
    lr_scheduler, eval_dataset, metric_fn = CellAttribute(), CellAttribute(), CellAttribute()
    after_step, extra_state = CellAttribute(), CellAttribute()  # extra: an EMA, {name: obj}

    def __init__(self, objects: dict, config: RunConfig | Mapping[str, Any], device: str,
                 slot: int | None = None, frozen_digests: dict[str, str] | None = None):
        config = config if isinstance(config, RunConfig) else RunConfig.from_dict(config)
        cell = CellObjects.of(objects, config)
        self.config, self.slot = config, slot
        # with its index: torch.device("cuda") != torch.device("cuda:0") in comparisons
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if device.startswith("cuda") else torch.device("cpu"))
        if config.sync_batchnorm:
            cell.use_sync_batchnorm(config, self.device)
        self.objects = cell
        # who holds the training state: every rank, or each its rows (engine.modes.state_mode)
        self.mode = state_mode(config)
        self.mode.check(cell, self.device)
        self.mode.place_model(self.model, self.device)
        self.frozen = FrozenWeights(self.model, not config.move_frozen, frozen_digests)
        _place_extra_state(self.extra_state, self.device)
        self.mode.set_up(cell, self.device, functools.partial(fault_point, "reduce_scatter", self))
        try:
            self.reducer = self.mode.gradient_reducer(self.model, self.device,
                                                      owners(cell.substeps))
            self.precision = Precision(config.precision, self.device)
        except (LayoutError, PrecisionError) as e:
            raise SetupError(str(e)) from None
        self.weights = StepWeights(self.precision, self.reducer)  # MeanOver or samples
        self._first_step_of_generation = False
        self.running_stats = RunningStats(self.model)
        self.cut_choice = CutChoice(config, cell, self.device, self.precision)
        try:
            cut = self.cut_choice.configured()
        except SetupError:
            self.reducer.close()  # its hooks would keep it on a model that outlives the run
            raise
        samples, B, drop_last = len(self.dataset), config.global_batch, bool(config.drop_last)
        self.plan = BatchPlan(samples, B, config.seed, cut, drop_last,
                              shuffle=not (config.no_shuffle or isinstance(cell.dataset, Streams)))
        self.progress = state_mod.Progress()  # its cut is recorded at the first generation
        self.pipeline = input_pipeline(cell, self.plan, config, self.device, lambda: self.progress)
        self.evaluation = Evaluation(config, cell, self.plan, self.device, self.mode)
        self.total_steps = config.total_steps or config.steps or (
            (config.epochs or 1) * steps_per_epoch(samples, B, drop_last))
        # the dataset's fingerprint (engine.data.fingerprint) once the setup took it: checkpoints
        # carry it in their config, and a resume checks it
        self.fingerprint: dict | None = None
        self.history = History()  # the newest records only (engine.state.history)
        self.in_flight = False  # a step begun, not committed (what a fault now would lose)
        # whether this engine holds the run's state: a generation's rank that is sent none (its
        # setup's state at the run's start), or once a state is loaded (recovery counts these)
        self.holds_state = False
        # the record of a committed step whose evaluation, history entry and scheduler step
        # are still to do (a fault hit its evaluation): the next generation does them first
        self.pending: dict | None = None
        # rank 0's whole checkpoints (engine.state.whole_checkpoints; a sharded run writes
        # none: every rank its part)
        self.checkpoints = WholeCheckpoints(self.mode.checkpoint_writer(self._before_write))

    def check_setup(self) -> None:
        """Refuse, before the first step, a setup whose checkpoints could not be loaded, whose
        scheduler options do not fit, or (where the state mode lets the engine try them) whose
        functions the run calls later fail when tried once, on a small batch
        (engine.step.trials.SetupTrials.run: nothing they change stays). Raises SetupError."""
        schedulers.check(self.lr_scheduler, self.config.plateau_metric,
                         self.eval_dataset is not None)
        self.mode.check_setup(
            lambda: SetupTrials(self.config, self.objects, self.plan, self.device,
                                self.mode.model_runs_at_setup(self.device)).run())
        state = state_mod.capture(self.model, self.optimizer, self.lr_scheduler, self.progress,
                                  self.history.records, self.config_record(),
                                  copy_tensors=False, grad_scaler=self.precision.scaler)
        problem = unloadable(state)
        if problem:
            raise SetupError(f"the training state could not be checkpointed: {problem}")

    def moved_to(self, objects: dict, device: str, slot: int) -> Worker:
        """This run's Worker built again from the cell's `objects` on `device` (a warm engine
        bound to a GPU slot: engine.entrypoints.bind_slot); this one is closed. A cell that
        chose a device for itself fails here, not mid-step. Raises SetupError."""
        self.close()
        again = Worker(objects, self.config, device, slot=slot,
                       frozen_digests=self.frozen.digests)  # the same bytes: not hashed again
        # a sharded run's released rows (entrypoints.setup_run) cannot run the trials, which
        # ran on the host at its setup: the mode skips them
        again.check_setup()
        again.fingerprint = self.fingerprint
        return again

    def close(self) -> None:
        """Finish the checkpoint writes and end the writer thread (which holds this Worker),
        and take the gradient reducer's hooks off the parameters (which would hold its
        buckets)."""
        self.checkpoints.close()
        self.reducer.close()

    # state -------------------------------------------------------------------------------------

    def _before_write(self) -> None:
        """Before each checkpoint write, on the writer's thread."""
        fault_point("checkpoint", self)
        self.frozen.verify()  # a frozen tensor that changed fails the run (engine.state.frozen)

    def capture(self, copy_tensors: bool = True, staging: state_mod.Staging | None = None
                ) -> TrainingState:
        """The training state as plain data (engine.state.training_state); ``copy_tensors=False``
        gives the live tensors, for a reader done before training goes on; `staging` reused buffers
        to copy into (a checkpoint's)."""
        return self.mode.capture(
            state_mod.capture, model=self.model, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, progress=self.progress,
            history=self.history.records, config=self.config_record(),
            copy_tensors=copy_tensors, grad_scaler=self.precision.scaler, staging=staging,
            extra=self.extra_state, frozen=self.frozen.digests)

    def config_record(self) -> dict:
        """The run's options as its checkpoints store them (plain data): the config's fields,
        the total steps as derived, and ``dataset``, the dataset's fingerprint once taken."""
        record = dict(self.config.as_dict(), total_steps=self.total_steps)
        if self.fingerprint is not None:
            record["dataset"] = self.fingerprint
        return record

    def restore(self, state: TrainingState) -> None:
        """Continue from `state` (a broadcast or a checkpoint), with its step whose evaluation
        is still to do when it holds one (``pending``: the checkpoint written before the final
        evaluation, engine.generation)."""
        self.checkpoints.wait_for_copies()  # they read the tensors this overwrites
        self.pending, self.in_flight = state.get("pending"), False
        self.progress, records = state_mod.restore(
            state, self.model, self.optimizer, self.lr_scheduler, self.precision.scaler,
            self.extra_state, load_model=self.mode.model_loader(self.frozen, state))
        self.history = History(records)
        check_resumed(self.objects.substeps, self.progress.substep, self.progress.losses)
        self.checkpoints.forget_saved()  # what it wrote before may be of another timeline
        self.holds_state = True
        if self.progress.cut is not None:  # the run's own cut, whatever this run's options
            self.plan.cut = Cut(**self.progress.cut)

    def forget_history(self, acknowledged: int | None) -> None:
        """Drop the records no one will ask this rank for (engine.state.history): those the kernel
        acknowledged (`acknowledged`: its complete step; None when no kernel reads the run),
        that are in the checkpoint folder's history file (up to the checkpoint before the
        newest scheduled one, or this rank's last written one if older: any rank may write
        the next), and not of the current epoch when ReduceLROnPlateau steps by its loss."""
        p = self.progress
        epoch_start = (self.history.epoch_start(p.epoch) if isinstance(
            self.lr_scheduler, ReduceLROnPlateau) and not self.config.plateau_metric else None)
        self.history.forget_unneeded(p.step, acknowledged, [
            self.checkpoints.history_needed_after(p.step, self.config.checkpoint_every or 0),
            None if epoch_start is None else epoch_start - 1], self.mode.history_kept_after)

    # a generation's start -------------------------------------------------------------------

    def start_generation(self, rank: int, world_size: int) -> Event | None:
        """Ready this rank for a new generation's steps (a collective: all ranks call it, after
        the state broadcast, before the first step): the run's cut recorded if it has none yet
        (measured first with ``--pass-cost measure``), and the gradient buckets laid out as
        rank 0's, then rebuilt once more after the generation's first step in the order its
        gradients come (engine.group.reduce).

        Returns, on rank 0 of the run's first generation, the ``micro_batches`` event.
        """
        # engine.step.cut_choice.CutChoice.record: a collective with --pass-cost measure
        event = self.cut_choice.record(self.plan, self.progress, rank, world_size) \
            if self.progress.cut is None else None
        self.mode.start(self, rank, world_size)  # a sharded model's rows come now
        self.reducer.sync_order(world_size)
        self._first_step_of_generation = True
        return event

    def input_at(self, rank: int, world_size: int) -> tuple[tuple, Callable, int]:
        """Where this rank's input pipeline reads next, as its calls take it: (rank, world
        size, epoch, position), the cut of a step's samples into its passes, the steps left."""
        p = self.progress
        return ((rank, world_size, p.epoch, p.position),
                lambda batch: self._passes(batch, rank, world_size), self.total_steps - p.step)

    def end_generation(self) -> None:
        """The generation ended (or failed): stop its input pipeline's loader processes, finish
        a checkpoint's copies and a sharded one's write (engine.generation gives it up)."""
        self.pipeline.stop()
        self.checkpoints.wait_for_copies()
        self.mode.end_generation()

    # one optimizer step ----------------------------------------------------------------------

    def _passes(self, batch: torch.Tensor, rank: int,
                world_size: int) -> list[tuple[int, torch.Tensor]]:
        """This rank's passes of a step over `batch` (sample indices): its micro-batches
        (index k, sample indices), or with --sync-batchnorm all of them in one pass."""
        return self.mode.passes(self.plan, batch,
                                self.plan.rank_micro_batches(batch, rank, world_size),
                                world_size)

    def _micro_batch_passes(self, parts: list[tuple[int, torch.Tensor]], B: int,
                            world_size: int):
        """Yield (zero-weight?, sample indices) for each of this rank's passes `parts` of a
        batch of `B` samples; the caller's loop body (forward, backward) runs in that
        micro-batch's random stream with its BatchNorm statistics recorded, the last one's
        backward starting the all-reduce as buckets fill (engine.group.reduce). Then the other
        buckets start and the statistics are combined (collectives: every rank's loop must
        end). An exception in the loop body closes this generator as it leaves the caller,
        which restores the outer RNG state and the layers' momenta."""
        self.running_stats.begin()
        for n, (index, chunk) in enumerate(host_generators_kept(parts)):
            if n == len(parts) - 1:  # SyncBatchNorm's collectives run inside backward
                self.reducer.last_pass(world_size > 1 and not self.config.sync_batchnorm)
            pad = is_pad(index)  # a zero-weight pass: no statistics kept
            with micro_batch_stream(self.config.seed, self.progress.step,
                                    pad_source(index) if pad else index, self.device), \
                    contextlib.nullcontext() if pad else self.running_stats.micro_batch(index):
                yield pad, chunk
        # ranks start buckets at different moments: all of them, before any other collective
        self.reducer.flush(world_size)
        self.running_stats.combine(self.plan.micro_batch_count(B))

    def _local_pass(self, parts: list[tuple[int, torch.Tensor]], B: int, rank: int,
                    world_size: int, sub: Substep, kept: list | None) -> tuple:
        """Forward and backward of sub-step `sub`'s loss over this rank's passes (index, sample
        indices) of a batch of `B` samples, each pass's batch from `kept` (the step's batches
        an earlier sub-step read), else from the input pipeline (then kept, when `kept` is a
        list: more sub-steps follow); returns (loss, extra metrics), each weighted by the
        passes' fraction of the batch: float64 tensors on the device where loss_fn gave
        tensors (read with engine.step.losses.floats, once per step), else floats."""
        loss_sum: torch.Tensor | float = 0.0
        first = sub is self.objects.substeps[0]  # only its loss_fn may give extra metrics
        extras: list = [0.0] * len(self.progress.metric_names) if first else []
        # closed on the way out, also when a pass raises: that restores the generators' states
        # and the layers' momenta now, not whenever the interpreter frees the loop
        with contextlib.closing(self._micro_batch_passes(parts, B, world_size)) as passes:
            for n, (pad, chunk) in enumerate(passes):
                if kept is not None and n < len(kept):
                    batch = kept[n]
                else:  # the input pipeline (engine.data.map_pipeline) starts where it must
                    batch = to_device(self.pipeline.next(*self.input_at(rank, world_size)),
                                      self.device)
                    if kept is not None:
                        kept.append(batch)
                fault_point("forward", self)
                with self.mode.collectives_in_passes(), micro_batch_note(
                        len(chunk), self.progress.step + 1, B, self.plan.cut,
                        self.config.global_batch):
                    with self.precision.autocast():
                        out = sub.loss_fn(self.model, batch)
                    fault_point("backward", self)
                    if pad:
                        self.weights.zero_weight_backward(out)
                        continue
                    loss, metrics, weight = self.weights.backward(
                        out, len(chunk), B, self.progress.step, self.config.sync_batchnorm)
                loss_sum = loss_sum + loss
                extras = _add_metrics(self.progress, sub, first, metrics, weight, extras)
        return loss_sum, extras

    def _reduce_and_vote(self, loss, extras: list, flag: float, B: int, world_size: int,
                         vote: Vote) -> tuple:
        """Sum gradients across ranks, then vote (the count, loss, extra metrics, leave flag
        and which parameters had gradients summed by the vote). Returns (loss, extras, leave)
        once every rank voted, loss and extras summed as floats (with one rank: as
        :meth:`_local_pass` gave them); raises StepAborted (a PeerFailure) when not committed.

        The local pass weighted each micro-batch by count / B; with MeanOver counts the total
        is not B, and multiplying by B / total makes the update the mean over every item.
        Raises ValueError when the MeanOver counts of the whole global batch sum to 0.
        """
        fault_point("allreduce", self)
        has_grad = self.reducer.finish(world_size)
        fault_point("vote", self)
        # reading the loss waits for the device: with peers the vote needs it (and with nccl
        # that wait is also what says the reduction is done); one rank reads it only after
        # its update is queued (train_step), so the device does not idle meanwhile
        shared = floats([loss, *extras]) if world_size > 1 else []
        flag, count, *rest = vote.sum([flag, self.weights.count, *shared, *has_grad])
        if shared:
            loss, *extras = rest[:len(shared)]
        has_grad = rest[len(shared):]
        self.reducer.drop_unused(has_grad)
        factor = self.weights.settle(count, B, self.progress.step)
        if factor is not None:
            self.reducer.scale(factor)
            loss, extras = loss * factor, [e * factor for e in extras]
        return loss, extras, flag > 0

    def train_step(self, rank: int, world_size: int, vote: Vote | None = None,
                   leave_flag: float = 0.0) -> tuple[dict, bool]:
        """One optimizer step on this rank's share of the global batch; all ranks call it.
        With several optimizers (engine.step.optimizers), its sub-steps from the first one not yet
        committed (``progress.substep``), each a transaction of its own.

        Args:
            vote: the generation's commit vote (engine.group.vote); None with one rank and no store.
            leave_flag: 1.0 on rank 0 when the owner asked the ranks to leave after this step.
        Returns (history record, whether any rank asked to leave after this step); the record
        is also :attr:`pending` until the generation has evaluated, recorded it and stepped
        the scheduler (engine.generation).
        Raises PeerFailure (StepAborted among them) when the step (or a sub-step) was not
        committed: the model, optimizer and BatchNorm statistics are then as it found them.
        """
        t0 = time.perf_counter()
        p = self.progress
        batch = self.plan.batch(p.epoch, p.position)
        parts = self._passes(batch, rank, world_size)
        # the passes' batches, read once for the step's sub-steps (none kept for one)
        kept: list | None = [] if len(self.objects.substeps) - p.substep > 1 else None
        lrs = learning_rates(self.optimizer)  # the schedulers step after the whole step
        leave = False
        for sub in self.objects.substeps[p.substep:]:
            leave = self._substep(sub, parts, kept, len(batch), rank, world_size,
                                  vote or Vote(None, 0, 1, 0.0), leave_flag)
        losses, p.substep, p.losses = p.losses, 0, {}
        epoch = p.epoch
        p.epoch, p.position = self.plan.advance(p.epoch, p.position)
        self.pipeline.moved_to((rank, world_size, p.epoch, p.position))  # its next step
        p.step += 1
        p.samples += len(batch)
        self.pending = record = _step_record(p, epoch, losses, lrs, world_size, len(batch),
                                             time.perf_counter() - t0, self.weights)
        if self._first_step_of_generation:  # the buckets, in the order backward filled them:
            # a collective, so only once the step is done (a peer failing here loses nothing)
            self._first_step_of_generation = False
            self.reducer.sync_order(world_size)
        if self.after_step is not None:  # an EMA of the weights, SWA, a weight-norm log
            with after_step_note(p.step):
                self.after_step(self.model, self.optimizer, p.step)
        return record, leave

    def _substep(self, sub: Substep, parts: list, kept: list | None, B: int, rank: int,
                 world_size: int, vote: Vote, leave_flag: float) -> bool:
        """One optimizer's update over the step's `B` samples (this rank's passes `parts`, their
        batches `kept` once read): passes, reduction, vote, and once committed its optimizer's
        step, its losses in ``progress.losses``. Returns whether a rank asked to leave."""
        p = self.progress
        if p.substep:  # a sub-step after a committed one (fault tests stop here)
            fault_point("substep", self)
        self.in_flight = True
        self.reducer.begin_step(p.substep)  # zeroed gradients: views of its buckets
        self.weights.begin()
        try:
            loss, extras = self._local_pass(parts, B, rank, world_size, sub, kept)
            loss, extras, leave = self._reduce_and_vote(loss, extras, leave_flag, B,
                                                        world_size, vote)
        except BaseException:
            self.running_stats.undo()
            self.pipeline.stop()  # it stands past this step
            raise
        # committed: every rank applies this update (a rank dying from here on changes nothing)
        fault_point("optimizer", self)
        self.checkpoints.wait_for_copies()  # the last checkpoint's, of what this step changes
        # the scheduler steps in the loop, after evaluation (schedulers.py); each optimizer's
        # gradient norm is its own parameters'
        self.precision.step(sub.optimizer, self.config.clip_grad_norm,
                            self.model.parameters() if sub.name is None
                            else optimized(sub.optimizer), self.reducer.clip)
        p.losses[sub.name or ""] = floats([loss, *extras])
        p.substep += 1
        self.in_flight = False
        return leave

    # evaluation and the setup's trials --------------------------------------------------------

    def evaluate(self, rank: int, world_size: int, vote: Vote | None = None) -> dict:
        """The mean of each ``metric_fn`` value over ``eval_dataset``, ``{"val_<name>": mean}``
        ({} without one; engine.step.evaluation): the chunks' sums meet in a round of the commit
        vote (`vote`; None with one rank), so every rank returns the same or raises."""
        if self.eval_dataset is None:
            return {}
        chunks = self.evaluation.local_chunks(rank, world_size, self.progress.step)
        fault_point("evaluate", self)
        return self.evaluation.combine(chunks, vote)
