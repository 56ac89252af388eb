"""IPython magics: %elastic_pool, %%elastic_train, %elastic_resize, %elastic_stop.

Each magic parses its line with argparse (``--help`` prints the usage) and calls the same
Python API a script would use. Errors become IPython UsageErrors: a message, no traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from IPython.core.error import UsageError as IPythonUsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.display import display

from ..arbiter.machine_view import MachineView
from ..config import (REMOVED, Group, LauncherOptions, PoolOptions, RunConfig, RunStart,
                      UsageError, flag, flagged, positive_int)
from ..pool.launchers import Launcher, make_launcher
from ..pool.pool import EnginePool, Exclusion
from ..pool.status import PoolStatus
from ..run.run import RunSetupError, TrainingRun
from .options import HelpShown, Parser, add_option, add_options, values


def _schedule(text: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        try:
            step, size = (int(v) for v in item.split(":"))
        except ValueError:
            raise UsageError(f"--schedule takes STEP:SIZE pairs like 100:3,300:1; got {item!r}") from None
        out.append((step, size))
    return out


class _PoolStatus(dict):
    """The status dict; as a cell's last line it shows nothing more, since the magic has
    printed it as a table already (IPython would otherwise print the raw dict below it)."""

    def _ipython_display_(self):
        pass


def _status_table(status: PoolStatus) -> str:
    """The pool's status as lines of text: size and bounds, the engines, excluded slots."""
    lines = [f"Pool: {status['size']} engine(s), bounds [{status['min']}, {status['max']}], "
             f"backend {status['backend']}, on {status['launcher']}, "
             f"run: {status['run'] or 'none'}"
             + (f" ({status['run_mode']})" if status.get("run_mode") else "")]
    jobs = any(e["job_id"] for e in status["engines"])  # a scheduler's jobs: their ids too
    lines += _columns([("slot", "host", "device", "pid", "engine id") + ("job",) * jobs] + [
        (str(e["slot"]), e["host"], e["device"], str(e["pid"]), str(e["engine_id"]))
        + (e["job_id"],) * jobs for e in status["engines"]])
    for slot, job in status["queued"].items():
        lines.append(f"Slot {slot}: waiting in the queue, {job}")
    for warm in status.get("warm", []):
        lines.append(f"Warm engine (pid {warm['pid']}): set up on no slot, "
                     f"{warm['rss_mib']:.0f} MiB of host memory; the run's next growth binds it "
                     "to the granted slot (--warm 0: none)")
    now = time.time()
    for slot, exclusion in sorted(status["excluded_slots"].items()):
        lines.append(f"Excluded slot {slot}: {Exclusion(**exclusion).describe(now)}")
    if note := status["size_note"]:  # a run left the pool at another size than it started with
        lines.append(f"{note[0].upper()}{note[1:]}: a run without --engines starts at "
                     f"{status['size']}; %elastic_pool resize {status['start_size']} goes back.")
    lease = status.get("lease")
    if lease is not None:
        lines.append(f"Lease: {'auto' if lease['auto'] else 'manual'}, weight {lease['weight']:g}"
                     f", training slots {lease['slots']}, standby {lease['standby']}, "
                     f"target {lease['target']}, grantable {lease['grantable']}"
                     + (f", place {lease['queued']} in the queue" if lease["queued"] else "")
                     + ("" if lease.get("lend", True) else ", keeps its slots (--no-lend)"))
        for lent in lease.get("lent", []):
            lines.append(f"Slot {lent['slot']} lent to {lent['to']} ({lent['user']}) while no "
                         "run trains here; back when you train: the start waits for that "
                         "run's next step and an engine start")
    return "\n".join(lines)


