"""TrainingRun: one elastic training run on an EnginePool, driven from the owner thread.

The run is a sequence of generations (see engine.generation). Between two generations the owner
changes the membership: a shrink stops the youngest engines after they left the group; a grow
adds engines that were started and set up in the background while the others trained, so
training pauses only for forming the new group and one broadcast of the state.
"""
from __future__ import annotations

import asyncio
import bisect
import os
import re
import threading
import time

from . import faults, registry
from .config import RESUME_KEYS, RunConfig, UsageError
from .engine import checkpoint as ckpt
from .engine import entrypoints
from .rendezvous import Rendezvous

POLL = 0.05  # seconds between the owner's looks at a running generation
MAX_BOOT_FAILURES = 3


# Not "checkpoints": at a Jupyter server's root, /api/contents/checkpoints/<x> is routed to the
# contents checkpoints API (405), so the file browser could not open the folder.
CHECKPOINT_FOLDER = "elastic-checkpoints"

class RunSetupError(RuntimeError):
    """The run's setup failed on an engine; the message carries that engine's traceback."""


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _remote_message(error: BaseException) -> str:
    """The engine-side traceback of an ipyparallel RemoteError (plain text), or the error."""
    tb = getattr(error, "traceback", None)
    if not tb:
        return f"{type(error).__name__}: {error}"
    text = _ANSI.sub("", tb if isinstance(tb, str) else "\n".join(tb))
    # drop ipyparallel's own frames (the task wrapper): they say nothing about the user's code
    blocks = [b for b in text.split("\n\n")
              if not (b.startswith("File <string>") or
                      (b.startswith("File ") and "/ipyparallel/" in b.splitlines()[0]))]
    return "\n\n".join(blocks)


def _remote_summary(error: BaseException) -> str:
    ename, evalue = getattr(error, "ename", None), getattr(error, "evalue", None)
    return f"{ename}: {evalue}" if ename else f"{type(error).__name__}: {error}"


