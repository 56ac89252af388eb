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
``--warm``             1 engine an auto run keeps set up on no slot (growth then starts none)
``--plateau-metric``   none: a ReduceLROnPlateau steps once per epoch on the epoch's mean
                       training loss
``--precision``        none: fp32 (``bf16``/``fp16``: loss_fn under torch.autocast)
``--move-frozen``      off: frozen weights stay on each engine and out of grows and
                       checkpoints (engine.frozen)
``--tensorboard``      off (on: ``tensorboard/`` in the run's checkpoint folder; ``DIR``: ``DIR/<name>/``)
=====================  ===========================================================

Each option a magic's line takes is declared once, as a dataclass field whose metadata holds
its :class:`Flag` (spelling, help, parsing): ``RunConfig``'s for ``%%elastic_train``,
``PoolOptions`` and ``LauncherOptions`` for ``%elastic_pool``; ui/options.py derives the
magics' parsers from them, and a run's config from the parsed line.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import Field, asdict, dataclass, field, fields
from typing import Any, Callable

DEFAULT_CPU_SLOTS, DEFAULT_CPU_MAX = 2, 4
# a file name has room for 255 bytes: the run's folder and its discovery entry
# (``<name>-<8 hex>.json.tmp``) must fit
MAX_NAME_BYTES = 200
PRECISIONS = (None, "bf16", "fp16")


class UsageError(ValueError):
    """A request that cannot be carried out as given; the message says what to change."""


# ---------------------------------------------------------------------- how an option is spelled

NEEDS_VALUE: Any = object()  # Flag.bare's default: the flag is not given without a value


@dataclass(frozen=True)
class Flag:
    """How a magic's line spells one option (ui/options.py turns it into argparse's terms).

    name: the flag (``--global-batch``, ``-n``), or a positional's name (its field's).
    help: its --help text. parse: text -> value; raises argparse.ArgumentTypeError saying
    what was expected (None: the text as given). choices: the values allowed. metavar: the
    value's name in --help (None: argparse's, from the flag). bare: the value of the flag
    given alone, which makes its value optional (NEEDS_VALUE: it is not given alone).
    after: the option (a field name) this one follows in --help, for a line that joins
    several declarations (None: where it is declared). A bool field that defaults to False
    and has no ``bare`` is a switch: the flag alone sets it.
    """

    name: str
    help: str | None = None
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    bare: Any = NEEDS_VALUE
    after: str | None = None


def flag(name: str, text: str | None = None, **spelling: Any) -> dict[str, Flag]:
    """A field's metadata that declares its option: ``field(default=..., metadata=flag(...))``;
    `text`: its help, `spelling`: the other attributes of :class:`Flag`."""
    return {"flag": Flag(name, text, **spelling)}


def flagged(cls: type, *names: str) -> list[tuple[Field, Flag]]:
    """The options `cls` declares (only `names`, when given), in declaration order."""
    options = [(f, f.metadata["flag"]) for f in fields(cls) if "flag" in f.metadata]
    return [(f, spelled) for f, spelled in options if not names or f.name in names]


def flag_of(cls: type, name: str) -> str:
    """How the line spells `cls`'s option `name` (``--global-batch``), for messages."""
    return next(spelled.name for f, spelled in flagged(cls) if f.name == name)


def positive_int(text: str) -> int:
    """An option's text as an integer >= 1; argparse.ArgumentTypeError otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def samples_or_measure(text: str) -> float | str:
    """``--pass-cost``'s text: a number of samples, or "measure"."""
    if text == "measure":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of samples or 'measure', got "
                                         f"{text!r}") from None


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def byte_size(text: str) -> int:
    """A size's text in bytes: a number with K, M, G or T (binary units, as Slurm's --mem:
    ``24G`` is 24 GiB; ``GiB``, ``GB`` and ``B`` suffixes read alike), or plain bytes."""
    spelled = str(text).strip().upper().removesuffix("B").removesuffix("I")
    unit = spelled[-1:] if spelled[-1:] in _UNITS else ""
    try:
        value = float(spelled[:len(spelled) - len(unit)]) * _UNITS[unit]
    except ValueError:
        value = 0
    if not 1 <= value < 2**63:  # NaN and infinity too
        raise argparse.ArgumentTypeError(f"expected a size like 24G, 800M or a number of bytes,"
                                         f" got {text!r}")
    return int(value)


