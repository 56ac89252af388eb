"""The kernel's side of a run's state mode (the engines' side: engine.modes.state_mode): what the
owner decides differently when every rank holds the whole state (:class:`ReplicatedRun`) and
when each rank holds its rows (:class:`ShardedRun`, ``--shard``).

The driver, the run's setup and its results call the mode and never ask which one it is;
:func:`run_mode` chooses it once per run, the one place on the kernel side that reads the
option.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from ..config import RunConfig
from .final_state import FinalState, ShardedFinalState, WholeFinalState
from .memory_bound import MemoryBound, NoMemoryBound, ShardedMemoryBound
from .runlog import RunLog

if TYPE_CHECKING:
    from ..pool.engine_calls import EngineCalls
    from ..pool.processes import Engine
    from .membership import Membership


class RunMode(ABC):
    """Where a run's training state lives, as the owner sees it."""

    name: ClassVar[str]  # as views show the run: "replicated" or "sharded"

    @abstractmethod
    def memory_bound(self) -> MemoryBound:
        """The run's memory bound, filled by its first engines' setup (run.memory_bound)."""

    @abstractmethod
    def final_state(self, calls: EngineCalls, log: RunLog, checkpoint_dir: str,
                    keep: int) -> FinalState:
        """The owner of the run's final state (run.final_state)."""

    @abstractmethod
    def leavers(self, world_size: int, stopping: bool,
                shrink: Callable[[], list[int]]) -> list[int]:
        """The ranks named to leave when the generation ends at a requested step, so that they
        hand over what they hold first: every rank on a stop (`stopping`), else `shrink()`'s
        (the membership's choice for the size due); [] where nothing is handed over."""

    @abstractmethod
    def saved_for_stop(self, handed_over: int, world_size: int) -> bool:
        """Whether a generation whose ranks handed over `handed_over` of `world_size` leaves
        the state saved, so that a stop may end the run now (else one more generation)."""

    @abstractmethod
    def size_now(self, target: int, world_size: int) -> int:
        """The size a step boundary applies when `target` is due: where leavers must hand over
        first, a shrink waits for the next boundary, at which the driver names them."""

    @abstractmethod
    def swap(self, membership: Membership) -> list[Engine]:
        """At a boundary that keeps the size: the newcomers that take over slots the machine's
        arbiter wants back (membership.Membership.swap), or none where ranks cannot leave
        without a hand-over."""


class ReplicatedRun(RunMode):
    """Every rank holds the whole state: any rank may go at any boundary."""

    name = "replicated"

    def memory_bound(self) -> MemoryBound:
        return NoMemoryBound()

    def final_state(self, calls: EngineCalls, log: RunLog, checkpoint_dir: str,
                    keep: int) -> FinalState:
        return WholeFinalState(calls, log, checkpoint_dir, keep)

    def leavers(self, world_size: int, stopping: bool,
                shrink: Callable[[], list[int]]) -> list[int]:
        return []

    def saved_for_stop(self, handed_over: int, world_size: int) -> bool:
        return True  # rank 0 holds it all: the stop's checkpoint is taken from it

    def size_now(self, target: int, world_size: int) -> int:
        return target

    def swap(self, membership: Membership) -> list[Engine]:
        return membership.swap()


class ShardedRun(RunMode):
    """Each rank holds its rows: ranks leave only after handing them over (engine.sharded.lifecycle:
    a shrink is a drain), and the final state is the newest checkpoint folder."""

    name = "sharded"

    def memory_bound(self) -> MemoryBound:
        return ShardedMemoryBound()

    def final_state(self, calls: EngineCalls, log: RunLog, checkpoint_dir: str,
                    keep: int) -> FinalState:
        return ShardedFinalState(calls, log, checkpoint_dir, keep)

    def leavers(self, world_size: int, stopping: bool,
                shrink: Callable[[], list[int]]) -> list[int]:
        return list(range(world_size)) if stopping else shrink()  # a stop: their checkpoint

    def saved_for_stop(self, handed_over: int, world_size: int) -> bool:
        return handed_over == world_size  # every rank left: their checkpoint is the end

    def size_now(self, target: int, world_size: int) -> int:
        return max(target, world_size)  # the rest of a shrink goes after the next step

    def swap(self, membership: Membership) -> list[Engine]:
        return []  # handed over at the boundary instead (the driver names the leavers)


def run_mode(config: RunConfig) -> RunMode:
    """The mode `config` asks for (``--shard``)."""
    return ShardedRun() if config.shard else ReplicatedRun()
