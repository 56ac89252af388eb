"""A resume: the newest usable checkpoint loaded on rank 0, checked against this run.

A resumed run must go on as the uninterrupted run would: a different global batch, seed or
dataset is refused (:class:`UsageError`); a checkpoint that cuts steps otherwise than this
run's options would keeps its cut (an event says so). Runs once, during the run's setup, after
the cell ran on every engine (the dataset's fingerprint is known).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import RESUME_KEYS, RunConfig, UsageError
from ..events import EventKind
from ..pool.engine_calls import remote_summary
from .cellsetup import RunSetupError, describe_dataset
from .runlog import RunLog

if TYPE_CHECKING:
    from ..pool.engine_calls import EngineCalls
    from ..pool.processes import Engine

PLAN_KEYS = ("micro_batch", "pass_cost", "pool_min_size", "pool_max_size")  # what cuts steps into micro-batches


class Resume:
    """Args: calls (EngineCalls), log (RunLog: the checkpoint's history goes there), config
    (the run's config as plain data, with the pool's bounds: CellSetup.config)."""

    def __init__(self, calls: EngineCalls, log: RunLog, config: dict):
        self.calls, self.log, self.config = calls, log, config

    async def load(self, engine: Engine, folder: str, dataset: dict | None) -> str:
        """Load the newest usable checkpoint in `folder` on `engine` (rank 0); returns its
        path. Skipped files become warnings; a different global batch, seed or dataset (this
        run's fingerprint: `dataset`) is refused. Raises RunSetupError or UsageError."""
        try:
            loaded = await self.calls.load_state(engine, folder)
        except Exception as e:
            raise RunSetupError(f"cannot resume from {folder}: {remote_summary(e)}") from None
        for message in loaded["warnings"]:
            self.log.event(EventKind.WARNING, message=message)
        # a key an older checkpoint lacks had the option's default then (drop_last: False)
        old = {k: getattr(RunConfig, k) for k in RESUME_KEYS if hasattr(RunConfig, k)}
        old.update(loaded["config"])
        diffs = [f"{k}: {old.get(k)!r} in the checkpoint, {self.config[k]!r} now"
                 for k in RESUME_KEYS if old.get(k) != self.config[k]]
        if diffs:
            raise UsageError("cannot resume with a different config (" + "; ".join(diffs) +
                             "): use the checkpoint's values, or start a new run with another "
                             "--name")
        _check_dataset(old.get("dataset"), dataset)
        self._warn_if_cut_otherwise(old, loaded["progress"].get("cut"))
        # a checkpoint whose last step is to finish (pending) holds the records before it
        self.log.load(loaded["history"], loaded["progress"]["step"] - bool(loaded.get("pending")))
        return loaded["path"]

    def _warn_if_cut_otherwise(self, old: dict, cut: dict | None) -> None:
        """A resume keeps the cut its checkpoint recorded (engine.data.batching.Cut), so it goes on
        as the uninterrupted run would; options that would cut otherwise are said to be
        unused. A checkpoint from before cuts were recorded is cut by this run's options:
        correct, but dropout draws and BatchNorm statistics differ from the uninterrupted
        run."""
        if cut is not None:
            if not any(old.get(k) != self.config[k] for k in PLAN_KEYS):
                return
            self.log.event(EventKind.MICRO_BATCHES, message=(
                f"the checkpoint's steps were cut for {_plan(old)}; this run keeps that cut "
                f"(one run, one cut), not {_plan(self.config)}"))
            return
        self.log.event(EventKind.WARNING, message=(
            f"the checkpoint was written before runs recorded how their steps are cut into "
            f"micro-batches ({_plan(old)}); this run cuts them by its own rules: each update is "
            "still the mean gradient of the same samples, but dropout draws and BatchNorm "
            "statistics (per micro-batch) differ from the uninterrupted run"))


def _check_dataset(saved: dict | None, dataset: dict | None) -> None:
    """Raise UsageError when the checkpoint's dataset fingerprint (`saved`) is not this run's
    (`dataset`): its steps would continue over other samples. Older checkpoints carry none:
    accepted."""
    if saved is not None and saved != dataset:
        now = describe_dataset(dataset) if dataset is not None else "none"
        raise UsageError(f"cannot resume with a different dataset ({describe_dataset(saved)} in "
                         f"the checkpoint, {now} now): resume with the same dataset, or start a "
                         "new run with another --name")


def _plan(config: dict) -> str:
    options = [f"--{k.replace('_', '-')} {config[k]}" for k in ("micro_batch", "pass_cost")
               if config.get(k) is not None]
    return ", ".join(options + [f"a pool of {config.get('pool_min_size')}.."
                                f"{config.get('pool_max_size')}"])