# ---------------------------------------------------------------------- pools

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
class PoolOptions:
    """A pool's options as ``%elastic_pool start`` takes them; None leaves the value to
    :meth:`PoolConfig.resolve`. The line's weight is None when not given (the pool's is 1)."""

    n: int | None = field(default=None, metadata=flag(
        "-n", "engines to start (default: #GPUs, or 2)", parse=positive_int))
    min_size: int | None = field(default=None, metadata=flag(
        "--min", "smallest size (default 1)", parse=positive_int))
    max_size: int | None = field(default=None, metadata=flag(
        "--max", "largest size (default: #GPUs, or 4)", parse=positive_int))
    gpus: str = field(default="all", metadata=flag(
        "--gpus", "all | none | a list like 0,2 (default all)"))
    engine_timeout: float = field(default=60.0, metadata=flag(
        "--engine-timeout", "seconds to wait for an engine to start (default 60)", parse=float))
    auto: bool = field(default=False, metadata=flag(
        "--auto", "auto mode: the machine's arbiter sizes the pool between --min and --max by "
        "weighted fair share with the machine's other runs (on Slurm: grow while the partition "
        "is idle, give back while other jobs wait; over ssh: each host's arbiter grants its "
        "slots)"))
    weight: float | None = field(default=None, metadata=flag(
        "--weight", "the pool's weight in that fair share among your runs (default 1)",
        parse=float))
    no_lend: bool = field(default=False, metadata=flag(
        "--no-lend", "keep this pool's slots while no run trains on it (by default the "
        "machine's arbiter lends them to auto runs after a minute, and they come back when "
        "you train)"))
    no_arbiter: bool = field(default=False, metadata=flag(
        "--no-arbiter", "do not take slots from the machine's arbiter, even where the admin "
        "runs one (for --gpus lists and --schedule)"))


@dataclass
class LauncherOptions:
    """Where a pool's engines run, as ``%elastic_pool start`` takes it: ``--launcher`` and the
    launchers' options. Which launcher takes which is the launcher's own signature
    (pool.launchers.make_launcher refuses the others); None: the launcher's default."""

    launcher: str = field(default="local", metadata=flag(
        "--launcher", "local: processes of this host (default); ssh: processes of --hosts, "
        "started over ssh; slurm: one batch job each", choices=("local", "ssh", "slurm")))
    hosts: str | None = field(default=None, metadata=flag(
        "--hosts", "ssh: hosts and their slots, like gpu1:4,gpu2:4"))
    partition: str | None = field(default=None, metadata=flag(
        "--partition", "slurm: the partition (default: Slurm's)"))
    account: str | None = field(default=None, metadata=flag(
        "--account", "slurm: the account to charge"))
    time: str | None = field(default=None, metadata=flag(
        "--time", "slurm: each job's time limit, like 60 or 1-00:00:00"))
    gpus_per_engine: int | None = field(default=None, metadata=flag(
        "--gpus-per-engine", "slurm, ssh: GPUs per engine (default 0: CPU engines, gloo)",
        parse=int))
    cpus_per_engine: int | None = field(default=None, metadata=flag(
        "--cpus-per-engine", "slurm, ssh: CPU threads per engine (default 1)", parse=int))
    grace: int | None = field(default=None, metadata=flag(
        "--grace", "slurm: seconds before the time limit when Slurm signals the engine to "
        "drain, and a replacement is queued (default 60)", parse=int))
    interface: str | None = field(default=None, metadata=flag(
        "--interface", "slurm, ssh: the network interface the engines' hosts reach this kernel "
        "on (default: the one on the route to slurmctld, or to the first host). The rendezvous "
        "store has no authentication: never all interfaces"))

    def settings(self) -> dict[str, Any]:
        """The launcher's options by name (pool.launchers.make_launcher's keywords)."""
        return {k: v for k, v in asdict(self).items() if k != "launcher"}


