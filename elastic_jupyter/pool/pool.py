"""EnginePool: the public API of a pool of engines, one per slot (a GPU, or a share of the CPUs).

The pool delegates to owners that hold their own state: its engine sets (:mod:`.engine_sets`:
the ipyparallel cluster, starting and stopping engines), its slots (:mod:`.slots`: which slot
an engine may start on) and, in lease mode, its lease and the follower of its grants
(:mod:`.lease`). Where the engines run (this host, other hosts over ssh, Slurm jobs) is the
pool's :class:`~.launchers.Launcher`.

In lease mode (``auto=True``, or a machine whose admin runs a shared arbiter) the slots are the
machine's, leased by its arbiter: engines start only on leased slots, and the pool follows the
lease: while no run trains, the pool itself starts and stops engines to match it; while one
trains, the run's size policy resizes it at step boundaries. Whoever trains on the pool holds
it as its :class:`~.claimant.Claimant`; the pool knows no more of it.
"""
from __future__ import annotations

import asyncio
import atexit
import dataclasses
from typing import Any, Coroutine, TypeVar, cast

from ..arbiter.machine_view import MachineView
from ..arbiter.table import ArbiterError
from ..config import PoolConfig, UsageError
from ..owner import background, get_owner
from .claimant import Claimant
from .engine_sets import EngineSets
from .launchers import Launcher, LocalLauncher
from .lease import POLL_S, LeaseFollower, check_weight_usage, pool_lease
from .processes import Engine, rss
from .queue_printer import QueuePrinter
from .slots import Exclusion, Slots
from .status import EngineStatus, ExclusionStatus, LeaseStatus, PoolStatus, WarmStatus
from .supply import EngineSupply

__all__ = ["EnginePool", "Engine", "Exclusion"]

T = TypeVar("T")

# what each removed forwarding member of EnginePool became (its part's own member)
MOVED = {
    "engines": "pool.engine_sets.engines (or pool.status()['engines'])",
    "client": "pool.engine_sets.client",
    "calls": "pool.engine_sets.calls",
    "queued": "pool.engine_sets.queued",
    "running": "pool.engine_sets.running (or pool.status()['running'])",
    "resize_idle": "pool.engine_sets.resize",
    "min_size": "pool.config.min_size (or pool.status()['min'])",
    "max_size": "pool.config.max_size (or pool.status()['max'])",
    "excluded_slots": "pool.slots.excluded (or pool.status()['excluded_slots'])",
    "readmit_slot": "pool.slots.readmit",
}


