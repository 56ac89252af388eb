"""A rank's input pipeline: a torch DataLoader over the rank's passes of the coming steps.

The batch plan (engine.data.batching) fixes every step's samples and how they are cut into passes,
so within a generation (fixed rank and world size) a rank knows all its future passes: a
:class:`PassSampler` lists them, and a DataLoader fetches them ahead, in ``--workers``
processes that keep ``prefetch_factor`` (2) batches each in flight, with the cell's
``collate_fn`` and ``worker_init_fn``, into pinned memory on GPU slots, so the copy to the
device is asynchronous; with 0, the training process fetches a pass's samples when the pass
asks for its batch. The loader lives for one generation; a new one starts from the run's progress
in the next, so every sample is still used once per epoch (what a prefetched batch of a
finished generation held is fetched again by the rank that now has it).

Each sample is fetched under torch's CPU generator, Python's ``random`` and numpy's global
generator seeded by (seed, epoch, sample index) (engine.data.randomness.sample_seed), so a random
transform gives the same sample at any world size and any number of loader processes.
"""
from __future__ import annotations

import multiprocessing
from collections.abc import Iterable, Iterator
from typing import Callable

import torch

from ...events import Event
from .batching import BatchPlan
from .randomness import caller_generators_kept, seed_sample
from .stream_pipeline import StreamPipeline
from .stream_split import Streams


