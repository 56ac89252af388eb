"""IPython magics: %elastic_pool, %%elastic_train, %elastic_resize, %elastic_stop.

Each magic parses its line with argparse (``--help`` prints the usage) and calls the same
Python API a script would use. Errors become IPython UsageErrors: a message, no traceback.
"""
from __future__ import annotations

import argparse
import os
import shlex
import time

from IPython.core.error import UsageError as IPythonUsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.display import display

from ..config import RunConfig, UsageError
from ..pool.launchers import make_launcher
from ..pool.pool import EnginePool, Exclusion
from ..run.run import RunSetupError, TrainingRun


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{message}\n{self.format_usage()}")

    def exit(self, status=0, message=None):
        raise _HelpShown()


class _HelpShown(Exception):
    pass


def _pass_cost(text: str) -> float | str:
    if text == "measure":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of samples or 'measure', got "
                                         f"{text!r}") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _weight(value: float | None) -> float:
    return 1.0 if value is None else value


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


def _status_table(status: dict) -> str:
    """The pool's status as lines of text: size and bounds, the engines, excluded slots."""
    lines = [f"Pool: {status['size']} engine(s), bounds [{status['min']}, {status['max']}], "
             f"backend {status['backend']}, on {status['launcher']}, "
             f"run: {status['run'] or 'none'}"]
    jobs = any(e["job_id"] for e in status["engines"])  # a scheduler's jobs: their ids too
    lines += _columns([("slot", "host", "device", "pid", "engine id") + ("job",) * jobs] + [
        (str(e["slot"]), e["host"], e["device"], str(e["pid"]), str(e["engine_id"]))
        + (e["job_id"],) * jobs for e in status["engines"]])
    for slot, job in status["queued"].items():
        lines.append(f"Slot {slot}: waiting in the queue, {job}")
    now = time.time()
    for slot, exclusion in sorted(status["excluded_slots"].items()):
        lines.append(f"Excluded slot {slot}: {Exclusion(**exclusion).describe(now)}")
    if status.get("size_note"):  # a run left the pool at another size than it started with
        note = status["size_note"]
        lines.append(f"{note[0].upper()}{note[1:]}: a run without --engines starts at "
                     f"{status['size']}; %elastic_pool resize {status['start_size']} goes back.")
    lease = status.get("lease")
    if lease is not None:
        lines.append(f"Lease: {'auto' if lease['auto'] else 'manual'}, weight {lease['weight']:g}"
                     f", training slots {lease['slots']}, standby {lease['standby']}, "
                     f"target {lease['target']}, grantable {lease['grantable']}"
                     + (f", place {lease['queued']} in the queue" if lease["queued"] else ""))
    return "\n".join(lines)


def _machine_table(view: dict, now: float) -> str:
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
    rows = [("slot", "holder", "user", "notebook", "for", "use")]
    for s in view["slots"]:
        h = s["holder"]
        if h is not None:
            who = h["name"] + (" (standby)" if h["standby"] else "")
            row = (who, h["user"], h["notebook"] or "-", f"{now - h['since']:.0f} s")
        elif s["outside"]:
            row = ("outside: " + s["outside"], "-", "-", "-")
        else:
            row = ("free", "-", "-", "-")
        use = " ".join(f"{k} {s[k]}" for k in ("util", "memory_mib") if s.get(k) is not None)
        rows.append((str(s["slot"]),) + row + (use or "-",))
    lines = [f"Machine: {len(view['slots'])} {view.get('kind', '')} slot(s)"]
    lines += _columns(rows)
    rows = [("run", "user", "auto", "weight", "min", "max", "holds", "target", "queue")]
    rows += [(r["name"], r["user"], "on" if r["auto"] else "off", f"{r['weight']:g}",
              str(r["min"]), str(r["max"]), str(r["held"]), str(r["target"]),
              str(r["queued"] or "-")) for r in view["runs"]]
    return "\n".join(lines + _columns(rows))


def _columns(rows: list[tuple]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]


