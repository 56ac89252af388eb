"""One engine's share of a run: the user's objects, their state, one optimizer step.

The Worker holds the model, optimizer and dataset the cell defined, captures and restores their
state (for broadcasts and checkpoints), and runs one optimizer step or an evaluation with every
rank of the current process group. A step is a transaction: its update is applied only after
every rank voted that its reduction succeeded (engine.vote); a step that fails before leaves
the model, optimizer and BatchNorm statistics as it found them, so after a fault the survivors
simply go on, and no copy of the state is kept. Forming the group and looping over steps is
engine.generation's job; the calls the owner makes are in engine.entrypoints.

The update is the mean gradient of the global batch B whatever the world size: each rank scales
the mean loss of a micro-batch of m samples by m / B, and gradients are summed across ranks. (The
last step of an epoch has fewer samples than B; there B is that step's sample count.) A loss that
is a mean over c items (``MeanOver(loss, c)``) is scaled by c / B instead, the counts are summed
with the gradients, and the sum is multiplied by B / (total count): the mean over every item.
Gradients are summed as torch's DDP sums them (engine.reduce).

This module imports nothing from IPython or the UI: it runs the same way from a script.
"""
from __future__ import annotations

import contextlib
import copy
import math
import time
import warnings

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim.lr_scheduler import ReduceLROnPlateau

from . import calibration
from . import state as state_mod
from .batching import (BATCHNORM_FLOOR, BatchPlan, Cut, choose_cut, rank_share,
                       steps_per_epoch)
from .checkpoint import CheckpointWriter
from .collective import PeerFailure, collective
from .faultpoints import fault_point
from .history import History
from .loader import PassSampler, pass_batches
from .losses import read_loss, read_metrics
from .precision import Precision, PrecisionError
from .randomness import (host_generator_state, host_generators_kept, micro_batch_stream,
                         set_host_generator_state)
from .reduce import GradReducer, LayoutError
from .running_stats import RunningStats
from .transfer import to_device as _to_device
from .vote import Vote

REQUIRED = ("model", "optimizer", "dataset", "loss_fn")
CALIBRATION_STREAM = 2**64 - 1  # the random stream of measuring passes: no micro-batch's
EVAL_EPOCH = 2**64 - 1  # the epoch in evaluation samples' seeds (engine.loader): no training's
EVAL_STREAM = 2**63  # + k: the random stream of evaluation chunk k (beside the step's micro-batches)
TRIAL_SAMPLES = 4  # samples each user function is tried on at setup (Worker.try_user_functions)


def _weighted(value, weight: float):
    """`value` (a metric or loss: a one-element tensor, or a number) times `weight`: a float64
    tensor on the value's GPU (reading it now would wait for the device), else a float."""
    if torch.is_tensor(value) and value.device.type != "cpu":
        return value.detach().double().reshape(()) * weight  # it may still require grad
    return float(value.detach() if torch.is_tensor(value) else value) * weight


def _floats(values: list) -> list[float]:
    """`values` (floats, or tensors from :func:`_weighted`) as floats; the tensors are read in
    one transfer, so the step waits for its device once."""
    at = [i for i, v in enumerate(values) if torch.is_tensor(v)]
    out = [float(v) if not torch.is_tensor(v) else 0.0 for v in values]
    if at:
        device = values[at[0]].device  # a metric may sit elsewhere than the loss
        for i, v in zip(at, torch.stack([values[i].to(device) for i in at]).tolist()):
            out[i] = v
    return out


def _group_lrs(optimizer) -> dict:
    """The learning rates a step record logs: ``lr``, the first param group's, and with more
    groups ``lr_1``, ``lr_2``... (``lr_k`` is ``optimizer.param_groups[k]``'s). A tensor
    learning rate is logged as a float."""
    lrs = [g["lr"] for g in optimizer.param_groups]
    lrs = [float(lr) if torch.is_tensor(lr) else lr for lr in lrs]
    return {"lr": lrs[0], **{f"lr_{k}": lr for k, lr in enumerate(lrs[1:], 1)}}


def _note(error: BaseException, text: str) -> None:
    """Add `text` to `error`'s traceback (PEP 678's notes, Python 3.11; on 3.10 the note goes
    into its message instead)."""
    if hasattr(error, "add_note"):
        error.add_note(text)
    elif error.args and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]}\n{text}", *error.args[1:])


class SetupError(RuntimeError):
    """The run's cell or setup function did not produce a usable training setup."""


