"""TrainingRun: the user's handle on one elastic training run.

The handle starts, resizes, stops and waits for the run and reads its results; it validates
what it is asked and hands the work to owners, split by concern:

- claim.RunClaim: the pool and the checkpoint folder, from the start to the end;
- driver.Driver: forms, watches and ends generations; the run's state, error and store
  (with membership.Membership, recovery.Recovery, final_state.FinalState);
- sizing.Sizer: the requested size and schedule (fed by size policies; it coalesces requests);
- runlog.RunLog: records, events and the run's log file; progress.ProgressPrinter: wait();
- results.RunResults: checkpoints, the trained weights, the logs;
- registry / control: discovery by other processes and the control channel.
"""
from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

from ..config import RunConfig, UsageError
from ..events import Event, EventKind
from ..owner import background, get_owner
from ..server import registry
from ..server.snapshot import ACTIVE_STATES, TRAINING_STATES, RunSnapshot, RunState, of_run
from .cellsetup import CellSetup, RunSetupError, pickle_by_value
from .claim import LEASED_SCHEDULE, RunClaim
from .driver import Driver
from .progress import ProgressPrinter
from .results import RunResults
from .run_mode import run_mode
from .runlog import RunLog, describe_event
from .speed_meter import SpeedMeter
from .sizing import Schedule, SizeRequest, Sizer, UserRequests
from .tensorboard import TensorBoardLog, log_folder

if TYPE_CHECKING:
    from ..pool.pool import EnginePool
    from ..pool.processes import Engine
    from ..server.registry import Registration

__all__ = ["TrainingRun", "RunSetupError", "CHECKPOINT_FOLDER", "describe_event"]

# Not "checkpoints": at a Jupyter server's root, /api/contents/checkpoints/<x> is routed to the
# contents checkpoints API (405), so the file browser could not open the folder.
CHECKPOINT_FOLDER = "elastic-checkpoints"


