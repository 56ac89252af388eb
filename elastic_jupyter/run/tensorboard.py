"""TensorBoard: a run's history and events as TensorBoard event files, written by the kernel.

The run log (runlog.RunLog) hands a :class:`TensorBoardLog` every record it merges and every
event it records, on the owner thread; ``torch.utils.tensorboard.SummaryWriter`` writes them
(a thread of its own does the file I/O, behind a queue long enough that a slow disk does not
hold up the owner). Every step is written once, in order: a record waits until the records of
all steps before it arrived (the live stream may miss one that a later delivery fills in).

The log is opened once the run is set up, with the run's history so far (a resumed run's, from
its checkpoint), and starts over from step 1: a resumed run's log shows its whole history,
whether or not the earlier run logged to TensorBoard. A fault that rolls the run back to a
checkpoint goes on from the step restored. Steps written after the step a log starts from are
hidden by TensorBoard's own mechanism for a restarted job: a writer opened with
``purge_step=s`` writes a session-start event at ``s``, and TensorBoard's Python reader drops
every event at step ``s`` or later written before it (its Rust data server drops a tag's later
points when the tag's step goes back, which the rewritten steps' scalars do). So TensorBoard
shows each step once, with the values the run kept.

Tags: ``train/loss``, ``train/lr`` (with several param groups also ``train/lr_1``...),
``elastic/world_size``, ``elastic/samples_per_s``, the cell's extra metrics under ``train/``,
validation metrics (``val_*``) under ``val/``; resizes, faults, drains, checkpoints, warnings
and the run's start and end as text under ``events``.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Sequence

from ..config import UsageError
from ..events import Event
from .runlog import describe_event

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

TAGS = {"loss": "train/loss", "lr": "train/lr", "world_size": "elastic/world_size",
        "samples_per_s": "elastic/samples_per_s"}
NOT_SCALARS = ("step", "time", "epoch", "items")  # bookkeeping fields of a record
EVENT_KINDS = ("resize", "resized", "fault", "checkpoint", "checkpoint_failed", "drain",
               "slot", "warning", "error", "start", "finished", "stopped")
FLUSH_S = 2  # a live TensorBoard sees a step within about this long
QUEUE = 10_000  # events the writer's thread may lag behind before a write waits for it


def check_available() -> None:
    """Raises UsageError (with what to install) unless TensorBoard files can be written."""
    try:
        import torch.utils.tensorboard  # noqa: F401  (imports the tensorboard package)
    except ImportError as e:
        raise UsageError(
            f"--tensorboard needs the tensorboard package ({e}): pip install tensorboard, "
            "or run without --tensorboard") from None


def log_folder(setting: bool | str | None, checkpoint_dir: str, name: str) -> str | None:
    """The folder of run `name`'s TensorBoard log for ``RunConfig.tensorboard`` = `setting`:
    ``<checkpoint_dir>/tensorboard`` for True, ``<setting>/<name>`` for a folder, None when
    off. Raises UsageError (with what to install) when TensorBoard is missing."""
    if not setting:
        return None
    check_available()
    return os.path.abspath(os.path.join(checkpoint_dir, "tensorboard") if setting is True
                           else os.path.join(setting, name))


class TensorBoardLog:
    """Writes records and events to TensorBoard event files in `folder` (created if missing).

    Args:
        folder: the log folder (``tensorboard --logdir`` takes it or a folder above it).
        history: the run's records so far (oldest first): written at once.
        events: the run's events so far: written at once.
    """

    def __init__(self, folder: str, history: Sequence[dict] = (), events: Sequence[Event] = ()):
        self.folder = folder
        self._next = history[0]["step"] if history else 1  # the next step to write
        self._pending: dict[int, dict] = {}  # records that wait for an earlier step
        # opened at the first write, reopened after a rollback
        self._writer: SummaryWriter | None = None
        self._closed = False
        self.add_records(history)
        for event in events:
            self.add_event(event)

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

    def add_event(self, event: Event) -> None:
        """Write `event` (kind, step, time, fields) as a line of text under ``events``."""
        if event["kind"] in EVENT_KINDS and (writer := self._open()) is not None:
            writer.add_text("events", describe_event(event) or event["kind"],
                            global_step=event["step"], walltime=event["time"])

    def close(self) -> None:
        """Flush and close the files (the run ended); later writes are dropped (run.log has
        every event)."""
        self._close_writer()
        self._closed = True

    def _write_record(self, record: dict) -> None:
        if (writer := self._open()) is None:
            return
        step, walltime = record["step"], record.get("time")
        for key, value in record.items():
            if key in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            tag = TAGS.get(key) or (f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}")
            writer.add_scalar(tag, value, global_step=step, walltime=walltime)

    def _open(self):
        if self._writer is None and not self._closed:
            from torch.utils.tensorboard import SummaryWriter
            os.makedirs(self.folder, exist_ok=True)
            # purge_step: TensorBoard hides what an earlier writer logged from this step on
            self._writer = SummaryWriter(self.folder, purge_step=self._next, flush_secs=FLUSH_S,
                                         max_queue=QUEUE)
        return self._writer

    def _close_writer(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