# ---------------------------------------------------------------------- runs

@dataclass
class RunConfig:
    """A run's options; plain data, stored in every checkpoint.

    Sizes are in samples; ``total_steps`` is derived from ``epochs`` unless ``steps`` is given.
    How steps are cut into micro-batches (engine.batching.Cut, fixed at the run's start and kept
    by a resume): ``micro_batch`` (N samples each), else ``pass_cost`` (a number, or
    ``"measure"``: engine.calibration), else one per slot of the pool's ``pool_max_size``;
    ``pool_min_size`` and ``pool_max_size`` are filled in by the run. The fields with a flag
    are ``%%elastic_train``'s options, listed by --help in this order (save where a Flag's
    ``after`` moves one).
    """

    name: str = field(metadata=flag(
        "--name", "run name; checkpoints go to elastic-checkpoints/NAME/"))
    global_batch: int = field(default=64, metadata=flag(
        "--global-batch", "samples per optimizer step, whatever the world size (default 64)",
        parse=positive_int))
    micro_batch: int | None = field(default=None, metadata=flag(
        "--micro-batch", "samples per micro-batch: a step of b samples is cut into ceil(b/N) "
        "(default: one micro-batch per slot of the pool's --max)", parse=positive_int))
    pass_cost: float | str | None = field(default=None, metadata=flag(
        "--pass-cost", "opt-in tuning: a forward/backward pass's fixed cost in samples; a step "
        "is cut into the fewest micro-batches that keep every world size balanced ('measure': "
        "timed at the start, the value is logged)", parse=samples_or_measure))
    drop_last: bool = field(default=False, metadata=flag(
        "--drop-last", "leave out each epoch's short last step, as DataLoader(drop_last=True)"))
    no_shuffle: bool = field(default=False, metadata=flag(
        "--no-shuffle", "keep the dataset's order, as DataLoader(shuffle=False): each epoch "
        "reads samples 0, 1, 2... (default: a permutation per epoch from --seed)"))
    epochs: int | None = field(default=None, metadata=flag(
        "--epochs", "epochs to train (default 1)", parse=positive_int))
    workers: int = field(default=0, metadata=flag(  # DataLoader processes (engine.loader)
        "--workers", "DataLoader processes per engine that fetch and collate the coming passes' "
        "samples ahead (default 0: in the training process)", parse=int, after="commit_every"))
    steps: int | None = field(default=None, metadata=flag(
        "--steps", "optimizer steps to train (instead of --epochs)", parse=positive_int))
    eval_every: int | None = field(default=None, metadata=flag(
        "--eval-every", "evaluate eval_dataset every N steps (and always at the end)",
        parse=positive_int))
    clip_grad_norm: float | None = field(default=None, metadata=flag(
        "--clip-grad-norm", "clip the gradient's total norm", parse=float))
    checkpoint_every: int = field(default=100, metadata=flag(
        "--checkpoint-every", "checkpoint every N steps, and at the end (default 100; 0: end "
        "only)", parse=int))
    checkpoint_dir: str | None = field(default=None, metadata=flag(
        "--checkpoint-dir", "folder (default: elastic-checkpoints/NAME/ beside the notebook)"))
    keep: int = field(default=3, metadata=flag(
        "--keep", "checkpoints kept (default 3)", parse=positive_int))
    seed: int = field(default=0, metadata=flag(
        "--seed", "seed of initial weights and data order", parse=int))
    collective_timeout: float = field(default=30.0, metadata=flag(
        "--collective-timeout", "seconds a rank may block in a collective before it counts as "
        "hung (default 30)", parse=float))
    commit_every: int | None = field(default=None, metadata=flag(  # see COMMIT_EVERY_NOTICE
        "--commit-every", "ignored: every step is committed by a vote, so a fault loses at most "
        "one step (accepted for one more release)", parse=positive_int))
    standby: int = field(default=0, metadata=flag(
        "--standby", "engines kept set up outside the group so a grow is instant (default 0)",
        parse=int))
    warm: int = field(default=1, metadata=flag(
        "--warm", "engines an auto run keeps set up on no slot, so growing into a granted slot "
        "starts none (default 1; 0 saves their host memory)", parse=int))
    sync_batchnorm: bool = field(default=False, metadata=flag(
        "--sync-batchnorm", "convert BatchNorm layers to SyncBatchNorm (GPU slots only)",
        after="tensorboard"))
    pool_min_size: int = 1
    pool_max_size: int = 1
    plateau_metric: str | None = field(default=None, metadata=flag(
        "--plateau-metric", "validation metric a ReduceLROnPlateau lr_scheduler steps on at each "
        "evaluation, like val_loss (needs --eval-every; default: once per epoch on the epoch's "
        "mean training loss)"))
    precision: str | None = field(default=None, metadata=flag(  # None: fp32
        "--precision", "run loss_fn under torch.autocast in this dtype; fp16 adds a gradient "
        "scaler (default: fp32)", choices=PRECISIONS[1:]))
    tensorboard: bool | str = field(default=False, metadata=flag(  # a folder: tensorboard.py
        "--tensorboard", "also log to TensorBoard, in DIR/NAME/ (default: tensorboard/ in the "
        "run's checkpoint folder); needs the tensorboard package. Put the handle's name first: "
        "a word after --tensorboard is its DIR", metavar="DIR", bare=True))
    move_frozen: bool = field(default=False, metadata=flag(
        "--move-frozen", "send frozen weights (parameters with requires_grad=False, buffers of "
        "frozen modules) to new engines and write them in checkpoints, as trained ones "
        "(default: each engine keeps the ones its cell built, checked by a hash)",
        after="sync_batchnorm"))
    shard: bool = field(default=False, metadata=flag(
        "--shard", "shard the model's parameters, gradients and optimizer state over the ranks "
        "with FSDP2 (each block; the cell's shard_fn(model, mesh) may choose), resized in "
        "memory"))
    replica_every: int = field(default=20, metadata=flag(
        "--replica-every", "with --shard: steps between two copies of each rank's part on its "
        "partner rank's host memory, the most a fault loses (default 20; also after each "
        "resize and at each checkpoint, which is written from that copy)", parse=positive_int, metavar="K"))
    memory_per_rank: int | None = field(default=None, metadata=flag(
        "--memory-per-rank", "with --shard: the training memory a rank may use, like 24G "
        "(default: a GPU slot's memory; none on CPU slots). The run refuses a pool's --min, "
        "and a resize, below the smallest world size that fits (one micro-batch's activations "
        "included)",
        parse=byte_size, metavar="SIZE"))
    fault_dir: str | None = None  # fault-injection hook for tests (see engine.faultpoints)
    total_steps: int = 0

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
           ("steps", 1, True), ("eval_every", 1, True), ("keep", 1, False),
           ("standby", 0, False), ("warm", 0, False), ("workers", 0, False),
           ("commit_every", 1, True))


COMMIT_EVERY_NOTICE = (
    "--commit-every is ignored and will be removed in the next release: each step is now "
    "committed by a vote of every rank, so a fault loses at most the step in flight and no "
    "in-memory copies of the state are kept")

# options that fix the data order and the update: a resume must keep them
RESUME_KEYS = ("global_batch", "seed", "drop_last", "no_shuffle")
