"""Which samples each rank uses at each step: the data-assignment half of elastic training.

The plan depends only on (seed, epoch, position in the epoch, global batch, the run's
:class:`Cut`), never on the world size or on how the run got there, so a resize mid-epoch
neither repeats nor skips a sample. Horovod's ElasticSampler and torch's DistributedSampler pad
or drop samples when the world size changes (horovod #3399, #3143; pytorch #36650); this plan
does not.

Each step's batch of b samples is cut into K micro-batches at the offsets ``k * b // K`` (sizes
differ by at most one); K follows from b and the run's :class:`Cut` (rules fixed at the run's
start and kept in its state), never from the world size W or a clock. Rank r of W processes the
contiguous micro-batches ``rank_share(K, r, W)``. A micro-batch is the unit of one forward pass, of
one random stream (engine.data.randomness) and of BatchNorm statistics (engine.step.running_stats),
so the computation does not depend on W: only which rank does which part of it.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import torch

_GOLDEN = 0x9E3779B97F4A7C15  # spreads (seed, epoch) pairs over the generator's seed space
SLOWDOWN = 1.1  # a step may take 1.1 x an even split's time at every pool size


def epoch_permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    """The order of the `n` samples in `epoch`: a permutation (int64, shape ``(n,)``)."""
    gen = torch.Generator()
    gen.manual_seed((seed * _GOLDEN + epoch) % (2**63))
    return torch.randperm(n, generator=gen)


def steps_per_epoch(n: int, global_batch: int, drop_last: bool = False) -> int:
    """Optimizer steps in one epoch; the last one takes the remainder ``n % global_batch``, or
    with `drop_last` is left out (as ``DataLoader(drop_last=True)`` leaves it)."""
    return n // global_batch if drop_last else math.ceil(n / global_batch)


def rank_share(batch_size: int, rank: int, world_size: int) -> slice:
    """The contiguous part of `batch_size` items (samples or micro-batches) that `rank` takes.

    Shares differ by at most one item; the first ``batch_size % world_size`` ranks take one more.
    A rank may get an empty share (the last step of an epoch can hold fewer samples than ranks).
    """
    base, extra = divmod(batch_size, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def micro_batches(indices: torch.Tensor, micro_batch: int | None) -> list[torch.Tensor]:
    """Split `indices` into chunks of at most `micro_batch` samples (evaluation's passes)."""
    if len(indices) == 0:
        return []
    if not micro_batch or micro_batch >= len(indices):
        return [indices]
    return list(torch.split(indices, micro_batch))


def micro_batch_bounds(batch_size: int, count: int) -> list[int]:
    """Offsets of the `count` micro-batches of a batch: ``[k * batch_size // count for k in
    0..count]``; sizes differ by at most one, the larger ones spread evenly."""
    return [k * batch_size // count for k in range(count + 1)]


def busiest_rank(bounds: list[int], world_size: int, pass_cost: float = 0.0) -> float:
    """The step time of the slowest rank, in samples, when the micro-batches cut at `bounds`
    are dealt out to `world_size` ranks by :func:`rank_share`: its samples plus `pass_cost`
    (engine.step.calibration) per micro-batch it runs."""
    count = len(bounds) - 1
    shares = (rank_share(count, r, world_size) for r in range(world_size))
    return max(bounds[s.stop] - bounds[s.start] + (s.stop - s.start) * pass_cost
               for s in shares)


@functools.lru_cache(maxsize=256)
def micro_batch_count(batch_size: int, cap: int | None, min_size: int, max_size: int,
                      pass_cost: float = 0.0) -> int:
    """K, the number of micro-batches a batch of `batch_size` samples is cut into.

    A rank's step takes its samples plus `pass_cost` samples' worth per micro-batch it runs
    (engine.step.calibration); an even split at world size W takes ``batch_size / W + pass_cost``.
    K is the smallest count such that
      - no micro-batch holds more than `cap` samples (``--micro-batch``; None: no cap),
      - every rank gets a micro-batch whenever the batch has at least as many samples as ranks
        (K >= min(batch_size, max_size)), and
      - at every world size W in ``[min_size, max_size]`` the slowest rank takes at most 1.1 x
        an even split's time.
    When no K meets 1.1 (tiny batches: 8 samples on 1..8 ranks; or a large pass cost, where
    every extra pass costs more than the balance it buys), K is the smallest count with the
    lowest worst ratio. Examples, pass cost 0: 64 samples on 1..4 ranks: 12 micro-batches of
    5-6; 256 on 1..8: 39 of 6-7. Pass cost 16: 64 on 1..4: 4 of 16 (worst ratio 1.71, at W=3).

    Raises ValueError for a batch, cap or bound below 1, min_size > max_size, or a negative
    pass cost.
    """
    if batch_size < 1 or (cap is not None and cap < 1) or not 1 <= min_size <= max_size \
            or pass_cost < 0:
        raise ValueError(f"bad micro-batch plan: batch {batch_size}, cap {cap}, pool sizes "
                         f"{min_size}..{max_size}, pass cost {pass_cost}")
    best: int | None = None
    best_worst = math.inf
    for count in range(micro_batch_floor(batch_size, cap, max_size), batch_size + 1):
        worst = worst_slowdown(micro_batch_bounds(batch_size, count), min_size, max_size,
                               pass_cost)
        if worst <= SLOWDOWN + 1e-9:
            return count
        if worst < best_worst - 1e-9:
            best, best_worst = count, worst
    if best is None:  # every count's worst ratio is infinite (or NaN): no plan balances
        raise ValueError(f"bad micro-batch plan: batch {batch_size}, cap {cap}, pool sizes "
                         f"{min_size}..{max_size}, pass cost {pass_cost}")
    return best


def micro_batch_floor(batch_size: int, cap: int | None, max_size: int) -> int:
    """The fewest micro-batches a batch may have: none over `cap`, one per rank at `max_size`."""
    return max(-(-batch_size // cap) if cap else 1, min(batch_size, max_size))


def worst_slowdown(bounds: list[int], min_size: int, max_size: int,
                   pass_cost: float = 0.0) -> float:
    """The largest ratio, over world sizes ``min_size..max_size``, of the slowest rank's step
    time (:func:`busiest_rank`) to an even split's (``batch_size / W + pass_cost``)."""
    batch_size = bounds[-1]
    return max(busiest_rank(bounds, w, pass_cost) * w / (batch_size + pass_cost * w)
               for w in range(min_size, max_size + 1))


BATCHNORM_FLOOR = 8  # samples a micro-batch holds at least when the model has BatchNorm


@dataclass(frozen=True)
class Cut:
    """How every step is cut into micro-batches: fixed at a run's start, part of its state (a
    resume and every newcomer cut as the run began), never measured unless asked for.

    rule:
      - ``"virtual workers"`` (the default): a full step of B samples is cut into ``virtual``
        micro-batches, the pool's ``--max`` at the run's start, so each rank at the largest
        size runs one; EasyScale's fixed virtual workers (Li et al., SC'23).
      - ``"micro_batch"`` (``--micro-batch N``): a step of b samples into ceil(b / N).
      - ``"pass_cost"`` (``--pass-cost P``, or measured with ``--pass-cost measure``): the
        fewest micro-batches that keep every world size in ``min_size..max_size`` within 1.1 x
        an even split's time when a pass costs P samples' worth (:func:`micro_batch_count`).
    floor: the fewest samples a micro-batch may hold (``floor_why`` says what set it: BatchNorm,
      whose statistics are per micro-batch; the cell's ``min_micro_batch``); a short step is cut
      into fewer micro-batches rather than smaller ones.
    """

    rule: str = "virtual workers"
    virtual: int = 1
    micro_batch: int | None = None
    pass_cost: float | None = None
    min_size: int = 1
    max_size: int = 1
    floor: int = 1
    floor_why: str = ""

    def count(self, batch_size: int) -> int:
        """K, the micro-batches of a step of `batch_size` samples (>= 1)."""
        if self.rule == "micro_batch" and self.micro_batch:
            wanted = -(-batch_size // self.micro_batch)
        elif self.rule == "pass_cost":
            wanted = micro_batch_count(batch_size, None, self.min_size, self.max_size,
                                       self.pass_cost or 0.0)
        else:
            wanted = self.virtual
        return max(1, min(wanted, batch_size // self.floor))

    def describe(self, global_batch: int) -> str:
        """What cuts a step of `global_batch` samples, and why, in a sentence."""
        count = self.count(global_batch)
        small, large = global_batch // count, -(-global_batch // count)
        sizes = f"{small}" if small == large else f"{small}-{large}"
        why = {"virtual workers": f"one per virtual worker: the pool's --max {self.virtual}",
               "micro_batch": f"--micro-batch {self.micro_batch}",
               "pass_cost": f"a pass costs as much as {self.pass_cost:g} samples"
               if self.pass_cost is not None else "pass cost"}[self.rule]
        floor = f"; floor {self.floor}: {self.floor_why}" if self.floor > 1 else ""
        return (f"each step of {global_batch} samples is cut into {count} micro-batches of "
                f"{sizes} ({why}{floor}); an epoch's short last step into fewer, none below "
                "the floor unless the step itself is smaller (then one)")

    def as_dict(self) -> dict:
        return asdict(self)


def choose_cut(global_batch: int, micro_batch: int | None, pass_cost: float | None,
               min_size: int, max_size: int, floor: int, floor_why: str,
               lowest: int = 1) -> Cut:
    """The run's :class:`Cut` from its options (``--micro-batch``, ``--pass-cost``, the pool's
    bounds) and the model's floor (`lowest`: the smallest floor the cell may declare, 2 with
    BatchNorm). Raises ValueError, saying what to change, when the floor cannot be met: a
    micro-batch below it at the pool's largest size. With ``--pass-cost`` the floor is not
    checked against the pool: the ``micro_batches`` event says which world sizes leave ranks
    without a micro-batch."""
    if micro_batch:
        cut = Cut("micro_batch", micro_batch=micro_batch, min_size=min_size,
                  max_size=max_size, floor=floor, floor_why=floor_why)
        if micro_batch < floor:
            raise ValueError(f"--micro-batch {micro_batch} is below the floor of {floor} samples "
                             f"per micro-batch ({floor_why}): use --micro-batch {floor} or more")
        return cut
    if pass_cost is not None:
        return Cut("pass_cost", pass_cost=float(pass_cost), min_size=min_size,
                   max_size=max_size, floor=floor, floor_why=floor_why)
    if global_batch // max_size < floor:
        each = global_batch // max_size
        remedies = [f"raise --global-batch to {floor * max_size} or more"]
        if global_batch >= floor:
            remedies.append(f"start the pool with --max {global_batch // floor} or fewer")
        if each >= lowest:
            remedies.append(f"declare min_micro_batch = {each} in the cell to accept smaller "
                            "micro-batches")
        raise ValueError(
            f"--global-batch {global_batch} over the pool's --max {max_size} gives micro-batches "
            f"of {each} samples, below the floor of {floor} ({floor_why}): "
            + (", ".join(remedies[:-1]) + ", or " if len(remedies) > 1 else "") + remedies[-1])
    return Cut("virtual workers", virtual=max_size, min_size=min_size, max_size=max_size,
               floor=floor, floor_why=floor_why)


class BatchPlan:
    """The global batch of every step and its micro-batches, for one dataset size.

    Args:
        n: number of samples in the dataset.
        global_batch: B, samples consumed by one optimizer step whatever the world size.
        seed: the run's seed; epoch e uses the permutation of (seed, e).
        cut: how a step is cut into micro-batches (:class:`Cut`); the run may set another
            (its state's) before the first step.
        drop_last: leave out an epoch's short last step (its samples wait for a later epoch's
            permutation; in order, they are never read), as ``DataLoader(drop_last=True)``
            does.
        shuffle: False keeps the dataset's order in every epoch (``--no-shuffle``, as
            ``DataLoader(shuffle=False)``; a stream's, engine.data.stream_split, is always kept).
    """

    def __init__(self, n: int, global_batch: int, seed: int, cut: Cut | None = None,
                 drop_last: bool = False, shuffle: bool = True):
        self.n, self.global_batch, self.seed = n, global_batch, seed
        self.cut, self.drop_last, self.shuffle = cut or Cut(), drop_last, shuffle
        self._epoch: int | None = None
        self._perm: torch.Tensor | None = None  # the permutation of epoch _epoch

    def batch(self, epoch: int, position: int) -> torch.Tensor:
        """Sample indices (int64, shape ``(min(B, n - position),)``) of the step at `position`."""
        if not self.shuffle:  # never the whole arange: a stream's n may be endless
            return torch.arange(position, min(position + self.global_batch, self.n))
        if epoch != self._epoch or self._perm is None:
            self._epoch, self._perm = epoch, epoch_permutation(self.seed, epoch, self.n)
        return self._perm[position:position + self.global_batch]

    def advance(self, epoch: int, position: int) -> tuple[int, int]:
        """(epoch, position) after the step at `position`."""
        position += min(self.global_batch, self.n - position)
        end = self.n - self.n % self.global_batch if self.drop_last else self.n
        return (epoch + 1, 0) if position >= end else (epoch, position)

    def micro_batch_count(self, batch_size: int) -> int:
        """K for a step of `batch_size` samples (the last step of an epoch has fewer than B)."""
        return self.cut.count(batch_size)

    def micro_batches(self, batch: torch.Tensor) -> list[torch.Tensor]:
        """The step's K micro-batches in order: consecutive slices of `batch` (sample indices)."""
        bounds = micro_batch_bounds(len(batch), self.micro_batch_count(len(batch)))
        return [batch[start:stop] for start, stop in zip(bounds, bounds[1:])]

    def rank_micro_batches(self, batch: torch.Tensor, rank: int,
                           world_size: int) -> list[tuple[int, torch.Tensor]]:
        """(index k, sample indices) of the micro-batches `rank` processes: the contiguous run
        ``rank_share(K, rank, world_size)``; empty when the batch has fewer micro-batches than
        ranks (the rank still takes part in the step's collectives)."""
        parts = self.micro_batches(batch)
        mine = rank_share(len(parts), rank, world_size)
        return list(zip(range(mine.start, mine.stop), parts[mine]))
