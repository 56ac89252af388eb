"""A run's claim on its pool and its checkpoint folder, from its start to its end.

At the start the run claims the pool (one run at a time), waits for the pool's engines (in lease
mode: for the machine's arbiter to lease the pool's min slots), settles its starting size and
locks its checkpoint folder; at its end, or when its setup fails, it gives both back. Runs on
the owner loop.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import UsageError
from .checkpoint_folder import FolderLock, prepare_checkpoint_dir
from .sizing import LeasePolicy

if TYPE_CHECKING:
    from ..config import RunConfig
    from ..pool.claimant import Claimant
    from ..pool.pool import EnginePool

LEASED_SCHEDULE = ("this pool takes its slots from the machine's arbiter, which decides when "
                   "it changes size: resize it now (run.resize(n)), or start a pool with "
                   "--no-arbiter (EnginePool(arbiter=False)) for resizes at given steps")


class RunClaim:
    """Args:
        pool: the pool to claim; claimant: the run that claims it.
        config: the run's; engines: its starting world size (None: the pool's size).
        checkpoint_dir, log_dir: its folders; resume: continue from the newest checkpoint.
        notebook: where the run was started (recorded in the folder's lock).
        scheduled: the run has resizes at given steps (refused in lease mode).

    Attributes:
        start_note: a line saying why the run starts at its size, or None.
        lease_policy: in lease mode, the size policy that follows the lease (None before the
            claim, and outside lease mode).
    """

    def __init__(self, pool: EnginePool, claimant: Claimant, config: RunConfig,
                 engines: int | None, checkpoint_dir: str, log_dir: str, resume: bool,
                 notebook: str | None, scheduled: bool):
        self.pool, self.claimant, self.config, self.engines = pool, claimant, config, engines
        self.supply = pool.supply  # its lease, in lease mode
        self.checkpoint_dir, self.log_dir, self.resume = checkpoint_dir, log_dir, resume
        self.notebook, self.scheduled = notebook, scheduled
        self.start_note: str | None = None
        self.lease_policy: LeasePolicy | None = None
        self._folder_lock: FolderLock | None = None  # held from the claim to the release

    async def take(self) -> tuple[int, str | None]:
        """Claim the pool and the folder; returns (the starting world size, the checkpoint to
        resume from or None). Raises UsageError (busy pool, bad size or batch, folder
        problems), having given back what it took."""
        pool = self.pool
        pool.claim(self.claimant)
        try:
            await pool.ensure_started()
            size = await self._lease_slots() if self.supply.leased else self._size()
            if self.config.global_batch < size:
                raise UsageError(
                    f"--global-batch {self.config.global_batch} is smaller than the world size "
                    f"{size}: every rank needs at least one sample; raise the global batch to "
                    f"at least {size} or use fewer --engines")
            resume_from, self._folder_lock = prepare_checkpoint_dir(
                self.checkpoint_dir, self.log_dir, self.config.name, self.resume, self.notebook)
        except BaseException:
            self.release()
            raise
        return size, resume_from

    def release(self) -> None:
        """Give the folder and the pool back (idempotent)."""
        if self._folder_lock is not None:
            self._folder_lock.release()
        self.pool.release(self.claimant)

    def _size(self) -> int:
        pool = self.pool
        size = pool.check_size(self.engines or pool.size)
        note = pool.size_note() if self.engines is None else None
        if note:  # the user may expect the -n the pool started with
            self.start_note = (f"{note}: training starts at {size}; give --engines N "
                               "(engines=N) to choose")
        return size

    async def _lease_slots(self) -> int:
        """Lease mode: tell the arbiter about the run, wait in the machine's queue for the
        pool's min, and start at the slots kept (the rest is grown into when granted)."""
        pool, lease = self.pool, self.supply.lease
        assert lease is not None
        if self.scheduled:
            raise UsageError(LEASED_SCHEDULE)
        auto = lease.demand["auto"]
        wanted = self.engines or lease.demand["wanted"]
        wanted = pool.check_size(wanted) if not auto else wanted  # auto: the arbiter decides
        await lease.update(name=self.config.name, notebook=self.notebook or "", wanted=wanted,
                           standby=self.config.standby)
        await pool.admitted()
        # auto: start on the engines already up (at least the min), grow into the rest while
        # training, as engines become ready, rather than wait for all of them to start
        size = min(wanted, lease.kept) if not auto else min(
            lease.kept, max(pool.size, self.supply.min_size))
        self.lease_policy = LeasePolicy(lease, size)
        return size
