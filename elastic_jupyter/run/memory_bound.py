"""A sharded run's memory bound: the smallest world size whose rank fits its memory budget.

The engines count a sharded model's memory per rank at setup (engine.sharded.memory_need); the
budget is ``--memory-per-rank`` where given, else each engine's device memory (a GPU slot's; a CPU
slot has none, and the run then has no bound). :class:`ShardedMemoryBound` holds the result
for the run (a replicated run's :class:`NoMemoryBound` has none): the setup refuses a pool
whose ``--min`` lies below it (with the numbers), a resize below it is refused, and
``%elastic_pool status`` shows it. The pool's ``--min`` is what the machine's
arbiter and the fault recovery keep a run at, so a run that starts never goes below the bound.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from ..config import UsageError
from ..engine.sharded.memory_need import GiB, MemoryNeed


class MemoryBound(ABC):
    """A run's memory bound (one per run, from its mode: run.run_mode.RunMode.memory_bound;
    filled by its first engines' setup).

    Attributes:
        world_size: the smallest world size that fits (1 without a bound).
    """

    world_size = 1

    @abstractmethod
    def set_up(self, found: list[dict], min_size: int, max_size: int) -> None:
        """Take the first engines' counts (`found`: engine.entrypoints.setup_run's "memory"
        of each) and check the pool's bounds against them. Raises UsageError when no world
        size up to `max_size` fits, or `min_size` (the pool's ``--min``) does not."""

    @abstractmethod
    def check(self, size: int) -> None:
        """Raise UsageError when a resize to `size` would go below the bound."""

    @property
    @abstractmethod
    def mode(self) -> str:
        """How status names the run's mode: "replicated", or "sharded" with its bound."""


class NoMemoryBound(MemoryBound):
    """A replicated run's: every rank holds the whole state, so no world size fits better."""

    def set_up(self, found: list[dict], min_size: int, max_size: int) -> None:
        pass

    def check(self, size: int) -> None:
        pass

    @property
    def mode(self) -> str:
        return "replicated"


class ShardedMemoryBound(MemoryBound):
    """A sharded run's bound: each rank holds 1/W of the state, so below some W a rank's
    share does not fit its budget.

    Attributes:
        need: the engines' count (None until the setup).
        budget: bytes per rank (``--memory-per-rank``, else the smallest device memory of
            the first engines; None: no budget).
    """

    def __init__(self) -> None:
        self.need: MemoryNeed | None = None
        self.budget: int | None = None
        self.world_size = 1

    def set_up(self, found: list[dict], min_size: int, max_size: int) -> None:
        if not found:
            return
        need = MemoryNeed(**found[0]["need"])
        budgets = [f["budget"] for f in found if f["budget"] is not None]
        budget = min(budgets) if budgets else None
        where = "--memory-per-rank" if found[0]["given"] else "the device's memory"
        fits = need.smallest_world(budget, max_size)
        if fits is None:
            raise UsageError(
                f"the sharded model does not fit a rank even at the pool's --max {max_size}: "
                f"{need.describe(max_size)}, against {_gib(budget)} ({where}). Start a pool "
                "with a larger --max, or give a larger --memory-per-rank if the slots have it")
        if min_size < fits:
            raise UsageError(
                f"the pool's --min {min_size} is below this sharded run's memory bound "
                f"{fits}: {need.describe(min_size)}, against {_gib(budget)} per rank ({where}),"
                f" while {need.describe(fits)} fits. Start the pool with --min {fits} (a fault "
                "or the machine's arbiter may take a run down to --min)")
        self.need, self.budget, self.world_size = need, budget, fits

    def check(self, size: int) -> None:
        if size < self.world_size and self.need is not None:
            raise UsageError(f"world size {size} is below this sharded run's memory bound "
                             f"{self.world_size}: {self.need.describe(size)}, against "
                             f"{_gib(self.budget)} per rank; choose {self.world_size} or more")

    @property
    def mode(self) -> str:
        if self.need is None or self.budget is None:
            return "sharded, no memory bound (no --memory-per-rank)" if self.need else "sharded"
        return (f"sharded, memory bound: world size >= {self.world_size} "
                f"({self.need.at(self.world_size, per_pass=True) / GiB:.2f} of "
                f"{_gib(self.budget)} per rank there"
                + (f", {self.need.activations_unknown})" if self.need.activations_unknown
                   else ", one micro-batch's activations included)"))


def _gib(n: int | None) -> str:
    return f"{n / GiB:.2f} GiB" if n is not None else "no budget"