def _pool_parser() -> _Parser:
    p = _Parser(prog="%elastic_pool", description="Start, inspect, resize or stop the engine pool.")
    p.add_argument("action", choices=["start", "status", "resize", "stop"])
    p.add_argument("size", nargs="?", help="new size (resize only)")
    p.add_argument("-n", type=_positive_int, help="engines to start (default: #GPUs, or 2)")
    p.add_argument("--min", type=_positive_int, help="smallest size (default 1)")
    p.add_argument("--max", type=_positive_int, help="largest size (default: #GPUs, or 4)")
    p.add_argument("--gpus", default="all", help="all | none | a list like 0,2 (default all)")
    p.add_argument("--engine-timeout", type=float, default=60.0,
                   help="seconds to wait for an engine to start (default 60)")
    _auto_options(p)
    p.add_argument("--no-arbiter", action="store_true",
                   help="do not take slots from the machine's arbiter, even where the admin "
                        "runs one (for --gpus lists and --schedule)")
    g = p.add_argument_group("where the engines run")
    g.add_argument("--launcher", choices=["local", "ssh", "slurm"], default="local",
                   help="local: processes of this host (default); ssh: processes of --hosts, "
                        "started over ssh; slurm: one batch job each")
    g.add_argument("--hosts", help="ssh: hosts and their slots, like gpu1:4,gpu2:4")
    g.add_argument("--partition", help="slurm: the partition (default: Slurm's)")
    g.add_argument("--account", help="slurm: the account to charge")
    g.add_argument("--time", help="slurm: each job's time limit, like 60 or 1-00:00:00")
    g.add_argument("--gpus-per-engine", type=int,
                   help="slurm, ssh: GPUs per engine (default 0: CPU engines, gloo)")
    g.add_argument("--cpus-per-engine", type=int,
                   help="slurm, ssh: CPU threads per engine (default 1)")
    g.add_argument("--grace", type=int,
                   help="slurm: seconds before the time limit when Slurm signals the engine to "
                        "drain, and a replacement is queued (default 60)")
    g.add_argument("--interface",
                   help="slurm, ssh: the network interface the engines' hosts reach this "
                        "kernel on (default: the one on the route to slurmctld, or to the "
                        "first host). The rendezvous store has no authentication: never all "
                        "interfaces")
    return p


_LAUNCHER_OPTIONS = {  # the options of each --launcher
    "local": (),
    "ssh": ("hosts", "gpus_per_engine", "cpus_per_engine", "interface"),
    "slurm": ("partition", "account", "time", "gpus_per_engine", "cpus_per_engine", "grace",
              "interface"),
}


def _launcher(args):
    """The pool's Launcher from ``%elastic_pool start`` options (None: this host's)."""
    mine = _LAUNCHER_OPTIONS[args.launcher]
    other = sorted({k for opts in _LAUNCHER_OPTIONS.values() for k in opts} - set(mine))
    given = [f"--{k.replace('_', '-')}" for k in other if getattr(args, k) is not None]
    if given:
        raise UsageError(f"--launcher {args.launcher} takes none of {', '.join(given)}")
    if args.launcher == "local":
        return None
    return make_launcher(args.launcher, **{k: getattr(args, k) for k in mine})


def _auto_options(p: _Parser) -> None:
    p.add_argument("--auto", action="store_true",
                   help="auto mode: the machine's arbiter sizes the pool between --min and --max"
                        " by weighted fair share with the machine's other runs (on Slurm: grow "
                        "while the partition is idle, give back while other jobs wait; over "
                        "ssh: each host's arbiter grants its slots)")
    p.add_argument("--weight", type=float, default=None,
                   help="the pool's weight in that fair share among your runs (default 1)")


