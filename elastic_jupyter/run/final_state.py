"""The run's final state, and the checkpoints the owner writes itself.

Once a run ends its state is kept in the kernel (``run.state_dict()``, ``export()``): the
finished or stopped run's last step, or after an error the last committed step's. The owner
writes it as a checkpoint when no rank did (a stop, an error, every rank drained), so
``--resume`` works from it. The only writer of the final state.

Where the state is depends on the run's state mode (run.run_mode): :class:`WholeFinalState`
keeps a replicated run's whole state, taken from rank 0 or its last checkpoint;
:class:`ShardedFinalState` a sharded run's, whose rows stay in its newest checkpoint folder.
"""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, cast

from ..config import UsageError
from ..engine.state import checkpoint as ckpt
from ..engine.sharded import checkpoint_parts as sharded_checkpoint
from ..engine.protocol import TrainingState
from ..events import EventKind
from .runlog import RunLog

if TYPE_CHECKING:
    from ..pool.engine_calls import EngineCalls, GenerationTask
    from ..pool.processes import Engine

RECORDS_TIMEOUT = 10.0  # seconds rank 0 has to send its last records after an error
STATE_TIMEOUT = 120.0  # seconds rank 0 has to send its committed state after an error


class FinalState(ABC):
    """The run's final state (see the module's docstring).

    Args: calls (EngineCalls), log (RunLog), checkpoint_dir, keep (checkpoints kept, as
    ``RunConfig.keep_checkpoints``).

    Attributes:
        state: the run's final training state (model, optimizer, progress, ...), None until
            it ended (or after an error whose rank 0 could not be read). A sharded run's
            has no ``"model"``: it stays in ``folder``.
        folder: a sharded run's checkpoint folder that holds its final model, read one tensor
            at a time when asked for (engine.sharded.checkpoint_parts's ``read_model``): it may be
            larger than the kernel's memory. stamp: its manifest's identity then (a later run
            in the same folder may prune or replace it).
    """

    def __init__(self, calls: EngineCalls, log: RunLog, checkpoint_dir: str, keep: int):
        self.calls, self.log, self.checkpoint_dir, self.keep = calls, log, checkpoint_dir, keep
        self.state: TrainingState | None = None
        self.folder: str | None = None
        self.stamp: tuple | None = None

    async def take(self, members: list[Engine]) -> TrainingState:
        """Keep the run's state at its last step as its final state; returns it. From the
        checkpoint of that step when one was written (a finished run always has one; so does
        a drain of every rank, which leaves no `members`), which spares rank 0 a serialized
        copy of the whole state in a reply; else from rank 0 (``members[0]``)."""
        self.state = await self._last_state(members)
        return self.state

    @abstractmethod
    async def _last_state(self, members: list[Engine]) -> TrainingState:
        """The state at the run's last step (:meth:`take`)."""

    @abstractmethod
    async def keep_after_error(self, task: GenerationTask, rank0: Engine) -> None:
        """An error ends the run; no committed step is lost. Takes rank 0's records the live
        stream had not delivered (the step whose evaluation failed among them), so the history
        keeps every committed step, and the last committed step's state as the run's final
        state: ``state_dict()``, ``export()`` and ``--resume`` work from it. Skipped when rank
        0 (`task`: its generation) is still out (hung) or does not answer."""

    async def _records_after_error(self, task: GenerationTask, rank0: Engine) -> bool:
        """Rank 0's records the run's log lacks, merged; False when rank 0 is out or could not
        be read (logged)."""
        if not task.future.done():
            return False
        try:
            records = await asyncio.wait_for(self.calls.history_since(
                rank0, self.log.complete_upto, pending=True), RECORDS_TIMEOUT)
            self.log.merge({"records": records}, complete=True)
        except Exception as e:  # noqa: BLE001 -- the error itself is what the run reports
            self.log.log(f"rank 0's last records or state could not be read: {e}")
            return False
        return True

    @abstractmethod
    async def write_checkpoint(self, state: TrainingState) -> None:
        """Write `state` unless its step has a checkpoint (off the owner loop: the disk may be
        slow); a failed write is an event, not an error."""

    @abstractmethod
    def listing(self) -> list[dict]:
        """The run's checkpoints in its folder, oldest first: file, path, step, bytes, time."""

    @abstractmethod
    def model_folder(self, name: str) -> str | None:
        """The checkpoint folder a run's model is read from one tensor at a time: a sharded
        run's final state's once it ended, else its newest (None: the state holds the model,
        or no checkpoint yet). Raises UsageError when run `name`'s final folder was pruned or
        replaced since it ended."""