class TrainingRun:
    """An elastic data-parallel training run.

    Args:
        pool: the EnginePool to train on (started if needed); one run at a time per pool.
        config: RunConfig (name, global batch, steps or epochs, checkpoints...).
        source: Python source run on every engine that defines ``model``, ``optimizer``,
            ``dataset`` and ``loss_fn(model, batch)`` (the ``%%elastic_train`` cell); or
        setup: a function returning a dict of the same objects (pickled by value).
        push: notebook variables to define on the engines before the source runs.
        resume: continue from the newest checkpoint in the run's checkpoint folder.
        engines: starting world size (default: the pool's size).
        workspace: folder that holds ``elastic-checkpoints/<name>/`` (default: the current folder).
        schedule: resizes as (at_step, size) pairs, the same as ``resize(size, at_step)``
            called before training starts.

    Attributes:
        state: one of "created", "starting", "training", "resizing", "finished", "failed",
            "stopped".
        world_size: current number of ranks; requested_size: the newest requested size.
    """

    def __init__(self, pool, config: RunConfig, source: str | None = None, setup=None,
                 push: dict | None = None, resume: bool = False, engines: int | None = None,
                 workspace: str | None = None, notebook: str | None = None,
                 schedule: list[tuple[int, int]] | None = None):
        if (source is None) == (setup is None):
            raise UsageError("give the run's code as source (a cell) or as a setup function")
        if push is not None and not isinstance(push, dict):
            raise UsageError("push takes a dict of notebook variables, like push={'lr': lr}")
        config.validate()
        self.pool, self.config, self.name = pool, config, config.name
        self.source, self.setup_fn, self.push = source, setup, dict(push or {})
        self.resume, self.engines_at_start = resume, engines
        self.notebook = notebook
        workspace = os.path.abspath(workspace or os.getcwd())
        self.checkpoint_dir = os.path.abspath(
            config.checkpoint_dir or os.path.join(workspace, CHECKPOINT_FOLDER, config.name))
        self.log_dir = os.path.join(self.checkpoint_dir, "logs")
        self.state = "created"
        self.error: str | None = None
        self.total_steps = 0
        self.world_size = 0
        self.requested_size = 0
        self.members = []  # Engines in rank order
        self._records: dict[int, dict] = {}
        self._merged_upto = 0  # newest step merged from rank 0's stream
        self.events: list[dict] = []
        self._event_keys: set = set()  # (kind, step) of every event, to skip repeats
        self._schedule = sorted(schedule or [])  # (at_step, size) pairs
        self._spares, self._booting = [], None
        self._boot_failures = 0  # consecutive; past MAX_BOOT_FAILURES a grow gives up
        self._slot_faults: dict[int, int] = {}
        self._faults_without_progress = 0
        self._last_rollback = 0
        self._joining = []  # replacements that join at the next generation
        self._stop_requested = False
        self._pending_resize = None  # event dict of the resize being carried out
        self._pending_request_time = None
        self._final_state = None
        self._done = threading.Event()
        self._resumed_from = None
        self._rendezvous = None
        self._task = None
        self._registration = None

    # ---------------------------------------------------------------- public API (any thread)

    @property
    def active(self) -> bool:
        return self.state in ("starting", "training", "resizing")

    @property
    def step(self) -> int:
        return max(self._records) if self._records else 0

    @property
    def history(self) -> list[dict]:
        """Per-step records: step, epoch, loss, lr, world_size, samples_per_s, time (s since
        the epoch), extra metrics from loss_fn, and val_* metrics at evaluation steps."""
        return [r for _, r in sorted(self._records.items())]

    def records_since(self, step: int) -> list[dict]:
        """History records after `step`, oldest first (cost: the new records only)."""
        records = self._records  # the owner thread may delete entries meanwhile (a rollback)
        found = (records.get(s) for s in range(step + 1, self.step + 1))
        return [r for r in found if r is not None]

    @property
    def checkpoints(self) -> list[dict]:
        """Checkpoint files of this run, oldest first: file, path, step, bytes, time."""
        return ckpt.list_checkpoints(self.checkpoint_dir)

    def start(self) -> "TrainingRun":
        """Set up the run on every engine and start training in the background.

        Blocks until the setup succeeded everywhere. Raises UsageError (bad options, busy pool,
        checkpoint folder problems) or RunSetupError (the cell failed on an engine, with its
        traceback); either way the pool stays usable.
        """
        self.pool.owner.call(self._start())
        return self

    def resize(self, n: int, at_step: int | None = None) -> None:
        """Request world size `n`, now (the newest immediate request wins) or exactly after
        step `at_step`. Returns at once; ``events`` records when the resize took effect.

        Raises UsageError if `n` is outside the pool's bounds, or the run is not training, or
        `at_step` has already passed.
        """
        n = self.pool.check_size(n)
        if self.state not in ("training", "resizing"):
            hint = ("resize once it trains" if self.state in ("created", "starting") else
                    "to resize the idle pool use pool.resize(n) or %elastic_pool resize N")
            raise UsageError(f"run {self.name!r} is {self.state}: {hint}")
        if at_step is not None:
            if isinstance(at_step, bool) or not isinstance(at_step, int):
                raise UsageError(f"at_step must be an integer step, got {at_step!r}")
            if at_step <= self.step or (self.total_steps and at_step >= self.total_steps):
                raise UsageError(f"at_step={at_step} must be after the current step {self.step} "
                                 f"and before the last step {self.total_steps}")
        self.pool.owner.post(self._on_resize, n, at_step, time.time())

    def stop(self) -> None:
        """Stop after the current step (a checkpoint is written). Returns at once."""
        if self.active:
            self.pool.owner.post(self._on_stop)

    def wait(self, timeout: float | None = None, progress: bool = False) -> str:
        """Block until the run ends or `timeout` seconds pass; returns the state.

        With progress=True, prints the loss about twice a second and every resize and
        checkpoint as it happens. Interrupting the wait (the kernel's stop button) only stops
        waiting: the run keeps training.
        """
        if self.state == "created":
            raise UsageError(f"run {self.name!r} was not started: call run.start() first")
        deadline = None if timeout is None else time.monotonic() + timeout
        printed_events, printed_step = 0, -1
        try:
            while not self._done.is_set():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._done.wait(min(left, 0.5) if left is not None else 0.5)
                if progress:
                    printed_events = self._print_events(printed_events)
                    if self._records and self.step != printed_step:
                        print(self._progress_line(), flush=True)
                        printed_step = self.step
        except KeyboardInterrupt:
            print(f"Stopped waiting; run {self.name!r} keeps training (step {self.step}).")
            return self.state
        if progress:
            self._print_events(printed_events)
            print(self.summary(), flush=True)
        return self.state

    def _print_events(self, printed: int) -> int:
        for event in self.events[printed:]:
            line = describe_event(event)
            if line:
                print(line, flush=True)
        return len(self.events)

    def _progress_line(self) -> str:
        r = self._records[self.step]
        vals = " ".join(f"{k} {v:.4f}" for k, v in r.items() if k.startswith("val_"))
        return (f"step {r['step']:>5}/{self.total_steps}  epoch {r['epoch']}  loss {r['loss']:.4f}"
                f"  world size {r['world_size']}  {r['samples_per_s']:.0f} samples/s  {vals}")

    def summary(self) -> str:
        """One-line text summary of the run (for plain-text front ends)."""
        last = self._records.get(self.step, {})
        loss = f"{last['loss']:.4f}" if "loss" in last else "-"
        text = (f"run {self.name!r}: {self.state}, step {self.step}/{self.total_steps}, "
                f"world size {self.world_size}, loss {loss}")
        return text + (f"\n{self.error}" if self.error else "")

    def __repr__(self) -> str:
        return f"<TrainingRun {self.summary()}>"

    def dashboard(self):
        """A live dashboard widget of this run (resize slider, loss chart, status line); in a
        plain-text front end it shows as the text summary."""
        from .dashboard import Dashboard  # the widget stack loads only when asked for
        return Dashboard(self)

    def plot(self, save: str | None = None, smoothing: float = 0.6, log: bool = False,
             metric: str | None = None):
        """The dashboard's picture drawn with matplotlib; see :func:`elastic_jupyter.plot.plot_run`.

        Returns the matplotlib Figure; with ``save="loss.png"`` also writes it (PNG, SVG or PDF
        by the file's extension) and returns the Figure.
        """
        from .plot import plot_run
        return plot_run(self.history, self.events, title=f"run {self.name!r}", save=save,
                        smoothing=smoothing, log=log, metric=metric)

    def state_dict(self) -> dict:
        """The model's trained weights (tensors on the CPU), keyed like ``model.state_dict()``.

        Once the run ended, its final weights; while it trains, the newest checkpoint's.
        Raises UsageError if there is neither.
        """
        return self.training_state()["model"]

    def training_state(self) -> dict:
        """Full training state (model, optimizer, scheduler, progress, RNG, history, config):
        the final state once the run ended; while it trains (the engines are busy), the newest
        checkpoint's."""
        if self._final_state is not None:
            return self._final_state
        try:
            return ckpt.load_latest(self.checkpoint_dir)[1]
        except ckpt.CheckpointError as e:
            raise UsageError(f"run {self.name!r} has no state in memory and {e}") from None

    def load_into(self, model):
        """Copy the trained weights into `model` (a torch.nn.Module of the same architecture)."""
        model.load_state_dict(self.state_dict())
        return model

    def export(self, path: str) -> str:
        """Write the model's plain ``state_dict`` to `path`, loadable by ``torch.load`` alone."""
        import torch
        path = os.path.abspath(path)
        ckpt._atomic_write(path, lambda f: torch.save(self.state_dict(), f))
        return path

    def logs(self, tail: int = 40) -> str:
        """The run's log and the last `tail` lines of each engine's log (prints, warnings,
        tracebacks), as text."""
        parts = []
        if os.path.isdir(self.log_dir):
            for name in sorted(os.listdir(self.log_dir)):
                with open(os.path.join(self.log_dir, name), errors="replace") as f:
                    lines = f.read().splitlines()
                parts.append(f"==> {name} <==\n" + "\n".join(lines[-tail:]))
        return "\n\n".join(parts) or "(no logs yet)"

    # ---------------------------------------------------------------- owner thread: setup

    def _log(self, text: str) -> None:
        try:
            os.makedirs(self.log_dir, exist_ok=True)
            with open(os.path.join(self.log_dir, "run.log"), "a") as f:
                f.write(f"{time.strftime('%H:%M:%S')} {text}\n")
        except OSError:
            pass  # a lost log line must not stop training; events keep the record

    def _event(self, kind: str, **fields) -> dict:
        event = {"kind": kind, "step": fields.pop("step", self.step), "time": time.time(), **fields}
        self.events.append(event)
        self._event_keys.add((kind, event["step"]))
        self._log(f"{kind} " + " ".join(f"{k}={v}" for k, v in event.items() if k != "kind"))
        return event

    def _engine_log(self, engine) -> str:
        return os.path.join(self.log_dir, f"engine-slot{engine.slot}.log")

    def _prepare_checkpoint_dir(self) -> str | None:
        """Create and probe the folder; returns the checkpoint to resume from (or None)."""
        try:
            os.makedirs(self.log_dir, exist_ok=True)
            probe = os.path.join(self.checkpoint_dir, f".write-test-{os.getpid()}")
            with open(probe, "w") as f:
                f.write("ok")
            os.unlink(probe)
        except OSError as e:
            raise UsageError(f"checkpoint folder {self.checkpoint_dir} is not writable "
                             f"({e.strerror or e}); pass --checkpoint-dir (checkpoint_dir=) "
                             "with a writable folder") from None
        latest = ckpt.latest_checkpoint(self.checkpoint_dir)
        if latest and not self.resume:
            raise UsageError(f"run name {self.name!r} already has checkpoints in "
                             f"{self.checkpoint_dir}: pass --resume (resume=True) to continue "
                             "it, or choose another --name")
        if self.resume and not latest:
            raise UsageError(f"--resume: no checkpoint of run {self.name!r} in "
                             f"{self.checkpoint_dir}")
        return latest

    async def _start(self) -> None:
        if self.state != "created":
            raise UsageError(f"run {self.name!r} was already started ({self.state})")
        try:
            await self._claim_pool_and_setup()
        except BaseException as e:
            self.state = "failed"
            self.error = str(e)
            self._done.set()
            raise
        self.state = "training"
        self._event("start", world_size=self.world_size, resumed_from=self._resumed_from)
        self._registration = registry.register(self)
        self._task = asyncio.ensure_future(self._drive())
        self._boot_spares()

    async def _claim_pool_and_setup(self) -> None:
        pool = self.pool
        if pool.run is not None and pool.run.active:
            raise UsageError(f"the pool is busy with run {pool.run.name!r}: stop it "
                             "(%elastic_stop or run.stop()) or wait for it to finish")
        if not pool.running:
            await pool._start()
        size = pool.check_size(self.engines_at_start or pool.size)
        if self.config.global_batch < size:
            raise UsageError(f"--global-batch {self.config.global_batch} is smaller than the "
                             f"world size {size}: every rank needs at least one sample; raise "
                             f"the global batch to at least {size} or use fewer --engines")
        resume_from = self._prepare_checkpoint_dir()
        self.state = "starting"
        pool.run = self
        try:
            if size != pool.size:
                await pool._resize_idle(size)
            self.members = list(pool.engines[:size])
            await self._setup_engines(self.members)
            self._check_schedule()
            if resume_from:
                resume_from = await self._load_checkpoint()
            self._rendezvous = Rendezvous(timeout=self.config.collective_timeout)
            await self._connect(self.members)
        except BaseException:
            pool.run = None
            await self._drop(self.members)
            raise
        self.world_size = self.requested_size = size
        self._resumed_from = resume_from

    def _check_schedule(self) -> None:
        for at_step, n in self._schedule:
            self.pool.check_size(n)
            if not 0 < at_step < self.total_steps:
                raise UsageError(f"scheduled resize at step {at_step} is outside the run's "
                                 f"steps 1..{self.total_steps - 1}")

    async def _setup_engines(self, engines) -> None:
        setup_bytes = None
        if self.setup_fn is not None:
            setup_bytes = _pickle_by_value(self.setup_fn)
        config = self.config.as_dict()
        config["checkpoint_dir"] = self.checkpoint_dir
        ars = [self.pool.client[e.engine_id].apply_async(
            entrypoints.setup_run, config, self.source, setup_bytes, self.push, self._engine_log(e))
            for e in engines]
        results = await asyncio.gather(*(asyncio.wrap_future(a) for a in ars),
                                       return_exceptions=True)
        for engine, result in zip(engines, results):
            if isinstance(result, BaseException):
                detail = _remote_message(result)
                self._log(f"setup failed on engine slot {engine.slot}:\n{detail}")
                raise RunSetupError(
                    f"the cell failed on engine slot {engine.slot}: {_remote_summary(result)}\n"
                    f"--- engine traceback ---\n{detail}")
        self.total_steps = results[0]["total_steps"]

    async def _load_checkpoint(self) -> str:
        """Load the newest usable checkpoint on rank 0; returns its path."""
        ar = self.pool.client[self.members[0].engine_id].apply_async(
            entrypoints.load_state, self.checkpoint_dir)
        try:
            loaded = await asyncio.wrap_future(ar)
        except Exception as e:
            raise RunSetupError(f"cannot resume from {self.checkpoint_dir}: "
                                f"{_remote_summary(e)}") from None
        for message in loaded["warnings"]:
            self._event("warning", message=message)
        old, new = loaded["config"], self.config.as_dict()
        diffs = [f"{k}: {old.get(k)!r} in the checkpoint, {new[k]!r} now"
                 for k in RESUME_KEYS if old.get(k) != new[k]]
        if diffs:
            raise UsageError("cannot resume with a different config (" + "; ".join(diffs) +
                             "): use the checkpoint's values, or start a new run with another "
                             "--name")
        for record in loaded["history"]:
            self._records[record["step"]] = record
        self._merged_upto = loaded["progress"]["step"]
        return loaded["path"]

    async def _connect(self, engines) -> None:
        ars = [self.pool.client[e.engine_id].apply_async(
            entrypoints.connect_store, self._rendezvous.host, self._rendezvous.port,
            self.config.collective_timeout) for e in engines]
        await asyncio.gather(*(asyncio.wrap_future(a) for a in ars))

    async def _drop(self, engines) -> None:
        if not engines or self.pool.client is None:
            return
        ar = self.pool.client[[e.engine_id for e in engines]].apply_async(entrypoints.drop_run)
        await asyncio.gather(asyncio.wrap_future(ar), return_exceptions=True)

    async def _fetch_state(self) -> dict:
        ar = self.pool.client[self.members[0].engine_id].apply_async(entrypoints.training_state)
        return await asyncio.wrap_future(ar)

    # ---------------------------------------------------------------- owner thread: requests

    def _on_resize(self, n: int, at_step: int | None, requested: float) -> None:
        if not self.active:
            return
        if at_step is None:
            self.requested_size = n
            self._pending_request_time = requested
        else:
            bisect.insort(self._schedule, (at_step, n))
        self._log(f"resize request size={n} at_step={at_step}")
        self._boot_spares()

    def _on_stop(self) -> None:
        self._stop_requested = True

    def _engines_wanted(self) -> int:
        """Members plus ready spares this run wants: the largest requested size (now or
        scheduled), at least --min, plus the standby engines, within the usable slots."""
        wanted = max([self.requested_size, self.pool.min_size] + [n for _, n in self._schedule])
        return min(wanted + self.config.standby, self.pool.usable_slots)

    def _boot_spares(self, target: int | None = None) -> None:
        """Start engines in the background so that `target` engines (default: the engines
        wanted) are set up: members and ready spares."""
        target = self._engines_wanted() if target is None else target
        if self._booting is not None and not self._booting.done():
            return  # one boot at a time; the drive loop calls again when it finishes
        if self._boot_failures >= MAX_BOOT_FAILURES:
            return
        missing = target - len(self.members) - len(self._spares)
        if missing > 0:
            self._booting = asyncio.ensure_future(self._boot(missing))

    def _trim_spares(self) -> None:
        """Stop ready spares that no pending request or standby needs any more."""
        needed = self._engines_wanted() - len(self.members)
        if len(self._spares) > max(needed, 0):
            extra = self._spares[max(needed, 0):]
            self._spares = self._spares[:max(needed, 0)]
            self.pool.remove_engines(extra)

    def _boot_failed(self, message: str) -> None:
        self._boot_failures += 1
        if self._boot_failures >= MAX_BOOT_FAILURES:
            self.requested_size = min(self.requested_size, len(self.members))
            message += f"; gave up growing after {MAX_BOOT_FAILURES} tries"
        self._event("warning", message=message)

    async def _boot(self, k: int) -> None:
        # a slot that keeps failing is restarted ever more slowly (1, 2, 4... s)
        repeats = self._slot_faults.get(self.pool.next_free_slot(), 0)
        if repeats > 1:
            await asyncio.sleep(min(2.0 ** (repeats - 2), 16.0))
        t0 = time.time()
        try:
            engines = await self.pool.add_engines(k)
        except Exception as e:
            self._boot_failed(f"could not start {k} engine(s): {e}")
            return
        try:
            await self._setup_engines(engines)
            await self._connect(engines)
        except Exception as e:
            await self.pool.remove_engines(engines)
            self._boot_failed(f"new engines failed to set up: {_remote_summary(e)}")
            return
        self._spares.extend(engines)
        self._trim_spares()
        self._boot_failures = 0
        self._log(f"{k} engine(s) ready in {time.time() - t0:.2f} s")

    # ---------------------------------------------------------------- owner thread: generations

    async def _drive(self) -> None:
        generation, newcomers = 0, set(e.engine_id for e in self.members[1:])
        broadcast = True  # generation 0: every rank takes rank 0's state (same initial weights)
        try:
            while True:
                result = await self._run_generation(generation, newcomers, broadcast)
                generation += 1
                if result["reason"] == "fault":
                    newcomers, broadcast = await self._recover(result["outcome"])
                    continue
                if result["reason"] == "finished":
                    await self._finish("finished")
                    return
                if self._stop_requested:
                    await self._finish("stopped")
                    return
                newcomers = await self._change_membership(result["progress"]["step"])
                broadcast = bool(newcomers)
        except _Stopped:
            pass
        except Exception as e:
            await self._fail(e)
        finally:
            self._done.set()

    def _desired_end(self) -> int | None:
        """The step after which the current generation should end, or None."""
        if self._stop_requested:
            return 0
        want = None
        W = len(self.members)
        if self.requested_size < W or (self.requested_size > W and
                                       len(self._spares) >= self.requested_size - W):
            want = 0
        for at_step, _ in self._schedule:
            if want is None:
                want = at_step
            break
        return want

    async def _run_generation(self, generation: int, newcomers: set, broadcast: bool) -> dict:
        end_at = self._desired_end()
        self._rendezvous.request_end(generation, end_at)
        W = len(self.members)
        ars = []
        for rank, engine in enumerate(self.members):
            spec = {"rank": rank, "world_size": W, "generation": generation,
                    "backend": self.pool.backend, "timeout": self.config.collective_timeout,
                    "receive_state": engine.engine_id in newcomers, "broadcast": broadcast,
                    "end_at": end_at}
            ars.append(self.pool.client[engine.engine_id].apply_async(
                entrypoints.train_generation, spec, self._engine_log(engine)))
        futures = [asyncio.wrap_future(a) for a in ars]
        for f in futures:  # a hung rank's task is abandoned: its error must not go unread
            f.add_done_callback(lambda f: f.cancelled() or f.exception())
        first_failure, died = None, False
        while not all(f.done() for f in futures):
            await asyncio.sleep(POLL)
            self._merge(ars[0].data or {})
            failed = [e for e, f in zip(self.members, futures) if f.done() and f.exception()]
            for engine in failed:
                if not faults.alive(engine.pid) or faults.is_engine_death(
                        futures[self.members.index(engine)].exception()):
                    faults.kill(engine.pid)  # a zombie's sockets may still hold peers
                    died = True
            if failed and first_failure is None:
                first_failure = time.monotonic()
            # a rank forming a group with a dead peer waits on the store until the collective
            # timeout: give it that long before calling it hung
            grace = faults.HANG_GRACE + (self.config.collective_timeout if died else 0)
            if first_failure is not None and time.monotonic() - first_failure > grace:
                break  # the ranks still out are hung
            want = self._desired_end()
            if want != end_at:
                end_at = want
                self._rendezvous.request_end(generation, end_at)
            if self._booting is not None and self._booting.done():
                self._booting = None
                self._boot_spares()
        outcome = faults.classify(self.members, futures)
        if outcome.fault:
            return {"reason": "fault", "outcome": outcome}
        if outcome.errors:  # the user's code raised: the run ends with that engine's traceback
            raise _GenerationError(*outcome.errors[0])
        result = outcome.results[self.members[0].engine_id]
        self._merge(result, complete=True)
        return result

    def _merge(self, data: dict, complete: bool = False) -> None:
        """Take records and events streamed by rank 0 (repeats are skipped, unless the data
        is `complete`: a generation's result fills any gap the live stream left)."""
        for record in data.get("records", ()):
            if complete or record["step"] > self._merged_upto:
                self._records[record["step"]] = record
                self._merged_upto = max(self._merged_upto, record["step"])
        event = self._pending_resize
        first = self._records.get(event["step"] + 1) if event is not None else None
        if first is not None:  # the first step at the new size: the resize is done
            event["latency_s"] = first["time"] - event["requested_time"]
            self._event("resized", step=first["step"], latency_s=event["latency_s"],
                        **{"from": event["from"], "to": event["to"]})
            self._pending_resize = None
        for event in data.get("events", ()):
            if (event["kind"], event["step"]) not in self._event_keys:
                fields = dict(event)
                self._event(fields.pop("kind"), **fields)

    async def _change_membership(self, step: int) -> set:
        """Apply the requests due at `step`; returns the engine ids that join."""
        # an immediate request is timed from when it was made, a scheduled resize from the end
        # of its step, a replacement after a fault from now (each request is used once)
        requested_time, self._pending_request_time = self._pending_request_time, None
        scheduled = False
        while self._schedule and self._schedule[0][0] <= step:
            _, self.requested_size = self._schedule.pop(0)
            scheduled = True
        target, W = self.requested_size, len(self.members)
        if scheduled:
            requested_time = self._records[step]["time"]
        if target == W:
            self._trim_spares()
            return set()
        self.state = "resizing"
        event = self._event("resize", step=step, requested_time=requested_time or time.time(),
                            scheduled=scheduled, **{"from": W, "to": target})
        joined = set()
        if target < W:
            leaving = self.members[target:]
            self.members = self.members[:target]
            # with standby engines, those that left stay set up for the next grow
            room = max(0, self._engines_wanted() - target - len(self._spares))
            self._spares += leaving[:room]
            self.pool.remove_engines(leaving[room:])  # they left the group; stop them
        else:
            while len(self._spares) < target - W:  # training waits here for engines still starting
                if self._boot_failures >= MAX_BOOT_FAILURES:
                    break
                self._boot_spares(target)
                await asyncio.sleep(POLL)
            newcomers = self._spares[:target - W]
            self._spares = self._spares[len(newcomers):]
            self.members += newcomers
            joined = {e.engine_id for e in newcomers}
            if len(self.members) < target:
                self.requested_size = len(self.members)
                self._event("warning", message=f"could not grow to {target} engines after "
                            f"{MAX_BOOT_FAILURES} failed starts; training goes on with "
                            f"{len(self.members)}")
            event["to"] = len(self.members)
        self.world_size = len(self.members)
        self._trim_spares()
        self._boot_spares()  # standby engines used by this grow are replaced
        self._pending_resize = event
        self.state = "training"
        return joined

    # ---------------------------------------------------------------- owner thread: faults

    async def _recover(self, outcome) -> tuple[set, bool]:
        """Drop lost engines, roll survivors back to their last common commit, and start
        replacements. Returns (newcomers, broadcast) for the next generation."""
        for engine in outcome.lost:
            faults.kill(engine.pid)
        self.members = [m for m in self.members if m not in outcome.lost]
        self.pool.remove_engines(outcome.lost)
        for engine in outcome.lost:
            self._slot_faults[engine.slot] = self._slot_faults.get(engine.slot, 0) + 1
            if self._slot_faults[engine.slot] >= faults.MAX_SLOT_FAULTS:
                self.pool.exclude_slot(engine.slot, f"{faults.MAX_SLOT_FAULTS} faults in this run")
                self._event("warning", message=f"slot {engine.slot} left out after "
                            f"{faults.MAX_SLOT_FAULTS} faults")
        self.requested_size = min(self.requested_size, self.pool.usable_slots)
        if self.step > self._last_rollback:
            self._faults_without_progress = 0
        self._faults_without_progress += 1
        if self._faults_without_progress > faults.MAX_SLOT_FAULTS * max(1, self.pool.max_size):
            raise RuntimeError("the run keeps failing without making progress; see run.logs()")
        self._boot_spares()
        await self._wait_for_minimum()
        fault_step, target, newcomers = await self._roll_back_survivors()
        self._last_rollback = target
        for step in [s for s in self._records if s > target]:
            del self._records[step]
        # records the live stream had not delivered before the fault
        ar = self.pool.client[self.members[0].engine_id].apply_async(
            entrypoints.history_since, min(self._merged_upto, target))
        self._merged_upto = min(self._merged_upto, target)
        self._merge({"records": await asyncio.wrap_future(ar)})
        self.world_size = len(self.members)
        self._event("fault", step=fault_step, rolled_back_to=target, lost_steps=fault_step - target,
                    lost_slots=[e.slot for e in outcome.lost],
                    hung_slots=[e.slot for e in outcome.hung], world_size=self.world_size)
        return newcomers, bool(newcomers)

    async def _wait_for_minimum(self) -> None:
        """With fewer than --min survivors, wait (visibly) for replacements, then add them."""
        needed = max(self.pool.min_size, 1) - len(self.members)
        if needed <= 0:
            return
        self._event("warning", message=f"{len(self.members)} engine(s) left, below the minimum "
                    f"{self.pool.min_size}: waiting up to {faults.MIN_WAIT_TIMEOUT:.0f} s for "
                    "replacements")
        deadline = time.monotonic() + faults.MIN_WAIT_TIMEOUT
        while len(self._spares) < needed:
            if time.monotonic() > deadline or self._boot_failures >= MAX_BOOT_FAILURES:
                await self._stop_below_minimum()
            self._boot_spares()
            await asyncio.sleep(POLL)
        self._joining = self._spares[:needed]
        self._spares = self._spares[needed:]

    async def _stop_below_minimum(self) -> None:
        message = (f"stopped: fewer than --min {self.pool.min_size} engines and no replacement "
                   f"started within {faults.MIN_WAIT_TIMEOUT:.0f} s; resume later with --resume")
        if self.members:
            await self._roll_back()
            await self._finish("stopped")
        else:
            self.error = message + " (from the newest checkpoint: all engines were lost)"
            self.state = "failed"
            self._event("error", message=self.error)
            await self._release()
        self._event("warning", message=message)
        raise _Stopped()

    async def _roll_back_survivors(self) -> tuple[int, int, set]:
        """_roll_back, dropping engines that die meanwhile (a fault during recovery)."""
        while True:
            try:
                return await self._roll_back()
            except Exception:
                lost = [m for m in self.members if not faults.alive(m.pid)]
                if not lost:
                    raise
                self.members = [m for m in self.members if m not in lost]
                self.pool.remove_engines(lost)
                await self._wait_for_minimum()

    async def _roll_back(self) -> tuple[int, int, set]:
        """Bring every member to one consistent state; returns (step reached before, step
        restored, engine ids to receive it by broadcast). Prefers the newest in-memory commit
        all survivors hold."""
        joining, self._joining = self._joining, []
        survivors = list(self.members)
        self.members = survivors + joining
        client = self.pool.client
        if survivors:
            ars = [client[e.engine_id].apply_async(entrypoints.commit_steps) for e in survivors]
            held = await asyncio.gather(*(asyncio.wrap_future(a) for a in ars))
            reached = max(h["step"] for h in held)
            common = set.intersection(*(set(h["commits"]) for h in held))
            if common:
                target = max(common)
                ars = [client[e.engine_id].apply_async(entrypoints.rollback, target) for e in survivors]
                await asyncio.gather(*(asyncio.wrap_future(a) for a in ars))
                return reached, target, {e.engine_id for e in joining}
        else:
            reached = self.step
        if ckpt.latest_checkpoint(self.checkpoint_dir) is None:
            raise RuntimeError("engines were lost before any commit or checkpoint; start the "
                               "run again")
        ar = client[self.members[0].engine_id].apply_async(entrypoints.load_state, self.checkpoint_dir)
        loaded = await asyncio.wrap_future(ar)
        self._event("warning", message=f"no common in-memory commit: restored {loaded['path']}")
        return reached, loaded["progress"]["step"], {e.engine_id for e in self.members[1:]}

    async def _finish(self, state: str) -> None:
        self._final_state = await self._fetch_state()
        if state == "stopped":
            await self._final_checkpoint()
        self.state = state
        self._event(state, world_size=self.world_size)
        await self._release()

    async def _final_checkpoint(self) -> None:
        """Write the stopped run's state (off the owner loop: the disk may be slow)."""
        step = self._final_state["progress"]["step"]
        if any(c["step"] == step for c in self.checkpoints):
            return
        args = (self.checkpoint_dir, self._final_state, self.config.keep)
        try:
            try:
                record = await asyncio.get_running_loop().run_in_executor(
                    None, ckpt.write_checkpoint, *args)
            except RuntimeError:  # at interpreter exit the executor takes no work: write here
                record = ckpt.write_checkpoint(*args)
            self._event("checkpoint", step=step, path=record["path"], bytes=record["bytes"])
        except ckpt.CheckpointError as e:
            self._event("checkpoint_failed", step=step, message=str(e))

    async def _fail(self, error: Exception) -> None:
        if isinstance(error, _GenerationError):
            message = (f"training failed on engine slot {error.engine.slot}: "
                       f"{_remote_summary(error.error)}\n--- engine traceback ---\n"
                       f"{_remote_message(error.error)}")
        else:
            message = f"{type(error).__name__}: {error}"
        self.error = message
        self.state = "failed"
        self._event("error", message=message)
        await self._release()

    async def _release(self) -> None:
        spares = self._spares
        self._spares = []
        if self._booting is not None:
            await asyncio.gather(self._booting, return_exceptions=True)
            spares += self._spares
        if spares:
            await self.pool.remove_engines(spares)
        if self.pool.run is self:
            self.pool.run = None
        if self._rendezvous is not None:
            self._rendezvous.close()
        registry.update(self._registration, self)