class Worker:
    """One engine's share of a run: the user's objects plus the run's progress.

    Args:
        objects: namespace produced by the cell or setup function; must hold ``model``,
            ``optimizer``, ``dataset`` (map-style) and ``loss_fn(model, batch)``; may hold
            ``lr_scheduler``, ``collate_fn``, ``eval_dataset`` and ``metric_fn(model, batch)``.
        config: the run's plain-data config (global_batch, micro_batch, total_steps, ...).
        device: torch device string this engine trains on ("cpu" or "cuda").
        slot: the engine's slot (fault points match it against armed slots), None outside a pool.
    """

    def __init__(self, objects: dict, config: dict, device: str, slot: int | None = None):
        missing = [name for name in REQUIRED if name not in objects]
        if missing:
            raise SetupError(
                f"the cell did not define {', '.join(missing)}: it must define "
                "model, optimizer, dataset and loss_fn(model, batch)")
        self.config = config
        self.slot = slot
        # with its index: torch.device("cuda") != torch.device("cuda:0") in comparisons
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if device.startswith("cuda") else torch.device("cpu"))
        self.model = objects["model"]
        self.optimizer = objects["optimizer"]
        self.dataset = objects["dataset"]
        self.loss_fn = objects["loss_fn"]
        self.lr_scheduler = objects.get("lr_scheduler")
        self.collate_fn = objects.get("collate_fn") or torch.utils.data.default_collate
        self.worker_init_fn = objects.get("worker_init_fn")
        self.eval_dataset = objects.get("eval_dataset")
        self.metric_fn = objects.get("metric_fn")
        self.min_micro_batch = objects.get("min_micro_batch")  # the cell's floor, if declared
        self.after_step = objects.get("after_step")  # called after each committed step
        self.extra_state = objects.get("extra_state") or {}  # more training state (an EMA)
        self._check_objects()
        if config.get("sync_batchnorm"):
            self._convert_batchnorm()
        self.model.to(self.device)
        for obj in self.extra_state.values():  # an EMA updates from the model where it is,
            # unless it says where it lives (timm's ModelEmaV3(device="cpu"))
            if isinstance(obj, torch.nn.Module) and getattr(obj, "device", None) is None:
                obj.to(self.device)
        try:
            self.reducer = GradReducer(self.model, self.device)
            self.precision = Precision(config.get("precision"), self.device)
        except (LayoutError, PrecisionError) as e:
            raise SetupError(str(e)) from None
        self._mean_over: bool | None = None  # what loss_fn's losses are means over, once seen
        self._step_count = 0.0  # samples (or MeanOver items) this rank's share weighed this step
        self._items = 0.0  # the same, summed over the global batch (after the reduction)
        self._first_step_of_generation = False
        # the input pipeline (engine.loader), and the (rank, world size, epoch, position) of the
        # step whose batches it yields next
        self._batches, self._batches_at = None, None
        self.running_stats = RunningStats(self.model)
        try:
            cut = self._configured_cut()
        except SetupError:
            self.reducer.close()  # its hooks would keep it on a model that outlives the run
            raise
        self.plan = BatchPlan(len(self.dataset), config["global_batch"], config["seed"], cut,
                              bool(config.get("drop_last")))
        self.progress = state_mod.Progress()  # its cut is recorded at the first generation
        if not config.get("total_steps"):
            epochs = config.get("epochs") or 1
            config["total_steps"] = config.get("steps") or epochs * steps_per_epoch(
                len(self.dataset), config["global_batch"], bool(config.get("drop_last")))
        self.history = History()  # the newest records only (engine.history)
        # a step begun and not yet committed (what a fault now would lose)
        self.in_flight = False
        # whether this engine holds the run's state: a generation's rank that is sent none (its
        # setup's state at the run's start), or once a state is loaded (recovery counts these)
        self.holds_state = False
        # the record of a committed step whose evaluation, history entry and scheduler step
        # are still to do (a fault hit its evaluation): the next generation does them first
        self.pending: dict | None = None
        self.writer = None
        self.staging = state_mod.Staging()  # rank 0's checkpoint copies, reused
        if config.get("checkpoint_dir"):
            self.writer = CheckpointWriter(config["checkpoint_dir"], config["keep"],
                                           before_write=lambda: fault_point("checkpoint", self))

    def _check_objects(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise SetupError(f"model must be a torch.nn.Module, got {type(self.model).__name__}")
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise SetupError(
                f"optimizer must be a torch.optim.Optimizer, got {type(self.optimizer).__name__}")
        if not callable(self.loss_fn):
            raise SetupError("loss_fn must be a function loss_fn(model, batch) -> loss")
        try:
            n = len(self.dataset)
        except TypeError:
            raise SetupError("dataset must be a map-style torch Dataset (with __len__ and "
                             "__getitem__); iterable datasets are not supported") from None
        if n < self.config["global_batch"]:
            raise SetupError(f"dataset has {n} samples, fewer than the global batch "
                             f"{self.config['global_batch']}: lower --global-batch")
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

    def _floor(self) -> tuple[int, str]:
        """The fewest samples a micro-batch may hold, and what sets it: the cell's
        ``min_micro_batch``; else BatchNorm in training mode (its statistics are per
        micro-batch: BATCHNORM_FLOOR, and never below 2, where BatchNorm refuses to train),
        except with --sync-batchnorm (statistics over the global batch); else 1."""
        batchnorm = self._per_micro_batch_norm()
        if self.min_micro_batch is not None:
            if batchnorm and self.min_micro_batch < 2:
                return 2, "BatchNorm trains on 2 samples or more (min_micro_batch is 1)"
            return self.min_micro_batch, "the cell's min_micro_batch"
        if batchnorm:
            return BATCHNORM_FLOOR, "BatchNorm, whose statistics are per micro-batch"
        return 1, ""

    def _per_micro_batch_norm(self) -> bool:
        """Whether a BatchNorm layer (any subclass of torch's _BatchNorm) trains on each
        micro-batch's statistics: in training mode, without --sync-batchnorm."""
        return not self.config.get("sync_batchnorm") and any(
            isinstance(m, _BatchNorm) and m.training for m in self.model.modules())

    def _configured_cut(self, pass_cost: float | None = None) -> Cut:
        """The cut the run's options ask for (engine.batching.choose_cut); `pass_cost`: the
        measured one with ``--pass-cost measure``. Raises SetupError when the floor cannot be
        met."""
        cfg = self.config
        given = cfg.get("pass_cost")
        if given == "measure":
            given = pass_cost if pass_cost is not None else 0.0
        if cfg.get("sync_batchnorm") and given is None and not cfg.get("micro_batch"):
            given = 0.0  # a rank's share is one pass whatever the cut: balance by samples
        B, batchnorm = cfg["global_batch"], self._per_micro_batch_norm()
        if batchnorm and len(self.dataset) % B == 1 and not cfg.get("drop_last"):
            raise SetupError(
                f"the last step of each epoch holds 1 sample ({len(self.dataset)} samples, "
                f"--global-batch {B}), and BatchNorm cannot train on one: add --drop-last, or "
                "choose a --global-batch that leaves a remainder of 0 or at least 2")
        try:
            return choose_cut(B, cfg.get("micro_batch"), given, cfg.get("pool_min_size", 1),
                              cfg.get("pool_max_size", 1), *self._floor(),
                              lowest=2 if batchnorm else 1)
        except ValueError as e:
            raise SetupError(str(e)) from None

    def _convert_batchnorm(self) -> None:
        """BatchNorm statistics over the whole global batch instead of each micro-batch."""
        if self.device.type != "cuda":
            raise SetupError("--sync-batchnorm needs GPU slots: torch's SyncBatchNorm runs only "
                             "on CUDA. Plain BatchNorm needs no conversion for results "
                             "independent of the world size: its statistics are per "
                             "micro-batch, combined in micro-batch order")
        n, B = len(self.dataset), self.config["global_batch"]
        most = self.config.get("pool_max_size", 1)
        if B < most:
            raise SetupError(f"--sync-batchnorm needs a sample on every rank at every step "
                             f"(SyncBatchNorm is a collective): raise --global-batch {B} to at "
                             f"least the pool's --max {most}")
        if 0 < n % B < most and not self.config.get("drop_last"):
            raise SetupError(
                f"--sync-batchnorm needs a sample on every rank at every step (SyncBatchNorm is a "
                f"collective), but the last step of each epoch holds {n % B} samples, fewer than "
                f"the pool's --max {most}: choose a --global-batch that divides the dataset size "
                f"{n} or leaves a remainder of at least {most}")
        # the converted layers keep the same Parameter objects, so the optimizer still holds them
        self.model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(self.model)

    # state -------------------------------------------------------------------------------------

    def capture(self, copy_tensors: bool = True, staging: state_mod.Staging | None = None
                ) -> dict:
        """The training state as plain data (engine.state); ``copy_tensors=False`` gives the
        live tensors, for a reader done before training goes on; `staging` reused buffers to
        copy into (a checkpoint's)."""
        return state_mod.capture(self.model, self.optimizer, self.lr_scheduler, self.progress,
                                 self.history.records, self.config, copy_tensors=copy_tensors,
                                 grad_scaler=self.precision.scaler, staging=staging,
                                 extra=self.extra_state)

    def restore(self, state: dict) -> None:
        """Continue from `state` (a broadcast or a checkpoint), with its step whose evaluation
        is still to do when it holds one (``pending``: the checkpoint written before the final
        evaluation, engine.generation)."""
        self.staging.wait()  # a checkpoint's copies read the tensors this overwrites
        self.pending, self.in_flight = state.get("pending"), False
        self.progress, records = state_mod.restore(
            state, self.model, self.optimizer, self.lr_scheduler, self.precision.scaler,
            self.extra_state)
        self.history = History(records)
        if self.writer is not None:  # what it wrote before may be of another timeline
            self.writer.saved_step = None
        self.holds_state = True
        if self.progress.cut is not None:  # the run's own cut, whatever this run's options
            self.plan.cut = Cut(**self.progress.cut)

    def forget_history(self, acknowledged: int | None) -> None:
        """Drop the records no one will ask this rank for (engine.history): those the kernel
        acknowledged (`acknowledged`: its complete step; None when no kernel reads the run),
        that are in the checkpoint folder's history file (up to the checkpoint before the
        newest scheduled one, or this rank's last written one if older: any rank may write
        the next), and not of the current epoch when ReduceLROnPlateau steps by its loss."""
        step = self.progress.step
        # with no kernel to fill, whoever drives the run reads the engine's whole history
        keep_after = 0 if acknowledged is None else min(step, acknowledged)
        if self.writer is not None:
            every = self.config.get("checkpoint_every") or 0
            # without periodic checkpoints the last one holds every record
            keep_after = min(keep_after, max(0, (step // every - 1) * every) if every else 0)
            if self.writer.saved_step is not None:
                keep_after = min(keep_after, self.writer.saved_step)
        if isinstance(self.lr_scheduler, ReduceLROnPlateau) \
                and not self.config.get("plateau_metric"):
            start = self.history.epoch_start(self.progress.epoch)
            if start is not None:
                keep_after = min(keep_after, start - 1)
        self.history.forget_upto(keep_after)

    # a generation's start -------------------------------------------------------------------

    def start_generation(self, rank: int, world_size: int) -> dict | None:
        """Ready this rank for a new generation's steps (a collective: all ranks call it, after
        the state broadcast, before the first step): the run's cut recorded if it has none yet
        (measured first with ``--pass-cost measure``), and the gradient buckets laid out as
        rank 0's, then rebuilt once more after the generation's first step in the order its
        gradients come (engine.reduce).

        Returns, on rank 0 of the run's first generation, the ``micro_batches`` event.
        """
        event = self.record_cut(rank, world_size) if self.progress.cut is None else None
        self.reducer.sync_order(world_size)
        self._first_step_of_generation = True
        return event

    def end_generation(self) -> None:
        """The generation ended (or failed): stop its input pipeline's loader processes and
        finish a checkpoint's copies."""
        self._batches = self._batches_at = None
        self.staging.wait()

    def _next_batch(self, rank: int, world_size: int):
        """The next pass's collated batch from the input pipeline, started here when it does
        not stand at this step (a new generation, a restore, a step that was not committed)."""
        p = self.progress
        at = (rank, world_size, p.epoch, p.position)
        if self._batches is None or self._batches_at != at:
            sampler = PassSampler(self.plan, lambda batch: self._passes(batch, rank, world_size),
                                  p.epoch, p.position, self.config["total_steps"] - p.step)
            self._batches = pass_batches(
                self.dataset, sampler, self.config["seed"], self.config.get("workers") or 0,
                self.collate_fn, self.worker_init_fn, pin_memory=self.device.type == "cuda")
            self._batches_at = at
        return next(self._batches)

    # how steps are cut into micro-batches ---------------------------------------------------

    def record_cut(self, rank: int, world_size: int) -> dict | None:
        """Fix the run's cut in its state (a collective with ``--pass-cost measure``: rank 0
        measures, every rank takes its value; all ranks call it before the run's first step).

        Returns, on rank 0, the ``micro_batches`` event saying how steps are cut and why; None
        elsewhere. Measuring passes leave no trace: gradients, buffers and RNG states are as
        before.
        """
        start = time.perf_counter()
        measured = None
        if self.config.get("pass_cost") == "measure":
            cost = torch.zeros(1, dtype=torch.float64, device=self.device)  # nccl: on device
            if rank == 0:
                cost[0] = self._measure_pass_cost()
            if world_size > 1:
                with collective("sharing the pass cost"):
                    dist.broadcast(cost, src=0)
            measured = float(cost[0])
            self.plan.cut = self._configured_cut(measured)
        self.progress.cut = self.plan.cut.as_dict()
        self.progress.pass_cost = self.plan.cut.pass_cost
        if rank != 0:
            return None
        B = self.config["global_batch"]
        message = self.plan.cut.describe(B)
        if measured is not None:
            message += (f" (measured in {time.perf_counter() - start:.2f} s: another run cuts "
                        f"its steps the same way with --pass-cost {measured:g})")
        if self.plan.cut.count(B) < self.plan.cut.max_size:
            message += (f"; at world sizes above {self.plan.cut.count(B)} some ranks have no "
                        "micro-batch")
        return {"kind": "micro_batches", "step": self.progress.step, "time": time.time(),
                "micro_batches": self.plan.cut.count(B), "floor": self.plan.cut.floor,
                "pass_cost": self.plan.cut.pass_cost, "message": message}

    def _measure_pass_cost(self) -> float:
        """engine.calibration's P from passes over the first step's samples: 2 of them, and a
        micro-batch's most (the step's share of one rank at the pool's largest size, at least 8)."""
        B, p = self.config["global_batch"], self.progress
        indices = self.plan.batch(p.epoch, p.position)  # an epoch's last step may be short
        large = min(len(indices), max(-(-B // self.config.get("pool_max_size", 1)), 8))
        if large < 4:  # micro-batches of 1-3 samples: too few to tell passes from samples
            return 0.0
        buffers = [b.detach().clone() for b in self.model.buffers()]
        rng = state_mod.rng_state()  # the dataset's draws from Python's and numpy's too
        # fetched before the timing: the passes' cost is the model's, not the loading's (which
        # --workers processes may do beside the passes)
        batches = {size: _to_device(self.collate_fn([self.dataset[int(i)] for i in
                                                     indices[:size]]), self.device)
                   for size in (2, large)}

        def run_pass(size: int) -> None:
            with micro_batch_stream(self.config["seed"], p.step, CALIBRATION_STREAM, self.device):
                with self.precision.autocast():
                    loss = read_loss(self.loss_fn(self.model, batches[size]), size)[0]
                if loss.requires_grad:
                    loss.backward()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        try:
            return calibration.measure_pass_cost(run_pass, 2, large)
        finally:
            for param in self.model.parameters():
                param.grad = None
            state_mod.set_rng_state(rng)
            with torch.no_grad():
                for buffer, saved in zip(self.model.buffers(), buffers):
                    buffer.copy_(saved)

    # one optimizer step ----------------------------------------------------------------------

    def _passes(self, batch: torch.Tensor, rank: int,
                world_size: int) -> list[tuple[int, torch.Tensor]]:
        """This rank's passes of a step over `batch` (sample indices): its micro-batches
        (index k, sample indices), or with --sync-batchnorm all of them in one pass."""
        parts = self.plan.rank_micro_batches(batch, rank, world_size)
        if self.config.get("sync_batchnorm") and parts:
            # SyncBatchNorm's statistics span what every rank forwards at once: one pass over
            # the rank's whole share gives the global batch (and no rank waits on another)
            parts = [(parts[0][0], torch.cat([chunk for _, chunk in parts]))]
        return parts

    def _micro_batch_passes(self, parts: list[tuple[int, torch.Tensor]], B: int,
                            world_size: int):
        """Yield the sample indices of each of this rank's micro-batches (index, indices) of a
        batch of `B` samples; the caller's loop body (forward and backward) runs inside that
        micro-batch's random stream with its BatchNorm statistics recorded, and the last one's
        backward starts the gradients' all-reduce as buckets fill (engine.reduce). After the
        last one, the remaining buckets start and the running statistics are combined across
        ranks (collectives: every rank's loop must end). An exception in the loop body closes
        this generator as it leaves the caller (CPython frees the loop's iterator), which
        restores the outer RNG state and the layers' momenta."""
        self.running_stats.begin()
        for n, (index, chunk) in enumerate(host_generators_kept(parts)):
            if n == len(parts) - 1:  # SyncBatchNorm's collectives run inside backward
                self.reducer.last_pass(world_size > 1 and not self.config.get("sync_batchnorm"))
            with micro_batch_stream(self.config["seed"], self.progress.step, index, self.device), \
                    self.running_stats.micro_batch(index):
                yield chunk
        # ranks start buckets at different moments: all of them, before any other collective
        self.reducer.flush(world_size)
        self.running_stats.combine(self.plan.micro_batch_count(B))

    def _local_pass(self, parts: list[tuple[int, torch.Tensor]], B: int, rank: int,
                    world_size: int) -> tuple:
        """Forward and backward over this rank's passes (index, sample indices) of a batch of
        `B` samples, each pass's batch from the input pipeline; returns (loss, extra metrics),
        each weighted by the passes' fraction of the batch: float64 tensors on the device where
        loss_fn gave tensors (read with :func:`_floats`, once per step), else floats."""
        loss_sum, extras = 0.0, [0.0] * len(self.progress.metric_names)
        # closed on the way out, also when a pass raises: that restores the generators' states
        # and the layers' momenta now, not whenever the interpreter frees the loop
        with contextlib.closing(self._micro_batch_passes(parts, B, world_size)) as passes:
            for chunk in passes:
                batch = _to_device(self._next_batch(rank, world_size), self.device)
                fault_point("forward", self)
                with self._sync_batchnorm_collectives(), self._micro_batch_note(chunk, B):
                    with self.precision.autocast():
                        out = self.loss_fn(self.model, batch)
                    fault_point("backward", self)
                    loss, metrics, weight = self._backward(out, len(chunk), B)
                loss_sum = loss_sum + loss
                if metrics and not self.progress.metric_names:
                    self.progress.metric_names = sorted(metrics)
                    extras = [0.0] * len(metrics)
                for j, name in enumerate(self.progress.metric_names):
                    extras[j] = extras[j] + _weighted(metrics[name], weight)
        return loss_sum, extras

    def _after_step(self, step: int) -> None:
        """The cell's hook after committed step `step` (its record is kept: an error here
        fails the run with the step trained; a state the hook half updated is as it left it)."""
        try:
            self.after_step(self.model, self.optimizer, step)
        except Exception as e:
            _note(e, f"(elastic-jupyter: raised by the cell's after_step after step {step}, "
                     "which is committed and kept)")
            raise

    @contextlib.contextmanager
    def _micro_batch_note(self, chunk: torch.Tensor, B: int):
        """The user's code failing in a pass: its error says how large the micro-batch was,
        what cut it and how to change it (code such as Mixup asserts an even batch)."""
        try:
            yield
        except Exception as e:
            if not isinstance(e, PeerFailure):
                K = self.plan.cut.count(self.config["global_batch"])
                _note(e, f"(elastic-jupyter: this pass ran a micro-batch of {len(chunk)} samples "
                         f"at step {self.progress.step + 1}, a step of {B}: "
                         f"{self.plan.cut.describe(self.config['global_batch'])}. Change it "
                         f"with --micro-batch N, min_micro_batch = N in the cell, a "
                         f"--global-batch that {K} micro-batches divide evenly (a multiple of "
                         f"{2 * K} for even ones), or --drop-last for an epoch's short last "
                         "step)")
            raise

    def _sync_batchnorm_collectives(self):
        """SyncBatchNorm's collectives run inside the forward and backward passes: a peer
        failing there (torch's DistError) is a fault, like in our own collectives."""
        if not self.config.get("sync_batchnorm"):
            return contextlib.nullcontext()
        return collective("SyncBatchNorm statistics", only=dist.DistError)

    def _backward(self, out, samples: int, B: int) -> tuple:
        """Backward of one micro-batch's ``loss_fn`` output weighted by its count / `B`
        (its samples, or its MeanOver items); returns (weighted loss, metrics, weight), the
        loss as a float64 tensor on the device (reading it here would wait for the device)."""
        loss, metrics, count, mean_over = read_loss(out, samples)
        if self._mean_over is None:
            self._mean_over = mean_over
        elif mean_over != self._mean_over:
            raise TypeError("loss_fn returned MeanOver(loss, count) for some batches and a plain "
                            "loss for others: return the same kind for every batch")
        self._step_count += count
        if not count:  # nothing to average: its loss (NaN for an empty mean) must not count
            if self.config.get("sync_batchnorm"):
                self._backward_for_peers(loss)
            return 0.0, dict.fromkeys(metrics, 0.0), 0.0
        weight = count / B
        self.precision.backward(loss * weight)
        return _weighted(loss, weight), metrics, weight

    def _backward_for_peers(self, loss: torch.Tensor) -> None:
        """With --sync-batchnorm, the backward of a pass whose MeanOver count is 0, at weight 0:
        SyncBatchNorm's backward is a collective, and a rank that skipped it would leave its
        peers waiting. The pass is this rank's only one of the step (its whole share in one
        pass), so its parameters count as unused: a parameter no other rank has a gradient for
        ends with ``.grad`` None (engine.reduce). Tested on CPU with a stand-in for
        SyncBatchNorm's collective (tests/test_gradients.py), not with SyncBatchNorm on GPUs.

        Raises ValueError when `loss` is not finite: 0 * NaN is NaN, which SyncBatchNorm would
        all-reduce into every rank's gradients.
        """
        if not bool(torch.isfinite(loss.detach()).all()):
            raise ValueError(
                f"loss_fn returned a loss of {float(loss.detach())} with a MeanOver count of 0 "
                f"at step {self.progress.step + 1}: with --sync-batchnorm every rank's pass "
                "takes part in SyncBatchNorm's backward, so loss_fn must return a finite loss "
                "for a batch with no items (e.g. divide by count.clamp(min=1))")
        self.precision.backward(loss * 0.0)
        self.reducer.forget_pass()

    def _reduce_and_vote(self, loss, extras: list, flag: float, B: int, world_size: int,
                         vote: Vote) -> tuple:
        """Sum gradients across ranks, then vote: the count, loss, extra metrics, leave flag
        and which parameters had gradients are summed by the vote itself. Returns (loss,
        extras, leave) once every rank voted, loss and extras summed as floats (with one rank:
        as :meth:`_local_pass` gave them); raises StepAborted (a PeerFailure) when the step is
        not committed.

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
        shared = _floats([loss, *extras]) if world_size > 1 else []
        flag, count, *rest = vote.sum([flag, self._step_count, *shared, *has_grad])
        if shared:
            loss, *extras = rest[:len(shared)]
        has_grad = rest[len(shared):]
        self.reducer.drop_unused(has_grad)
        self._items = count  # the global batch's MeanOver items (B for plain losses)
        if count != B:
            if not count:
                raise ValueError(f"loss_fn's MeanOver counts sum to 0 over the global batch of "
                                 f"step {self.progress.step + 1}: there is nothing to average")
            factor = B / count
            self.reducer.scale(factor)
            loss, extras = loss * factor, [e * factor for e in extras]
        return loss, extras, flag > 0

    def train_step(self, rank: int, world_size: int, vote: Vote | None = None,
                   leave_flag: float = 0.0) -> tuple[dict, bool]:
        """One optimizer step on this rank's share of the global batch; all ranks call it.

        Args:
            vote: the generation's commit vote (engine.vote); None with one rank and no store.
            leave_flag: 1.0 on rank 0 when the owner asked the ranks to leave after this step.
        Returns (history record, whether any rank asked to leave after this step); the record
        is also :attr:`pending` until the generation has evaluated, recorded it and stepped
        the scheduler (engine.generation).
        Raises PeerFailure (StepAborted among them) when the step was not committed: the
        model, optimizer and BatchNorm statistics are then as the step found them.
        """
        t0 = time.perf_counter()
        p = self.progress
        batch = self.plan.batch(p.epoch, p.position)
        self.in_flight = True
        self.reducer.begin_step()  # zeroed gradients: views of the reduction's buckets
        self._step_count = 0.0
        parts = self._passes(batch, rank, world_size)
        try:
            loss, extras = self._local_pass(parts, len(batch), rank, world_size)
            loss, extras, leave = self._reduce_and_vote(
                loss, extras, leave_flag, len(batch), world_size, vote or Vote(None, 0, 1, 0.0))
        except BaseException:
            self.running_stats.undo()
            self._batches = self._batches_at = None  # it stands past this step
            raise
        # committed: every rank applies this update (a rank dying from here on changes nothing)
        lrs = _group_lrs(self.optimizer)
        fault_point("optimizer", self)
        self.staging.wait()  # the last checkpoint's copies of the tensors this step changes
        # the scheduler steps in the loop, after evaluation (schedulers.py)
        self.precision.step(self.optimizer, self.config.get("clip_grad_norm"),
                            self.model.parameters())
        loss, *extras = _floats([loss, *extras])
        epoch = p.epoch
        p.epoch, p.position = self.plan.advance(p.epoch, p.position)
        if self._batches is not None:  # the input pipeline stands at the next step now
            self._batches_at = (rank, world_size, p.epoch, p.position)
        p.step += 1
        p.samples += len(batch)
        seconds = time.perf_counter() - t0
        record = {"step": p.step, "epoch": epoch, "loss": loss, **lrs,
                  "world_size": world_size, "samples_per_s": len(batch) / max(seconds, 1e-9),
                  "time": time.time()}
        record.update(zip(p.metric_names, extras))
        if self._mean_over:  # what the step's loss is a mean over (an epoch's mean weighs it)
            record["items"] = int(round(self._items))
        self.in_flight, self.pending = False, record
        if self._first_step_of_generation:  # the buckets, in the order backward filled them:
            # a collective, so only once the step is done (a peer failing here loses nothing)
            self._first_step_of_generation = False
            self.reducer.sync_order(world_size)
        if self.after_step is not None:  # an EMA of the weights, SWA, a weight-norm log
            self._after_step(p.step)
        return record, leave

    # evaluation ------------------------------------------------------------------------------

    def _share_buffers(self, world_size: int) -> None:
        """Give every rank rank 0's buffers (the model ``run.state_dict()`` returns), which may
        differ elsewhere: a custom layer's buffer updated from each rank's own samples."""
        if world_size > 1:
            with collective("buffer broadcast"):
                for buffer in self.model.buffers():
                    dist.broadcast(buffer, src=0)

    def eval_chunk_size(self) -> int:
        """C, the samples of one evaluation chunk: ``--micro-batch N``, else the largest
        training micro-batch of a full step (the global batch over the pool's ``--max``).
        Fixed by the run's cut, so the chunks (samples k*C .. k*C + C - 1 of the eval set, the
        last one shorter) never depend on the world size."""
        B, cut = self.config["global_batch"], self.plan.cut
        return cut.micro_batch if cut.rule == "micro_batch" else -(-B // cut.count(B))

    def _eval_batches(self, chunks: range) -> tuple:
        """(an iterator over the collated batches of evaluation chunks `chunks`, in order; their
        sample counts), read through the input pipeline as training's passes are
        (engine.loader): in ``--workers`` loader processes (none for a single chunk, where they
        would fetch nothing ahead), each sample under the generators seeded by its index."""
        n, C = len(self.eval_dataset), self.eval_chunk_size()
        keys = [[(EVAL_EPOCH, i) for i in range(k * C, min(n, k * C + C))] for k in chunks]
        workers = min(self.config.get("workers") or 0, len(keys)) if len(keys) > 1 else 0
        batches = pass_batches(self.eval_dataset, keys, self.config["seed"], workers,
                               self.collate_fn, self.worker_init_fn,
                               pin_memory=workers > 0 and self.device.type == "cuda")
        return batches, [len(k) for k in keys]

    def _evaluate_chunks(self, chunks: range) -> list[dict]:
        """``metric_fn`` over evaluation chunks `chunks` (the model in evaluation mode, no
        gradients): one ``{name: (value x weight, weight)}`` per chunk, in float64 (a plain
        value weighs the chunk's samples, a MeanOver value its count; a count of 0 adds
        nothing). The values are read from the device once, after the last chunk. Chunk k runs
        in the random stream (seed, step, EVAL_STREAM + k) (engine.randomness), which the
        generators outside are not moved by."""
        batches, sizes = self._eval_batches(chunks)
        read = []
        for k, samples in zip(chunks, sizes):
            # chunk k's randomness (collate_fn here without loader processes, metric_fn) is
            # its own, whichever rank evaluates it
            with micro_batch_stream(self.config["seed"], self.progress.step, EVAL_STREAM + k,
                                    self.device):
                batch = _to_device(next(batches), self.device)
                read.append(read_metrics(self.metric_fn(self.model, batch), samples))
        del batches  # stops the loader processes
        values = iter(_floats([_weighted(x, 1.0) for metrics in read
                               for pair in metrics.values() for x in pair]))
        out = []
        for metrics in read:
            chunk = {}
            for name in metrics:
                value, weight = next(values), next(values)
                if not weight >= 0:
                    raise ValueError(f"metric_fn's {name!r}: MeanOver count must be >= 0, got "
                                     f"{weight}")
                chunk[name] = (value * weight, weight) if weight else (0.0, 0.0)
            out.append(chunk)
        return out

    def evaluate(self, rank: int, world_size: int, vote: Vote | None = None) -> dict:
        """The mean of each ``metric_fn`` value over ``eval_dataset``: ``{"val_<name>": mean}``;
        {} without one.

        The eval set is cut into chunks of C samples (:meth:`eval_chunk_size`, fixed by the
        config); rank r of W evaluates the contiguous chunks ``rank_share(chunks, r, W)``, read
        through the input pipeline. A plain value is a mean over its chunk's samples and counts
        for them; a ``MeanOver(value, count)`` counts for its count (a token mean). Each chunk's
        value x weight and weight (float64) are gathered, and every rank adds them in chunk
        order (``math.fsum``: exactly rounded): the mean is the exact mean over the eval set,
        the same at any world size, bit for bit where each chunk's value is (the same chunk on
        the same kind of device). A name no chunk weighs (MeanOver counts all 0) gives NaN.

        Every rank evaluates rank 0's buffers; afterwards each layer's buffers and training
        flag are its own again (a layer the cell froze with eval() stays frozen), also when a
        peer fails. The chunks' sums meet in a round of the commit vote (`vote`; None with one
        rank), so every rank returns the same metrics or raises PeerFailure.
        """
        if self.eval_dataset is None:
            return {}
        count = -(-len(self.eval_dataset) // self.eval_chunk_size())
        mine = rank_share(count, rank, world_size)
        with self._evaluation_mode():
            self._share_buffers(world_size)
            chunks = self._evaluate_chunks(range(mine.start, mine.stop))
        fault_point("evaluate", self)
        # rank order is chunk order: the shares are contiguous
        gathered = [chunk for part in (vote or Vote(None, 0, 1, 0.0)).gather(chunks)
                    for chunk in part]
        means = {}
        for name in sorted({name for chunk in gathered for name in chunk}):
            pairs = [chunk[name] for chunk in gathered if name in chunk]
            weight = math.fsum(w for _, w in pairs)
            means[f"val_{name}"] = math.fsum(v for v, _ in pairs) / weight if weight else math.nan
        return means

    @contextlib.contextmanager
    def _evaluation_mode(self):
        """The model in eval mode without gradients; afterwards each layer's training flag and
        buffers are as before (also when the block raises)."""
        modes = [(module, module.training) for module in self.model.modules()]
        buffers = [b.clone() for b in self.model.buffers()]
        try:
            self.model.eval()
            with torch.no_grad():
                yield
        finally:
            for module, training in modes:
                module.training = training
            with torch.no_grad():
                for buffer, saved in zip(self.model.buffers(), buffers):
                    buffer.copy_(saved)

    # the user's functions tried at setup -----------------------------------------------------

    def try_user_functions(self) -> None:
        """Call, once at setup, the functions the run calls later, on a small batch, so that a
        mistake in one shows now as a SetupError rather than after the training (a typo in
        ``metric_fn``, first called at the final evaluation): the dataset and ``collate_fn`` on
        the first step's first samples, the lr scheduler's step, and ``metric_fn`` on the first
        samples of ``eval_dataset`` (evaluation mode, no gradients), whose names must hold
        ``--plateau-metric``.

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
                self._try_metric_fn()
        finally:
            set_host_generator_state(host)

    def _try_collate(self) -> None:
        first = self.plan.batch(0, 0)[:TRIAL_SAMPLES].tolist()
        try:
            next(pass_batches(self.dataset, [[(0, i) for i in first]], self.config["seed"], 0,
                              self.collate_fn, self.worker_init_fn, pin_memory=False))
        except Exception as e:
            raise SetupError(
                f"reading {len(first)} training samples and collating them (dataset[i], "
                f"collate_fn), tried at setup, failed: {type(e).__name__}: {e}") from e

    def _try_scheduler(self) -> None:
        scheduler = self.lr_scheduler
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
                  for group in self.optimizer.param_groups]
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
            for group, values in zip(self.optimizer.param_groups, groups):
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
        if self.eval_dataset is None or len(self.eval_dataset) == 0:
            return
        samples = min(len(self.eval_dataset), TRIAL_SAMPLES)
        try:
            with self._evaluation_mode():
                batch = next(pass_batches(
                    self.eval_dataset, [[(EVAL_EPOCH, i) for i in range(samples)]],
                    self.config["seed"], 0, self.collate_fn, self.worker_init_fn,
                    pin_memory=False))
                out = self.metric_fn(self.model, _to_device(batch, self.device))
                metrics = read_metrics(out, samples)
                _floats([_weighted(x, 1.0) for pair in metrics.values() for x in pair])
        except Exception as e:
            raise SetupError(f"metric_fn, tried at setup on the first {samples} samples of "
                             f"eval_dataset, failed: {type(e).__name__}: {e}") from e
        metric = self.config.get("plateau_metric")
        if metric and metric not in {f"val_{name}" for name in metrics}:
            raise SetupError(f"--plateau-metric {metric}: metric_fn, tried at setup, gives "
                             f"{', '.join(sorted(f'val_{n}' for n in metrics)) or 'nothing'}")
