"""A rank's input pipeline over streams (engine.data.stream_split): its passes' samples, read
forwards.

The batch plan numbers a stream's samples as a map-style dataset's in order, so a rank knows
all its passes of a generation as it does for a map-style dataset (engine.data.map_pipeline); here
each sample is its stream's next. With ``--workers N`` a torch DataLoader runs N processes, each
reading the rank's streams s with ``s % N`` equal to its id, ahead of training (``prefetch_factor``
items each); every process yields one item per pass (its samples of that pass, maybe none), so
the DataLoader's round robin hands the items back pass by pass. A process that read a whole pass
collates it with the cell's ``collate_fn`` (so a batch, not each sample, crosses to the training
process); a pass read by several is put in order and collated here. With 0 the training process
reads them when the pass asks for its batch.

Before each step's samples, each reading process stands the streams it has not read in the
step's epoch where the step reads them (a marker, POSITIONED, says it did), which reads a
stream without a usable state again from its epoch's start. That may take minutes on some
ranks only, so where it happens (a generation's start, and a step in which a rank first reads a
stream mid-epoch: :meth:`StreamPipeline.opens`) the ranks do it before the step's collectives
(:meth:`StreamPipeline.position`) and wait for each other while they live
(engine.group.work_barrier), not for the collective timeout.

Each sample, read or skipped, is read under torch's CPU generator, Python's ``random`` and
numpy's global generator seeded by (seed, epoch, its number in the epoch)
(engine.data.randomness.seed_sample, in engine.data.stream_split.StreamReader), as a map-style one
is fetched: a random transform inside the stream gives the same sample at any world size, any number
of loader processes and after reading again.

A stream's newest state that a committed step reached goes into ``Progress.streams``; the
ranks share theirs (:meth:`StreamPipeline.share`, a collective) where the run's state may move
on without them: at a generation's start, at its checkpoints and before ranks leave.
"""
from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ...events import Event, EventKind
from ..group.collective import collective
from ..state.training_state import Progress
from .batching import BatchPlan, micro_batch_bounds, rank_share
from .randomness import caller_generators_kept
from .stream_split import StreamReader, Streams, outside_loader

# what each reading process yields at each step's start, once its streams stand where the
# step reads them
POSITIONED = "positioned"


def _as_is(item):
    return item


@contextlib.contextmanager
def _reading() -> Iterator[None]:
    """Read streams inside (one context a pass: engine.data.stream_split.StreamReader): their random
    draws leave the training process's generators as they were, and the loader's worker info
    is hidden."""
    with caller_generators_kept(), outside_loader():
        yield


class _PassPieces(torch.utils.data.IterableDataset):
    """The samples one reading process takes from a rank's passes, step after step, from the
    step at (`epoch`, `position`) for `steps` steps: per pass ``(batch, pieces, states)``:
    in a loader process that read the whole pass, its batch (`collate_fn`'s) and no pieces;
    else None and ``[(place in the pass, sample)]`` of its streams; states the newest state of
    each of its streams whose step share it finished reading (``{stream: state}``, on a step's
    last pass)."""

    def __init__(self, streams: Streams, plan: BatchPlan, passes: Callable, epoch: int,
                 position: int, steps: int, known: dict, collate_fn: Callable):
        self.streams, self.plan, self.passes = streams, plan, passes
        self.epoch, self.position, self.steps = epoch, position, steps
        self.known, self.collate_fn = known, collate_fn

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        me, of = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, position = self.epoch, self.position
        readers: dict[int, StreamReader] = {}
        for _ in range(self.steps):
            parts = self.passes(self.plan.batch(epoch, position))
            with _reading():
                self._open(parts, epoch, readers, me, of)
            yield POSITIONED
            for n, (_, chunk) in enumerate(parts):
                pieces = self._read(chunk.tolist(), readers, me, of)
                states = self._states(readers, epoch, position) if n == len(parts) - 1 else {}
                if info is not None and pieces and len(pieces) == len(chunk):
                    yield self.collate_fn([sample for _, sample in pieces]), [], states
                else:
                    yield None, pieces, states
            epoch, position = self.plan.advance(epoch, position)

    def _open(self, parts: list, epoch: int, readers: dict, me: int, of: int) -> None:
        """Readers of the streams this process reads in the step of `parts` (the rank's
        passes) and had none for, each standing where the step starts reading it, its first
        sample read: a stream without a usable state is read again here, before the step
        (engine.group.work_barrier, where StreamPipeline.opens says so), not inside it."""
        starts: dict[int, int] = {}
        for _, chunk in parts:
            for index in chunk.tolist():
                stream, offset = self.streams.locate(index)
                if stream % of == me:
                    starts[stream] = min(offset, starts.get(stream, offset))
        for stream, offset in sorted(starts.items()):
            reader = readers.get(stream)
            if reader is None or reader.epoch != epoch or reader.at > offset:
                readers[stream] = StreamReader(self.streams, stream, epoch, offset,
                                               self.known.get(stream))
                readers[stream].prime()  # one resumed from a state catches up here too

    def _read(self, indices: list[int], readers: dict, me: int, of: int) -> list:
        """[(place in the pass, sample)] of the pass's samples `indices` in this process's
        streams, each read by its stream's reader."""
        pieces = []
        with _reading():
            for place, index in enumerate(indices):
                stream, offset = self.streams.locate(index)
                if stream % of == me:  # its reader opened with the step (_open)
                    pieces.append((place, readers[stream].read(offset)))
        return pieces

    def _states(self, readers: dict, epoch: int, position: int) -> dict:
        """The states of the streams this process read to their step share's end."""
        return {stream: state for stream, reader in readers.items()
                if reader.epoch == epoch and reader.at == self.streams.step_end(stream, position)
                and (state := reader.state()) is not None}