class TrainingRun:
    """An elastic data-parallel training run.

    Its keywords after `config` are config.RunStart's fields (declared there with their
    defaults; ``%%elastic_train`` takes those with a flag).

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
    ``tensorboard_dir``: ``<checkpoint folder>/tensorboard/``, or ``<folder>/<name>/``.

    Attributes:
        state: a RunState (a str): "created", "starting", "training", "resizing",
            "finished", "failed" or "stopped".
        world_size: current number of ranks; requested_size: the newest requested size.
        memory: a sharded run's memory bound (run.memory_bound), which resizes respect.

    Raises:
        UsageError: both or neither of source and setup, push not a dict, a bad config.
    """

    def __init__(self, pool: EnginePool, config: RunConfig, source: str | None = None,
                 setup: Callable[[], dict] | None = None, push: dict | None = None,
                 resume: bool = False, engines: int | None = None,
                 workspace: str | None = None, notebook: str | None = None,
                 schedule: list[tuple[int, int]] | None = None):
        if (source is None) == (setup is None):
            raise UsageError("give the run's code as source (a cell) or as a setup function")
        if push is not None and not isinstance(push, dict):
            raise UsageError("push takes a dict of notebook variables, like push={'lr': lr}")
        config.validate()
        self.pool, self.config, self.name, self.notebook = pool, config, config.name, notebook
        self.workdir = os.getcwd()
        workspace = os.path.abspath(workspace or self.workdir)
        self.checkpoint_dir = os.path.abspath(
            config.checkpoint_dir or os.path.join(workspace, CHECKPOINT_FOLDER, config.name))
        self.log_dir = os.path.join(self.checkpoint_dir, "logs")
        self.log = RunLog(self.log_dir)
        self._speed = SpeedMeter(self.log)
        # the run's TensorBoard log opens there once the run is set up
        self.tensorboard_dir = log_folder(config.tensorboard, self.checkpoint_dir, self.name)
        self._supply = pool.supply  # the run's door into the pool's engines and slots
        self._requests = UserRequests()
        self._sizer = Sizer()
        cell_config = dict(config.as_dict(), checkpoint_dir=self.checkpoint_dir,
                           pool_min_size=self._supply.min_size,
                           pool_max_size=self._supply.max_size)
        self.mode = run_mode(config)  # where the training state lives (run.run_mode)
        self._cell = CellSetup(self._supply.calls, self.log, cell_config, source,
                               pickle_by_value(setup) if setup is not None else None,
                               dict(push or {}), self.workdir, self.mode.memory_bound(),
                               self._supply.preload)
        self.memory = self._cell.memory
        self._driver = Driver(pool, self._supply.calls, self.log, self._sizer,
                              [self._requests, Schedule(sorted(schedule or []))],
                              self._cell, config, self.mode, self.checkpoint_dir,
                              on_end=self._on_end)
        self._claim = RunClaim(pool, self, config, engines, self.checkpoint_dir, self.log_dir,
                               resume, notebook, scheduled=bool(schedule))
        self._results = RunResults(self.name, self.checkpoint_dir, self.log_dir, self.log,
                                   self._driver.final)
        self._registration: Registration | None = None
        self._resumed_from: str | None = None
        self._error_shown = False  # a wait() showed the run's error

    # ---------------------------------------------------------------- what views read

    @property
    def state(self) -> RunState:
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
        return len(self._driver.members)

    @property
    def requested_size(self) -> int:
        return self._sizer.requested

    @property
    def members(self) -> list[Engine]:
        """The engines training, in rank order."""
        return list(self._driver.members)

    @property
    def events(self) -> list[Event]:
        """Events in order (events.EventKind: start, resize, resized with latency_s,
        checkpoint, fault, warning, error, finished, stopped, ...); each with kind, step and
        time."""
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
        """Checkpoint files of this run, oldest first: file, path, step, bytes, time (read
        again only when the folder changed)."""
        return self._results.checkpoints()

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
        if self._claim.start_note:
            print(self._claim.start_note, flush=True)
        return self

    def resize(self, n: int | str, at_step: int | None = None) -> None:
        """Request world size `n`, now (the newest immediate request wins) or exactly after
        step `at_step`. Returns at once; ``events`` records when the resize took effect.
        Requests closer than ``sizing.COALESCE_S`` are one (a slider's drag).

        On a pool that takes its slots from the machine's arbiter, the request goes to the
        arbiter (and ends auto mode); the run resizes once the slots are granted.

        Raises UsageError if `n` is outside the pool's bounds (or beyond what the arbiter can
        grant, or below a sharded run's memory bound), or the run is not training, or
        `at_step` has already passed (or is given on a pool in lease mode).
        """
        n = self.pool.check_size(n)  # the one validation of a resize, whoever asks
        self.memory.check(n)  # and a sharded run's memory bound
        if self.state not in TRAINING_STATES:
            hint = ("resize once it trains" if self.state in (RunState.CREATED,
                                                              RunState.STARTING) else
                    "to resize the idle pool use pool.resize(n) or %elastic_pool resize N")
            raise UsageError(f"run {self.name!r} is {self.state}: {hint}")
        if self._supply.leased:
            if at_step is not None:
                raise UsageError(LEASED_SCHEDULE)
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
        its slots and changes size only when asked. Returns at once. Raises UsageError without
        the arbiter, or for a weight outside (0, 1e6]."""
        self.pool.set_auto(on, weight)

    def _ask_arbiter(self, n: int) -> None:
        lease = self._supply.lease
        assert lease is not None  # resize() checked
        self.log.log(f"resize request size={n} from user, to the machine's arbiter")
        background(lease.update(wanted=n, auto=False),
                   lambda e: self.log.event(EventKind.WARNING, message=f"resize to {n}: {e}"))

    def stop(self) -> None:
        """Stop after the current step (a checkpoint is written). Returns at once."""
        if self.active:
            self._on_owner(self._sizer.stop)

    def speed(self) -> list[tuple[int, float]]:
        """(world size, samples per second) of the recent steps at each size it trained at
        (owner loop; its pool reports it to the machine's arbiter)."""
        return self._speed.speeds()

    def note_event(self, kind: str, **fields: Any) -> None:
        """Record an event of the pool's: its lease's slot events and warnings (owner loop)."""
        self.log.event(kind, **fields)

    def _on_owner(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn` on the owner loop: now when already there (the control channel), else soon."""
        if get_owner().in_owner_thread():
            fn(*args)
        else:
            get_owner().post(fn, *args)

    def _request(self, request: SizeRequest) -> None:
        if self.active:
            self._requests.add(request)
            self._driver.look()

    def wait(self, timeout: float | None = None, progress: bool = False) -> RunState:
        """Block until the run ends or `timeout` seconds pass; returns the state.

        With progress=True, prints the loss about twice a second and every resize and
        checkpoint as it happens. Interrupting the wait (the kernel's stop button) only stops
        waiting: the run keeps training. The first wait that sees the run failed shows its
        error (``run.error``, with the engine's traceback) on stderr, or in the events printed.
        """
        if self.state == RunState.CREATED:
            raise UsageError(f"run {self.name!r} was not started: call run.start() first")
        printer = ProgressPrinter(self.log, lambda: self.total_steps)
        if not printer.follow(self._driver.done, timeout, progress):
            print(f"Stopped waiting; run {self.name!r} keeps training (step {self.step}).")
            return self.state
        if progress:
            printer.print_events()
            print(self.summary(), flush=True)
        state = self.state
        if state == RunState.FAILED and not self._error_shown:
            self._error_shown = True
            if not progress:  # the events printed it
                print(f"run {self.name!r} failed: {self.error}", file=sys.stderr, flush=True)
        return state

    # ---------------------------------------------------------------- results

    def dashboard(self) -> Any:
        """A live dashboard widget of this run (resize slider, loss chart, status line); in a
        plain-text front end it shows as the text summary."""
        from ..ui.dashboard import Dashboard  # the widget stack loads only when asked for
        return Dashboard(self)

    def plot(self, save: str | None = None, smoothing: float = 0.6, log: bool = False,
             metric: str | None = None) -> Any:
        """The dashboard's picture drawn with matplotlib (:func:`elastic_jupyter.ui.plot.plot_run`):
        a Figure; ``save="loss.png"`` also writes it (PNG, SVG or PDF by the file's extension)."""
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
        Frozen weights (parameters with ``requires_grad=False``, buffers of frozen modules:
        each engine keeps those its cell built) are not in it unless the run was started with
        ``--move-frozen``: :meth:`load_into` a model built as the cell builds it.
        Raises UsageError if there is neither, or no such part.
        """
        return self._results.state_dict(part)

    def training_state(self) -> dict:
        """Full training state (model, optimizer, scheduler, progress, RNG, history, config):
        the final state once the run ended; while it trains (the engines are busy), the newest
        checkpoint's. Its history is the whole run's (engines hold only the newest records)."""
        return self._results.training_state()

    def load_into(self, model: Any, part: str = "model") -> Any:
        """Copy the trained weights into `model` (a torch.nn.Module of the same architecture,
        compiled with ``torch.compile`` or not, whether the trained one was); `part` as in
        :meth:`state_dict`. `model`'s frozen weights are kept, and must be those the run
        trained with (their digests are compared: UsageError otherwise)."""
        return self._results.load_into(model, part)

    def export(self, path: str, part: str = "model") -> str:
        """Write the model's plain ``state_dict`` to `path` (keys as :meth:`state_dict`'s:
        without frozen weights, so a LoRA fine-tune exports its adapter alone), loadable by
        ``torch.load`` alone; `part` as in :meth:`state_dict`."""
        return self._results.export(path, part)

    def logs(self, tail: int = 40) -> str:
        """The run's log and the last `tail` lines of each engine's log (prints, warnings,
        tracebacks), as text."""
        return self._results.logs(tail)

    # ---------------------------------------------------------------- owner thread

    async def _start(self) -> None:
        if self.state != RunState.CREATED:
            raise UsageError(f"run {self.name!r} was already started ({self.state})")
        try:
            await self._claim_pool_and_setup()
        except BaseException as e:
            self._driver.fail_setup(e)
            raise
        if self.tensorboard_dir:  # with the history so far: a resume's is known now
            self.log.tensorboard = TensorBoardLog(self.tensorboard_dir, self.log.history(),
                                                  self.log.events)
        if self._claim.start_note:
            self.log.log(self._claim.start_note)
        self.log.event(EventKind.START, world_size=self.world_size, resumed_from=self._resumed_from)
        self._driver.launch()
        self._registration = registry.register(self)

    async def _claim_pool_and_setup(self) -> None:
        size, resume_from = await self._claim.take()
        try:
            if self._claim.lease_policy is not None:
                self._driver.policies.append(self._claim.lease_policy)
            self._resumed_from = await self._driver.setup(size, resume_from)
        except BaseException:
            self._claim.release()
            raise

    def _on_end(self) -> None:
        """The driver reached a final state (its last checkpoint written): free the pool and
        the checkpoint folder, record the end for discovery."""
        self._claim.release()
        if self.log.tensorboard is not None:
            self.log.tensorboard.close()
        registry.update(self._registration, self)