def _train_parser() -> _Parser:
    p = _Parser(prog="%%elastic_train",
                description="Train the model the cell defines across the pool. The cell runs on "
                            "every engine and must define model, optimizer, dataset and "
                            "loss_fn(model, batch).")
    p.add_argument("variable", nargs="?", default="run",
                   help="notebook variable for the run handle (default: run)")
    p.add_argument("--name", required=True, help="run name; checkpoints go to elastic-checkpoints/NAME/")
    p.add_argument("--engines", type=_positive_int, help="starting world size (default: pool size)")
    p.add_argument("--global-batch", type=_positive_int, default=64,
                   help="samples per optimizer step, whatever the world size (default 64)")
    p.add_argument("--micro-batch", type=_positive_int,
                   help="samples per micro-batch: a step of b samples is cut into ceil(b/N) "
                        "(default: one micro-batch per slot of the pool's --max)")
    p.add_argument("--pass-cost", type=_pass_cost,
                   help="opt-in tuning: a forward/backward pass's fixed cost in samples; a "
                        "step is cut into the fewest micro-batches that keep every world size "
                        "balanced ('measure': timed at the start, the value is logged)")
    p.add_argument("--drop-last", action="store_true",
                   help="leave out each epoch's short last step, as DataLoader(drop_last=True)")
    p.add_argument("--epochs", type=_positive_int, help="epochs to train (default 1)")
    p.add_argument("--steps", type=_positive_int, help="optimizer steps to train (instead of --epochs)")
    p.add_argument("--eval-every", type=_positive_int,
                   help="evaluate eval_dataset every N steps (and always at the end)")
    p.add_argument("--clip-grad-norm", type=float, help="clip the gradient's total norm")
    p.add_argument("--checkpoint-every", type=int, default=100,
                   help="checkpoint every N steps, and at the end (default 100; 0: end only)")
    p.add_argument("--checkpoint-dir", help="folder (default: elastic-checkpoints/NAME/ beside the notebook)")
    p.add_argument("--keep", type=_positive_int, default=3, help="checkpoints kept (default 3)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seed of initial weights and data order")
    p.add_argument("--push", default="", help="notebook variables to send to the engines: a,b")
    p.add_argument("--collective-timeout", type=float, default=30.0,
                   help="seconds a rank may block in a collective before it counts as hung "
                        "(default 30)")
    p.add_argument("--commit-every", type=_positive_int, default=None,
                   help="ignored: every step is committed by a vote, so a fault loses at most "
                        "one step (accepted for one more release)")
    p.add_argument("--workers", type=int, default=0,
                   help="DataLoader processes per engine that fetch and collate the coming "
                        "passes' samples ahead (default 0: in the training process)")
    p.add_argument("--standby", type=int, default=0,
                   help="engines kept set up outside the group so a grow is instant (default 0)")
    p.add_argument("--plateau-metric",
                   help="validation metric a ReduceLROnPlateau lr_scheduler steps on at each "
                        "evaluation, like val_loss (needs --eval-every; default: once per epoch "
                        "on the epoch's mean training loss)")
    p.add_argument("--precision", choices=["bf16", "fp16"],
                   help="run loss_fn under torch.autocast in this dtype; fp16 adds a gradient "
                        "scaler (default: fp32)")
    p.add_argument("--tensorboard", nargs="?", const=True, default=False, metavar="DIR",
                   help="also log to TensorBoard, in DIR/NAME/ (default: tensorboard/ in the "
                        "run's checkpoint folder); needs the tensorboard package. Put the "
                        "handle's name first: a word after --tensorboard is its DIR")
    p.add_argument("--sync-batchnorm", action="store_true",
                   help="convert BatchNorm layers to SyncBatchNorm (GPU slots only)")
    p.add_argument("--schedule", default="",
                   help="resizes at given steps, STEP:SIZE,... (like run.resize(SIZE, at_step=STEP))")
    _auto_options(p)
    p.add_argument("--wait", action="store_true", help="block until training ends, printing progress")
    p.add_argument("--no-dashboard", action="store_true",
                   help="do not show the live dashboard (run.dashboard() shows it later)")
    return p


def _resize_parser() -> _Parser:
    p = _Parser(prog="%elastic_resize", description="Resize the running run's pool.")
    p.add_argument("size", help="new world size")
    p.add_argument("--at-step", type=_positive_int, help="apply exactly after this step")
    return p