def _machine_table(view: MachineView, now: float) -> str:
    """The machine's slots (holder, since, use) and runs, as the arbiter sees them; for a
    scheduler's pool (Slurm), what its partition's last look found."""
    if (scheduler := view.get("scheduler")) is not None:
        seen = scheduler["seen"]
        where = f"Slurm partition {scheduler['partition'] or '(default)'}"
        if seen is None:
            return f"{where}: not looked at yet (or Slurm did not answer)"
        waiting = ", ".join(seen["waiting"]) or "none"
        return (f"{where}: {seen['idle_cpus']} idle CPU(s), {seen['idle_gpus']} idle GPU(s) "
                f"(room for {seen['fits']} more engine(s)); other jobs waiting: {waiting}")
    rows: list[tuple[str, ...]] = [("slot", "holder", "user", "notebook", "for", "use")]
    for s in view["slots"]:
        h = s["holder"]
        if h is not None:
            lender = h.get("lent_by")
            who = h["name"] + (" (standby)" if h["standby"] else "") + (
                f" (lent by {lender['name']})" if lender else "")
            row = (who, h["user"], h["notebook"] or "-", f"{now - h['since']:.0f} s")
        elif s["outside"]:
            row = ("outside: " + s["outside"], "-", "-", "-")
        else:
            row = ("free", "-", "-", "-")
        use = " ".join(f"{k} {s[k]}" for k in ("util", "memory_mib") if s.get(k) is not None)
        rows.append((str(s["slot"]),) + row + (use or "-",))
    lines = [f"Machine: {len(view['slots'])} {view.get('kind', '')} slot(s)"]
    lines += _columns(rows)
    rows = [("run", "user", "auto", "weight", "min", "max", "holds", "target", "queue",
             "samples/s by size")]
    rows += [(r["name"], r["user"], "on" if r["auto"] else "off", f"{r['weight']:g}",
              str(r["min"]), str(r["max"]), str(r["held"]), str(r["target"]),
              str(r["queued"] or "-"),
              ", ".join(f"{n}: {v:.3g}" for n, v in r.get("speed") or []) or "-")
             for r in view["runs"]]
    return "\n".join(lines + _columns(rows))


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]


@dataclass
class _PoolLine:
    """%elastic_pool's own words; its options are the pool's and the launcher's (config)."""

    action: str = field(metadata=flag("action", choices=("start", "status", "resize", "stop")))
    size: str | None = field(default=None, metadata=flag("size", "new size (resize only)"))


def _pool_parser() -> Parser:
    p = Parser(prog="%elastic_pool", description="Start, inspect, resize or stop the engine pool.")
    add_options(p, flagged(_PoolLine), flagged(PoolOptions), grouped=False)
    where = p.add_argument_group("where the engines run")
    for option, spelled in flagged(LauncherOptions):
        add_option(where, option, spelled)
    return p


def _launcher(line: argparse.Namespace) -> Launcher | None:
    """The pool's Launcher from ``%elastic_pool start`` options (None: this host's). Raises
    UsageError for an option the chosen launcher does not take."""
    chosen = values(LauncherOptions, line)
    launcher = make_launcher(chosen.launcher, **chosen.settings())
    return None if chosen.launcher == "local" else launcher


@dataclass
class _TrainLine:
    """%%elastic_train's own options, shown among the run's (RunConfig) and the pool's."""

    variable: str = field(default="run", metadata=flag(
        "variable", "notebook variable for the run handle (default %(default)s)"))
    push: str = field(default="", metadata=flag(
        "--push", "notebook variables to send to the engines: a,b", group=Group.RUN))
    schedule: str = field(default="", metadata=flag(
        "--schedule", "resizes at given steps, STEP:SIZE,... (like run.resize(SIZE, "
        "at_step=STEP))", group=Group.ELASTICITY))
    wait: bool = field(default=False, metadata=flag(
        "--wait", "block until training ends, printing progress", group=Group.RUN))
    no_dashboard: bool = field(default=False, metadata=flag(
        "--no-dashboard", "do not show the live dashboard (run.dashboard() shows it later)",
        group=Group.RUN))


