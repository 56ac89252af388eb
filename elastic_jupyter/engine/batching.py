"""Which samples each rank uses at each step: the data-assignment half of elastic training.

The plan depends only on (seed, epoch, position in the epoch, global batch, world size), never on
how the run got there, so a resize mid-epoch neither repeats nor skips a sample. Horovod's
ElasticSampler and torch's DistributedSampler pad or drop samples when the world size changes
(horovod #3399, #3143; pytorch #36650); this plan does not.
"""
from __future__ import annotations

import math

import torch

_GOLDEN = 0x9E3779B97F4A7C15  # spreads (seed, epoch) pairs over the generator's seed space


def epoch_permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    """The order of the `n` samples in `epoch`: a permutation (int64, shape ``(n,)``)."""
    gen = torch.Generator()
    gen.manual_seed((seed * _GOLDEN + epoch) % (2**63))
    return torch.randperm(n, generator=gen)


def steps_per_epoch(n: int, global_batch: int) -> int:
    """Optimizer steps in one epoch; the last one takes the remainder ``n % global_batch``."""
    return math.ceil(n / global_batch)


def rank_share(batch_size: int, rank: int, world_size: int) -> slice:
    """The contiguous part of a batch of `batch_size` samples that `rank` processes.

    Shares differ by at most one sample; the first ``batch_size % world_size`` ranks take one more.
    A rank may get an empty share (the last step of an epoch can hold fewer samples than ranks).
    """
    base, extra = divmod(batch_size, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def micro_batches(indices: torch.Tensor, micro_batch: int | None) -> list[torch.Tensor]:
    """Split a rank's share into chunks of at most `micro_batch` samples (gradient accumulation)."""
    if len(indices) == 0:
        return []
    if not micro_batch or micro_batch >= len(indices):
        return [indices]
    return list(torch.split(indices, micro_batch))


class BatchPlan:
    """The global batch of every step for one dataset size, cached per epoch.

    Args:
        n: number of samples in the dataset.
        global_batch: B, samples consumed by one optimizer step whatever the world size.
        seed: the run's seed; epoch e uses the permutation of (seed, e).
    """

    def __init__(self, n: int, global_batch: int, seed: int):
        self.n, self.global_batch, self.seed = n, global_batch, seed
        self._epoch, self._perm = None, None

    def batch(self, epoch: int, position: int) -> torch.Tensor:
        """Sample indices (int64, shape ``(min(B, n - position),)``) of the step at `position`."""
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, epoch_permutation(self.seed, epoch, self.n)
        return self._perm[position:position + self.global_batch]

    def advance(self, epoch: int, position: int) -> tuple[int, int]:
        """(epoch, position) after the step at `position`."""
        position += min(self.global_batch, self.n - position)
        return (epoch + 1, 0) if position >= self.n else (epoch, position)
