"""Streaming data: an iterable dataset read as a fixed number of streams, each a shard of it.

A map-style dataset is read in the order of a permutation (engine.batching); an iterable one
(shards of token files, ``datasets`` streaming, WebDataset) can only be read forwards. A run
splits it once into S streams, stream s being ``dataset.shard(num_shards=S, index=s)`` (the
protocol of ``datasets.IterableDataset.shard``), with S fixed at the run's start (the pool's
``--max``, at most the dataset's ``num_shards``) and kept in its state. A step of b samples
takes from each stream s its next ``bounds[s + 1] - bounds[s]`` samples (``bounds =
micro_batch_bounds(b, S)``), stream after stream: the step's j-th sample is a fixed stream's
fixed offset whatever the world size, as EasyScale's virtual workers fix a step's work
(Li et al., SC'23). With the default cut (one micro-batch per slot of ``--max``) micro-batch k
of a full step is stream k's share, so a rank reads only the streams of its micro-batches.

:class:`Streams` numbers the samples of an epoch as a map-style dataset's are (its length is
the declared one, or ENDLESS), step by step in that stream-major order, so the batch plan, the
cut, the passes and the weighting treat a stream as a map-style dataset read in order
(``BatchPlan(shuffle=False)``); only reading differs (engine.loader.StreamPipeline).

Where a stream stands follows from the run's (epoch, position). What the run keeps besides, in
``Progress.streams``, is where reading can resume cheaply: a stream with ``state_dict()`` and
``load_state_dict()`` (``datasets.IterableDataset``, torchdata's nodes) resumes from its newest
state that a step committed, then skips to its position; any other stream is read again from
its epoch's start and skips the samples before its position (the ``streams`` event says how
many). No elastic trainer we know keeps exact stream positions across a change of world size:
torchdata's StatefulDataLoader keeps one state per rank, torchtitan refuses to reshard its
dataloader.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import bisect
import contextlib
from typing import Any

import torch

from .batching import micro_batch_bounds

ENDLESS = 2**62  # the epoch length of a stream without a declared one: it never ends


class StreamEnded(ValueError):
    """A stream ended before the sample the run needs from it."""


def is_iterable_dataset(dataset: Any) -> bool:
    """Whether `dataset` can only be read forwards: a torch ``IterableDataset`` (a
    ``datasets.IterableDataset`` is one), or an object with ``__iter__`` and no
    ``__getitem__``."""
    return isinstance(dataset, torch.utils.data.IterableDataset) or (
        hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__"))


def declared_length(dataset: Any, namespace: dict) -> int | None:
    """The samples of one epoch: ``len(dataset)`` where it has one, else the cell's
    ``dataset_length``, else None (an endless stream)."""
    try:
        return len(dataset)
    except TypeError:
        return namespace.get("dataset_length")


@contextlib.contextmanager
def outside_loader():
    """Hide that this is a DataLoader process while a stream reads: a
    ``datasets.IterableDataset`` (and any iterable written by torch's pattern) splits itself
    across a DataLoader's processes, but each stream here is read whole by one of them."""
    # pylint: disable=protected-access
    worker = torch.utils.data._utils.worker  # torch keeps the process's worker info only there
    saved, worker._worker_info = worker._worker_info, None
    try:
        yield
    finally:
        worker._worker_info = saved


class Streams:
    """The cell's iterable dataset as `count` streams, read as a map-style dataset's epoch.

    Args:
        source: the cell's dataset; ``source.shard(num_shards, index)`` gives a stream.
        count: S, the streams (fixed for the run: ``Progress.streams["count"]``).
        length: the samples of one epoch (declared), or None: endless.
        global_batch: B, the samples of a step.
        drop_last: an epoch's short last step is left out (``--drop-last``).
    ``len()`` is the epoch's length (ENDLESS without one). ``streams[i]`` reads sample i of
    epoch 0 from its stream, opened anew unless it stands before it: for the setup's trials
    and the first samples, never for training (engine.loader.StreamPipeline reads those).
    """

    def __init__(self, source: Any, count: int, length: int | None, global_batch: int,
                 drop_last: bool = False):
        self.source, self.length, self.global_batch = source, length, global_batch
        self.drop_last = drop_last
        self.count = count
        self._opened: dict[int, StreamReader] = {}  # streams[i]'s readers

    @property
    def count(self) -> int:
        return self._count

    @count.setter
    def count(self, count: int) -> None:
        self._count = count
        self._full = micro_batch_bounds(self.global_batch, count)  # a full step's shares
        self._opened = {}

    @property
    def resumable(self) -> bool:
        """Whether a stream resumes from a state (``state_dict``/``load_state_dict``)."""
        return all(callable(getattr(self.source, name, None))
                   for name in ("state_dict", "load_state_dict"))

    def __len__(self) -> int:
        return self.length if self.length is not None else ENDLESS

    def __getitem__(self, index: int):
        stream, offset = self.locate(index)
        reader = self._opened.get(stream)
        if reader is None or reader.epoch != 0 or reader.at > offset:
            reader = self._opened[stream] = StreamReader(self, stream, 0, offset, None)
        return reader.read(offset)

    def head(self, count: int) -> list:
        """The dataset's first `count` samples in its own order (its fingerprint's)."""
        out: list = []
        with outside_loader():
            for sample in self.source:
                if len(out) == count:
                    break
                out.append(sample)
        return out

    def locate(self, index: int) -> tuple[int, int]:
        """(stream, offset in the stream's epoch) of the epoch's sample `index`."""
        B = self.global_batch
        step, within = divmod(index, B)
        bounds = self._bounds(step)
        stream = bisect.bisect_right(bounds, within) - 1
        return stream, self.offset(stream, step * B) + within - bounds[stream]

    def offset(self, stream: int, position: int) -> int:
        """Where `stream` stands once the epoch's first `position` samples (whole steps of
        B) are read."""
        full = self._full
        return position // self.global_batch * (full[stream + 1] - full[stream])

    def step_end(self, stream: int, position: int) -> int:
        """Where `stream` stands after the step at `position`."""
        bounds = self._bounds(position // self.global_batch)
        return self.offset(stream, position) + bounds[stream + 1] - bounds[stream]

    def _bounds(self, step: int) -> list[int]:
        n, B = len(self), self.global_batch
        size = min(B, n - step * B)
        return self._full if size == B else micro_batch_bounds(size, self.count)

    def needs(self, stream: int) -> int:
        """The samples `stream` gives in one epoch of the declared length."""
        n, B = len(self), self.global_batch
        last = [0] * (self.count + 1) if self.drop_last or not n % B else \
            micro_batch_bounds(n % B, self.count)
        return self.offset(stream, n - n % B) + last[stream + 1] - last[stream]

    def open(self, stream: int, epoch: int, state: dict | None):
        """Stream `stream` for `epoch` (``set_epoch`` where it has one: a new shuffle),
        resumed from `state` where given."""
        part = self.source.shard(num_shards=self.count, index=stream)
        if callable(getattr(part, "set_epoch", None)):
            part.set_epoch(epoch)
        if state is not None:
            part.load_state_dict(state)
        return part


class StreamReader:
    """One stream of one epoch, read forwards from `offset`: from `known`, the newest committed
    state of that stream (``{"epoch", "offset", "state"}``), where it is of this epoch and not
    past `offset`, else from the epoch's start (reading again the samples before)."""

    def __init__(self, streams: Streams, stream: int, epoch: int, offset: int,
                 known: dict | None):
        self.streams, self.stream, self.epoch = streams, stream, epoch
        usable = (known is not None and known["epoch"] == epoch and known["offset"] <= offset
                  and streams.resumable)
        if not usable or known is None:
            known = {"offset": 0, "state": None}
        self.part = streams.open(stream, epoch, known["state"])
        self.at = known["offset"]
        self._samples = iter(self.part)
        self._skip_to(offset)

    def read(self, offset: int):
        """The stream's sample at `offset` (not before where it stands); raises StreamEnded."""
        self._skip_to(offset)
        return self._next()

    def state(self) -> dict | None:
        """Where it stands, as the run keeps it (None for a stream without a state)."""
        if not self.streams.resumable:
            return None
        return {"epoch": self.epoch, "offset": self.at, "state": self.part.state_dict()}

    def _skip_to(self, offset: int) -> None:
        while self.at < offset:
            self._next()

    def _next(self):
        with outside_loader():
            try:
                sample = next(self._samples)
            except StopIteration:
                raise StreamEnded(self._ended()) from None
        self.at += 1
        return sample

    def _ended(self) -> str:
        s, streams = self.stream, self.streams
        where = (f"stream {s} (dataset.shard(num_shards={streams.count}, index={s})) ended "
                 f"after {self.at} samples in epoch {self.epoch}")
        if streams.length is None:
            return (f"{where}, before the samples the run's --steps need: lower --steps, or "
                    f"declare dataset_length = the samples of one epoch in the cell (each "
                    f"epoch then reads every stream again)")
        return (f"{where}, but the declared length {streams.length} takes "
                f"{streams.needs(s)} samples from it each epoch (a step of "
                f"{streams.global_batch} samples takes its part from each of the "
                f"{streams.count} streams): give shards of equal size, or declare a smaller "
                "dataset_length")