class SeededSamples(torch.utils.data.Dataset):
    """The cell's dataset indexed by (epoch, index) pairs; each sample fetched under torch's
    CPU generator, Python's ``random`` and numpy's global generator seeded by (seed, epoch,
    index) (engine.data.randomness.seed_sample), the caller's generator states kept
    (engine.data.randomness.caller_generators_kept)."""

    def __init__(self, dataset, seed: int):
        self.dataset, self.seed = dataset, seed
        # seeding Python's and numpy's generators costs ~7 us a sample: not for a dataset
        # that cannot draw from them
        self.host = not _draws_nothing(dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list:
        """The samples of one pass (DataLoader calls this with a whole batch's keys)."""
        out = []
        with caller_generators_kept(self.host):
            for epoch, index in keys:
                seed_sample(self.seed, epoch, index, self.host)
                out.append(self.dataset[index])
        return out


def _draws_nothing(dataset) -> bool:
    """Whether fetching a sample of `dataset` surely draws no random number: a TensorDataset,
    or a Subset of one (exactly these classes; a subclass may add a transform)."""
    if type(dataset) is torch.utils.data.Subset:
        return _draws_nothing(dataset.dataset)
    return type(dataset) is torch.utils.data.TensorDataset


class PassSampler(torch.utils.data.Sampler):
    """A batch sampler: the (epoch, index) keys of each of one rank's passes, step after step,
    from the step at (`epoch`, `position`) until `steps` steps are listed.

    Args:
        plan: the run's batch plan.
        passes: the rank's passes of a step, ``passes(step's sample indices) -> [(k, indices)]``
            (Worker._passes: the same function the training step cuts by).
    """

    def __init__(self, plan: BatchPlan, passes: Callable, epoch: int, position: int,
                 steps: int):
        self.plan, self.passes = plan, passes
        self.epoch, self.position, self.steps = epoch, position, steps

    def __iter__(self):
        epoch, position = self.epoch, self.position
        for _ in range(self.steps):
            for _, chunk in self.passes(self.plan.batch(epoch, position)):
                yield [(epoch, index) for index in chunk.tolist()]
            epoch, position = self.plan.advance(epoch, position)


def pass_batches(dataset, sampler: Iterable[list[tuple[int, int]]], seed: int, workers: int,
                 collate_fn: Callable, worker_init_fn: Callable | None,
                 pin_memory: bool) -> Iterator:
    """An iterator over the collated batches of `sampler`'s passes, in order.

    Args:
        sampler: each pass's (epoch, sample index) keys: a :class:`PassSampler`, or a list.
        workers: loader processes (0: fetch in this process when a batch is asked for).
        pin_memory: with loader processes, batches arrive in pinned memory (GPU slots), so
            moving them to the device with ``non_blocking=True`` overlaps with its work.
    """
    samples = SeededSamples(dataset, seed)
    if not workers:  # what DataLoader would do in this process, without its per-batch cost
        return (collate_fn(samples.__getitems__(keys)) for keys in sampler)
    # forked, not spawned: the cell's classes live in its module, which only this process has
    # (a spawned process could not unpickle the dataset)
    context = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    loader = torch.utils.data.DataLoader(
        samples, batch_sampler=sampler, num_workers=workers,
        collate_fn=collate_fn, worker_init_fn=worker_init_fn, pin_memory=pin_memory,
        multiprocessing_context=context,
        # the loader processes' own seeds (which the samples' do not depend on) follow the run's
        generator=torch.Generator().manual_seed(seed % 2**63))
    return iter(loader)


class InputPipeline:
    """One rank's input pipeline: the batches of its coming passes, from the step it stands at.

    It lives for one generation at most (:meth:`stop`); :meth:`next` starts it again wherever
    it does not stand at the asked step (a new generation, a restore, a step not committed).

    Args:
        dataset, collate_fn, worker_init_fn: the cell's.
        plan: the run's batch plan.
        seed: the run's seed (each sample's generators, engine.data.randomness).
        workers: loader processes (0: fetch in this process).
        pin_memory: batches in pinned memory (GPU slots).
    """

    def __init__(self, dataset, plan: BatchPlan, seed: int, workers: int, collate_fn: Callable,
                 worker_init_fn: Callable | None, pin_memory: bool):
        self.dataset, self.plan, self.seed, self.workers = dataset, plan, seed, workers
        self.collate_fn, self.worker_init_fn = collate_fn, worker_init_fn
        self.pin_memory = pin_memory
        self._batches: Iterator | None = None
        # (rank, world size, epoch, position) of the step whose batches it yields next
        self._at: tuple[int, int, int, int] | None = None

    def next(self, at: tuple[int, int, int, int], passes: Callable, steps: int):
        """The next pass's collated batch of the step at `at` (rank, world size, epoch,
        position), whose passes `passes` cuts (see :class:`PassSampler`); started here, for
        `steps` steps, when the pipeline does not stand at that step."""
        if self._batches is None or self._at != at:
            sampler = PassSampler(self.plan, passes, at[2], at[3], steps)
            self._batches = pass_batches(self.dataset, sampler, self.seed, self.workers,
                                         self.collate_fn, self.worker_init_fn,
                                         pin_memory=self.pin_memory)
            self._at = at
        return next(self._batches)

    def opens(self, epoch: int, position: int, world_size: int) -> bool:
        """Never: nothing is read before a step
        (engine.data.stream_pipeline.StreamPipeline.opens)."""
        return False

    def position(self, at: tuple[int, int, int, int], passes: Callable, steps: int) -> None:
        """Nothing to do: a map-style dataset fetches any sample at once, and the first
        :meth:`next` starts it (engine.data.stream_pipeline.StreamPipeline reads streams here)."""

    def moved_to(self, at: tuple[int, int, int, int]) -> None:
        """The step it was reading committed: it stands at the step at `at` now (if running)."""
        if self._batches is not None:
            self._at = at

    def stop(self) -> None:
        """Stop it (its loader processes end): the next :meth:`next` starts it again."""
        self._batches = self._at = None

    def share(self, rank: int, world_size: int, opening: bool) -> Event | None:
        """Nothing to share: a map-style dataset's reading depends on the progress alone
        (engine.data.stream_pipeline.StreamPipeline.share has streams' states to share)."""
        return None


def input_pipeline(cell, plan: BatchPlan, config, device: torch.device,
                   progress: Callable) -> InputPipeline | StreamPipeline:
    """A rank's input pipeline for the cell's dataset (engine.step.objects.CellObjects): a
    :class:`InputPipeline`, or for streams (engine.data.stream_split) a
    :class:`~.stream_loader.StreamPipeline`, which reads `progress()`'s stream states."""
    args = (plan, config.seed, config.loader_processes, cell.collate_fn, cell.worker_init_fn,
            device.type == "cuda")
    if isinstance(cell.dataset, Streams):
        return StreamPipeline(cell.dataset, *args, progress=progress)
    return InputPipeline(cell.dataset, *args)