def _train_parser() -> Parser:
    p = Parser(prog="%%elastic_train",
               description="Train the model the cell defines across the pool. The cell runs on "
                           "every engine and must define model, optimizer, dataset and "
                           "loss_fn(model, batch).")
    add_options(p, flagged(RunConfig), flagged(RunStart),
                flagged(PoolOptions, "auto", "weight"), flagged(_TrainLine), removed=REMOVED)
    return p


@dataclass
class _ResizeLine:
    """%elastic_resize's options."""

    size: str = field(metadata=flag("size", "new world size"))
    at_step: int | None = field(default=None, metadata=flag(
        "--at-step", "apply exactly after this step", parse=positive_int))


def _resize_parser() -> Parser:
    p = Parser(prog="%elastic_resize", description="Resize the running run's pool.")
    add_options(p, flagged(_ResizeLine))
    return p


@magics_class
class ElasticMagics(Magics):
    """The magics; one pool per kernel."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.pool: EnginePool | None = None
        self.run: TrainingRun | None = None

    def _parse(self, parser: Parser, line: str) -> argparse.Namespace:
        try:
            words = shlex.split(line)
        except ValueError as e:  # unbalanced quotes
            raise UsageError(f"cannot parse options: {e}") from None
        return parser.parse_args(words)

    def _guard(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except HelpShown:
            return None
        except (UsageError, RunSetupError) as e:
            raise IPythonUsageError(str(e)) from None

    # %elastic_pool -------------------------------------------------------------------------

    @line_magic
    def elastic_pool(self, line: str) -> Any:
        """%elastic_pool start|status|resize N|stop [-n N] [--min N] [--max N] [--gpus all|0,2|none]"""
        return self._guard(self._pool, line)

    def _pool(self, line: str) -> _PoolStatus | None:
        args = self._parse(_pool_parser(), line)
        if args.action == "start":
            if self.pool is not None and self.pool.engine_sets.running:
                raise UsageError(f"a pool is already running ({self.pool!r}); "
                                 "%elastic_pool stop it first")
            given = values(PoolOptions, args)
            self.pool = EnginePool(**dataclasses.asdict(given), launcher=_launcher(args)).start()
            print(f"Started {self.pool!r} on {self.pool.launcher.describe()}: " + ", ".join(
                f"slot {e.slot} ({e.device} on {e.host}, pid {e.pid})"
                for e in self.pool.engine_sets.engines))
            return None
        if self.pool is None or not self.pool.engine_sets.running:
            raise UsageError("no pool is running: start one with %elastic_pool start")
        if args.action == "status":
            status = self.pool.status()
            print(_status_table(status))  # shown wherever the line is in the cell
            if self.pool.lease is not None:
                print(_machine_table(self.pool.machine(), time.time()))
            return _PoolStatus(status)
        if args.action == "resize":
            if args.size is None:
                raise UsageError("%elastic_pool resize needs a size, like %elastic_pool resize 3")
            self.pool.resize(args.size)
            print(f"Resize to {args.size} requested." if self._training() else f"{self.pool!r}")
            return None
        self.pool.stop()
        print("Pool stopped.")
        return None

    def _training(self) -> bool:
        return self.run is not None and self.run.active

    def _training_run(self, otherwise: str) -> tuple[EnginePool, TrainingRun]:
        """The pool and the run training on it; UsageError `otherwise` when none trains."""
        if self.pool is None or self.run is None or not self.run.active:
            raise UsageError(otherwise)
        return self.pool, self.run

    # %%elastic_train -----------------------------------------------------------------------

    @line_cell_magic
    def elastic_train(self, line: str, cell: str | None = None) -> Any:
        """%%elastic_train [VARIABLE] --name NAME [options]: train the cell's model elastically."""
        if cell is None:  # the line form only shows the usage
            return self._guard(self._train_line, line)
        return self._guard(self._train, line, cell)

    def _train_line(self, line: str) -> None:
        try:
            self._parse(_train_parser(), line)  # --help prints the usage and stops here
        except UsageError:
            pass
        raise UsageError("%%elastic_train is a cell magic: put the training code in the cell "
                         "below the %%elastic_train line")

    def _train(self, line: str, cell: str) -> None:
        args = self._parse(_train_parser(), line)
        if not args.variable.isidentifier():
            raise UsageError(f"{args.variable!r} is not a valid variable name for the run handle")
        push = self._pushed(args.push)
        config = values(RunConfig, args)
        if self.pool is None or not self.pool.engine_sets.running:
            self.pool = EnginePool(auto=args.auto, weight=args.weight).start()
            print(f"Started {self.pool!r}")
        elif args.auto or args.weight is not None:
            self.pool.set_auto(args.auto or self.pool.lease is not None
                               and self.pool.lease.demand["auto"], args.weight)
        start = dataclasses.replace(values(RunStart, args), source=cell, push=push,
                                    notebook=os.environ.get("JPY_SESSION_NAME"),
                                    schedule=_schedule(args.schedule))
        run = TrainingRun(self.pool, config, **vars(start))  # shallow: push's objects as given
        run.start()
        self.run = run
        self._namespace()[args.variable] = run
        print(f"Run {run.name!r} training on {run.world_size} engine(s) "
              f"({self.pool.backend}), {run.total_steps} steps; handle: {args.variable}. "
              f"Checkpoints: {run.checkpoint_dir}")
        if run.tensorboard_dir:
            print(f"TensorBoard: tensorboard --logdir {run.tensorboard_dir}")
        if not args.no_dashboard:
            display(run.dashboard())
        if args.wait:
            run.wait(progress=True)
        return None

    def _pushed(self, names: str) -> dict[str, Any]:
        pushed, namespace = {}, self._namespace()
        for name in filter(None, (n.strip() for n in names.split(","))):
            if name not in namespace:
                raise UsageError(f"--push {name}: no variable {name!r} in the notebook")
            pushed[name] = namespace[name]
        return pushed

    def _namespace(self) -> dict[str, Any]:
        """The notebook's variables."""
        if self.shell is None:  # IPython registers the magics with its shell
            raise UsageError("the magics run in an IPython shell")
        return self.shell.user_ns

    # %elastic_resize, %elastic_stop ----------------------------------------------------------

    @line_magic
    def elastic_resize(self, line: str) -> Any:
        """%elastic_resize N [--at-step K]: resize the running training run."""
        return self._guard(self._resize, line)

    def _resize(self, line: str) -> None:
        args = self._parse(_resize_parser(), line)
        pool, run = self._training_run("no run is training: start one with %%elastic_train")
        # the text as a number, for the check below; run.resize validates it (bounds, type)
        size: int | str = int(args.size) if args.size.strip().isdigit() else args.size
        pool.owner.flush()  # an earlier request in flight counts: the newest one wins
        if args.at_step is None and size == run.world_size == run.requested_size:
            print(f"Run {run.name!r} already trains at world size {size}: nothing to do.")
            return
        run.resize(size, at_step=args.at_step)
        when = f"after step {args.at_step}" if args.at_step else "at the next step boundary"
        print(f"Resize of {run.name!r} to {args.size} requested ({when}).")

    @line_magic
    def elastic_stop(self, line: str) -> Any:
        """%elastic_stop: stop the running run after its current step (a checkpoint is written)."""
        return self._guard(self._stop, line)

    def _stop(self, line: str) -> None:
        Parser(prog="%elastic_stop", description=ElasticMagics.elastic_stop.__doc__).parse_args(
            shlex.split(line))
        _, run = self._training_run("no run is training: nothing to stop")
        run.stop()
        state = run.wait(timeout=60)
        print(f"Run {run.name!r} {state} at step {run.step}.")