def describe_event(event: dict) -> str | None:
    """One human-readable line for an event (None for events not worth a line)."""
    kind, step = event["kind"], event["step"]
    if kind == "resize":
        how = "scheduled" if event.get("scheduled") else "requested"
        return f"[step {step}] resize {event['from']} -> {event['to']} ({how})"
    if kind == "resized":
        return (f"[step {step}] world size is now {event['to']}: resize took "
                f"{event['latency_s']:.3f} s (request to first step at the new size)")
    if kind == "checkpoint":
        return f"[step {step}] checkpoint {event['path']} ({event['bytes'] / 1e6:.2f} MB)"
    if kind == "checkpoint_failed":
        return f"[step {step}] WARNING checkpoint not written: {event['message']}"
    if kind in ("error", "warning", "finished", "stopped", "start"):
        extra = event.get("message") or f"world size {event.get('world_size')}"
        return f"[step {step}] {kind}: {extra}"
    return None


class _Stopped(Exception):
    """The run ended inside fault recovery (its state is already final)."""


class _GenerationError(Exception):
    def __init__(self, engine, error):
        super().__init__(str(error))
        self.engine, self.error = engine, error


def _pickle_by_value(fn) -> bytes:
    """Pickle a setup function with its module's code, so engines need not import the module."""
    import sys
    import cloudpickle
    module = sys.modules.get(fn.__module__)
    by_value = module is not None and fn.__module__ not in ("__main__",)
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(fn)
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)
