"""A rank's per-step records: it holds only the newest; the checkpoint folder keeps the rest.

Every rank appends the record of each step it commits. Held whole, a run of millions of steps
would keep millions of records on every engine, copy them all into every checkpoint and send
them all to every newcomer. A rank holds only the records someone may still ask it for
(:meth:`History.forget_unneeded` works out the oldest step still wanted, from what
``Worker.forget_history`` gathers of each owner's needs):

- those the kernel has not acknowledged (its run log's complete step, written in the
  rendezvous store): a generation's result and a recovery's ``history_since`` fill its gaps;
- those not yet in the checkpoint folder's history file: any rank may become rank 0 and write
  the next checkpoint;
- with a ReduceLROnPlateau stepped by the epoch's mean loss, the current epoch's.

The kernel's run log holds the whole history (``run.history``). In the checkpoint folder,
``history.jsonl`` holds it too, one JSON record per line: each checkpoint write appends the
records its state holds that the file lacks, before the checkpoint's own file lands. A step
written twice (redone after a rollback to an older checkpoint) counts by its last line, and a
checkpoint of step S reads the lines up to S (:func:`whole_history`). On disk this is about
200 bytes a step; the file is never pruned (it is the run's history).
"""
from __future__ import annotations

import bisect
import json
import os
from typing import Callable

from ..protocol import TrainingState

HISTORY_FILE = "history.jsonl"
_TAIL_BYTES = 1 << 16  # read from the file's end to find its last line


class History:
    """The newest records of one rank, oldest first, one per step (consecutive steps)."""

    def __init__(self, records=()):
        self.records: list[dict] = list(records)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self):
        return iter(self.records)

    def append(self, record: dict) -> None:
        self.records.append(record)

    def since(self, step: int) -> list[dict]:
        """The held records after `step`, oldest first."""
        return self.records[bisect.bisect_right(self.records, step, key=_step):]

    def forget_upto(self, step: int) -> None:
        """Drop the records of `step` and before (no one will ask for them again)."""
        del self.records[:bisect.bisect_right(self.records, step, key=_step)]

    def forget_unneeded(self, step: int, acknowledged: int | None, needed_after: list[int | None],
                        also: Callable[[int], int] = lambda keep_after: keep_after) -> None:
        """Drop the records no one will ask this rank for, at `step` (the newest committed):
        keep those after the kernel's `acknowledged` step (None when no kernel reads the run:
        whoever drives it reads the engine's whole history, so all are kept) and after each of
        `needed_after` (the steps after which an owner still needs the records: the checkpoint
        folder's history file, the current epoch's for ReduceLROnPlateau; None: needs none);
        `also` lowers the result further (a sharded rank's part writer)."""
        keep_after = 0 if acknowledged is None else min(step, acknowledged)
        for needed in needed_after:
            if needed is not None:
                keep_after = min(keep_after, needed)
        self.forget_upto(also(keep_after))

    def epoch_start(self, epoch: int) -> int | None:
        """The first held step of `epoch`, or None when no held record is of it."""
        i = bisect.bisect_left(self.records, epoch, key=lambda r: r["epoch"])
        return self.records[i]["step"] if i < len(self.records) and \
            self.records[i]["epoch"] == epoch else None


def _step(record: dict) -> int:
    return record["step"]


# ---------------------------------------------------------------- the checkpoint folder's file

def append(folder: str, records: list[dict]) -> None:
    """Append to `folder`'s history file the `records` (consecutive steps) it lacks: those
    after its last line, when that line is the same as ours for its step; otherwise all of
    them (the file's newest lines are of steps a rollback redid: ours must count, being
    later). Flushed and fsynced before it returns.

    Raises OSError (disk full, permission).
    """
    if not records:
        return
    path = os.path.join(folder, HISTORY_FILE)
    last, torn = _last_record(path)
    first = records[0]["step"]
    if last is not None and first <= last["step"] < records[-1]["step"] \
            and _as_json(records[last["step"] - first]) == last:
        records = records[last["step"] - first + 1:]
    # a writer killed mid-append left a line without its newline: ours start on the next
    text = "\n" * torn + "".join(json.dumps(r, default=_plain_value) + "\n" for r in records)
    with open(path, "a") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _last_record(path: str) -> tuple[dict | None, bool]:
    """(the file's last complete line as a record, or None; whether the file ends in a torn
    line, one without its newline)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - _TAIL_BYTES))
            lines = f.read().split(b"\n")
    except OSError:
        return None, False
    torn = lines[-1] != b""
    for line in reversed(lines[:-1]):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            return record, torn
    return None, torn


def _as_json(record: dict) -> dict:
    return json.loads(json.dumps(record, default=_plain_value))


def _plain_value(value):
    """JSON for what a record may hold beyond numbers and strings (a tensor, a numpy value)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def whole_history(folder: str, state: TrainingState) -> list[dict]:
    """The whole history of the checkpoint `state` read from `folder`: the file's records up
    to the checkpoint's step (a step's last line wins), then the state's own records over
    them. A torn last line (a writer killed mid-append) is skipped. A checkpoint from before
    the file existed holds its whole history itself; so does one whose file is gone."""
    upto = state["progress"]["step"]
    by_step: dict[int, dict] = {}
    try:
        with open(os.path.join(folder, HISTORY_FILE)) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and isinstance(record.get("step"), int) \
                        and record["step"] <= upto:
                    by_step[record["step"]] = record
    except OSError:
        pass
    for record in state.get("history") or ():
        by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]
