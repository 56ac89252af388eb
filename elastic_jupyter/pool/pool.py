"""EnginePool: an ipyparallel cluster with one engine per slot (a GPU, or a share of the CPUs).

Each slot's engine is its own engine set of one, because ipyparallel cannot stop a single engine
of a larger set (``Cluster.stop_engine`` raises) and forgets per-set environments on restart.
CUDA_VISIBLE_DEVICES is fixed at engine start, so a slot's GPU binding cannot change. Where the
engines run (this host, other hosts over ssh, Slurm jobs) is the pool's :class:`~.launchers.Launcher`.

In lease mode (``auto=True``, or a machine whose admin runs a shared arbiter) the slots are the
machine's, leased by its arbiter: engines start only on leased slots, and the pool follows the
lease (:mod:`.lease`): while no run trains, the pool itself starts and stops engines to match
it; while one trains, the run's :class:`~.lease.LeasePolicy` resizes it at step boundaries.
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass

import psutil

from ..run import faults
from ..arbiter.client import arbiter_configured
from ..arbiter.table import ArbiterError, check_weight
from ..config import PoolConfig, UsageError
from ..engine.entrypoints import versions
from .engine_calls import EngineCalls
from ..host import own_folder
from .launchers import Job, Launcher, LocalLauncher, StartWithdrawn
from .lease import POLL_S, SlotLease, describe_slot_event
from ..run.membership import free_slots
from ..owner import background, get_owner
from .reaper import start_reaper, write_pidfile
from ..server.registry import registry_dir

CONTROLLER_ARGS = ["--ping=500", "--nodb", "--log-level=ERROR"]
# Seconds the controller gets to exit on SIGTERM (it takes ~0.4 s and removes its connection
# files) before SIGKILL, and a removed engine's nanny after its engine is gone.
STOP_GRACE = 1.0
RETRY_S = 5.0  # lease mode: after a failed look at the grant (or engine start), wait this long

log = logging.getLogger(__name__)


@dataclass
class Engine:
    """One engine process bound to one slot.

    Attributes:
        slot: slot number (with GPUs, the index into the pool's GPU list).
        device: "cpu" or "cuda:<physical GPU id>".
        engine_id: ipyparallel engine id; set_id: its engine set.
        pid: process id on `host`; started: wall time (s since the epoch) it registered.
        host: the host it runs on; local: whether it is this user's process on this host
            (the pool signals it itself; other engines end with their job).
        job_id: the scheduler's job that runs it (a Slurm job id; "" elsewhere).
    """

    slot: int
    device: str
    engine_id: int
    set_id: str
    pid: int
    started: float
    host: str = ""
    local: bool = True
    job_id: str = ""


@dataclass(frozen=True)
class Exclusion:
    """Why a slot is left out of engine starts, and until when.

    Attributes:
        reason: one line, such as "3 faults within 60 s".
        until: wall time (s since the epoch) the slot comes back; None: it stays out.
    """

    reason: str
    until: float | None = None

    def describe(self, now: float) -> str:
        if self.until is None:
            return f"{self.reason}; stays out"
        return f"{self.reason}; back in {max(0.0, self.until - now):.0f} s"


def _engine_env(slot: int, gpu: int | None, threads: int, leased: bool,
                launcher: Launcher) -> dict:
    env = {
        "ELASTIC_JUPYTER_SLOT": str(slot),
        "CUDA_VISIBLE_DEVICES": "" if gpu is None else str(gpu),
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
    }
    env.update(launcher.engine_env())
    if leased:  # the arbiter's GPU ids are NVML's, by PCI bus; CUDA's are by speed unless told
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return env


class EnginePool:
    """A resizable pool of engines, owned by this process's owner thread.

    Args:
        n: engines to start (default: the number of GPUs, or 2 without GPUs).
        min_size, max_size: bounds for resizes (default 1 and the number of GPUs, or 4).
        gpus: "all", "none" or a list of GPU ids such as "0,2".
        engine_timeout: seconds to wait for a new engine to register.
        auto: auto mode: the machine's arbiter sizes the pool between min and max by weighted
            fair share with the other runs on the machine (docs/arbiter.md); on Slurm, Slurm's
            queue does (grow while the partition is idle, give back while others wait:
            :mod:`.arbiter.slurm`).
        weight: the pool's weight in that fair share among its user's runs (> 0).
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
    """

    def __init__(self, n: int | None = None, min_size: int | None = None,
                 max_size: int | None = None, gpus: str = "all", engine_timeout: float = 60.0,
                 auto: bool = False, weight: float = 1.0, arbiter: bool | None = None,
                 name: str = "", notebook: str | None = None, launcher: Launcher | None = None):
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
        self.lease = self._lease(auto, weight, arbiter, gpus, name, notebook)
        self.owner = get_owner()
        self.engines: list[Engine] = []  # oldest first
        self.cluster = None
        self.client = None
        self.calls = EngineCalls(self)
        self._run = None  # the run training on this pool (claim / release)
        self._left_by: str | None = None  # the last run to end, which left the pool at its size
        self._stopping: set = set()  # background tasks stopping removed engines
        self._removing: set[psutil.Process] = set()  # the engines those tasks stop
        self._exclusions: dict[int, Exclusion] = {}  # slot -> why and until when it is out
        self._pidfile = None
        self._folder = None  # the pool's private folder (batch scripts)
        self._reaper = None  # subprocess.Popen of the reaper
        self._busy_slots: set[int] = set()  # slots of engines starting or stopping
        self._starting: set[int] = set()  # slots of engines starting (never handed out twice)
        self._resizing = asyncio.Lock()  # an idle resize and the lease's following
        self._following: asyncio.Task | None = None  # lease mode: _follow_lease
        # slot -> its engine's batch job, not running yet; replaced, never changed in place:
        # other threads read it (the cell printing the queue, views)
        self.queued: dict[int, Job] = {}
        self._set_of: dict[int, str | None] = {}  # engine id -> its set, asked once (_arrivals)
        self._asking: dict = {}  # engine id -> its reply to that question, not in yet
        self._forgotten: set[str] = set()  # sets of failed starts (_forget_sets)

    def _lease(self, auto, weight, arbiter, gpus, name, notebook) -> SlotLease | None:
        if arbiter is None:
            arbiter = auto or arbiter_configured()
        if not arbiter:
            if auto:
                raise UsageError("auto mode needs the machine's arbiter: leave arbiter unset")
            return None
        _check_weight(weight)
        client = self.launcher.arbiter(self._jobs)  # None: this machine's arbiter
        if client is None and (gpus not in ("all", "none")
                               or (gpus == "none" and PoolConfig.gpu_count())):
            raise UsageError(f"--gpus {gpus}: in lease mode the machine's arbiter places the "
                             "engines on its slots; give --gpus all, or start the pool without "
                             "the arbiter (--no-arbiter, EnginePool(arbiter=False))")
        c = self.config
        return SlotLease(f"pool-{uuid.uuid4().hex}", dict(
            name=name or "pool", notebook=notebook or os.environ.get("JPY_SESSION_NAME", ""),
            min=c.min_size, max=c.max_size, weight=weight, auto=auto, wanted=c.n, standby=0),
            client)

    # properties --------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.engines)

    @property
    def min_size(self) -> int:
        return self.config.min_size

    @property
    def max_size(self) -> int:
        return self.config.max_size

    @property
    def backend(self) -> str:
        return "nccl" if self.config.gpus or self.launcher.gpus_per_engine else "gloo"

    @property
    def running(self) -> bool:
        return self.cluster is not None

    @property
    def run(self):
        """The TrainingRun that holds this pool, or None."""
        return self._run

    def claim(self, run) -> None:
        """`run` trains on this pool from now on. Raises UsageError while another run is active."""
        if self._run is not None and self._run is not run and self._run.active:
            raise UsageError(f"the pool is busy with run {self._run.name!r}: stop it "
                             "(%elastic_stop or run.stop()) or wait for it to finish")
        self._run = run
        if self.lease is not None:
            self.lease.active = True  # told to the arbiter as the run registers

    def release(self, run) -> None:
        """`run` no longer holds the pool (its spares are gone: no standby slots wanted)."""
        if self._run is run:
            self._run = None
            self._left_by = run.name
            if self.lease is not None:
                self.lease.active = False
                background(self.lease.update(standby=0), self._lease_warning)

    def size_note(self) -> str | None:
        """A line saying the pool stands at another size than it started with (``-n``) where
        the last run left it (its schedule, resizes or faults), while it does; else None. Not
        in lease mode, where the arbiter's grant sets the size."""
        n, size = self.config.n, self.size
        if self._left_by is None or self.lease is not None or not self.running or size == n:
            return None
        return (f"the pool stands at {size} engine{'s' * (size != 1)}, where run "
                f"{self._left_by!r} left it (it started with {n})")

    def check_size(self, n) -> int:
        """Validate a requested size; returns it as int or raises UsageError saying the bounds."""
        if isinstance(n, bool) or not isinstance(n, int):
            try:
                if isinstance(n, str) and n.strip().lstrip("-").isdigit():
                    n = int(n)
                else:
                    raise ValueError
            except ValueError:
                raise UsageError(f"pool size must be an integer in this pool's bounds "
                                 f"[{self.min_size}, {self.max_size}], got {n!r}") from None
        if not self.min_size <= n <= self.max_size:
            raise UsageError(f"pool size {n} is outside this pool's bounds [{self.min_size}, "
                             f"{self.max_size}]; choose a size in range or start a pool with "
                             "other --min/--max")
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

    def wait_printing_queue(self, coro):
        """Run `coro` on the owner loop and return its result, printing the pool's place in
        the machine's queue while it waits for its slots, and its engine jobs that wait in a
        scheduler's queue (as ``Owner.call`` otherwise)."""
        if self.owner.in_owner_thread():
            coro.close()
            raise RuntimeError("waiting on the owner thread would deadlock; await instead")
        future, shown, jobs = self.owner.submit(coro), None, {}
        while True:
            try:
                concurrent.futures.wait([future], timeout=POLL_S)
                if future.done():
                    return future.result()
            except BaseException:  # interrupted: the start is cancelled and cleans up
                future.cancel()
                raise
            place = self.lease.queued if self.lease is not None else None
            if place != shown and place is not None:
                print(f"Waiting for {self.min_size} slot(s): place {place} in the machine's "
                      "queue (%elastic_pool status shows who holds the slots)", flush=True)
            shown = place
            if self.queued != jobs:
                jobs = self.queued
                if jobs:
                    print("Waiting in the queue: " + "; ".join(
                        f"slot {slot}: {job}" for slot, job in sorted(jobs.items())), flush=True)

    def resize(self, n: int, at_step: int | None = None):
        """Change the number of engines. During a run this is the run's resize request.
        In lease mode this also ends auto mode (the size is the user's from now on)."""
        n = self.check_size(n)
        if self.run is not None and self.run.active:
            return self.run.resize(n, at_step=at_step)
        if at_step is not None:
            raise UsageError("at_step needs a running training run")
        self.owner.call(self._resize_to(n))

    def set_auto(self, on: bool = True, weight: float | None = None) -> None:
        """Turn auto mode on or off (and set the pool's weight). Raises UsageError without
        the machine's arbiter, or for a weight it refuses."""
        if self.lease is None:
            raise UsageError("this pool does not take its slots from the machine's arbiter: "
                             "start it with --auto (EnginePool(auto=True))")
        changes = {"auto": bool(on)}
        if weight is not None:
            _check_weight(weight)
            changes["weight"] = weight
        if self.cluster is None:  # not started (or stopped): the demand it will register
            self.lease.demand.update(changes)
        elif self.owner.in_owner_thread():  # the control channel (the panel's toggle)
            background(self.lease.update(**changes), self._lease_warning)
        else:
            self.owner.call(self.lease.update(**changes))

    def machine(self) -> dict:
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

    def lease_status(self) -> dict | None:
        """The pool's lease as views show it (None outside lease mode): auto, weight, the
        training and standby slots, target, queue place, grantable."""
        if self.lease is None:
            return None
        g = self.lease.grant
        return {"auto": self.lease.demand["auto"], "weight": self.lease.demand["weight"],
                "slots": g.get("slots", []), "standby": g.get("standby", []),
                "target": g.get("target", 0), "queued": g.get("queued"),
                "grantable": g.get("grantable", 0)}

    def status(self) -> dict:
        return {"running": self.running, "size": self.size, "start_size": self.config.n,
                "size_note": self.size_note(), "min": self.min_size,
                "max": self.max_size, "backend": self.backend,
                "excluded_slots": {slot: vars(x).copy()
                                   for slot, x in self.excluded_slots.items()},
                "engines": [vars(e).copy() for e in self.engines],
                "launcher": self.launcher.describe(),
                "queued": {slot: str(q) for slot, q in sorted(self.queued.items())},
                "run": self.run.name if self.run is not None and self.run.active else None,
                "lease": self.lease_status()}

    def __repr__(self) -> str:
        return (f"<EnginePool size={self.size} bounds=[{self.min_size}, {self.max_size}] "
                f"backend={self.backend}>")

    # owner thread ------------------------------------------------------------------------------

    async def ensure_started(self) -> None:
        """Start the controller and the first ``n`` engines unless running (owner loop)."""
        if self.cluster is not None:
            return
        import ipyparallel as ipp
        cluster_id = f"elastic-{uuid.uuid4().hex[:8]}"
        self._folder = own_folder(os.path.join(registry_dir(), f"pool-{cluster_id}"))
        self.cluster = ipp.Cluster(n=0, cluster_id=cluster_id,
                                   controller_args=list(CONTROLLER_ARGS), log_level=40,
                                   **self.launcher.cluster_options(self._folder))
        await self.cluster.start_controller()
        self._pidfile = os.path.join(registry_dir(), f"pool-{self.cluster.cluster_id}.pids")
        self._update_pidfile()
        self._reaper = start_reaper(self._pidfile)
        atexit.register(self._shutdown_at_exit)
        self.client = await self.cluster.connect_client()
        if self.lease is None:
            try:
                await self.add_engines(self.config.n)
            except BaseException:  # engines that did not start, or an interrupted wait
                await self._stop()
                raise
            return
        try:  # wait in the machine's queue, then start on the slots leased now
            await self.lease.register()
            while self.lease.kept < self.min_size:
                await asyncio.sleep(POLL_S)
                await self.lease.poll(engines={})
            auto = self.lease.demand["auto"]  # auto: every slot leased; else n of them
            await self.resize_idle(self.lease.kept if auto else min(self.lease.kept, self.config.n))
        except BaseException as e:  # refused, interrupted, engines that did not start
            await self._stop()
            if isinstance(e, ArbiterError):
                raise UsageError(str(e)) from None
            raise
        self._following = background(self._follow_lease(), self._lease_warning)

    async def admitted(self) -> None:
        """Wait until the lease keeps ``min`` training slots (lease mode, a run starting on the
        pool: the pool's place in the machine's queue shows meanwhile)."""
        while self.lease.kept < self.min_size:
            await asyncio.sleep(POLL_S / 5)

    def _update_pidfile(self) -> None:
        """Tell the reaper which processes to end if this process dies without stopping us."""
        if self._pidfile is not None:
            write_pidfile(self._pidfile, [self.cluster.controller.pid] +
                          [e.pid for e in self.engines if e.local], self._jobs())

    def _jobs(self) -> list[str]:
        """Batch jobs of this pool's engines (running or queued): the reaper cancels them.
        Also called from the lease's worker thread (a Slurm auto pool's own jobs)."""
        cluster = self.cluster
        sets = list(cluster.engines.values()) if cluster is not None else []  # one GIL step
        return [s.job_id for s in sets if getattr(s, "job_id", "")]

    def _shutdown_at_exit(self) -> None:
        """Graceful kernel shutdown: stop the run (it writes a checkpoint), then the pool."""
        try:
            if self.running:
                self.stop()
        except Exception:
            pass  # the reaper still ends what is left

    async def resize_idle(self, n: int) -> None:
        """Start or stop engines until `n` run (owner loop; no run trains meanwhile). In lease
        mode the engines on slots the arbiter wants back stop first, and a grow waits (up to
        a few seconds) for leased slots whose engines are still stopping."""
        async with self._resizing:
            if n > self.size:
                await self._wait_startable(n - self.size)
                await self.add_engines(n - self.size)
            elif n < self.size:
                leaving = self.leaving_slots() if self.lease is not None else set()
                order = ([e for e in self.engines if e.slot not in leaving]
                         + [e for e in self.engines if e.slot in leaving])
                await self.remove_engines(order[n:])

    async def _wait_startable(self, k: int, timeout: float = 5 * STOP_GRACE) -> None:
        deadline = time.monotonic() + timeout
        while (self.lease is not None and self.startable() < k and self._busy_slots
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)

    async def _resize_to(self, n: int) -> None:
        """An idle pool's resize by the user: in lease mode it asks the arbiter first (auto
        mode ends) and grows to what is granted now; the rest follows when granted."""
        if self.lease is not None:
            await self.lease.update(wanted=n, auto=False)
            n = min(n, self.lease.kept)
        self._left_by = None  # the size is the user's now
        await self.resize_idle(n)

    # lease mode --------------------------------------------------------------------------------

    async def _follow_lease(self) -> None:
        """Every POLL_S: tell the arbiter what runs where, take its grant, and follow it (an
        idle pool here; a training run through its LeasePolicy); slots to give back go back
        once no engine of ours runs there. Ends with the pool."""
        failing = None
        while self.cluster is not None:
            try:
                await self.lease.poll(engines={e.slot: e.pid for e in self.engines})
                self._show_lease_events()
                if self._run is None:
                    await self._follow_idle()
                await self._release_unused()
                failing = None
            except Exception as e:  # the arbiter restarts, or an engine did not start:
                if str(e) != failing:  # the pool keeps what it holds and tries again
                    self._lease_warning(f"{type(e).__name__}: {e}")
                failing = str(e)
                await asyncio.sleep(RETRY_S)
            await asyncio.sleep(POLL_S)

    def leaving_slots(self) -> set[int]:
        """Slots whose engines should go: those the arbiter wants back, and any no longer
        leased to the pool (the arbiter lost its state and leased others)."""
        leased = set(self.lease.leased)
        return self.lease.leaving | {e.slot for e in self.engines if e.slot not in leased}

    async def _follow_idle(self) -> None:
        async with self._resizing:
            if self._run is not None:
                return  # a run claimed the pool meanwhile: it follows the lease from now
            leaving = [e for e in self.engines if e.slot in self.leaving_slots()]
            if leaving:
                self.remove_engines(leaving)
            missing = min(self.lease.kept - self.size, self.startable())
            if missing > 0:
                try:
                    await self.add_engines(missing)
                except StartWithdrawn:
                    pass  # the slot went back; the next look follows the grant again

    async def _release_unused(self) -> None:
        """Give back the slots the arbiter asks for (and, while idle, standby slots) that no
        engine of the pool runs on, starts on or still stops on."""
        used = {e.slot for e in self.engines} | self._busy_slots
        unused = self.lease.leaving
        if self._run is None:
            unused |= set(self.lease.grant.get("standby", []))
        unused -= used
        if unused:
            await self.lease.release(sorted(unused))

    def _show_lease_events(self) -> None:
        """The arbiter's "grew into"/"gave" events go to the run's events (and its chart)."""
        events, self.lease.events = self.lease.events, []
        if self._run is not None:
            kind = "gpu" if self.config.gpus else "cpu"
            for event in events:
                self._run.log.event("slot", message=describe_slot_event(event, kind),
                                    slot=event["slot"])

    def _lease_warning(self, message: str) -> None:
        log.warning("elastic_jupyter: the slot arbiter: %s", message)
        if self._run is not None:
            self._run.log.event("warning", message=f"the slot arbiter: {message}")

    async def _stop(self) -> None:
        if self.cluster is None:
            return
        if self._following is not None:  # first: it must start no engine from now on
            self._following.cancel()
            await asyncio.gather(self._following, return_exceptions=True)
            self._following = None
        # removals in flight: their engines need no grace either (the nannies, still alive,
        # tell the controller at once), then the tasks finish quickly and report their own errors
        _signal(list(self._removing), psutil.Process.kill)
        await asyncio.gather(*self._stopping, return_exceptions=True)
        # We end every process ourselves, all at once and without blocking the loop:
        # ipyparallel's stop joins each launcher's wait thread in turn, blocking this loop for
        # the SIGTERM grace of each engine, and knows nothing of the engines' nannies, which
        # outlive their engine by seconds once the controller is gone. Engines get SIGKILL at
        # once: they hold nothing by now (the run has stopped and drained its checkpoint
        # writes) and their graceful exit takes a second of kernel and socket teardown.
        # with their nannies; other hosts' engines are asked to exit, and batch jobs still
        # queued are cancelled (stop_cluster below)
        await self._shut_down_remote([e for e in self.engines if not e.local])
        engines = _with_descendants([e.pid for e in self.engines if e.local])
        _signal(engines, psutil.Process.kill)
        others = [self.cluster.controller.pid]  # with its schedulers
        if self._reaper is not None:
            others.append(self._reaper.pid)  # nothing is left for it to watch
        try:
            await _terminate(engines + _with_descendants(others), grace=STOP_GRACE)
            try:
                await self._stop_sets(list(self.cluster.engines))  # ssh, queued jobs
                await self.cluster.stop_cluster()  # now only its bookkeeping: state, files, logs
            except Exception as e:
                log.warning("elastic_jupyter: ipyparallel's cleanup after stopping the pool "
                            "failed: %s: %s", type(e).__name__, e)
        finally:
            self._forget_cluster()
            if self.lease is not None:
                await self.lease.close()

    def _forget_cluster(self) -> None:
        if self._pidfile is not None and os.path.exists(self._pidfile):
            os.unlink(self._pidfile)  # a reaper still running exits
        self._pidfile = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
        if self._reaper is not None and self._reaper.poll() is None:
            self._reaper.terminate()
        self._reaper = None  # Popen reaps it: no zombie is left behind
        if self.client is not None:
            self.client.close()
        self.cluster = self.client = None
        self.engines = []
        self._set_of, self._asking, self._forgotten = {}, {}, set()

    @property
    def excluded_slots(self) -> dict[int, Exclusion]:
        """Slots left out now (an exclusion whose cooldown ended is not)."""
        now = time.time()
        return {slot: x for slot, x in self._exclusions.items()
                if x.until is None or x.until > now}

    @property
    def usable_slots(self) -> int:
        return self.max_size - len(self.excluded_slots)

    def startable(self) -> int:
        """How many engines could start now: on free slots (lease mode: leased slots that no
        engine uses and the arbiter does not want back)."""
        if self.lease is None:  # a slot whose engine still starts is not free
            taken = {e.slot for e in self.engines} | self._starting
            return self.usable_slots - len(taken - set(self.excluded_slots))
        return len(self._free_leased())

    def _free_leased(self) -> list[int]:
        used = {e.slot for e in self.engines} | self._busy_slots | set(self.excluded_slots)
        leaving = self.leaving_slots()
        return [s for s in self.lease.leased if s not in used and s not in leaving]

    def exclude_slot(self, slot: int, reason: str, until: float | None = None) -> None:
        """Leave `slot` out of engine starts until the wall time `until` (None: for good);
        a run's Membership decides (membership.SlotHealth)."""
        self._exclusions[slot] = Exclusion(reason, until)

    def readmit_slot(self, slot: int) -> None:
        """Take `slot` back now (say, one left out for good after its engine failed to start,
        once the cause is fixed)."""
        self._exclusions.pop(slot, None)

    def next_free_slots(self, k: int) -> list[int]:
        """The slots the next `k` started engines get (fewer when fewer are free)."""
        for n in range(k, 0, -1):
            try:
                return self._free_slots(n)
            except UsageError:
                continue
        return []

    def _free_slots(self, k: int) -> list[int]:
        if self.lease is not None:
            free = self._free_leased()
            if len(free) < k:
                raise UsageError(f"no free slot: the arbiter leased this pool "
                                 f"{len(self.lease.leased)} slot(s), {len(free)} free")
            return free[:k]
        # starts under way (a run's boots of batch jobs run side by side) keep their slots
        return free_slots(self.max_size, {e.slot for e in self.engines} | self._starting,
                          set(self.excluded_slots), k)

    async def add_engines(self, k: int, slots: list[int] | None = None) -> list[Engine]:
        """Start `k` engines on free slots (concurrently; on `slots` when given, as
        :meth:`next_free_slots` named them) and wait until they registered."""
        if k <= 0:
            return []
        slots = slots or self._free_slots(k)
        self._busy_slots.update(slots)
        self._starting.update(slots)
        try:
            return await self._start_engines(slots)
        finally:
            self._busy_slots.difference_update(slots)
            self._starting.difference_update(slots)

    async def _start_set(self, slot: int, set_id: str) -> None:
        """Start `slot`'s engine set of one, as `set_id` (its engine says it: _arrivals)."""
        gpu = None
        if self.config.gpus:  # in lease mode a slot is the machine's GPU index
            gpu = slot if self.lease is not None else self.config.gpus[slot]
        options = self.launcher.start_options(slot)
        # a fresh dict each time: start_engines mutates the one it is given
        env = _engine_env(slot, gpu, self.config.threads_per_engine,
                          self.lease is not None and self.launcher.local, self.launcher)
        env.update(options.pop("environment", {}), ELASTIC_JUPYTER_SET=set_id)
        await self.cluster.start_engines(1, engine_set_id=set_id, environment=env, **options)

    async def _start_engines(self, slots: list[int]) -> list[Engine]:
        set_ids = {slot: f"s{slot}-{uuid.uuid4().hex[:8]}" for slot in slots}
        try:
            # side by side: an SSH start takes seconds of round trips (in a worker thread)
            started = await asyncio.gather(*(self._start_set(s, i) for s, i in set_ids.items()),
                                           return_exceptions=True)
            self._update_pidfile()  # batch jobs: cancelled should this process die meanwhile
            if failed := [e for e in started if isinstance(e, BaseException)]:
                raise failed[0]
            new = await self._wait_registered(set_ids)
            infos = await self.calls.init_engines(new)
            _check_versions(infos)
        except BaseException:  # failed, timed out, refused or cancelled: nothing stays
            await self._forget_sets(set(set_ids.values()))
            raise
        finally:
            self.queued = {s: q for s, q in self.queued.items() if s not in slots}
        engines = []
        for engine_id, info in zip(new, infos):
            device = info["device"]
            engines.append(Engine(slot=info["slot"], device=device, engine_id=engine_id,
                                  set_id=set_ids[info["slot"]], pid=info["pid"],
                                  started=time.time(),
                                  host=self.launcher.host_of(info["slot"]) or info["host"],
                                  local=self.launcher.local,
                                  job_id=self._job_of(set_ids[info["slot"]])))
        self.engines.extend(sorted(engines, key=lambda e: e.slot))
        self._update_pidfile()
        return engines

    def _job_of(self, set_id: str) -> str:
        """The batch job of an engine set ("" without a scheduler)."""
        return str(getattr(self.cluster.engines.get(set_id), "job_id", None) or "")

    async def _forget_sets(self, set_ids: set) -> None:
        """Stop engine sets of a start that failed (each on its own: one that cannot be
        stopped must not keep the others), and never take their engines for new ones."""
        self._set_of.update({i: None for i, s in self._set_of.items() if s in set_ids})
        self._forgotten |= set_ids  # an engine of theirs that registers later is shut down
        await self._stop_sets(set_ids)

    async def _stop_sets(self, set_ids) -> None:
        """ipyparallel's stop of these engine sets, each on its own (one that cannot be
        reached, a lost host, must not leave the others' stops pending), then forgotten: a
        stop that failed is not tried again when the Cluster is collected."""
        cluster = self.cluster
        sets = [s for s in set_ids if s in cluster.engines]
        await asyncio.gather(*(cluster.stop_engines(s) for s in sets), return_exceptions=True)
        for s in sets:
            cluster.engines.pop(s, None)

    async def _wait_registered(self, set_ids: dict) -> list[int]:
        """Wait until the engine of each set in `set_ids` (slot -> set id) registered; returns
        their engine ids. A batch job's engine gets ``engine_timeout`` from when its job left
        the scheduler's queue. Raises RuntimeError when one timed out or its job ended,
        StartWithdrawn when the arbiter wants a slot back while its job still waits."""
        k, timeout = len(set_ids), self.config.engine_timeout
        deadline, next_look = time.monotonic() + timeout, 0.0
        wanted = set(set_ids.values())
        while len(mine := [i for i, s in self._arrivals().items() if s in wanted]) < k:
            now = time.monotonic()
            if not self.launcher.local and now >= next_look:  # a batch system: ask it
                next_look = now + 1.0
                jobs = await self.launcher.jobs(
                    {s: self.cluster.engines[s] for s in set_ids.values()})
                if jobs is None:  # the scheduler did not answer: ask again later
                    continue
                if ended := [j.why_ended() for j in jobs.values() if j.ended]:
                    raise RuntimeError("; ".join(ended))
                mine = {slot: jobs[s] for slot, s in set_ids.items()
                        if s in jobs and jobs[s].waiting}
                if self.lease is not None and (back := set(mine) & self.lease.leaving):
                    raise StartWithdrawn(f"slot(s) {sorted(back)} given back while their "
                                         "job waited in the queue: job cancelled")
                self.queued = {**{s: q for s, q in self.queued.items() if s not in set_ids},
                               **mine}
                if mine:
                    deadline = now + timeout
            if now > deadline:
                raise RuntimeError(f"{k} engine(s) did not register within {timeout:.0f} s; "
                                   "the machine may be overloaded (raise engine_timeout)")
            await asyncio.sleep(0.05)
        return sorted(mine)

    def _arrivals(self) -> dict[int, str]:
        """engine id -> engine set of the registered engines not in the pool yet, as far as
        known: each is asked once (its set is in its environment). Starts under way at once
        (a run's boots of batch jobs) tell their engines apart by it, and an engine of a start
        that failed is never taken for a new one."""
        known = {e.engine_id for e in self.engines}
        for i in self.client.ids:
            if i not in known and i not in self._set_of and i not in self._asking:
                self._asking[i] = self.client[i].apply_async(_set_from_env)
        for i, reply in list(self._asking.items()):
            if reply.ready():
                del self._asking[i]
                try:
                    self._set_of[i] = reply.get()
                except Exception:  # noqa: BLE001 -- it went away: not one of ours to wait for
                    self._set_of[i] = None
                if self._set_of[i] in self._forgotten:  # a failed start's, registered late
                    self._set_of[i] = None
                    self.client.shutdown(targets=[i], hub=False, block=False)
        return {i: self._set_of.get(i) for i in self.client.ids
                if i not in known and i in self._set_of}

    def remove_engines(self, engines: list[Engine]) -> asyncio.Task:
        """Forget these engines now and stop them (each is its own engine set) in the
        background; await the returned task to wait until they are gone."""
        for e in engines:
            self.engines.remove(e)
            self._set_of[e.engine_id] = None  # still registered a while: no new arrival
        self._update_pidfile()
        # the processes now (psutil then checks that a pid was not reused before signalling)
        procs = _processes([e.pid for e in engines if e.local])
        self._removing.update(procs)
        self._busy_slots.update(e.slot for e in engines)
        task = asyncio.ensure_future(self._stop_engines(engines, procs))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)
        return task

    async def _stop_engines(self, engines: list[Engine], procs: list[psutil.Process]) -> None:
        # a background task nobody may await: it reports its failure here, in one line,
        # rather than leaving asyncio to print "Task exception was never retrieved"
        try:
            await self._end_engines(engines, procs)
        except Exception as err:
            log.warning("elastic_jupyter: stopping the engine(s) of slot %s failed: %s: %s",
                        ", ".join(str(e.slot) for e in engines), type(err).__name__, err)
        finally:
            self._removing.difference_update(procs)
            self._busy_slots.difference_update(e.slot for e in engines)

    def alive(self, engine: Engine) -> bool:
        """Whether `engine` runs: its process on this host; another host's while the
        controller counts it (it drops an engine whose nanny reports it dead or whose
        heartbeats stop)."""
        if engine.local:
            return faults.alive(engine)
        return self.client is not None and engine.engine_id in self.client.ids

    async def _shut_down_remote(self, engines: list[Engine]) -> None:
        """Ask other hosts' engines to exit, through the controller (no ssh round trip, and a
        lost host costs no connection timeout), and forget the engine sets of those that did:
        ipyparallel's stop then reaches out only to engines that did not (ssh kill, scancel).
        An engine's batch job ends with its engine."""
        if not engines or self.client is None:
            return
        ids = [e.engine_id for e in engines if e.engine_id in self.client.ids]
        if ids:
            self.client.shutdown(targets=ids, hub=False, block=False)
        deadline = time.monotonic() + 5 * STOP_GRACE
        while set(ids) & set(self.client.ids) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for e in engines:
            if e.engine_id not in self.client.ids:
                self.cluster.engines.pop(e.set_id, None)

    async def _end_engines(self, engines: list[Engine], procs: list[psutil.Process]) -> None:
        if self.cluster is not None:
            await self._shut_down_remote([e for e in engines if not e.local])
        nannies = [c for p in procs for c in _children(p)]
        # ipyparallel's stop waits for the process with a blocking join, which would freeze
        # the owner loop for seconds: end the processes here first, then let it clean up.
        await _terminate(procs)
        if self.cluster is not None:  # else the pool stopped meanwhile and cleaned up itself
            await self._stop_sets([e.set_id for e in engines])
            for e in engines:
                await self._wait_unregistered(e.engine_id)
        # each nanny has told the controller its engine is gone; without a controller it
        # would linger for seconds
        await _terminate(nannies, grace=STOP_GRACE)

    async def _wait_unregistered(self, engine_id: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while (self.client is not None and engine_id in self.client.ids
               and time.monotonic() < deadline):
            await asyncio.sleep(0.02)


def _check_versions(infos: list[dict]) -> None:
    """Refuse engines whose Python, torch or elastic-jupyter differ from this kernel's: they
    would fail later in a state transfer or a pickled call, far from the cause."""
    mine = versions()
    for info in infos:
        theirs = info.get("versions", {})  # an older engine sends none
        diff = [f"{k} {theirs.get(k, 'unknown')} (this kernel: {mine[k]})" for k in mine
                if theirs.get(k) != mine[k]]
        if diff:
            raise RuntimeError(f"the engine on {info['host']} runs {', '.join(diff)}: install "
                               "the same versions where the engines run (a shared environment "
                               "is simplest)")


def _set_from_env() -> str:
    import os
    return os.environ.get("ELASTIC_JUPYTER_SET", "")


def _check_weight(weight) -> None:
    try:
        check_weight(weight)
    except ArbiterError as e:
        raise UsageError(str(e)) from None


def _processes(pids: list[int]) -> list[psutil.Process]:
    """The processes of `pids` that still exist."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    return procs


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:  # it exited meanwhile
        return []


def _with_descendants(pids: list[int]) -> list[psutil.Process]:
    """The processes and everything they started (an engine's nanny, the controller's
    schedulers)."""
    return [q for p in _processes(pids) for q in [p] + _children(p)]


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # it exited between the two checks
        return False


def _signal(procs: list[psutil.Process], send) -> None:
    for p in procs:
        try:
            send(p)
        except psutil.Error:  # already gone
            pass


async def _terminate(procs: list[psutil.Process], grace: float = 5.0) -> None:
    """SIGTERM the processes, SIGKILL those still alive after `grace` seconds, and return once
    all are gone (at most a second after the SIGKILL). Never blocks the event loop; a process
    may exit at any moment in between."""
    _signal(procs, psutil.Process.terminate)
    deadline, killed = time.monotonic() + grace, False
    while procs := [p for p in procs if _alive(p)]:
        if time.monotonic() > deadline:
            if killed:
                log.warning("elastic_jupyter: process(es) %s survived SIGKILL",
                            ", ".join(str(p.pid) for p in procs))
                return
            _signal(procs, psutil.Process.kill)
            deadline, killed = time.monotonic() + 1.0, True
        await asyncio.sleep(0.02)

