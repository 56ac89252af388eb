"""The evaluation of a run: ``metric_fn`` over ``eval_dataset``, the same mean at any world size.

The eval set is cut into chunks of C samples (:meth:`Evaluation.chunk_size`, fixed by the run's
cut); rank r of W evaluates the contiguous chunks ``rank_share(chunks, r, W)``, read through
the input pipeline (engine.data.map_pipeline). A plain value is a mean over its chunk's samples and
counts for them; a ``MeanOver(value, count)`` counts for its count (a token mean). Each chunk's
value x weight and weight (float64) are gathered by the commit vote (engine.group.vote), and every
rank adds them in chunk order (``math.fsum``: exactly rounded): the mean is the exact mean over
the eval set, the same at any world size, bit for bit where each chunk's value is (the same
chunk on the same kind of device). A name no chunk weighs (MeanOver counts all 0) gives NaN.
Under ``--shard`` every rank runs as many forward passes as rank 0 (FSDP2 all-gathers in each):
a rank with fewer chunks first evaluates chunk 0 again and drops what it gave.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist

from ...config.run import RunConfig
from ..data.batching import BatchPlan, rank_share
from ..data.map_pipeline import pass_batches
from ..data.randomness import micro_batch_stream
from ..data.to_device import to_device
from ..group.collective import collective
from ..group.vote import Vote
from .losses import floats, read_metrics, weighted
from .objects import CellObjects

# the epoch in evaluation samples' seeds (engine.data.map_pipeline): no training's
EVAL_EPOCH = 2**64 - 1
EVAL_STREAM = 2**63  # + k: the random stream of evaluation chunk k (beside the micro-batches')


class Forwards(Protocol):
    """What the evaluation asks of the run's state mode (engine.modes.state_mode.StateMode):
    where its forward passes are collectives, every rank runs as many."""

    def evaluation_pads(self, own: int, rank0: int) -> int: ...
    def forwards_done(self, model: torch.nn.Module) -> None: ...


# one chunk's metrics: {name: (value x weight, weight)}
Chunk = dict[str, tuple[float, float]]


@contextlib.contextmanager
def evaluation_mode(model: torch.nn.Module) -> Iterator[None]:
    """`model` in eval mode without gradients; afterwards each layer's training flag and
    buffers are as before (also when the block raises)."""
    modes = [(module, module.training) for module in model.modules()]
    buffers = [b.clone() for b in model.buffers()]
    try:
        model.eval()
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training
        with torch.no_grad():
            for buffer, saved in zip(model.buffers(), buffers):
                buffer.copy_(saved)


class Evaluation:
    """``metric_fn`` over the cell's ``eval_dataset`` (see the module docstring).

    Args:
        config: the run's options (global_batch, seed, workers).
        objects: the cell's objects; ``objects.eval_dataset`` and ``objects.metric_fn`` are set.
        plan: the run's batch plan (its cut fixes the chunk size).
        device: where the model runs.
    """

    def __init__(self, config: RunConfig, objects: CellObjects, plan: BatchPlan,
                 device: torch.device, mode: Forwards):
        self.config, self.objects, self.plan, self.device = config, objects, plan, device
        self.mode = mode  # who holds the state: its forwards may be collectives

    def chunk_size(self) -> int:
        """C, the samples of one evaluation chunk: ``--micro-batch N``, else the largest
        training micro-batch of a full step (the global batch over the pool's ``--max``).
        Fixed by the run's cut, so the chunks (samples k*C .. k*C + C - 1 of the eval set, the
        last one shorter) never depend on the world size."""
        B, cut = self.config.global_batch, self.plan.cut
        if cut.rule == "micro_batch" and cut.micro_batch:
            return cut.micro_batch
        return -(-B // cut.count(B))

    def local_chunks(self, rank: int, world_size: int, step: int) -> list[Chunk]:
        """This rank's share of the chunks, evaluated after the step `step` (their random
        streams): every rank evaluates rank 0's buffers; afterwards each layer's buffers and
        training flag are its own again (a layer the cell froze with eval() stays frozen),
        also when a peer fails (a collective: all ranks call it)."""
        count = -(-len(self.objects.eval_dataset) // self.chunk_size())
        mine = range(count)[rank_share(count, rank, world_size)]
        pads = self.mode.evaluation_pads(len(mine),
                                         len(range(count)[rank_share(count, 0, world_size)]))
        with evaluation_mode(self.objects.model):
            self._share_buffers(world_size)
            try:
                return self._evaluate_chunks([0] * pads + list(mine), step)[pads:]
            finally:
                self.mode.forwards_done(self.objects.model)

    @staticmethod
    def combine(chunks: list[Chunk], vote: Vote | None) -> dict[str, float]:
        """Every rank's `chunks` (gathered in the commit vote's round: `vote`, None with one
        rank) as ``{"val_<name>": mean}``, the same on every rank. Raises PeerFailure when the
        vote did not reach every rank."""
        # rank order is chunk order: the shares are contiguous
        gathered = [chunk for part in (vote or Vote(None, 0, 1, 0.0)).gather(chunks)
                    for chunk in part]
        means = {}
        for name in sorted({name for chunk in gathered for name in chunk}):
            pairs = [chunk[name] for chunk in gathered if name in chunk]
            weight = math.fsum(w for _, w in pairs)
            means[f"val_{name}"] = math.fsum(v for v, _ in pairs) / weight if weight else math.nan
        return means

    def _share_buffers(self, world_size: int) -> None:
        """Give every rank rank 0's buffers (the model ``run.state_dict()`` returns), which may
        differ elsewhere: a custom layer's buffer updated from each rank's own samples."""
        if world_size > 1:
            with collective("buffer broadcast"):
                for buffer in self.objects.model.buffers():
                    dist.broadcast(buffer, src=0)

    def _eval_batches(self, chunks: list[int]) -> tuple[Iterator, list[int]]:
        """(an iterator over the collated batches of evaluation chunks `chunks`, in order; their
        sample counts), read through the input pipeline as training's passes are
        (engine.data.map_pipeline): in ``--workers`` loader processes (none for a single chunk,
        where they would fetch nothing ahead), each sample under the generators seeded by its
        index."""
        cell = self.objects
        n, C = len(cell.eval_dataset), self.chunk_size()
        keys = [[(EVAL_EPOCH, i) for i in range(k * C, min(n, k * C + C))] for k in chunks]
        workers = min(self.config.loader_processes, len(keys)) if len(keys) > 1 else 0
        batches = pass_batches(cell.eval_dataset, keys, self.config.seed, workers,
                               cell.collate_fn, cell.worker_init_fn,
                               pin_memory=workers > 0 and self.device.type == "cuda")
        return batches, [len(k) for k in keys]

    def _evaluate_chunks(self, chunks: list[int], step: int) -> list[Chunk]:
        """``metric_fn`` over evaluation chunks `chunks` (the model in evaluation mode, no
        gradients): one ``{name: (value x weight, weight)}`` per chunk, in float64 (a plain
        value weighs the chunk's samples, a MeanOver value its count; a count of 0 adds
        nothing). The values are read from the device once, after the last chunk. Chunk k runs
        in the random stream (seed, step, EVAL_STREAM + k) (engine.data.randomness), which the
        generators outside are not moved by."""
        cell = self.objects
        assert cell.metric_fn is not None  # objects.CellObjects checks it with eval_dataset
        batches, sizes = self._eval_batches(chunks)
        read = []
        for k, samples in zip(chunks, sizes):
            # chunk k's randomness (collate_fn here without loader processes, metric_fn) is
            # its own, whichever rank evaluates it
            with micro_batch_stream(self.config.seed, step, EVAL_STREAM + k, self.device):
                batch = to_device(next(batches), self.device)
                read.append(read_metrics(cell.metric_fn(cell.model, batch), samples))
        del batches  # stops the loader processes
        values = iter(floats([weighted(x, 1.0) for metrics in read
                              for pair in metrics.values() for x in pair]))
        out = []
        for metrics in read:
            chunk = {}
            for name in metrics:
                value, weight = next(values), next(values)
                if not weight >= 0:
                    raise ValueError(f"metric_fn's {name!r}: MeanOver count must be >= 0, got "
                                     f"{weight}")
                chunk[name] = (value * weight, weight) if weight else (0.0, 0.0)
            out.append(chunk)
        return out
