"""A run's options: ``%%elastic_train``'s line, ``TrainingRun``'s config, the engines' view of
the run and the ``config`` of every checkpoint, declared once (:class:`RunConfig`).

The kernel sends ``RunConfig.as_dict()`` to the engines, which read it back with
:meth:`RunConfig.from_dict`; a checkpoint stores the same dict. This module imports only the
standard library, so that engines can read it (pyproject.toml's import contracts).
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from dataclasses import InitVar, asdict, dataclass, field
from typing import Any, Callable

from .flags import (Group, Removed, Renamed, UsageError, byte_size, flag, flag_of,
                    positive_int, samples_or_measure)

# a file name has room for 255 bytes: the run's folder and its discovery entry
# (``<name>-<8 hex>.json.tmp``) must fit
MAX_NAME_BYTES = 200
PRECISIONS = (None, "bf16", "fp16")
# the release until which renamed spellings are accepted (CHANGELOG.md)
ALIASES_UNTIL = "0.3.0"

_RUN, _DATA, _OPTIM = Group.RUN, Group.STEPS_AND_DATA, Group.OPTIMISATION
_CKPT, _ELASTIC, _SHARDED, _TUNING = (Group.CHECKPOINTS, Group.ELASTICITY, Group.SHARDED,
                                      Group.TUNING)


@dataclass
class RunConfig:
    """A run's options; plain data, stored in every checkpoint.

    Sizes are in samples; ``total_steps`` is derived from ``epochs`` unless ``steps`` is given
    (0: the engines derive it). How steps are cut into micro-batches (engine.data.batching.Cut,
    fixed at the run's start and kept by a resume): ``micro_batch`` (N samples each), else
    ``pass_cost`` (a number, or ``"measure"``: engine.step.calibration), else one per slot of the
    pool's ``pool_max_size``; ``pool_min_size``, ``pool_max_size`` and ``total_steps`` are
    filled in by the run. The fields with a flag are ``%%elastic_train``'s options, shown by
    --help in their groups (config.flags.Group), in this order; docs/options.md lists them.

    ``workers=`` and ``keep=`` are the old names of ``loader_processes`` and
    ``keep_checkpoints``: accepted with a FutureWarning until release ``ALIASES_UNTIL``.
    ``commit_every=`` was removed and raises UsageError.
    """

    name: str = field(metadata=flag(
        "--name", "run name; checkpoints go to elastic-checkpoints/NAME/", group=_RUN))
    global_batch: int = field(default=64, metadata=flag(
        "--global-batch", "samples per optimizer step, whatever the world size (default "
        "%(default)s)", parse=positive_int, group=_DATA))
    micro_batch: int | None = field(default=None, metadata=flag(
        "--micro-batch", "samples per micro-batch: a step of b samples is cut into ceil(b/N) "
        "(unset: one micro-batch per slot of the pool's --max)", parse=positive_int,
        group=_TUNING))
    pass_cost: float | str | None = field(default=None, metadata=flag(
        "--pass-cost", "opt-in tuning: a forward/backward pass's fixed cost in samples; a step "
        "is cut into the fewest micro-batches that keep every world size balanced ('measure': "
        "timed at the start, the value is logged)", parse=samples_or_measure, group=_TUNING))
    drop_last: bool = field(default=False, metadata=flag(
        "--drop-last", "leave out each epoch's short last step, as DataLoader(drop_last=True)",
        group=_DATA))
    no_shuffle: bool = field(default=False, metadata=flag(
        "--no-shuffle", "keep the dataset's order, as DataLoader(shuffle=False): each epoch "
        "reads samples 0, 1, 2... (without it: a permutation per epoch from --seed)",
        group=_DATA))
    epochs: int | None = field(default=None, metadata=flag(
        "--epochs", "epochs to train (unset: 1, unless --steps)", parse=positive_int,
        group=_DATA))
    # DataLoader processes (engine.data.map_pipeline); "workers" read as ranks to Ray and
    # Horovod users
    loader_processes: int = field(default=0, metadata=flag(
        "--loader-processes", "DataLoader processes per engine that fetch and collate the "
        "coming passes' samples ahead, into pinned memory on GPU slots (default %(default)s: "
        "in the training process; a streaming dataset's are read by these processes too)",
        parse=int, group=_DATA, renamed=(Renamed("--workers", ALIASES_UNTIL),)))
    steps: int | None = field(default=None, metadata=flag(
        "--steps", "optimizer steps to train (instead of --epochs)", parse=positive_int,
        group=_DATA))
    eval_every: int | None = field(default=None, metadata=flag(
        "--eval-every", "evaluate eval_dataset every N steps (and always at the end)",
        parse=positive_int, group=_OPTIM))
    clip_grad_norm: float | None = field(default=None, metadata=flag(
        "--clip-grad-norm", "clip the gradient's total norm", parse=float, group=_OPTIM))
    checkpoint_every: int = field(default=100, metadata=flag(
        "--checkpoint-every", "checkpoint every N steps, and at the end (default %(default)s; "
        "0: at the end only)", parse=int, group=_CKPT))
    checkpoint_dir: str | None = field(default=None, metadata=flag(
        "--checkpoint-dir", "folder of the checkpoints and logs (unset: "
        "elastic-checkpoints/NAME/ beside the notebook)", group=_CKPT))
    # "keep" alone did not say what is kept
    keep_checkpoints: int = field(default=3, metadata=flag(
        "--keep-checkpoints", "checkpoints kept, the newest (default %(default)s)",
        parse=positive_int, group=_CKPT, renamed=(Renamed("--keep", ALIASES_UNTIL),)))
    seed: int = field(default=0, metadata=flag(
        "--seed", "seed of initial weights and data order (default %(default)s)", parse=int,
        group=_RUN))
    collective_timeout: float = field(default=30.0, metadata=flag(
        "--collective-timeout", "seconds a rank may block in a collective before it counts as "
        "hung (default %(default)s)", parse=float, group=_ELASTIC))
    standby: int = field(default=0, metadata=flag(
        "--standby", "engines kept set up outside the group so a grow is instant (default "
        "%(default)s)", parse=int, group=_ELASTIC))
    warm: int = field(default=1, metadata=flag(
        "--warm", "engines an auto run keeps set up on no slot, so growing into a granted slot "
        "starts none (default %(default)s; 0 saves their host memory)", parse=int,
        group=_ELASTIC))
    sync_batchnorm: bool = field(default=False, metadata=flag(
        "--sync-batchnorm", "convert BatchNorm layers to SyncBatchNorm (GPU slots only)",
        group=_OPTIM))
    pool_min_size: int = 1
    pool_max_size: int = 1
    plateau_metric: str | None = field(default=None, metadata=flag(
        "--plateau-metric", "validation metric a ReduceLROnPlateau lr_scheduler steps on at each "
        "evaluation, like val_loss (needs --eval-every; unset: once per epoch on the epoch's "
        "mean training loss)", group=_OPTIM))
    precision: str | None = field(default=None, metadata=flag(  # None: fp32
        "--precision", "run loss_fn under torch.autocast in this dtype; fp16 adds a gradient "
        "scaler (unset: fp32)", choices=PRECISIONS[1:], group=_OPTIM))
    tensorboard: bool | str = field(default=False, metadata=flag(  # a folder: tensorboard.py
        "--tensorboard", "also log to TensorBoard, in DIR/NAME/ (given alone: tensorboard/ in "
        "the run's checkpoint folder); needs the tensorboard package. Put the handle's name "
        "first: a word after --tensorboard is its DIR", metavar="DIR", bare=True, group=_CKPT))
    move_frozen: bool = field(default=False, metadata=flag(
        "--move-frozen", "send frozen weights (parameters with requires_grad=False, buffers of "
        "frozen modules) to new engines and write them in checkpoints, as trained ones "
        "(without it: each engine keeps the ones its cell built, checked by a hash)",
        group=_CKPT))
    shard: bool = field(default=False, metadata=flag(
        "--shard", "shard the model's parameters, gradients and optimizer state over the ranks "
        "with FSDP2 (each block; the cell's shard_fn(model, mesh) may choose), resized in "
        "memory", group=_SHARDED))
    replica_every: int = field(default=20, metadata=flag(
        "--replica-every", "steps between two copies of each rank's part on its partner "
        "rank's host memory, the most a fault loses (default %(default)s; also after each "
        "resize and at each checkpoint, which is written from that copy)", parse=positive_int,
        metavar="K", group=_SHARDED))
    memory_per_rank: int | None = field(default=None, metadata=flag(
        "--memory-per-rank", "the training memory a rank may use, like 24G (unset: a GPU "
        "slot's memory; none on CPU slots). The run refuses a pool's --min, and a resize, "
        "below the smallest world size that fits (one micro-batch's activations included)",
        parse=byte_size, metavar="SIZE", group=_SHARDED))
    fault_dir: str | None = None  # fault-injection hook for tests (see engine.faultpoints)
    total_steps: int = 0
    # the old names, and a removed option: see the docstring and __post_init__
    workers: InitVar[int | None] = None
    keep: InitVar[int | None] = None
    commit_every: InitVar[int | None] = None

    def __post_init__(self, workers: int | None, keep: int | None,
                      commit_every: int | None) -> None:
        if commit_every is not None:
            raise UsageError(COMMIT_EVERY.message())
        for (old, new), value in zip(RENAMED_FIELDS.items(), (workers, keep)):
            if value is not None:
                warnings.warn(f"RunConfig({old}=...) is now RunConfig({new}=...); the old "
                              f"name goes in release {ALIASES_UNTIL}", FutureWarning,
                              stacklevel=3)
                setattr(self, new, value)

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> RunConfig:
        """The config of the plain dict `options` (``as_dict()`` as the kernel sends it, a
        checkpoint's ``config``, or a part of either: a missing field takes its default, and
        the name is empty, which an engine does not read). An older release's name of a field
        reads as the field; a key that names no field (a checkpoint's ``dataset``, a removed
        option) is ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        renamed = {RENAMED_FIELDS[k]: v for k, v in options.items()
                   if k in RENAMED_FIELDS and RENAMED_FIELDS[k] not in options}
        known = {k: v for k, v in {**options, **renamed}.items() if k in names}
        return cls(**{"name": "", **known})

    def validate(self) -> None:
        """Raises UsageError naming the first option (as the line spells it) that is wrong."""
        self._validate_name()
        self._validate_counts()
        if self.precision not in PRECISIONS:
            raise UsageError(f"--precision takes bf16 or fp16 (leave it out for fp32), got "
                             f"{self.precision!r}")
        self._validate_cut()
        self._validate_outputs()
        self._validate_plateau_metric()

    def _validate_name(self) -> None:
        if not self.name or any(c in self.name for c in "/\\") or self.name.startswith("."):
            raise UsageError(f"--name must be a plain name (no slashes), got {self.name!r}")
        if len(self.name.encode()) > MAX_NAME_BYTES:
            raise UsageError(f"--name is {len(self.name.encode())} bytes long; at most "
                             f"{MAX_NAME_BYTES} (it names the run's folder and files)")

    def _validate_counts(self) -> None:
        for name, least, optional in _COUNTS:
            value = getattr(self, name)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                what = "a positive integer" if least else "an integer >= 0"
                raise UsageError(f"{flag_of(RunConfig, name)} must be {what}, got {value!r}")
        if self.checkpoint_every is not None and self.checkpoint_every < 0:
            raise UsageError("--checkpoint-every must be >= 0 (0: only at the end)")
        if self.epochs is not None and self.steps is not None:
            raise UsageError("give --epochs or --steps, not both")

    def _validate_cut(self) -> None:
        cost = self.pass_cost
        if cost not in (None, "measure") and (isinstance(cost, bool) or
                not isinstance(cost, (int, float)) or not 0 <= cost < float("inf")):
            raise UsageError(f"--pass-cost is a number of samples >= 0 (as the run's "
                             f"micro_batches event reports it) or measure, got {cost!r}")
        if self.micro_batch is not None and self.pass_cost is not None:
            raise UsageError("give --micro-batch or --pass-cost, not both: each chooses how "
                             "steps are cut into micro-batches")
        if not isinstance(self.drop_last, bool):
            raise UsageError(f"drop_last is True or False, got {self.drop_last!r}")

    def _validate_outputs(self) -> None:
        if isinstance(self.tensorboard, os.PathLike):
            self.tensorboard = os.fspath(self.tensorboard)
        if not isinstance(self.tensorboard, (bool, str)) or self.tensorboard == "":
            raise UsageError(f"tensorboard takes True (the run's folder) or a folder, got "
                             f"{self.tensorboard!r}")
        if self.memory_per_rank is not None and (isinstance(self.memory_per_rank, bool) or
                not isinstance(self.memory_per_rank, int) or self.memory_per_rank < 1):
            raise UsageError(f"--memory-per-rank is a number of bytes (the magic reads 24G), "
                             f"got {self.memory_per_rank!r}")
        if self.memory_per_rank is not None and not self.shard:
            raise UsageError("--memory-per-rank bounds a sharded run (each rank of a "
                             "replicated one holds the whole state): add --shard")
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise UsageError(f"--clip-grad-norm must be > 0, got {self.clip_grad_norm}")

    def _validate_plateau_metric(self) -> None:
        metric = self.plateau_metric
        if metric is None:
            return
        if not isinstance(metric, str) or not metric.startswith("val_"):
            raise UsageError("--plateau-metric names a validation metric as logged, like "
                             f"val_loss or val_accuracy; got {metric!r}")
        if self.eval_every is None:
            raise UsageError(f"--plateau-metric {metric} needs --eval-every N: "
                             "the scheduler steps at each evaluation")

    def as_dict(self) -> dict:
        return asdict(self)


# the counts validate checks, in its order: (field, least value, None allowed)
_COUNTS = (("global_batch", 1, False), ("micro_batch", 1, True), ("epochs", 1, True),
           ("steps", 1, True), ("eval_every", 1, True), ("keep_checkpoints", 1, False),
           ("standby", 0, False), ("warm", 0, False), ("loader_processes", 0, False))


@dataclass
class RunStart:
    """How a run starts, beside its options: ``TrainingRun(pool, config, ...)``'s keywords,
    declared once (run.run.TrainingRun documents each). ``%%elastic_train`` takes those with
    a flag; its ``--push a,b`` and ``--schedule STEP:SIZE,...`` are the line's spellings of
    `push` and `schedule` (ui.magics)."""

    source: str | None = None  # the cell's code, run on every engine
    setup: Callable[[], dict] | None = None  # or a function that returns the cell's objects
    push: dict[str, Any] | None = None  # notebook variables defined on the engines first
    resume: bool = field(default=False, metadata=flag(
        "--resume", "continue from the newest checkpoint", group=_CKPT))
    engines: int | None = field(default=None, metadata=flag(
        "--engines", "starting world size (unset: the pool's size)", parse=positive_int,
        group=_ELASTIC))
    workspace: str | None = None  # the folder that holds elastic-checkpoints/NAME/
    notebook: str | None = None  # the notebook's name, as views show the run
    schedule: list[tuple[int, int]] | None = None  # resizes (at_step, size) before training


# the fields' older names, still read (with a FutureWarning from a call) until ALIASES_UNTIL
RENAMED_FIELDS = {"workers": "loader_processes", "keep": "keep_checkpoints"}

# steps became transactional (engine.group.vote) in 0.1.0, which left the option nothing to do
COMMIT_EVERY = Removed("--commit-every", "commit_every", "0.2.0",
                       "every step is committed by a vote of every rank, so a fault loses at "
                       "most the step in flight; leave it out")
REMOVED = (COMMIT_EVERY,)

# options that fix the data order and the update: a resume must keep them
RESUME_KEYS = ("global_batch", "seed", "drop_last", "no_shuffle")