class WholeFinalState(FinalState):
    """A replicated run's final state: whole, in the kernel."""

    async def _last_state(self, members: list[Engine]) -> TrainingState:
        written = self.log.last_event(EventKind.CHECKPOINT)  # this run's, not an older file's
        if written is not None and written["step"] == self.log.step:
            try:
                return await asyncio.get_running_loop().run_in_executor(
                    None, ckpt.load_checkpoint, written["path"])
            except (ckpt.CheckpointError, RuntimeError):  # pruned, unreadable; interpreter exit
                pass
        return await self.calls.training_state(members[0])

    async def keep_after_error(self, task: GenerationTask, rank0: Engine) -> None:
        """As FinalState's, rank 0's state (a failed step is undone on every rank: the state
        is the last committed step's), written as a checkpoint unless its step has one."""
        if not await self._records_after_error(task, rank0):
            return
        try:
            state = await asyncio.wait_for(self.calls.training_state(rank0), STATE_TIMEOUT)
        except Exception as e:  # noqa: BLE001 -- the error itself is what the run reports
            self.log.log(f"rank 0's last records or state could not be read: {e}")
            return
        self.state = state
        await self.write_checkpoint(state)

    async def write_checkpoint(self, state: TrainingState) -> None:
        step = state["progress"]["step"]
        if any(c["step"] == step for c in ckpt.list_checkpoints(self.checkpoint_dir)):
            return
        args = (self.checkpoint_dir, state, self.keep)
        try:
            try:
                record = await asyncio.get_running_loop().run_in_executor(
                    None, ckpt.write_checkpoint, *args)
            except RuntimeError:  # at interpreter exit the executor takes no work: write here
                record = ckpt.write_checkpoint(*args)
            self.log.event(EventKind.CHECKPOINT, step=step, path=record["path"],
                           bytes=record["bytes"])
        except ckpt.CheckpointError as e:
            self.log.event(EventKind.CHECKPOINT_FAILED, step=step, message=str(e))

    def listing(self) -> list[dict]:
        return ckpt.list_checkpoints(self.checkpoint_dir)

    def model_folder(self, name: str) -> str | None:
        return None  # the state holds the whole model


class ShardedFinalState(FinalState):
    """A sharded run's final state: its newest checkpoint folder, which its ranks wrote
    themselves (engine.sharded.checkpoint_parts); rank 0 holds its own rows only."""

    async def _last_state(self, members: list[Engine]) -> TrainingState:
        return await self._sharded_state()

    async def keep_after_error(self, task: GenerationTask, rank0: Engine) -> None:
        """As FinalState's, the newest checkpoint on disk, which needs no answer from rank 0
        (its records are taken when it answers; the checkpoint also when it does not)."""
        await self._records_after_error(task, rank0)
        try:
            self.state = await self._sharded_state()
        except Exception as e:  # noqa: BLE001 -- the error itself is what the run reports
            self.log.log(f"the sharded run's last checkpoint could not be read: {e}")

    async def _sharded_state(self) -> TrainingState:
        """A sharded run's final state: its newest checkpoint, whose folder becomes
        ``folder``; returns the rest of its state (read off the owner loop), with a warning
        when that is older than the run's last step (an error since)."""
        loop = asyncio.get_running_loop()
        found = await loop.run_in_executor(None, self._newest_sharded)
        if found is None:
            raise ckpt.CheckpointError("the sharded run wrote no checkpoint: its final state "
                                       "is in no single place")
        step, path = found
        if step != self.log.step:
            self.log.event(EventKind.WARNING, message=f"the final state is the checkpoint of step "
                           f"{step}: a sharded run's rows after it were not written")
        state = await loop.run_in_executor(None, sharded_checkpoint.read_state, path)
        self.folder, self.stamp = path, sharded_checkpoint.stamp(path)
        # a manifest written without the rest of the state: an empty one, as before
        return state if state is not None else cast(TrainingState, {})

    def _newest_sharded(self) -> tuple[int, str] | None:
        """(step, path) of the newest complete sharded checkpoint of this run's steps: the
        ranks write them beside training, so one committed after the engines' last report
        (an error at the step after it) is found on disk. Its step's loss must be the log's:
        a run that went back may have left folders of steps it trained again, which are the
        same state where the retrained step is (the same loss: every rank's, reduced), and
        another folder in the same place is of other training."""
        for listed in reversed(sharded_checkpoint.list_parts(self.checkpoint_dir)):
            mine = self.log.record(listed["step"])
            if not mine:
                continue
            try:
                state = sharded_checkpoint.read_state(listed["path"])
            except ckpt.CheckpointError:
                continue
            held = state["history"] if state is not None else []
            theirs = [r for r in held if r.get("step") == listed["step"]]
            loss = mine.get("loss")
            if loss is not None and theirs and theirs[-1].get("loss") == loss:
                return listed["step"], listed["path"]
        return None

    async def write_checkpoint(self, state: TrainingState) -> None:
        pass  # every rank wrote its part of each checkpoint itself

    def listing(self) -> list[dict]:
        return sharded_checkpoint.list_parts(self.checkpoint_dir)

    def model_folder(self, name: str) -> str | None:
        if self.state is None:
            return sharded_checkpoint.latest(self.checkpoint_dir)
        folder = self.folder
        if folder is not None and sharded_checkpoint.stamp(folder) != self.stamp:
            raise UsageError(
                f"run {name!r} ended with its model in {folder}, which a later run in the "
                "same checkpoint folder pruned or replaced since: its weights are no longer "
                "on disk. Export a sharded run before another one trains in its folder, or "
                "give each its own --checkpoint-dir")
        return folder
