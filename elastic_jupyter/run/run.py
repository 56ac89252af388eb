"""TrainingRun: the user's handle on one elastic training run.

The handle starts, resizes, stops and waits for the run and reads its results (history,
events, checkpoints, weights). The work happens on the owner thread, split by concern:

- driver.Driver: forms, watches and ends generations; the run's state and error;
- sizing.Sizer: the requested size and schedule (fed by size policies);
- membership.Membership: members, spares and joining engines;
- recovery.Recovery: from a fault back to one consistent state;
- runlog.RunLog: records, events and the run's log file;
- registry / control: discovery by other processes and the control channel.
"""
from __future__ import annotations

import os
import sys
import time
import warnings

from ..server import registry
from .cellsetup import CellSetup, RunSetupError, pickle_by_value, prepare_checkpoint_dir
from ..config import COMMIT_EVERY_NOTICE, RunConfig, UsageError
from .driver import Driver
from ..engine import checkpoint as ckpt
from ..engine.history import whole_history
from ..pool.lease import LeasePolicy
from .membership import Membership
from ..owner import background
from .runlog import RunLog, describe_event
from .sizing import Schedule, SizeRequest, Sizer, UserRequests
from ..server.snapshot import ACTIVE_STATES, RunSnapshot, of_run
from .tensorboard import TensorBoardLog, check_available

__all__ = ["TrainingRun", "RunSetupError", "CHECKPOINT_FOLDER", "describe_event"]