class EnginePool:
    """A resizable pool of engines, owned by this process's owner thread.

    Its keywords are config.PoolOptions' fields (``%elastic_pool start``'s options, declared
    there with their defaults) and ``launcher``.

    Args:
        n: engines to start (default: the number of GPUs, or 2 without GPUs).
        min_size, max_size: bounds for resizes (default 1 and the number of GPUs, or 4).
        gpus: "all", "none" or a list of GPU ids such as "0,2".
        engine_timeout: seconds to wait for a new engine to register.
        auto: auto mode: the machine's arbiter sizes the pool between min and max by weighted
            fair share with the other runs on the machine (docs/arbiter.md); on Slurm, Slurm's
            queue does (grow while the partition is idle, give back while others wait:
            :mod:`.arbiter.slurm`).
        weight: the pool's weight in that fair share among its user's runs (> 0; None: 1).
        lend: while no run trains on it for the admin's ``lend_s`` (a minute by default), the
            arbiter may lend the pool's slots to auto runs that want more; they come back when
            a run starts on it (docs/arbiter.md). False keeps them.
        arbiter: take slots from the machine's arbiter (default: with ``auto``, or when the
            admin runs a shared one or ``$ELASTIC_JUPYTER_ARBITER`` names one).
        name, notebook: how the machine's view shows the pool (a run on it renames it).
        launcher: where the engines run (:mod:`.launchers`; default: this host). Slots of a
            Slurm pool are its engine jobs; the machine's arbiter does not place them.
    Raises:
        UsageError: bounds that do not fit (n outside [min, max], more engines than GPUs),
            ``auto`` without the arbiter, a GPU list in lease mode (the arbiter places), a GPU
            list with a launcher other than this host's, or ``auto`` where the launcher's
            arbiter refuses it (hosts whose arbiters have other slot counts, a Slurm that
            hides other users' jobs).

    Attributes:
        engine_sets: the engines and the ipyparallel cluster (start, add, remove, alive);
        slots: slot accounting (free, startable, left out); lease: the arbiter's lease (None
        outside lease mode); launcher, config, owner.
    """

    def __init__(self, n: int | None = None, min_size: int | None = None,
                 max_size: int | None = None, gpus: str = "all", engine_timeout: float = 60.0,
                 auto: bool = False, weight: float | None = None, arbiter: bool | None = None,
                 name: str = "", notebook: str | None = None, launcher: Launcher | None = None,
                 lend: bool = True):
        weight = 1.0 if weight is None else weight
        self.launcher = launcher or LocalLauncher()
        if not self.launcher.local:
            if gpus not in ("all", "none"):
                raise UsageError(f"--launcher {self.launcher.kind} places each engine itself: "
                                 "--gpus applies to pools on this host only")
            gpus, arbiter = "none", auto  # this host's GPUs and arbiter are not the engines'
        slots = self.launcher.slot_count
        if slots is not None and (max_size or slots) > slots:
            raise UsageError(f"--max {max_size} exceeds the {slots} slot(s) of "
                             f"{self.launcher.describe()}")
        self.config = PoolConfig.resolve(n, min_size, max_size or slots, gpus, engine_timeout)
        if self.launcher.cpus_per_engine:
            self.config.threads_per_engine = self.launcher.cpus_per_engine
        # the pool's jobs are asked for once it runs (a Slurm auto pool's own)
        self.lease = pool_lease(self.config, self.launcher, lambda: self.engine_sets.jobs(),
                                auto, weight, arbiter, gpus, name, notebook, lend)
        self.owner = get_owner()
        self.slots = Slots(self.config.max_size, self.lease,
                           lambda: {e.slot for e in self.engine_sets.engines if e.slot is not None})
        self.engine_sets = EngineSets(self.launcher, self.config, self.slots)
        # a run's one door into the engines and slots (run/ reaches no part of the pool)
        self.supply = EngineSupply(self.engine_sets, self.slots, self.launcher, self.lease,
                                   self.config)
        self._claimant: Claimant | None = None  # who trains on this pool (claim / release)
        self._left_by: str | None = None  # the last run to end, which left the pool at its size
        self._queue_printer = QueuePrinter(self.owner, self.lease, lambda: self.engine_sets.queued,
                                           self.config.min_size)
        self._follower = None if self.lease is None else LeaseFollower(
            self.lease, self.engine_sets, lambda: self._claimant,
            "gpu" if self.config.gpus else "cpu")

    # properties --------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """The number of engines now (``engine_sets.engines``: every one, busy or idle)."""
        return len(self.engine_sets.engines)

    @property
    def backend(self) -> str:
        return "nccl" if self.config.gpus or self.launcher.gpus_per_engine else "gloo"

    def __getattr__(self, name: str) -> Any:
        # the members that only handed a read on to one of the pool's parts were removed in
        # 0.2.0 (CHANGELOG.md): say where each went rather than a bare AttributeError
        if name in MOVED:
            raise AttributeError(f"EnginePool.{name} was removed in 0.2.0: use {MOVED[name]}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def run(self) -> Claimant | None:
        """Who trains on this pool (a TrainingRun), or None."""
        return self._claimant

    def claim(self, run: Claimant) -> None:
        """`run` trains on this pool from now on. Raises UsageError while another run is active."""
        if self._claimant is not None and self._claimant is not run and self._claimant.active:
            raise UsageError(f"the pool is busy with run {self._claimant.name!r}: stop it "
                             "(%elastic_stop or run.stop()) or wait for it to finish")
        self._claimant = run
        if self.lease is not None:
            self.lease.active = True  # told to the arbiter as the run registers

    def release(self, run: Claimant) -> None:
        """`run` no longer holds the pool (its spares are gone: no standby slots wanted)."""
        if self._claimant is run:
            self._claimant = None
            self._left_by = run.name
            if self.lease is not None:
                self.lease.active = False
                background(self.lease.update(standby=0), self._lease_warning)

    def size_note(self) -> str | None:
        """A line saying the pool stands at another size than it started with (``-n``) where
        the last run left it (its schedule, resizes or faults), while it does; else None. Not
        in lease mode, where the arbiter's grant sets the size."""
        n, size = self.config.n, self.size
        if (self._left_by is None or self.lease is not None or not self.engine_sets.running
                or size == n):
            return None
        return (f"the pool stands at {size} engine{'s' * (size != 1)}, where run "
                f"{self._left_by!r} left it (it started with {n})")

    def check_size(self, n: Any) -> int:
        """Validate a requested size; returns it as int or raises UsageError saying the bounds."""
        low, high = self.config.min_size, self.config.max_size
        if isinstance(n, bool) or not isinstance(n, int):
            try:
                if isinstance(n, str) and n.strip().lstrip("-").isdigit():
                    n = int(n)
                else:
                    raise ValueError
            except ValueError:
                raise UsageError(f"pool size must be an integer in this pool's bounds "
                                 f"[{low}, {high}], got {n!r}") from None
        if not low <= n <= high:
            raise UsageError(f"pool size {n} is outside this pool's bounds [{low}, {high}]; "
                             "choose a size in range or start a pool with other --min/--max")
        if self.lease is not None and self.lease.grant and n > max(
                self.lease.grantable, len(self.lease.slots)):
            raise UsageError(f"the machine's arbiter can grant this pool at most "
                             f"{self.lease.grantable} slot(s) now (the other runs hold the rest:"
                             " %elastic_pool status shows the machine); choose a smaller size")
        return n

    # public, any thread ------------------------------------------------------------------------

    def start(self) -> "EnginePool":
        """Start the controller and the first ``n`` engines; returns self when all registered.
        In lease mode, waits (printing its place in the machine's queue) until the arbiter
        leased ``min`` slots."""
        self.wait_printing_queue(self.ensure_started())
        return self

    def wait_printing_queue(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the owner loop and return its result, printing the pool's place in
        the machine's queue and its engine jobs waiting in a scheduler's (:mod:`.queue_printer`)."""
        return self._queue_printer.wait(coro)

    def resize(self, n: int, at_step: int | None = None) -> None:
        """Change the number of engines. During a run this is the run's resize request.
        In lease mode this also ends auto mode (the size is the user's from now on)."""
        if self.run is not None and self.run.active:
            return self.run.resize(n, at_step=at_step)  # which validates it
        n = self.check_size(n)
        if at_step is not None:
            raise UsageError("at_step needs a running training run")
        self.owner.call(self._resize_to(n))

    def set_auto(self, on: bool = True, weight: float | None = None) -> None:
        """Turn auto mode on or off (and set the pool's weight). Raises UsageError without
        the machine's arbiter, or for a weight it refuses."""
        if self.lease is None:
            raise UsageError("this pool does not take its slots from the machine's arbiter: "
                             "start it with --auto (EnginePool(auto=True))")
        changes: dict[str, Any] = {"auto": bool(on)}
        if weight is not None:
            check_weight_usage(weight)
            changes["weight"] = weight
        if not self.engine_sets.running:  # not started (or stopped): the demand it will register
            self.lease.demand.update(changes)
        elif self.owner.in_owner_thread():  # the control channel (the panel's toggle)
            background(self.lease.update(**changes), self._lease_warning)
        else:
            self.owner.call(self.lease.update(**changes))

    def machine(self) -> MachineView:
        """The machine's slots and runs as the arbiter sees them (see arbiter.table.view).
        Raises UsageError when the pool is not in lease mode."""
        if self.lease is None:
            raise UsageError("this pool does not take its slots from the machine's arbiter")
        try:
            return self.lease.client.view()
        except ArbiterError as e:
            raise UsageError(str(e)) from None

    def stop(self) -> None:
        """Stop every engine and the controller (a running run is stopped first)."""
        if self.run is not None and self.run.active:
            self.run.stop()
            self.run.wait(timeout=60)
        self.owner.call(self._stop())

    def lease_status(self) -> LeaseStatus | None:
        """The pool's lease as views show it (None outside lease mode): auto, weight, the
        training and standby slots, target, queue place, grantable, whether it lends and the
        slots it lent (slot, to, user)."""
        if self.lease is None:
            return None
        g = self.lease.grant
        return LeaseStatus(
            auto=self.lease.demand["auto"], weight=self.lease.demand["weight"],
            slots=g.get("slots", []), standby=g.get("standby", []), target=g.get("target", 0),
            queued=g.get("queued"), grantable=g.get("grantable", 0),
            lend=self.lease.demand.get("lend", True), lent=g.get("lent", []))

    def status(self) -> PoolStatus:
        """The pool now (pool.status.PoolStatus): sizes, engines, exclusions, its run, lease."""
        run = self.run if self.run is not None and self.run.active else None
        return PoolStatus(
            running=self.engine_sets.running, size=self.size, start_size=self.config.n,
            size_note=self.size_note(), min=self.config.min_size, max=self.config.max_size,
            backend=self.backend,
            excluded_slots={slot: ExclusionStatus(reason=x.reason, until=x.until)
                            for slot, x in self.slots.excluded.items()},
            engines=[cast(EngineStatus, dataclasses.asdict(e)) for e in self.engine_sets.engines],
            warm=[WarmStatus(pid=e.pid, rss_mib=rss(e.pid) / 2**20)
                  for e in self.engine_sets.warm],
            launcher=self.launcher.describe(), run=run.name if run else None,
            queued={slot: str(q) for slot, q in sorted(self.engine_sets.queued.items())},
            run_mode=run.memory.mode if run else None, lease=self.lease_status())

    def __repr__(self) -> str:
        return (f"<EnginePool size={self.size} "
                f"bounds=[{self.config.min_size}, {self.config.max_size}] "
                f"backend={self.backend}>")

    # owner thread ------------------------------------------------------------------------------

    async def ensure_started(self) -> None:
        """Start the controller and the first ``n`` engines unless running (owner loop)."""
        if self.engine_sets.running:
            return
        await self.engine_sets.start()
        # after the controller started: atexit runs handlers last-in first-out, and
        # ipyparallel's Cluster registers its own stop then, which must not end the engines
        # before the run stops and writes its checkpoint
        atexit.register(self._shutdown_at_exit)
        if self.lease is None or self._follower is None:
            try:
                await self.engine_sets.add(self.config.n)
            except BaseException:  # engines that did not start, or an interrupted wait
                await self._stop()
                raise
            return
        try:  # wait in the machine's queue, then start on the slots leased now
            await self._start_leased()
        except BaseException as e:  # refused, interrupted, engines that did not start
            await self._stop()
            if isinstance(e, ArbiterError):
                raise UsageError(str(e)) from None
            raise
        self._follower.start()

    async def _start_leased(self) -> None:
        """Lease mode: ask the arbiter, wait in the machine's queue, start on the slots leased.
        With fewer free slots than the min (they come from other runs), on this host the
        min's engines start on no slot first (run/warm_engines.py) and are bound once leased."""
        lease = self.lease
        assert lease is not None
        first = self.launcher.local and await lease.free_slots() < self.config.min_size
        warm = await self.engine_sets.add_warm_many(self.config.min_size if first else 0)
        await lease.register()
        while lease.kept < self.config.min_size:
            await asyncio.sleep(POLL_S)
            await lease.poll(engines={})
        for engine, slot in zip(warm, self.slots.next_free(len(warm))):
            await self.engine_sets.bind(engine, slot)
        if unbound := [e for e in warm if e in self.engine_sets.warm]:
            await self.engine_sets.remove(unbound)  # the slots went back meanwhile
        auto = lease.demand["auto"]  # auto: every slot leased; else n of them
        await self.engine_sets.resize(lease.kept if auto else min(lease.kept, self.config.n))

    async def admitted(self) -> None:
        """Wait until the lease keeps ``min`` training slots (lease mode, a run starting on the
        pool: the pool's place in the machine's queue shows meanwhile)."""
        while self.lease is not None and self.lease.kept < self.config.min_size:
            await asyncio.sleep(POLL_S / 5)

    def _shutdown_at_exit(self) -> None:
        """Graceful kernel shutdown: stop the run (it writes a checkpoint), then the pool."""
        try:
            if self.engine_sets.running:
                self.stop()
        except Exception:
            pass  # the reaper still ends what is left

    async def _resize_to(self, n: int) -> None:
        """An idle pool's resize by the user: in lease mode it asks the arbiter first (auto
        mode ends) and grows to what is granted now; the rest follows when granted."""
        if self.lease is not None:
            await self.lease.update(wanted=n, auto=False)
            n = min(n, self.lease.kept)
        self._left_by = None  # the size is the user's now
        await self.engine_sets.resize(n)

    def _lease_warning(self, message: str) -> None:
        if self._follower is not None:
            self._follower.warn(message)

    async def _stop(self) -> None:
        if not self.engine_sets.running:
            return
        if self._follower is not None:  # first: it must start no engine from now on
            await self._follower.stop()
        try:
            await self.engine_sets.stop()
        finally:
            if self.lease is not None:
                await self.lease.close()
