"""A pool's options: how many engines, on which slots, and where they run.

:class:`PoolOptions` and :class:`LauncherOptions` are ``%elastic_pool start``'s line (and
``EnginePool``'s keywords); :meth:`PoolConfig.resolve` turns the sizes the user gave (None: not
given) into the pool's resolved sizes and GPUs.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from .flags import Group, UsageError, flag, positive_int

DEFAULT_CPU_SLOTS, DEFAULT_CPU_MAX = 2, 4


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
    def resolve(cls, n: int | None, min_size: int | None, max_size: int | None, gpus: str,
                engine_timeout: float) -> PoolConfig:
        """The pool's sizes and GPUs from the options given (None: not given): -n and --max
        default to the GPUs selected, or to 2 and 4 CPU slots. Raises UsageError."""
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
    """A pool's options as ``%elastic_pool start`` takes them and ``EnginePool(...)`` takes
    them as keywords (with ``launcher``, LauncherOptions'); None leaves a size to
    :meth:`PoolConfig.resolve`. The weight is None when not given (a pool's is then 1, and
    ``%%elastic_train`` keeps the pool's)."""

    n: int | None = field(default=None, metadata=flag(
        "-n", "engines to start (unset: one per GPU, or 2 without GPUs)", parse=positive_int))
    min_size: int | None = field(default=None, metadata=flag(
        "--min", "smallest size (unset: 1)", parse=positive_int))
    max_size: int | None = field(default=None, metadata=flag(
        "--max", "largest size (unset: the number of GPUs, or 4 without GPUs)", parse=positive_int))
    gpus: str = field(default="all", metadata=flag(
        "--gpus", "all | none | a list like 0,2 (default %(default)s)"))
    engine_timeout: float = field(default=60.0, metadata=flag(
        "--engine-timeout", "seconds to wait for an engine to start (default %(default)s)",
        parse=float))
    auto: bool = field(default=False, metadata=flag(
        "--auto", "auto mode: the machine's arbiter sizes the pool between --min and --max by "
        "weighted fair share with the machine's other runs (on Slurm: grow while the partition "
        "is idle, give back while other jobs wait; over ssh: each host's arbiter grants its "
        "slots)", group=Group.ELASTICITY))
    weight: float | None = field(default=None, metadata=flag(
        "--weight", "the pool's weight in that fair share among your runs (unset: 1)",
        parse=float, group=Group.ELASTICITY))
    lend: bool = field(default=True, metadata=flag(
        "--no-lend", "keep this pool's slots while no run trains on it (without it, the "
        "machine's arbiter lends them to auto runs after a minute, and they come back when "
        "you train)", sets=False))
    # None: take slots from the machine's arbiter with --auto, or where the admin runs one
    arbiter: bool | None = field(default=None, metadata=flag(
        "--no-arbiter", "do not take slots from the machine's arbiter, even where the admin "
        "runs one (for --gpus lists and --schedule)", sets=False))
    # how the machine's view shows the pool (a run on it renames it); no flag
    name: str = ""
    notebook: str | None = None


@dataclass
class LauncherOptions:
    """Where a pool's engines run, as ``%elastic_pool start`` takes it: ``--launcher`` and the
    launchers' options. Which launcher takes which is the launcher's own signature
    (pool.launchers.make_launcher refuses the others); None: the launcher's default."""

    launcher: str = field(default="local", metadata=flag(
        "--launcher", "where the engines run (default %(default)s): local, processes of this "
        "host; ssh, processes of --hosts started over ssh; slurm, one batch job each",
        choices=("local", "ssh", "slurm")))
    hosts: str | None = field(default=None, metadata=flag(
        "--hosts", "ssh: hosts and their slots, like gpu1:4,gpu2:4"))
    partition: str | None = field(default=None, metadata=flag(
        "--partition", "slurm: the partition (unset: the one Slurm picks)"))
    account: str | None = field(default=None, metadata=flag(
        "--account", "slurm: the account to charge"))
    time: str | None = field(default=None, metadata=flag(
        "--time", "slurm: each job's time limit, like 60 or 1-00:00:00"))
    gpus_per_engine: int | None = field(default=None, metadata=flag(
        "--gpus-per-engine", "slurm, ssh: GPUs per engine (unset: 0, CPU engines on gloo)",
        parse=int))
    cpus_per_engine: int | None = field(default=None, metadata=flag(
        "--cpus-per-engine", "slurm, ssh: CPU threads per engine (unset: 1)", parse=int))
    grace: int | None = field(default=None, metadata=flag(
        "--grace", "slurm: seconds before the time limit when Slurm signals the engine to "
        "drain, and a replacement is queued (unset: 60)", parse=int))
    interface: str | None = field(default=None, metadata=flag(
        "--interface", "slurm, ssh: the network interface the engines' hosts reach this kernel "
        "on (unset: the one on the route to slurmctld, or to the first host). The rendezvous "
        "store has no authentication: never all interfaces"))

    def settings(self) -> dict[str, Any]:
        """The launcher's options by name (pool.launchers.make_launcher's keywords)."""
        return {k: v for k, v in asdict(self).items() if k != "launcher"}