# Not "checkpoints": at a Jupyter server's root, /api/contents/checkpoints/<x> is routed to the
# contents checkpoints API (405), so the file browser could not open the folder.
CHECKPOINT_FOLDER = "elastic-checkpoints"
# a folder unchanged for this long keeps its mtime until its next change: far above the file
# systems' timestamp granularity (a clock tick), short beside the time between checkpoints
LISTING_SETTLED_NS = 1_000_000_000


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
            The cell runs on the engines in the current folder (the notebook's), whatever
            `workspace` says, so it opens and imports the files the notebook would.
        schedule: resizes as (at_step, size) pairs, the same as ``resize(size, at_step)``
            called before training starts.

    With ``config.tensorboard`` the run also logs to TensorBoard (tensorboard.py), in
    ``tensorboard_dir``: ``<checkpoint folder>/tensorboard/``, or ``<folder>/<name>/`` for a
    folder given.

    Attributes:
        state: one of "created", "starting", "training", "resizing", "finished", "failed",
            "stopped".
        world_size: current number of ranks; requested_size: the newest requested size.

    Raises:
        UsageError: both or neither of source and setup, push not a dict, a bad config.
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
        self.resume, self.engines_at_start, self.notebook = resume, engines, notebook
        self.workdir = os.getcwd()
        workspace = os.path.abspath(workspace or self.workdir)
        self.checkpoint_dir = os.path.abspath(
            config.checkpoint_dir or os.path.join(workspace, CHECKPOINT_FOLDER, config.name))
        self.log_dir = os.path.join(self.checkpoint_dir, "logs")
        self.log = RunLog(self.log_dir)
        self.tensorboard_dir = None  # the run's TensorBoard log: opened once it is set up
        if config.tensorboard:
            check_available()
            self.tensorboard_dir = os.path.abspath(
                os.path.join(self.checkpoint_dir, "tensorboard") if config.tensorboard is True
                else os.path.join(config.tensorboard, config.name))
        if config.commit_every is not None:
            warnings.warn(COMMIT_EVERY_NOTICE, FutureWarning, stacklevel=2)
            self.log.event("warning", message=COMMIT_EVERY_NOTICE)
        self._requests = UserRequests()
        self._sizer = Sizer()
        calls = pool.calls
        cell_config = dict(config.as_dict(), checkpoint_dir=self.checkpoint_dir,
                           pool_min_size=pool.min_size, pool_max_size=pool.max_size)
        self._cell = CellSetup(calls, self.log, cell_config, source,
                               pickle_by_value(setup) if setup is not None else None,
                               dict(push or {}), self.workdir)
        self._membership = Membership(pool, self.log, self._cell)
        self._scheduled = bool(schedule)
        self._driver = Driver(pool, calls, self.log, self._sizer,
                              [self._requests, Schedule(sorted(schedule or []))],
                              self._membership, self._cell, config, self.checkpoint_dir,
                              on_end=self._on_end)
        self._registration = None
        self._resumed_from = None
        self._folder_lock = None  # held from setup to the run's end (cellsetup.FolderLock)
        self._listing: tuple[int, list] | None = None  # the checkpoints, by the folder's mtime
        self._error_shown = False  # a wait() showed the run's error
        self._start_note = None  # said as the run starts: why at this size (pool.size_note)

    # ---------------------------------------------------------------- what views read

    @property
    def state(self) -> str:
        return self._driver.state

    @property
    def error(self) -> str | None:
        return self._driver.error

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def step(self) -> int:
        return self.log.step

    @property
    def total_steps(self) -> int:
        return self._cell.total_steps

    @property
    def world_size(self) -> int:
        return len(self._membership.members)

    @property
    def requested_size(self) -> int:
        return self._sizer.requested

    @property
    def members(self) -> list:
        """The engines training, in rank order."""
        return list(self._membership.members)

    @property
    def events(self) -> list[dict]:
        """Events in order: start, resize, resized (with latency_s), checkpoint, fault,
        warning, error, finished, stopped; each with kind, step and time."""
        return self.log.events

    @property
    def history(self) -> list[dict]:
        """Per-step records: step, epoch, loss, lr, world_size, samples_per_s, time (s since
        the epoch), extra metrics from loss_fn, and val_* metrics at evaluation steps."""
        return self.log.history()

    def records_since(self, step: int) -> list[dict]:
        """History records after `step`, oldest first (cost: the new records only)."""
        return self.log.records_since(step)

    @property
    def run_id(self) -> str | None:
        """The id other processes know the run by (None until it started)."""
        return self._registration.run_id if self._registration else None

    def snapshot(self) -> RunSnapshot:
        """The run now, as every view shows it (see snapshot.RunSnapshot)."""
        return of_run(self, self.run_id)

    @property
    def checkpoints(self) -> list[dict]:
        """Checkpoint files of this run, oldest first: file, path, step, bytes, time.

        Views ask several times a second: the listing is read again only when the folder's
        mtime changed (adding, pruning or renaming a file changes it). A change within the
        file system's timestamp granularity of the listing may leave the mtime as it was, so
        a listing is kept only once its folder has been quiet for LISTING_SETTLED_NS.
        """
        try:
            stamp = os.stat(self.checkpoint_dir).st_mtime_ns
        except OSError:  # not created yet
            return []
        cached = self._listing  # (stamp, list), one attribute: read by views' threads too
        if cached is not None and cached[0] == stamp:
            return list(cached[1])
        listing = ckpt.list_checkpoints(self.checkpoint_dir)
        if time.time_ns() - stamp > LISTING_SETTLED_NS:
            self._listing = (stamp, listing)
        return list(listing)

    def summary(self) -> str:
        """One-line text summary of the run (for plain-text front ends)."""
        return self.snapshot().summary()

    def __repr__(self) -> str:
        return f"<TrainingRun {self.summary()}>"

    # ---------------------------------------------------------------- control (any thread)

    def start(self) -> "TrainingRun":
        """Set up the run on every engine and start training in the background.

        Without ``engines``, training starts at the pool's size; where the last run left the
        pool at another size than it started with, a line says so. Blocks until the setup
        succeeded everywhere. Raises UsageError (bad options, busy pool, checkpoint folder
        problems) or RunSetupError (the cell failed on an engine, with its traceback); either
        way the pool stays usable.
        """
        self.pool.wait_printing_queue(self._start())
        if self._start_note:
            print(self._start_note, flush=True)
        return self

    def resize(self, n: int, at_step: int | None = None) -> None:
        """Request world size `n`, now (the newest immediate request wins) or exactly after
        step `at_step`. Returns at once; ``events`` records when the resize took effect.

        On a pool that takes its slots from the machine's arbiter, the request goes to the
        arbiter (and ends auto mode); the run resizes once the slots are granted.

        Raises UsageError if `n` is outside the pool's bounds (or beyond what the arbiter can
        grant), or the run is not training, or `at_step` has already passed (or is given on
        a pool in lease mode, whose size the arbiter decides).
        """
        n = self.pool.check_size(n)
        if self.state not in ("training", "resizing"):
            hint = ("resize once it trains" if self.state in ("created", "starting") else
                    "to resize the idle pool use pool.resize(n) or %elastic_pool resize N")
            raise UsageError(f"run {self.name!r} is {self.state}: {hint}")
        if self.pool.lease is not None:
            if at_step is not None:
                raise UsageError(_LEASED_SCHEDULE)
            return self._on_owner(self._ask_arbiter, n)
        if at_step is not None:
            if isinstance(at_step, bool) or not isinstance(at_step, int):
                raise UsageError(f"at_step must be an integer step, got {at_step!r}")
            if at_step <= self.step or (self.total_steps and at_step >= self.total_steps):
                raise UsageError(f"at_step={at_step} must be after the current step {self.step} "
                                 f"and before the last step {self.total_steps}")
        self._on_owner(self._request, SizeRequest(n, at_step, time.time()))

    def auto(self, on: bool = True, weight: float | None = None) -> None:
        """Turn auto mode on or off: in auto mode the machine's arbiter sizes the run between
        the pool's --min and --max by weighted fair share (docs/arbiter.md); off, the run keeps
        its slots and changes size only when asked. Returns at once. Raises UsageError when the
        pool does not take its slots from the arbiter, or for a weight outside (0, 1e6]."""
        self.pool.set_auto(on, weight)

    def _ask_arbiter(self, n: int) -> None:
        self.log.log(f"resize request size={n} from user, to the machine's arbiter")
        background(self.pool.lease.update(wanted=n, auto=False),
                   lambda e: self.log.event("warning", message=f"resize to {n}: {e}"))

    def stop(self) -> None:
        """Stop after the current step (a checkpoint is written). Returns at once."""
        if self.active:
            self._on_owner(self._sizer.stop)

    def _on_owner(self, fn, *args) -> None:
        """Run `fn` on the owner loop: now when already there (the control channel), else soon."""
        if self.pool.owner.in_owner_thread():
            fn(*args)
        else:
            self.pool.owner.post(fn, *args)

    def _request(self, request: SizeRequest) -> None:
        if self.active:
            self._requests.add(request)
            self._driver.take_requests()

    def wait(self, timeout: float | None = None, progress: bool = False) -> str:
        """Block until the run ends or `timeout` seconds pass; returns the state.

        With progress=True, prints the loss about twice a second and every resize and
        checkpoint as it happens. Interrupting the wait (the kernel's stop button) only stops
        waiting: the run keeps training. The first wait that sees the run failed shows why:
        its error (``run.error``, with the engine's traceback) on stderr, or with progress=True
        in the printed events.
        """
        if self.state == "created":
            raise UsageError(f"run {self.name!r} was not started: call run.start() first")
        deadline = None if timeout is None else time.monotonic() + timeout
        printed_events, printed_step = 0, -1
        done = self._driver.done
        try:
            while not done.is_set():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                done.wait(min(left, 0.5) if left is not None else 0.5)
                if progress:
                    printed_events = self._print_events(printed_events)
                    if self.step and self.step != printed_step:
                        print(self._progress_line(), flush=True)
                        printed_step = self.step
        except KeyboardInterrupt:
            print(f"Stopped waiting; run {self.name!r} keeps training (step {self.step}).")
            return self.state
        if progress:
            self._print_events(printed_events)
            print(self.summary(), flush=True)
        state = self.state
        if state == "failed" and not self._error_shown:
            self._error_shown = True
            if not progress:  # the events printed it
                print(f"run {self.name!r} failed: {self.error}", file=sys.stderr, flush=True)
        return state

    def _print_events(self, printed: int) -> int:
        for event in self.events[printed:]:
            line = describe_event(event)
            if line:
                print(line, flush=True)
        return len(self.events)

    def _progress_line(self) -> str:
        r = self.log.record(self.step)
        vals = " ".join(f"{k} {v:.4f}" for k, v in r.items() if k.startswith("val_"))
        return (f"step {r['step']:>5}/{self.total_steps}  epoch {r['epoch']}  loss {r['loss']:.4f}"
                f"  world size {r['world_size']}  {r['samples_per_s']:.0f} samples/s  {vals}")

    # ---------------------------------------------------------------- results

    def dashboard(self):
        """A live dashboard widget of this run (resize slider, loss chart, status line); in a
        plain-text front end it shows as the text summary."""
        from ..ui.dashboard import Dashboard  # the widget stack loads only when asked for
        return Dashboard(self)

    def plot(self, save: str | None = None, smoothing: float = 0.6, log: bool = False,
             metric: str | None = None):
        """The dashboard's picture drawn with matplotlib; see :func:`elastic_jupyter.ui.plot.plot_run`.

        Returns the matplotlib Figure; with ``save="loss.png"`` also writes it (PNG, SVG or PDF
        by the file's extension) and returns the Figure.
        """
        from ..ui.plot import plot_run
        return plot_run(self.history, self.events, title=f"run {self.name!r}", save=save,
                        smoothing=smoothing, log=log, metric=metric)

    def state_dict(self, part: str = "model") -> dict:
        """The model's trained weights (tensors on the CPU), keyed like ``model.state_dict()``
        of the plain model: a ``torch.compile``d model's (or submodule's) ``_orig_mod.`` is left
        out of the keys, so a model loads them whether it is compiled or not. `part`: a name of
        the cell's ``extra_state`` gives that object's ``state_dict()`` instead (``"ema"``: the
        moving average an ``after_step`` hook kept).

        Once the run ended, its final weights; while it trains, the newest checkpoint's.
        Raises UsageError if there is neither, or no such part.
        """
        state = self._state()[1]
        if part == "model":
            return plain_keys(state["model"])
        extra = state.get("extra") or {}
        if part not in extra:
            raise UsageError(f"run {self.name!r} has no part {part!r}: its parts are "
                             f"{', '.join(['model', *extra])} (the cell's extra_state names "
                             "the others)")
        keyed = isinstance(extra[part], dict) and all(isinstance(k, str) for k in extra[part])
        return plain_keys(extra[part]) if keyed else extra[part]

    def training_state(self) -> dict:
        """Full training state (model, optimizer, scheduler, progress, RNG, history, config):
        the final state once the run ended; while it trains (the engines are busy), the newest
        checkpoint's. Its history is the whole run's (engines hold only the newest records)."""
        folder, state = self._state()
        history = self.history if folder is None else whole_history(folder, state)
        return dict(state, history=history)

    def _state(self) -> tuple[str | None, dict]:
        """(None, the final state) once the run ended, else (its folder, the newest
        checkpoint's state)."""
        if self._driver.final_state is not None:
            return None, self._driver.final_state
        try:
            path, state, _ = ckpt.load_latest(self.checkpoint_dir)
        except ckpt.CheckpointError as e:
            raise UsageError(f"run {self.name!r} has no state in memory and {e}") from None
        return os.path.dirname(path), state

    def load_into(self, model, part: str = "model"):
        """Copy the trained weights into `model` (a torch.nn.Module of the same architecture,
        compiled with ``torch.compile`` or not, whether the trained one was); `part` as in
        :meth:`state_dict`."""
        weights = self.state_dict(part)
        own = {_plain_key(key): key for key in model.state_dict()}
        model.load_state_dict({own.get(key, key): value for key, value in weights.items()})
        return model

    def export(self, path: str, part: str = "model") -> str:
        """Write the model's plain ``state_dict`` to `path` (keys as :meth:`state_dict`'s),
        loadable by ``torch.load`` alone; `part` as in :meth:`state_dict`."""
        import torch
        path = os.path.abspath(path)
        weights = self.state_dict(part)
        ckpt.atomic_write(path, lambda f: torch.save(weights, f))
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

    # ---------------------------------------------------------------- owner thread

    async def _start(self) -> None:
        if self.state != "created":
            raise UsageError(f"run {self.name!r} was already started ({self.state})")
        try:
            await self._claim_pool_and_setup()
        except BaseException as e:
            self._driver.fail_setup(e)
            raise
        if self.tensorboard_dir:  # with the history so far: a resume's is known now
            self.log.tensorboard = TensorBoardLog(self.tensorboard_dir, self.log.history(),
                                                  self.log.events)
        if self._start_note:
            self.log.log(self._start_note)
        self.log.event("start", world_size=self.world_size, resumed_from=self._resumed_from)
        self._driver.launch()
        self._registration = registry.register(self)

    async def _claim_pool_and_setup(self) -> None:
        pool = self.pool
        pool.claim(self)
        try:
            await pool.ensure_started()
            if pool.lease is not None:
                size = await self._lease_slots()
            else:
                size = pool.check_size(self.engines_at_start or pool.size)
                note = pool.size_note() if self.engines_at_start is None else None
                if note:  # the user may expect the -n the pool started with
                    self._start_note = (f"{note}: training starts at {size}; give --engines N "
                                        "(engines=N) to choose")
            if self.config.global_batch < size:
                raise UsageError(
                    f"--global-batch {self.config.global_batch} is smaller than the world size "
                    f"{size}: every rank needs at least one sample; raise the global batch to "
                    f"at least {size} or use fewer --engines")
            resume_from, self._folder_lock = prepare_checkpoint_dir(
                self.checkpoint_dir, self.log_dir, self.name, self.resume, self.notebook)
            self._resumed_from = await self._driver.setup(size, resume_from)
        except BaseException:
            self._release_folder()
            pool.release(self)
            raise

    async def _lease_slots(self) -> int:
        """Lease mode: tell the arbiter about the run, wait in the machine's queue for the
        pool's min, and start at the slots kept (the rest is grown into when granted)."""
        pool = self.pool
        if self._scheduled:
            raise UsageError(_LEASED_SCHEDULE)
        auto = pool.lease.demand["auto"]
        wanted = self.engines_at_start or pool.lease.demand["wanted"]
        wanted = pool.check_size(wanted) if not auto else wanted  # auto: the arbiter decides
        await pool.lease.update(name=self.name, notebook=self.notebook or "", wanted=wanted,
                                standby=self.config.standby)
        await pool.admitted()
        # auto: start on the engines already up (at least the min), grow into the rest while
        # training, as engines become ready, rather than wait for all of them to start
        size = min(wanted, pool.lease.kept) if not auto else min(
            pool.lease.kept, max(pool.size, pool.min_size))
        self._driver.policies.append(LeasePolicy(pool.lease, size))
        return size

    def _release_folder(self) -> None:
        if self._folder_lock is not None:
            self._folder_lock.release()

    def _on_end(self) -> None:
        """The driver reached a final state (its last checkpoint written): free the pool and
        the checkpoint folder, record the end for discovery."""
        self._release_folder()
        self.pool.release(self)
        if self.log.tensorboard is not None:
            self.log.tensorboard.close()
        registry.update(self._registration, self)


_LEASED_SCHEDULE = ("this pool takes its slots from the machine's arbiter, which decides when "
                    "it changes size: resize it now (run.resize(n)), or start a pool with "
                    "--no-arbiter (EnginePool(arbiter=False)) for resizes at given steps")


# the submodule torch.compile's OptimizedModule wraps: its name is in every key of a compiled
# model's (or compiled submodule's) state dict
_COMPILED = "_orig_mod"


def _plain_key(key: str) -> str:
    """`key` of a state dict without the names torch.compile's wrappers add."""
    return ".".join(part for part in key.split(".") if part != _COMPILED)


def plain_keys(state_dict: dict) -> dict:
    """`state_dict` keyed as the model's would be without torch.compile: ``_orig_mod.0.weight``
    -> ``0.weight`` (also inside a compiled submodule: ``enc._orig_mod.w`` -> ``enc.w``)."""
    return {_plain_key(key): value for key, value in state_dict.items()}
