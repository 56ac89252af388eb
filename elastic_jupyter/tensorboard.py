"""TensorBoard: a run's history and events as TensorBoard event files, written by the kernel.

The run log (runlog.RunLog) hands a :class:`TensorBoardLog` every record it merges and every
event it records, on the owner thread; ``torch.utils.tensorboard.SummaryWriter`` writes them
(its own thread does the file I/O). Every step is written once, in order: a record waits until
the records of all steps before it arrived (the live stream may miss one that the generation's
result delivers later).

A fault that rolls the run back to a checkpoint, and a resumed run, continue the same log from
the step they restart at. The steps already written after it are hidden by TensorBoard's own
mechanism for a restarted job: a writer opened with ``purge_step=s`` writes a session-start
event at ``s``, and TensorBoard's readers drop every event at step ``s`` or later written before
it. So TensorBoard shows each step once, with the values the run kept.

Tags: ``train/loss``, ``train/lr``, ``elastic/world_size``, ``elastic/samples_per_s``, the
cell's extra metrics under ``train/``, validation metrics (``val_*``) under ``val/``; resizes,
faults, checkpoints, warnings and the run's end as text under ``events``.
"""
from __future__ import annotations

import os

from .config import UsageError

TAGS = {"loss": "train/loss", "lr": "train/lr", "world_size": "elastic/world_size",
        "samples_per_s": "elastic/samples_per_s"}
NOT_SCALARS = ("step", "time", "epoch", "items")  # bookkeeping fields of a record
EVENT_KINDS = ("resize", "resized", "fault", "checkpoint", "checkpoint_failed", "drain",
               "slot", "warning", "error", "start", "finished", "stopped")
FLUSH_S = 2  # a live TensorBoard sees a step within about this long


def check_available() -> None:
    """Raises UsageError (with what to install) unless TensorBoard files can be written."""
    try:
        import torch.utils.tensorboard  # noqa: F401  (imports the tensorboard package)
    except ImportError as e:
        raise UsageError(
            f"--tensorboard needs the tensorboard package ({e}): pip install tensorboard, "
            "or run without --tensorboard") from None


class TensorBoardLog:
    """Writes records and events to TensorBoard event files in `folder` (created if missing).

    Args:
        folder: the log folder (``tensorboard --logdir`` takes it or a folder above it).
        after: the step the run starts after (a resumed run's checkpoint; 0 for a new run).
            What an earlier writer logged for later steps is hidden.
    """

    def __init__(self, folder: str, after: int = 0):
        self.folder = folder
        self._next = after + 1  # the next step to write
        self._pending: dict[int, dict] = {}  # records that wait for an earlier step
        self._writer = None  # opened at the first write, reopened after a rollback

    def roll_back(self, step: int) -> None:
        """A fault rolled the run back to `step`: the records after it are void. Steps written
        after it are hidden, and written again as the run redoes them."""
        self._pending = {s: r for s, r in self._pending.items() if s <= step}
        if step + 1 < self._next:
            self._close_writer()
            self._next = step + 1

    def add_records(self, records) -> None:
        """Write the records (dicts with ``step``, ``time``, numbers) not written yet."""
        for record in records:
            if record["step"] >= self._next:
                self._pending[record["step"]] = record
        while self._next in self._pending:
            self._write_record(self._pending.pop(self._next))
            self._next += 1

    def add_event(self, event: dict, text: str) -> None:
        """Write `event` (kind, step, time) as the text `text` under the ``events`` tag."""
        if event["kind"] in EVENT_KINDS:
            self._open().add_text("events", text, global_step=event["step"],
                                  walltime=event["time"])

    def close(self) -> None:
        """Flush and close the files (the run ended). A later write reopens them."""
        self._close_writer()

    def _write_record(self, record: dict) -> None:
        writer, step, walltime = self._open(), record["step"], record.get("time")
        for key, value in record.items():
            if key in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            tag = TAGS.get(key) or (f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}")
            writer.add_scalar(tag, value, global_step=step, walltime=walltime)

    def _open(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter
            os.makedirs(self.folder, exist_ok=True)
            # purge_step: TensorBoard hides what an earlier writer logged from this step on
            self._writer = SummaryWriter(self.folder, purge_step=self._next, flush_secs=FLUSH_S)
        return self._writer

    def _close_writer(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