@magics_class
class ElasticMagics(Magics):
    """The magics; one pool per kernel."""

    def __init__(self, shell):
        super().__init__(shell)
        self.pool: EnginePool | None = None
        self.run: TrainingRun | None = None

    def _parse(self, parser: _Parser, line: str):
        try:
            words = shlex.split(line)
        except ValueError as e:  # unbalanced quotes
            raise UsageError(f"cannot parse options: {e}") from None
        return parser.parse_args(words)

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except _HelpShown:
            return None
        except (UsageError, RunSetupError) as e:
            raise IPythonUsageError(str(e)) from None

    # %elastic_pool -------------------------------------------------------------------------

    @line_magic
    def elastic_pool(self, line):
        """%elastic_pool start|status|resize N|stop [-n N] [--min N] [--max N] [--gpus all|0,2|none]"""
        return self._guard(self._pool, line)

    def _pool(self, line):
        args = self._parse(_pool_parser(), line)
        if args.action == "start":
            if self.pool is not None and self.pool.running:
                raise UsageError(f"a pool is already running ({self.pool!r}); "
                                 "%elastic_pool stop it first")
            self.pool = EnginePool(args.n, args.min, args.max, args.gpus, args.engine_timeout,
                                   auto=args.auto, weight=_weight(args.weight),
                                   arbiter=False if args.no_arbiter else None,
                                   launcher=_launcher(args)).start()
            print(f"Started {self.pool!r} on {self.pool.launcher.describe()}: " + ", ".join(
                f"slot {e.slot} ({e.device} on {e.host}, pid {e.pid})"
                for e in self.pool.engines))
            return None
        if self.pool is None or not self.pool.running:
            raise UsageError("no pool is running: start one with %elastic_pool start")
        if args.action == "status":
            status = _PoolStatus(self.pool.status())
            print(_status_table(status))  # shown wherever the line is in the cell
            if self.pool.lease is not None:
                print(_machine_table(self.pool.machine(), time.time()))
            return status
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

    # %%elastic_train -----------------------------------------------------------------------

    @line_cell_magic
    def elastic_train(self, line, cell=None):
        """%%elastic_train [VARIABLE] --name NAME [options]: train the cell's model elastically."""
        if cell is None:  # the line form only shows the usage
            return self._guard(self._train_line, line)
        return self._guard(self._train, line, cell)

    def _train_line(self, line):
        try:
            self._parse(_train_parser(), line)  # --help prints the usage and stops here
        except UsageError:
            pass
        raise UsageError("%%elastic_train is a cell magic: put the training code in the cell "
                         "below the %%elastic_train line")

    def _train(self, line, cell):
        args = self._parse(_train_parser(), line)
        if not args.variable.isidentifier():
            raise UsageError(f"{args.variable!r} is not a valid variable name for the run handle")
        push = self._pushed(args.push)
        config = RunConfig(
            name=args.name, global_batch=args.global_batch, micro_batch=args.micro_batch,
            pass_cost=args.pass_cost, drop_last=args.drop_last,
            epochs=args.epochs, steps=args.steps, eval_every=args.eval_every,
            clip_grad_norm=args.clip_grad_norm, checkpoint_every=args.checkpoint_every,
            checkpoint_dir=args.checkpoint_dir, keep=args.keep, seed=args.seed,
            collective_timeout=args.collective_timeout, sync_batchnorm=args.sync_batchnorm,
            commit_every=args.commit_every, standby=args.standby, workers=args.workers,
            plateau_metric=args.plateau_metric, precision=args.precision,
            tensorboard=args.tensorboard)
        if self.pool is None or not self.pool.running:
            self.pool = EnginePool(auto=args.auto, weight=_weight(args.weight)).start()
            print(f"Started {self.pool!r}")
        elif args.auto or args.weight is not None:
            self.pool.set_auto(args.auto or self.pool.lease is not None
                               and self.pool.lease.demand["auto"], args.weight)
        run = TrainingRun(self.pool, config, source=cell, push=push, resume=args.resume,
                          engines=args.engines, notebook=os.environ.get("JPY_SESSION_NAME"),
                          schedule=_schedule(args.schedule))
        run.start()
        self.run = run
        self.shell.user_ns[args.variable] = run
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

    def _pushed(self, names: str) -> dict:
        pushed = {}
        for name in filter(None, (n.strip() for n in names.split(","))):
            if name not in self.shell.user_ns:
                raise UsageError(f"--push {name}: no variable {name!r} in the notebook")
            pushed[name] = self.shell.user_ns[name]
        return pushed

    # %elastic_resize, %elastic_stop ----------------------------------------------------------

    @line_magic
    def elastic_resize(self, line):
        """%elastic_resize N [--at-step K]: resize the running training run."""
        return self._guard(self._resize, line)

    def _resize(self, line):
        args = self._parse(_resize_parser(), line)
        if not self._training():
            raise UsageError("no run is training: start one with %%elastic_train")
        size, run = self.pool.check_size(args.size), self.run
        self.pool.owner.flush()  # an earlier request in flight counts: the newest one wins
        if args.at_step is None and size == run.world_size == run.requested_size:
            print(f"Run {run.name!r} already trains at world size {size}: nothing to do.")
            return
        run.resize(size, at_step=args.at_step)
        when = f"after step {args.at_step}" if args.at_step else "at the next step boundary"
        print(f"Resize of {self.run.name!r} to {args.size} requested ({when}).")

    @line_magic
    def elastic_stop(self, line):
        """%elastic_stop: stop the running run after its current step (a checkpoint is written)."""
        return self._guard(self._stop, line)

    def _stop(self, line):
        _Parser(prog="%elastic_stop", description=self.elastic_stop.__doc__).parse_args(
            shlex.split(line))
        if not self._training():
            raise UsageError("no run is training: nothing to stop")
        self.run.stop()
        state = self.run.wait(timeout=60)
        print(f"Run {self.run.name!r} {state} at step {self.run.step}.")
