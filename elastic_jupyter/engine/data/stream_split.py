"""Streaming data: an iterable dataset read as a fixed number of streams, each a shard of it.

A map-style dataset is read in the order of a permutation (engine.data.batching); an iterable one
(shards of token files, ``datasets`` streaming, WebDataset) can only be read forwards. A run
splits it once into S streams, stream s being ``dataset.shard(num_shards=S, index=s)`` (the
protocol of ``datasets.IterableDataset.shard``), with S fixed at the run's start (the pool's
``--max``, at most the dataset's ``num_shards``) and kept in its state. Once the epoch's first
t samples are read, stream s has given ``(t + S - 1 - s) // S`` of them (the streams' counts
differ by at most one, so shards of equal size end together); a step takes from each stream
what that count grows by, stream after stream. So the step's j-th sample is a fixed stream's
fixed offset whatever the world size, as EasyScale's virtual workers fix a step's work (Li et
al., SC'23). With the default cut (one micro-batch per slot of ``--max``) and a global batch
that S divides, micro-batch k is stream k's share, so a rank reads only its streams.

:class:`Streams` numbers the samples of an epoch as a map-style dataset's are (its length is
the declared one, or ENDLESS), step by step in that stream-major order, so the batch plan, the
cut, the passes and the weighting treat a stream as a map-style dataset read in order
(``BatchPlan(shuffle=False)``); only reading differs (engine.data.stream_pipeline.StreamPipeline).

Where a stream stands follows from the run's (epoch, position). What the run keeps besides, in
``Progress.streams``, is where reading can resume cheaply: a stream with ``state_dict()`` and
``load_state_dict()`` (``datasets.IterableDataset``) resumes from its newest state that a step
committed, then skips to its position, once a trial at setup showed that it resumes exactly
(:meth:`Streams.check`: a shuffle buffer, which ``datasets`` does not save, fails it); any
other stream is read again from its epoch's start and skips the samples before its position
(the ``streams`` event says how many). No elastic trainer we know keeps exact stream positions
across a change of world size: torchdata's StatefulDataLoader keeps one state per rank,
torchtitan refuses to reshard its dataloader.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import bisect
import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch

from ..state.checkpoint import unloadable
from .digest import items_digest
from .randomness import caller_generators_kept, seed_sample

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
    except (TypeError, NotImplementedError):
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
        seed: the run's seed: every sample read, or skipped, is read under the generators
            seeded by (seed, epoch, its index) (engine.data.randomness.seed_sample), so a random
            transform inside a stream gives a sample alike whoever reads it, from wherever.
    ``len()`` is the epoch's length (ENDLESS without one). ``streams[i]`` reads sample i of
    epoch 0 from its stream, opened anew unless it stands before it: for the setup's trials
    and the first samples, never for training (engine.data.stream_pipeline reads those).
    ``resumable`` is set by :meth:`check`.
    """

    def __init__(self, source: Any, count: int, length: int | None, global_batch: int,
                 drop_last: bool = False, seed: int = 0):
        self.source, self.length, self.global_batch = source, length, global_batch
        self.drop_last, self.count, self.seed = drop_last, count, seed
        self.resumable, self.resume_note = False, "not checked"
        self._opened: dict[int, StreamReader] = {}  # streams[i]'s readers
        # the newest steps' bounds, by (stream count, position): a resume may set another
        # count, and a stream read again asks of the steps before the one read
        self._step_bounds: dict[tuple[int, int], list[int]] = {}

    def __len__(self) -> int:
        return self.length if self.length is not None else ENDLESS

    def __getitem__(self, index: int):
        stream, offset = self.locate(index)
        reader = self._opened.get(stream)
        with caller_generators_kept(), outside_loader():
            if reader is None or reader.epoch != 0 or reader.at > offset:
                reader = self._opened[stream] = StreamReader(self, stream, 0, offset, None)
            return reader.read(offset)

    def close(self) -> None:
        """Forget the readers ``streams[i]`` opened (training reads with its own)."""
        self._opened = {}

    def head(self, count: int) -> list:
        """The dataset's first `count` samples in its own order (its fingerprint's)."""
        return _take(self.source, count)

    def check(self) -> None:
        """Read stream 0 at setup: twice from its start (the same samples, else ValueError:
        re-reading could not find a position again), and where it has ``state_dict()`` and
        ``load_state_dict()``, once more from a state taken after its first sample (the same
        next sample, and a state a checkpoint can keep: else it is read again instead, and
        ``resume_note`` says why). Sets ``resumable``."""
        first = [items_digest(self._trial(self.open(0, 0, None), 0, 3)) for _ in range(2)]
        if first[0] != first[1]:
            raise ValueError(
                "dataset.shard(...) gives other samples each time it is read (a shuffle without "
                "a seed?): a stream must read alike each time, so a run can find a position "
                "again after a resize or fault; give its shuffle a seed")
        part, note = self.open(0, 0, None), ""
        if not all(callable(getattr(part, name, None))
                   for name in ("state_dict", "load_state_dict")):
            note = "it has no state_dict()/load_state_dict()"
        else:
            with caller_generators_kept(), outside_loader():
                seed_sample(self.seed, 0, self.index(0, 0))  # as StreamReader starts it
                samples = iter(part)
            state = copy.deepcopy(part.state_dict()) if self._trial(samples, 0, 1) else None
            expected, why = self._trial(samples, 1, 1), unloadable({"state": state})
            if not expected:
                note = "its stream 0 is too short to try resuming"
            elif _shuffle_buffer(part):
                note = "its shuffle buffer is not part of its state_dict()"
            elif why is not None:
                note = f"its state_dict() is not plain data: {why}"
            elif (items_digest(self._trial(self.open(0, 0, state), 1, 1))
                  != items_digest(expected)):
                note = ("its load_state_dict() does not resume where state_dict() was taken "
                        "(a shuffle buffer is not saved)")
        self.resumable, self.resume_note = not note, note

    def _trial(self, samples, offset: int, count: int) -> list:
        """The next `count` samples of stream 0 from `samples`, which stands at `offset`, each
        read under its seeds as training reads it (a random transform reads alike)."""
        return _take(samples, count,
                     lambda j: seed_sample(self.seed, 0, self.index(0, offset + j)))

    def locate(self, index: int) -> tuple[int, int]:
        """(stream, offset in the stream's epoch) of the epoch's sample `index`."""
        start = index - index % self.global_batch
        bounds = self._bounds(start)
        stream = bisect.bisect_right(bounds, index - start) - 1
        return stream, self.offset(stream, start) + index - start - bounds[stream]

    def index(self, stream: int, offset: int) -> int:
        """The epoch's sample index of `stream`'s sample at `offset` (:meth:`locate`'s inverse).

        Its step starts at the last multiple t of B with ``offset(stream, t) <= offset``, that
        is ``t <= offset * S + stream``."""
        start = offset * self.count + stream
        start -= start % self.global_batch
        if self.length is not None:  # not past the epoch's last step
            start = min(start, (self.length - 1) // self.global_batch * self.global_batch)
        return start + self._bounds(start)[stream] + offset - self.offset(stream, start)

    def offset(self, stream: int, position: int) -> int:
        """Where `stream` stands once the epoch's first `position` samples are read."""
        return (position + self.count - 1 - stream) // self.count

    def step_end(self, stream: int, position: int) -> int:
        """Where `stream` stands after the step at `position`."""
        return self.offset(stream, position + min(self.global_batch, len(self) - position))

    def _bounds(self, position: int) -> list[int]:
        """Where each stream's share starts in the step at `position` (and where the last
        ends); the newest steps' are kept (every sample of a step asks)."""
        bounds = self._step_bounds.get((self.count, position))
        if bounds is None:
            bounds = [0]
            for stream in range(self.count):
                bounds.append(bounds[-1] + self.step_end(stream, position)
                              - self.offset(stream, position))
            if len(self._step_bounds) >= 8:
                self._step_bounds.clear()
            self._step_bounds[(self.count, position)] = bounds
        return bounds

    def needs(self, stream: int) -> int:
        """The samples `stream` gives in one epoch of the declared length."""
        n = len(self)
        return self.offset(stream, n - n % self.global_batch if self.drop_last else n)

    def open(self, stream: int, epoch: int, state: dict | None):
        """Stream `stream` for `epoch` (``set_epoch`` where it has one: ``datasets`` then
        shuffles its files and buffer anew), resumed from `state` where given."""
        with outside_loader():
            part = self.source.shard(num_shards=self.count, index=stream)
            if callable(getattr(part, "set_epoch", None)):
                part.set_epoch(epoch)
            if state is not None:
                part.load_state_dict(copy.deepcopy(state))
        return part


def _shuffle_buffer(part) -> bool:
    """Whether `part` is a ``datasets`` stream with a shuffle buffer: its state leaves the
    buffer out (datasets warns so when it loads one), and a trial of a few samples cannot tell
    while the buffer's first filling is still read out exactly."""
    layer = getattr(part, "_ex_iterable", None)  # datasets' chain of example iterables
    while layer is not None:
        if type(layer).__name__ == "BufferShuffledExamplesIterable":
            return True
        layer = getattr(layer, "ex_iterable", None)
    return False


def _take(samples, count: int, before: Callable[[int], None] | None = None) -> list:
    """The next `count` samples of `samples` (a stream: its first; fewer where it ends), with
    ``before(j)`` run before the j-th is read (and before ``iter()``, as ``before(0)``); the
    caller's generators are kept."""
    out: list = []
    with caller_generators_kept(), outside_loader():
        if before is not None:
            before(0)
        samples = iter(samples)
        for j in range(count):
            if before is not None:
                before(j)
            try:
                out.append(next(samples))
            except StopIteration:
                break
    return out


class StreamReader:
    """One stream of one epoch, read forwards from `offset`: from `known`, the newest committed
    state of that stream (``{"epoch", "offset", "state"}``), where it is of this epoch and not
    past `offset` and the streams resume (``Streams.resumable``), else from the epoch's start
    (reading again the samples before). Made and read inside :func:`outside_loader` and
    engine.data.randomness.caller_generators_kept (once per pass: a context per sample would cost a
    tenth of the reading)."""

    def __init__(self, streams: Streams, stream: int, epoch: int, offset: int,
                 known: dict | None):
        self.streams, self.stream, self.epoch = streams, stream, epoch
        usable = (known is not None and known["epoch"] == epoch and known["offset"] <= offset
                  and streams.resumable)
        if not usable or known is None:
            known = {"offset": 0, "state": None}
        self.part = streams.open(stream, epoch, known["state"])
        self.at = known["offset"]
        # a stream that draws as it starts (a shuffle of its files by torch's generator)
        # draws under its first sample's seeds
        seed_sample(streams.seed, epoch, streams.index(stream, self.at))
        self._samples = iter(self.part)
        self._ahead: tuple | None = None  # (the sample at `at`,), read ahead by prime()
        self._skip_to(offset)

    def read(self, offset: int):
        """The stream's sample at `offset` (not before where it stands); raises StreamEnded."""
        assert offset >= self.at, (offset, self.at)
        self._skip_to(offset)
        return self._next()

    def prime(self) -> None:
        """Read the sample it stands at now, kept for the next :meth:`read`: a stream resumed
        from a state may catch up in its first read (``datasets`` reads its file again up to
        the saved example), which then happens here. Raises StreamEnded."""
        if self._ahead is None:
            self._ahead = (self._pull(),)

    def state(self) -> dict | None:
        """Where it stands, as the run keeps it (None for a stream that does not resume)."""
        if not self.streams.resumable:
            return None
        # a sample read ahead is past where it stands: the stream's own state is one further
        return {"epoch": self.epoch, "offset": self.at + (self._ahead is not None),
                "state": copy.deepcopy(self.part.state_dict())}

    def _skip_to(self, offset: int) -> None:
        while self.at < offset:
            self._next()

    def _next(self):
        if self._ahead is not None:
            (sample,), self._ahead = self._ahead, None
        else:
            sample = self._pull()
        self.at += 1
        return sample

    def _pull(self):
        """The stream's next sample, the one at `at`."""
        # each sample under its own seeds, skipped or not: a stream's random draws (a
        # transform, a shuffle drawn at its start) are the same whoever reads it from where
        s = self.streams
        seed_sample(s.seed, self.epoch, s.index(self.stream, self.at))
        try:
            return next(self._samples)
        except StopIteration:
            raise StreamEnded(self._ended()) from None

    def _ended(self) -> str:
        s, streams = self.stream, self.streams
        where = (f"stream {s} (dataset.shard(num_shards={streams.count}, index={s})) ended "
                 f"after {self.at} samples in epoch {self.epoch}")
        if streams.length is None:
            return (f"{where}, before the samples the run's --steps need: lower --steps, or "
                    f"declare dataset_length = the samples of one epoch in the cell (each "
                    f"epoch then reads every stream again)")
        return (f"{where}, but the declared length {streams.length} takes "
                f"{streams.needs(s)} samples from it each epoch (the {streams.count} streams "
                "give a step's samples in turn, their counts differing by at most one): give "
                f"the dataset {streams.count} shards (files) of equal size, or declare a "
                "smaller dataset_length")
