"""Setting a run up on engines: the checkpoint folder, the cell on every engine, a resume.

Used when the run starts and whenever membership boots new engines. Every failure becomes a
:class:`UsageError` (bad options, folder problems) or :class:`RunSetupError` (the cell failed on
an engine, with that engine's traceback); the pool stays usable either way.
"""
from __future__ import annotations

import os

from .config import RESUME_KEYS, UsageError
from .engine import checkpoint as ckpt
from .engine_calls import remote_message, remote_summary
from .rendezvous import Rendezvous


class RunSetupError(RuntimeError):
    """The run's setup failed on an engine; the message carries that engine's traceback."""


def prepare_checkpoint_dir(folder: str, log_dir: str, name: str, resume: bool) -> str | None:
    """Create and probe `folder`; returns the checkpoint to resume from (or None).

    Raises UsageError: not writable, checkpoints present without `resume`, none with it.
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
    latest = ckpt.latest_checkpoint(folder)
    if latest and not resume:
        raise UsageError(f"run name {name!r} already has checkpoints in {folder}: pass --resume "
                         "(resume=True) to continue it, or choose another --name")
    if resume and not latest:
        raise UsageError(f"--resume: no checkpoint of run {name!r} in {folder}")
    return latest


class CellSetup:
    """Runs the run's cell (or setup function) on engines and connects them to the run's
    rendezvous store, which it owns.

    Args:
        calls: EngineCalls. log: the RunLog. config: the run's config as plain data.
        source / setup_bytes: the cell's code, or a cloudpickled setup function.
        push: notebook variables defined on the engines first.
    """

    def __init__(self, calls, log, config: dict, source, setup_bytes, push: dict):
        self.calls, self.log, self.config = calls, log, config
        self.source, self.setup_bytes, self.push = source, setup_bytes, push
        self.rendezvous: Rendezvous | None = None  # opened once the first engines are set up
        self.total_steps = 0

    def engine_log(self, engine) -> str:
        return os.path.join(self.log.log_dir, f"engine-slot{engine.slot}.log")

    async def __call__(self, engines) -> None:
        """Set `engines` up for the run: the cell, then the rendezvous connection."""
        await self.run_cell(engines)
        await self.connect(engines)

    async def run_cell(self, engines) -> None:
        results = await self.calls.setup_run(engines, self.config, self.source, self.setup_bytes,
                                             self.push, self.engine_log)
        for engine, result in zip(engines, results):
            if isinstance(result, BaseException):
                detail = remote_message(result)
                self.log.log(f"setup failed on engine slot {engine.slot}:\n{detail}")
                raise RunSetupError(
                    f"the cell failed on engine slot {engine.slot}: {remote_summary(result)}\n"
                    f"--- engine traceback ---\n{detail}")
        self.total_steps = results[0]["total_steps"]

    def open_rendezvous(self) -> Rendezvous:
        self.rendezvous = Rendezvous(timeout=self.config["collective_timeout"])
        return self.rendezvous

    def close_rendezvous(self) -> None:
        if self.rendezvous is not None:
            self.rendezvous.close()

    async def connect(self, engines) -> None:
        rdv = self.rendezvous
        if rdv is not None:
            await self.calls.connect_store(engines, rdv.host, rdv.port,
                                           self.config["collective_timeout"])

    async def resume(self, engine, folder: str) -> str:
        """Load the newest usable checkpoint on `engine` (rank 0); returns its path. Skipped
        files become warnings; a different global batch or seed is refused."""
        try:
            loaded = await self.calls.load_state(engine, folder)
        except Exception as e:
            raise RunSetupError(f"cannot resume from {folder}: {remote_summary(e)}") from None
        for message in loaded["warnings"]:
            self.log.event("warning", message=message)
        old = loaded["config"]
        diffs = [f"{k}: {old.get(k)!r} in the checkpoint, {self.config[k]!r} now"
                 for k in RESUME_KEYS if old.get(k) != self.config[k]]
        if diffs:
            raise UsageError("cannot resume with a different config (" + "; ".join(diffs) +
                             "): use the checkpoint's values, or start a new run with another "
                             "--name")
        self.log.load(loaded["history"], loaded["progress"]["step"])
        return loaded["path"]


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
