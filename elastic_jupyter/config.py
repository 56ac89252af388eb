"""Options of pools and runs, their defaults and their validation.

Defaults (the README's table is generated from the same values):

=====================  ===========================================================
pool ``-n``            number of GPUs; 2 without GPUs
pool ``--min``         1
pool ``--max``         number of GPUs; 4 without GPUs
pool ``--gpus``        all (``none`` forces CPU slots; ``0,2`` picks GPUs)
engine start timeout   60 s
``--global-batch``     64
``--micro-batch``      none: a step is cut into one micro-batch per ``--max`` slot (N: into
                       micro-batches of N samples)
``--pass-cost``        none (P: the fewest micro-batches that balance when a pass costs P
                       samples; ``measure``: P timed at the run's start)
``--drop-last``        off: an epoch's short last step trains on the remainder
``--epochs``           1 (unless ``--steps``)
``--workers``          0 loader processes per engine: samples are fetched in the training
                       process when a pass needs them (N: fetched ahead in N processes)
``--checkpoint-every`` 100 steps, and always at the end
``--checkpoint-dir``   ``elastic-checkpoints/<name>/`` beside the notebook
``--keep``             3 checkpoints
``--seed``             0
collective timeout     30 s (a rank stuck in a collective longer is treated as hung)
``--commit-every``     ignored: steps are transactional (engine.vote); the option is accepted,
                       with a notice, for one more release
``--standby``          0 engines kept set up outside the group, so a grow needs no engine start
``--plateau-metric``   none: a ReduceLROnPlateau steps once per epoch on the epoch's mean
                       training loss
``--precision``        none: fp32 (``bf16``/``fp16``: loss_fn under torch.autocast)
``--tensorboard``      off (on: ``tensorboard/`` in the run's checkpoint folder; ``DIR``: ``DIR/<name>/``)
=====================  ===========================================================
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

DEFAULT_CPU_SLOTS, DEFAULT_CPU_MAX = 2, 4
# a file name has room for 255 bytes: the run's folder and its discovery entry
# (``<name>-<8 hex>.json.tmp``) must fit
MAX_NAME_BYTES = 200
PRECISIONS = (None, "bf16", "fp16")


class UsageError(ValueError):
    """A request that cannot be carried out as given; the message says what to change."""


def _gpu_ids(gpus: str) -> list[int]:
    if gpus in ("none", "", None):
        return []
    try:
        import torch
        available = torch.cuda.device_count()
    except Exception:
        available = 0
    if gpus == "all":
        return list(range(available))
    try:
        ids = [int(g) for g in str(gpus).split(",")]
    except ValueError:
        raise UsageError(f"--gpus takes all, none or a list like 0,2; got {gpus!r}") from None
    bad = [g for g in ids if not 0 <= g < available]
    if bad:
        raise UsageError(f"GPU {bad[0]} does not exist: this machine has {available} GPU(s)")
    return ids


@dataclass
class PoolConfig:
    n: int
    min_size: int
    max_size: int
    gpus: list = field(default_factory=list)
    engine_timeout: float = 60.0
    threads_per_engine: int = 1

    @staticmethod
    def gpu_count() -> int:
        """The GPUs this process sees."""
        return len(_gpu_ids("all"))

    @classmethod
    def resolve(cls, n, min_size, max_size, gpus, engine_timeout) -> "PoolConfig":
        ids = _gpu_ids(gpus)
        if ids:
            max_size = len(ids) if max_size is None else max_size
            if max_size > len(ids):
                raise UsageError(f"--max {max_size} exceeds the {len(ids)} GPU(s) selected: one "
                                 "engine per GPU")
            n = max_size if n is None else n
        else:
            max_size = DEFAULT_CPU_MAX if max_size is None else max_size
            n = min(DEFAULT_CPU_SLOTS, max_size) if n is None else n
        min_size = 1 if min_size is None else min_size
        for label, v in (("-n", n), ("--min", min_size), ("--max", max_size)):
            if not isinstance(v, int) or v < 1:
                raise UsageError(f"{label} must be a positive integer, got {v!r}")
        if not min_size <= n <= max_size:
            raise UsageError(f"need --min <= -n <= --max, got {min_size} <= {n} <= {max_size}")
        threads = max(1, (os.cpu_count() or 1) // max_size) if not ids else 4
        return cls(n, min_size, max_size, ids, engine_timeout, threads)


@dataclass
class RunConfig:
    """A run's options; plain data, stored in every checkpoint.

    Sizes are in samples; ``total_steps`` is derived from ``epochs`` unless ``steps`` is given.
    How steps are cut into micro-batches (engine.batching.Cut, fixed at the run's start and kept
    by a resume): ``micro_batch`` (N samples each), else ``pass_cost`` (a number, or
    ``"measure"``: engine.calibration), else one per slot of the pool's ``pool_max_size``;
    ``pool_min_size`` and ``pool_max_size`` are filled in by the run.
    """

    name: str
    global_batch: int = 64
    micro_batch: int | None = None
    pass_cost: float | str | None = None
    drop_last: bool = False
    epochs: int | None = None
    workers: int = 0  # DataLoader processes per engine (engine.loader)
    steps: int | None = None
    eval_every: int | None = None
    clip_grad_norm: float | None = None
    checkpoint_every: int = 100
    checkpoint_dir: str | None = None
    keep: int = 3
    seed: int = 0
    collective_timeout: float = 30.0
    commit_every: int | None = None  # ignored (see COMMIT_EVERY_NOTICE); goes next release
    standby: int = 0
    sync_batchnorm: bool = False
    pool_min_size: int = 1
    pool_max_size: int = 1
    plateau_metric: str | None = None  # the val_* metric a ReduceLROnPlateau steps on
    precision: str | None = None  # None (fp32), "bf16" or "fp16": loss_fn under torch.autocast
    tensorboard: bool | str = False  # False, True (in the run's folder) or a folder (tensorboard.py)
    fault_dir: str | None = None  # fault-injection hook for tests (see engine.faultpoints)
    total_steps: int = 0

    def validate(self) -> None:
        def positive(label, v, allow_none=False):
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UsageError(f"{label} must be a positive integer, got {v!r}")

        if not self.name or any(c in self.name for c in "/\\") or self.name.startswith("."):
            raise UsageError(f"--name must be a plain name (no slashes), got {self.name!r}")
        if len(self.name.encode()) > MAX_NAME_BYTES:
            raise UsageError(f"--name is {len(self.name.encode())} bytes long; at most "
                             f"{MAX_NAME_BYTES} (it names the run's folder and files)")
        positive("--global-batch", self.global_batch)
        positive("--micro-batch", self.micro_batch, allow_none=True)
        positive("--epochs", self.epochs, allow_none=True)
        positive("--steps", self.steps, allow_none=True)
        positive("--eval-every", self.eval_every, allow_none=True)
        positive("--keep", self.keep)
        for label, v in (("--standby", self.standby), ("--workers", self.workers)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise UsageError(f"{label} must be an integer >= 0, got {v!r}")
        positive("--commit-every", self.commit_every, allow_none=True)
        if self.checkpoint_every is not None and self.checkpoint_every < 0:
            raise UsageError("--checkpoint-every must be >= 0 (0: only at the end)")
        if self.epochs is not None and self.steps is not None:
            raise UsageError("give --epochs or --steps, not both")
        if self.precision not in PRECISIONS:
            raise UsageError(f"--precision takes bf16 or fp16 (leave it out for fp32), got "
                             f"{self.precision!r}")
        if self.pass_cost not in (None, "measure") and (isinstance(self.pass_cost, bool) or
                not isinstance(self.pass_cost, (int, float)) or
                not 0 <= self.pass_cost < float("inf")):
            raise UsageError(f"--pass-cost is a number of samples >= 0 (as the run's "
                             f"micro_batches event reports it) or measure, got "
                             f"{self.pass_cost!r}")
        if self.micro_batch is not None and self.pass_cost is not None:
            raise UsageError("give --micro-batch or --pass-cost, not both: each chooses how "
                             "steps are cut into micro-batches")
        if not isinstance(self.drop_last, bool):
            raise UsageError(f"drop_last is True or False, got {self.drop_last!r}")
        if isinstance(self.tensorboard, os.PathLike):
            self.tensorboard = os.fspath(self.tensorboard)
        if not isinstance(self.tensorboard, (bool, str)) or self.tensorboard == "":
            raise UsageError(f"tensorboard takes True (the run's folder) or a folder, got "
                             f"{self.tensorboard!r}")
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise UsageError(f"--clip-grad-norm must be > 0, got {self.clip_grad_norm}")
        if self.plateau_metric is not None:
            metric = self.plateau_metric
            if not isinstance(metric, str) or not metric.startswith("val_"):
                raise UsageError("--plateau-metric names a validation metric as logged, like "
                                 f"val_loss or val_accuracy; got {metric!r}")
            if self.eval_every is None:
                raise UsageError(f"--plateau-metric {metric} needs --eval-every N: "
                                 "the scheduler steps at each evaluation")

    def as_dict(self) -> dict:
        return asdict(self)


COMMIT_EVERY_NOTICE = (
    "--commit-every is ignored and will be removed in the next release: each step is now "
    "committed by a vote of every rank, so a fault loses at most the step in flight and no "
    "in-memory copies of the state are kept")

# options that fix the data order and the update: a resume must keep them
RESUME_KEYS = ("global_batch", "seed", "drop_last")