class StreamPipeline:
    """One rank's input pipeline over the run's streams, with
    engine.data.map_pipeline.InputPipeline's calls (:meth:`position`, :meth:`next`,
    :meth:`moved_to`, :meth:`stop`, :meth:`share`).

    Args:
        streams: the cell's dataset as streams.
        plan: the run's batch plan (in order: ``shuffle=False``).
        seed: the run's seed (the loader processes' own seeds follow it).
        workers: reading processes (0: read in this process).
        collate_fn, worker_init_fn: the cell's.
        pin_memory: batches in pinned memory (GPU slots).
        progress: the Worker's progress now (its ``streams`` holds the committed states).
    """

    def __init__(self, streams: Streams, plan: BatchPlan, seed: int, workers: int,
                 collate_fn: Callable, worker_init_fn: Callable | None, pin_memory: bool,
                 progress: Callable[[], Progress]):
        self.streams, self.plan, self.seed, self.workers = streams, plan, seed, workers
        self.collate_fn, self.worker_init_fn = collate_fn, worker_init_fn
        self.pin_memory, self.progress = pin_memory, progress
        self._items: Iterator | None = None
        self._at: tuple[int, int, int, int] | None = None
        self._positioned: tuple[int, int, int, int] | None = None  # the step's markers taken
        self._read: dict[int, dict] = {}  # states read in the step in flight
        # by rank, the streams it has read in this generation's epoch `_held_epoch` (opens)
        self._held: dict[int, set[int]] = {}
        self._held_epoch: int | None = None

    def opens(self, epoch: int, position: int, world_size: int) -> bool:
        """Whether some rank of the generation opens a stream in the middle of its epoch in
        the step at (`epoch`, `position`): one it has not read in this generation's epoch
        (a global batch that the stream count does not divide moves the streams' shares
        between ranks, and so does an epoch's short last step). Call it on every rank before
        each step of a generation, its first included, in order: the answer is the same on
        every rank, and where it is yes, the ranks :meth:`position` first, together."""
        if epoch != self._held_epoch:
            self._held, self._held_epoch = {}, epoch
        size = min(self.plan.global_batch, len(self.streams) - position)
        count = self.plan.micro_batch_count(size)
        bounds = micro_batch_bounds(size, count)
        opens = False
        for rank in range(world_size):
            mine = rank_share(count, rank, world_size)
            if mine.start == mine.stop:
                continue
            first = self.streams.locate(position + bounds[mine.start])
            last = self.streams.locate(position + bounds[mine.stop] - 1)[0]
            held = self._held.setdefault(rank, set())
            for stream in range(first[0], last + 1):  # a step reads its streams in order
                if self.streams.step_end(stream, position) == self.streams.offset(stream,
                                                                                 position):
                    continue  # none of its samples in this step (B < S)
                if stream not in held:
                    held.add(stream)
                    start = first[1] if stream == first[0] else self.streams.offset(stream,
                                                                                   position)
                    opens = opens or start > 0
        return opens

    def position(self, at: tuple[int, int, int, int], passes: Callable, steps: int) -> None:
        """Stand it at the step at `at` (rank, world size, epoch, position), started there for
        `steps` steps unless it stands there: returns once every stream this rank reads in
        that step stands where the step reads it. Call it before a step's collectives, at a
        generation's start (after :meth:`share`) and wherever :meth:`opens` says so
        (engine.group.work_barrier waits for it), and before every other step (a rank may read
        nothing in it: the step's markers are taken here): a stream without a usable state is
        read again from its epoch's start here, for as long as that takes."""
        if steps <= 0:  # a generation that only finishes an evaluation reads nothing
            return
        if self._items is None or self._at != at:
            self._start(at, passes, steps)
        self._arrive(at)

    def _arrive(self, at: tuple[int, int, int, int]) -> None:
        """Take each reading process's marker of the step at `at`: its streams stand in place."""
        if self._positioned == at:
            return
        assert self._items is not None
        for _ in range(max(1, self.workers)):
            if next(self._items) != POSITIONED:
                raise AssertionError("a stream reader yielded a step's samples before its "
                                     "streams stood in place")
        self._positioned = at

    def next(self, at: tuple[int, int, int, int], passes: Callable, steps: int):
        """The next pass's collated batch of the step at `at` (rank, world size, epoch,
        position); started here, for `steps` steps, when the pipeline does not stand there."""
        self.position(at, passes, steps)
        assert self._items is not None
        batch, pieces = None, []
        for _ in range(max(1, self.workers)):  # one item from each process, in turn
            collated, got, states = next(self._items)
            batch = collated if collated is not None else batch
            pieces += got
            self._read.update(states)
        if batch is None:
            batch = self.collate_fn([sample for _, sample in sorted(pieces, key=lambda p: p[0])])
        # pinned in the training process, as a DataLoader with pin_memory pins (its thread)
        return _pinned(batch) if self.pin_memory and self.workers else batch

    def _start(self, at: tuple[int, int, int, int], passes: Callable, steps: int) -> None:
        known = self._states()["states"]
        self.streams.close()  # the setup's readers: none is needed (nor forked) from here
        pieces = _PassPieces(self.streams, self.plan, passes, at[2], at[3], steps,
                             dict(known), self.collate_fn)
        self._read = {}
        if not self.workers:
            self._items = iter(pieces)
        else:
            context = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
            self._items = iter(torch.utils.data.DataLoader(
                pieces, batch_size=None, num_workers=self.workers, collate_fn=_as_is,
                worker_init_fn=self.worker_init_fn, multiprocessing_context=context,
                generator=torch.Generator().manual_seed(self.seed % 2**63)))
        self._at, self._positioned = at, None

    def moved_to(self, at: tuple[int, int, int, int]) -> None:
        """The step it was reading committed: it stands at the step at `at` now, and the
        states its reading reached are the run's."""
        if self._items is not None:
            self._at = at
        self._states()["states"].update(self._read)
        self._read = {}

    def stop(self) -> None:
        """Stop it (its reading processes end): the next :meth:`next` starts it again."""
        self._items = self._at = self._positioned = None
        self._held, self._held_epoch = {}, None  # the next generation opens all it reads
        self._read = {}

    def share(self, rank: int, world_size: int, opening: bool) -> Event | None:
        """Every rank's newest committed stream states, merged into each rank's progress (a
        collective: every rank calls it); states past where the run stands (a sharded run went
        back) are dropped. With `opening` (a generation's start), rank 0 returns the
        ``streams`` event: which streams resume from a state (``resumed``) and how many
        samples each reads again to reach its position (``reread``, by stream)."""
        kept = self._states()
        if world_size > 1:
            every: list = [None] * world_size
            with collective("sharing the streams' states"):
                dist.all_gather_object(every, kept["states"])
        else:
            every = [kept["states"]]
        p = self.progress()
        merged: dict = {}
        for states in every:
            for stream, state in states.items():
                limit = (p.epoch, self.streams.offset(stream, p.position))
                key = (state["epoch"], state["offset"])
                if key <= limit and (stream not in merged or key > (
                        merged[stream]["epoch"], merged[stream]["offset"])):
                    merged[stream] = state
        kept["states"] = merged
        return self._opening_event(merged) if opening and rank == 0 else None

    def _opening_event(self, states: dict) -> Event | None:
        p, s = self.progress(), self.streams
        if p.epoch == 0 and p.position == 0:
            return None
        reread, resumed = [], []
        for stream in range(s.count):
            offset, state = s.offset(stream, p.position), states.get(stream)
            usable = state is not None and state["epoch"] == p.epoch and s.resumable
            start = state["offset"] if usable and state is not None else 0
            resumed += [stream] if usable else []
            reread.append(offset - start)
        why = f" ({s.resume_note})" if s.resume_note else ""
        return {"kind": EventKind.STREAMS.value, "step": p.step, "streams": s.count,
                "resumed": resumed, "reread": reread, "message": (
                    f"{len(resumed)} of {s.count} streams resume from a state{why}; "
                    + (f"{sum(reread)} samples are read again to reach the streams' positions"
                       if any(reread) else "no sample is read again"))}

    def _states(self) -> dict:
        """``Progress.streams`` of the Worker's progress, made with the stream count when it
        has none; a restored one's count is the run's (it fixed the data's order)."""
        p = self.progress()
        if p.streams is None:
            p.streams = {"count": self.streams.count, "states": {}}
        elif p.streams["count"] != self.streams.count:
            self.streams.count = p.streams["count"]
        return p.streams


def _pinned(batch):
    """`batch` with its tensors in pinned memory (the copy to the GPU is then asynchronous),
    as a DataLoader with ``pin_memory=True`` pins the map-style passes' batches."""
    # DataLoader's own pinning of a collated batch
    return torch.utils.data._utils.pin_memory.pin_memory(batch)  # pylint: disable=protected-access
