"""The run's final state, and the checkpoints the owner writes itself.

Once a run ends its state is kept in the kernel (``run.state_dict()``, ``export()``): the
finished or stopped run's last step, or after an error the last committed step's. The owner
writes it as a checkpoint when no rank did (a stop, an error, every rank drained), so
``--resume`` works from it. The only writer of the final state.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, cast

from ..engine import checkpoint as ckpt
from ..engine import sharded_checkpoint
from ..engine.protocol import TrainingState
from ..events import EventKind
from .runlog import RunLog

if TYPE_CHECKING:
    from ..pool.engine_calls import EngineCalls, GenerationTask
    from ..pool.processes import Engine

RECORDS_TIMEOUT = 10.0  # seconds rank 0 has to send its last records after an error
STATE_TIMEOUT = 120.0  # seconds rank 0 has to send its committed state after an error


class FinalState:
    """Args: calls (EngineCalls), log (RunLog), checkpoint_dir, keep (checkpoints kept, as
    ``RunConfig.keep_checkpoints``).

    Attributes:
        state: the run's final training state (model, optimizer, progress, ...), None until
            it ended (or after an error whose rank 0 could not be read). A sharded run's
            has no ``"model"``: it stays in ``folder``.
        folder: a sharded run's checkpoint folder that holds its final model, read one tensor
            at a time when asked for (engine.sharded_checkpoint's ``read_model``): it may be
            larger than the kernel's memory. stamp: its manifest's identity then (a later run
            in the same folder may prune or replace it).
    """

    def __init__(self, calls: EngineCalls, log: RunLog, checkpoint_dir: str, keep: int,
                 sharded: bool = False):
        self.calls, self.log, self.checkpoint_dir, self.keep = calls, log, checkpoint_dir, keep
        # a sharded run's ranks write their parts themselves (engine.sharded_checkpoint), and
        # its final state comes from them: rank 0 holds its rows only
        self.sharded = sharded
        self.state: TrainingState | None = None
        self.folder: str | None = None
        self.stamp: tuple | None = None

    async def take(self, members: list[Engine]) -> TrainingState:
        """Keep the run's state at its last step as its final state; returns it. From the
        checkpoint of that step when rank 0 wrote one (a finished run always does; so did a
        drain of every rank, which leaves no `members`), which spares rank 0 a serialized copy
        of the whole state in a reply; else from rank 0 (``members[0]``)."""
        self.state = await self._last_state(members)
        return self.state

    async def _last_state(self, members: list[Engine]) -> TrainingState:
        written = self.log.last_event(EventKind.CHECKPOINT)  # this run's, not an older file's
        if self.sharded:
            return await self._sharded_state()
        if written is not None and written["step"] == self.log.step:
            try:
                return await asyncio.get_running_loop().run_in_executor(
                    None, ckpt.load_checkpoint, written["path"])
            except (ckpt.CheckpointError, RuntimeError):  # pruned, unreadable; interpreter exit
                pass
        return await self.calls.training_state(members[0])

    async def keep_after_error(self, task: GenerationTask, rank0: Engine) -> None:
        """An error ends the run; no committed step is lost. Takes rank 0's records the live
        stream had not delivered (the step whose evaluation failed among them), so the history
        keeps every committed step, and rank 0's state (a failed step is undone on every rank:
        the state is the last committed step's) as the run's final state, written as a
        checkpoint unless its step has one: ``state_dict()``, ``export()`` and ``--resume``
        work from it. Skipped when rank 0 (`task`: its generation) is still out (hung) or does
        not answer; a sharded run's state is then still its newest checkpoint on disk."""
        if not task.future.done():
            if self.sharded:  # the parts on disk need no answer from rank 0
                await self._sharded_after_error()
            return
        try:
            records = await asyncio.wait_for(self.calls.history_since(
                rank0, self.log.complete_upto, pending=True), RECORDS_TIMEOUT)
            self.log.merge({"records": records}, complete=True)
            if self.sharded:  # rank 0 holds its own rows only
                await self._sharded_after_error()
                return
            state = await asyncio.wait_for(self.calls.training_state(rank0), STATE_TIMEOUT)
        except Exception as e:  # noqa: BLE001 -- the error itself is what the run reports
            self.log.log(f"rank 0's last records or state could not be read: {e}")
            return
        self.state = state
        await self.write_checkpoint(state)

    async def _sharded_after_error(self) -> None:
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
        """Write `state` unless its step has a checkpoint (off the owner loop: the disk may be
        slow); a failed write is an event, not an error."""
        step = state["progress"]["step"]
        if self.sharded or any(c["step"] == step
                               for c in ckpt.list_checkpoints(self.checkpoint_dir)):
            return
        args = (self.checkpoint_dir, state, self.keep)
        try:
            try:
                record = await asyncio.get_running_loop().run_in_executor(
                    None, ckpt.write_checkpoint, *args)
            except RuntimeError:  # at interpreter exit the executor takes no work: write here
                record = ckpt.write_checkpoint(*args)
            self.log.event(EventKind.CHECKPOINT, step=step, path=record["path"], bytes=record["bytes"])
        except ckpt.CheckpointError as e:
            self.log.event(EventKind.CHECKPOINT_FAILED, step=step, message=str(e))
