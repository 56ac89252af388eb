"""Setting a run up on engines: the checkpoint folder and its lock, the cell on every engine
(in the notebook's working folder, with the same dataset everywhere), a resume.

Used when the run starts and whenever membership boots new engines. Every failure becomes a
:class:`UsageError` (bad options, folder problems) or :class:`RunSetupError` (the cell failed on
an engine, with that engine's traceback); the pool stays usable either way.
"""
from __future__ import annotations

import fcntl
import json
import os
import time

from ..config import RESUME_KEYS, RunConfig, UsageError
from ..engine import checkpoint as ckpt
from ..pool.engine_calls import remote_message, remote_summary
from ..server.registry import kernel_id
from .rendezvous import Rendezvous


class RunSetupError(RuntimeError):
    """The run's setup failed on an engine; the message carries that engine's traceback."""


LOCK_FILE = ".lock"
PLAN_KEYS = ("micro_batch", "pass_cost", "pool_min_size", "pool_max_size")  # what cuts steps into micro-batches


class FolderLock:
    """This process's exclusive hold on a checkpoint folder for a run's life, so two live runs
    never write into one folder (even two kernels starting the same name at the same moment).

    ``fcntl.flock`` on ``<folder>/.lock``, which records the holder (pid, kernel, notebook,
    run name, start time); the lock goes with :meth:`release` or with the process.

    Raises UsageError naming the holder when another run holds the folder.
    """

    def __init__(self, folder: str, name: str, notebook: str | None = None):
        self.path = os.path.join(folder, LOCK_FILE)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise UsageError(f"checkpoint folder {folder} is in use by {holder}: two live runs "
                             "cannot share a checkpoint folder; stop that run first, or choose "
                             "another --name (or --checkpoint-dir)") from None
        self._fd = fd
        me = {"pid": os.getpid(), "kernel": kernel_id(), "notebook": notebook, "name": name,
              "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)

    def release(self) -> None:
        """Let other runs use the folder (closing the file ends the lock); idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _read_holder(fd: int) -> str:
    """Who holds the lock, in words. The holder writes its record right after it took the
    lock, so a racing reader may find the file still empty for a moment."""
    for _ in range(40):
        try:
            h = json.loads(os.pread(fd, 4096, 0))
            break
        except ValueError:
            time.sleep(0.05)
    else:
        return "another process"
    where = ", ".join(filter(None, [f"process {h.get('pid')}",
                                    h.get("kernel") and f"kernel {h['kernel']}",
                                    h.get("notebook") and f"notebook {h['notebook']}"]))
    since = time.strftime("%H:%M:%S", time.localtime(h.get("since") or 0))
    return f"run {h.get('name')!r} ({where}) since {since}"


def prepare_checkpoint_dir(folder: str, log_dir: str, name: str, resume: bool,
                           notebook: str | None = None) -> tuple[str | None, FolderLock]:
    """Create, probe and lock `folder`; returns (the checkpoint to resume from or None, the
    lock, which the run holds until it ends).

    Raises UsageError: not writable, held by another live run, checkpoints present without
    `resume`, none with it.
    """
    try:
        os.makedirs(log_dir, exist_ok=True)
        probe = os.path.join(folder, f".write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"checkpoint folder {folder} is not writable ({e.strerror or e}); pass "
                         "--checkpoint-dir (checkpoint_dir=) with a writable folder") from None
    lock = FolderLock(folder, name, notebook)
    latest = ckpt.latest_checkpoint(folder)
    if latest and not resume:
        lock.release()
        raise UsageError(f"run name {name!r} already has checkpoints in {folder}: pass --resume "
                         "(resume=True) to continue it, or choose another --name")
    if resume and not latest:
        lock.release()
        raise UsageError(f"--resume: no checkpoint of run {name!r} in {folder}")
    return latest, lock


class CellSetup:
    """Runs the run's cell (or setup function) on engines and connects them to the run's
    rendezvous store, which it owns.

    Args:
        calls: EngineCalls. log: the RunLog. config: the run's config as plain data.
        source / setup_bytes: the cell's code, or a cloudpickled setup function.
        push: notebook variables defined on the engines first.
        workdir: the notebook's working folder when the cell ran; engines run the cell there
            (on a host without that folder, in their own: a warning says so, once a host).

    Attributes:
        total_steps: the run's length in steps, fixed by the first engines' setup.
        dataset: their dataset's fingerprint ({"samples", "hash"}); an engine that builds
            another dataset later is refused (the run's steps never change mid-run).
    """

    def __init__(self, calls, log, config: dict, source, setup_bytes, push: dict,
                 workdir: str):
        self.calls, self.log, self.config = calls, log, config
        self.source, self.setup_bytes, self.push = source, setup_bytes, push
        self.workdir = workdir
        self._elsewhere: set[str] = set()  # hosts that run the cell outside `workdir`
        self.rendezvous: Rendezvous | None = None  # opened once the first engines are set up
        self.total_steps = 0
        self.dataset: dict | None = None

    def engine_log(self, engine) -> str:
        return os.path.join(self.log.log_dir, f"engine-slot{engine.slot}.log")

    async def __call__(self, engines) -> None:
        """Set `engines` up for the run: the cell, then the rendezvous connection."""
        await self.run_cell(engines)
        await self.connect(engines)

    async def run_cell(self, engines) -> None:
        results = await self.calls.setup_run(engines, self.config, self.source, self.setup_bytes,
                                             self.push, self.engine_log, self.workdir)
        for engine, result in zip(engines, results):
            if isinstance(result, BaseException):
                detail = remote_message(result)
                self.log.log(f"setup failed on engine slot {engine.slot}:\n{detail}")
                raise RunSetupError(
                    f"the cell failed on engine slot {engine.slot}: {remote_summary(result)}\n"
                    f"--- engine traceback ---\n{detail}")
        for engine, result in zip(engines, results):
            # the notebook's folder is not on its host: said once per host
            if result["workdir"] != self.workdir and engine.host not in self._elsewhere:
                self._elsewhere.add(engine.host)
                self.log.event("warning", message=(
                    f"host {engine.host} has no folder {self.workdir}: the cell runs in "
                    f"{result['workdir']} there (relative paths and the notebook's own modules"
                    " resolve there)"))
        self._check_datasets(engines, [r["dataset"] for r in results])
        if self.dataset is None:
            self.dataset, self.total_steps = results[0]["dataset"], results[0]["total_steps"]

    def _check_datasets(self, engines, found: list[dict]) -> None:
        """Raise RunSetupError naming the engines whose dataset differs from the run's (or,
        at the start, from the first engine's)."""
        reference = self.dataset or found[0]
        odd = [(e, d) for e, d in zip(engines, found) if d != reference]
        if not odd:
            return
        why = (f"the cell must build the same dataset on every engine: each runs it in "
               f"{self.workdir}; check the files it reads and seed any random split")
        if self.dataset is None:
            listed = "; ".join(f"slot {e.slot}: {_describe(d)}" for e, d in zip(engines, found))
            slots = ", ".join(str(e.slot) for e, _ in odd)
            differ = f"slots {slots} differ" if len(odd) > 1 else f"slot {slots} differs"
            message = (f"the engines built different datasets (engine {differ} from slot "
                       f"{engines[0].slot}): {listed}. {why[0].upper()}{why[1:]}")
        else:
            message = "; ".join(f"engine slot {e.slot} built another dataset than the run's "
                                f"({_describe(d)}; the run's: {_describe(reference)})"
                                for e, d in odd)
            message += f": refused, since a run's steps never change mid-run; {why}"
        self.log.log(message)
        raise RunSetupError(message)

    def open_rendezvous(self, host: str) -> Rendezvous:
        """Serve the run's store on `host` (the pool's address: loopback on one host)."""
        self.rendezvous = Rendezvous(host, timeout=self.config["collective_timeout"])
        return self.rendezvous

    def close_rendezvous(self) -> None:
        if self.rendezvous is not None:
            self.rendezvous.close()

    async def connect(self, engines) -> None:
        rdv = self.rendezvous
        if rdv is not None:
            await self.calls.connect_store(engines, rdv.host, rdv.port,
                                           self.config["collective_timeout"])

    def _warn_if_cut_otherwise(self, old: dict, cut: dict | None) -> None:
        """A resume keeps the cut its checkpoint recorded (engine.batching.Cut), so it goes on
        as the uninterrupted run would; options that would cut otherwise are said to be
        unused. A checkpoint from before cuts were recorded is cut by this run's options:
        correct, but dropout draws and BatchNorm statistics differ from the uninterrupted
        run."""
        if cut is not None:
            if not any(old.get(k) != self.config[k] for k in PLAN_KEYS):
                return
            self.log.event("micro_batches", message=(
                f"the checkpoint's steps were cut for {_plan(old)}; this run keeps that cut "
                f"(one run, one cut), not {_plan(self.config)}"))
            return
        self.log.event("warning", message=(
            f"the checkpoint was written before runs recorded how their steps are cut into "
            f"micro-batches ({_plan(old)}); this run cuts them by its own rules: each update is "
            "still the mean gradient of the same samples, but dropout draws and BatchNorm "
            "statistics (per micro-batch) differ from the uninterrupted run"))

    def _check_resumed_dataset(self, saved: dict | None) -> None:
        """Raise UsageError when the checkpoint's dataset fingerprint is not this run's: its
        steps would continue over other samples. Older checkpoints carry none: accepted."""
        if saved is not None and saved != self.dataset:
            raise UsageError(f"cannot resume with a different dataset ({_describe(saved)} in the "
                             f"checkpoint, {_describe(self.dataset)} now): resume with the same "
                             "dataset, or start a new run with another --name")

    async def resume(self, engine, folder: str) -> str:
        """Load the newest usable checkpoint on `engine` (rank 0); returns its path. Skipped
        files become warnings; a different global batch, seed or dataset is refused (run_cell
        ran first: `self.dataset` is this run's)."""
        try:
            loaded = await self.calls.load_state(engine, folder)
        except Exception as e:
            raise RunSetupError(f"cannot resume from {folder}: {remote_summary(e)}") from None
        for message in loaded["warnings"]:
            self.log.event("warning", message=message)
        # a key an older checkpoint lacks had the option's default then (drop_last: False)
        old = {k: getattr(RunConfig, k) for k in RESUME_KEYS if hasattr(RunConfig, k)}
        old.update(loaded["config"])
        diffs = [f"{k}: {old.get(k)!r} in the checkpoint, {self.config[k]!r} now"
                 for k in RESUME_KEYS if old.get(k) != self.config[k]]
        if diffs:
            raise UsageError("cannot resume with a different config (" + "; ".join(diffs) +
                             "): use the checkpoint's values, or start a new run with another "
                             "--name")
        self._check_resumed_dataset(old.get("dataset"))
        self._warn_if_cut_otherwise(old, loaded["progress"].get("cut"))
        # a checkpoint whose last step is to finish (pending) holds the records before it
        self.log.load(loaded["history"], loaded["progress"]["step"] - bool(loaded.get("pending")))
        return loaded["path"]


def _plan(config: dict) -> str:
    options = [f"--{k.replace('_', '-')} {config[k]}" for k in ("micro_batch", "pass_cost")
               if config.get(k) is not None]
    return ", ".join(options + [f"a pool of {config.get('pool_min_size')}.."
                                f"{config.get('pool_max_size')}"])


def _describe(dataset: dict) -> str:
    return f"{dataset['samples']} samples, items hash {dataset['hash']}"


def pickle_by_value(fn) -> bytes:
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
