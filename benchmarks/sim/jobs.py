"""A simulated training job: its batch size stays the one it asked for (this product's semantics:
resources change, the training result does not); its speed follows its placement.

A job advances on the simulated clock: while it changes placement it pays a cost (a restart in
the Pollux study's model; a grow or shrink at a step boundary in this product's), then trains at
the goodput of its placement (progress per second: the efficiency-weighted steps of
:mod:`.applications` over the step time, with gradient accumulation where the local batch
exceeds what a GPU holds).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .applications import Application


@dataclass(frozen=True)
class Costs:
    """Seconds a job spends on a change of placement.

    start: its first placement (engines start, the model is set up), no progress meanwhile.
    grow: more GPUs; with ``trains_while_growing`` it trains on its old placement meanwhile
        (this product: newcomers set up beside the running generation), else it stops.
    shrink: fewer GPUs, no progress meanwhile; a move to other GPUs costs a start.
    grow_one: a grow by one GPU, when it costs less (this product binds its one warm engine;
        a grow by more starts the rest); None: as any grow.
    """

    start: float
    grow: float
    shrink: float
    trains_while_growing: bool
    label: str = ""
    grow_one: float | None = None

    def of(self, old: tuple[int, ...], new: tuple[int, ...], moved: bool) -> float:
        if not old or moved:
            return self.start
        if sum(new) == sum(old) + 1 and self.grow_one is not None:
            return self.grow_one
        return self.grow if sum(new) > sum(old) else self.shrink


# The Pollux study's simulator: every (re)placement is a 30 s restart from a checkpoint.
PAPER_COSTS = Costs(start=30.0, grow=30.0, shrink=30.0, trains_while_growing=False,
                    label="paper's 30 s restarts")


@dataclass
class Job:
    """A job of a simulated workload, whatever says how fast it trains (subclasses: its
    goodput on a placement and the progress it needs).

    Attributes:
        name, submitted (s), gpus: the GPUs it asked for.
        placement: GPUs per node now (() while it holds none); nodes: the node of each GPU.
        progress, completed (s or None), restarts: placement changes after the first.
        measured: GPUs -> steps per second the job last trained at with that many (what a run
        of this product reports as its speed).
    """

    name: str
    submitted: float
    gpus: int
    placement: tuple[int, ...] = ()
    nodes: list[int] = field(default_factory=list)
    progress: float = 0.0
    completed: float | None = None
    restarts: int = 0
    measured: dict[int, float] = field(default_factory=dict)
    _clock: float = 0.0
    _paused: float = 0.0  # seconds of the current change still to pay
    _old: tuple[int, ...] = ()  # the placement it trains on while growing

    @property
    def done(self) -> bool:
        return self.completed is not None

    def most(self, gpus: int) -> int:
        """The most GPUs it takes in auto mode on a cluster of `gpus`."""
        raise NotImplementedError

    def place(self, nodes: list[int], costs: Costs) -> None:
        """Hold the GPUs of `nodes` (one entry per GPU, its node) from now on."""
        placement = _placement(nodes)
        moved = bool(self.nodes) and not _contains(nodes, self.nodes) and not _contains(
            self.nodes, nodes)
        if placement:
            growing = bool(self.placement) and sum(placement) > sum(self.placement)
            self._old = self.placement if growing and costs.trains_while_growing and not moved \
                else ()
            self._paused = costs.of(self.placement, placement, moved)
            self.restarts += bool(self.placement)
        self.placement, self.nodes = placement, list(nodes)

    def advance(self, seconds: float) -> None:
        """Train for `seconds` of the simulated clock (nothing while it holds no GPU)."""
        end = self._clock + seconds
        if self.placement and not self.done:
            pause = min(self._paused, seconds)
            self._paused -= pause
            if self._old:  # a grow: the old placement trains on until the newcomers are in
                self._train(self._old, pause)
                if self._paused <= 0:
                    self._old = ()
            self._clock += pause
            if self._paused <= 0:
                self._train(self.placement, end - self._clock)
        self._clock = end

    def _train(self, placement: tuple[int, ...], seconds: float) -> None:
        """Make progress on `placement` for `seconds`, crossing milestones (epochs; the job
        ends after its last). The clock moves only as far as training went."""
        start = self._clock
        while seconds > 0 and not self.done:
            goodput = self._goodput(placement)
            goal = self._goal()
            if self.progress + goodput * seconds < goal:
                self.progress += goodput * seconds
                break
            spent = (goal - self.progress) / goodput
            self.progress = goal
            seconds -= spent
            self._clock += spent
            if self._reached():
                self.completed = self._clock
        self._clock = start if not self.done else self._clock

    def _goodput(self, placement: tuple[int, ...]) -> float:
        """Progress per second on `placement`."""
        raise NotImplementedError

    def _goal(self) -> float:
        """The progress at the next milestone."""
        raise NotImplementedError

    def _reached(self) -> bool:
        """The next milestone was reached: True when it was the last."""
        raise NotImplementedError


@dataclass
class SimJob(Job):
    """One job of the Pollux study's workloads: `app` (its measured application) and `batch`,
    its global batch; it ends after the application's epochs."""

    app: Application = field(default=None)  # type: ignore[assignment]
    batch: int = 0
    epoch: int = 0

    def most(self, gpus: int) -> int:
        """Its batch over the application's smallest local batch (each GPU keeps a local batch
        it was measured at, as the Pollux study's Optimus), at most the cluster."""
        return max(1, min(gpus, self.batch // self.app.min_local_batch))

    def _goal(self) -> float:
        return self.app.progress_at(self.epoch + 1)

    def _reached(self) -> bool:
        self.epoch += 1
        return self.epoch >= self.app.epochs

    def _goodput(self, placement: tuple[int, ...]) -> float:
        """Progress per second on `placement` at the job's batch size."""
        replicas = sum(placement)
        local = math.ceil(self.batch / replicas)
        accumulate = math.ceil(local / self.app.max_local_batch) - 1
        if replicas == 1 and self.batch > self.app.init_batch:
            accumulate = max(1, accumulate)  # as the study's model: one GPU accumulates
        micro = math.ceil(local / (accumulate + 1))
        micro = min(micro, self.app.max_batch // (replicas * (accumulate + 1)))
        step, sync = self.app.step_time(placement, micro)
        batch = replicas * micro * (accumulate + 1)
        seconds = step + accumulate * (step - sync)
        self.measured[replicas] = 1.0 / seconds  # steps per second: the same batch at any size
        return self.app.gain(batch, self.epoch) / seconds


def _placement(nodes: list[int]) -> tuple[int, ...]:
    """GPUs per node of a list with each GPU's node, nodes in the order the list gives them
    (a measured placement is looked up by its rotation, so the order counts)."""
    placement: list[int] = []
    for i, n in enumerate(nodes):
        if i and n == nodes[i - 1]:
            placement[-1] += 1
        else:
            placement.append(1)
    return tuple(placement)


def _contains(big: list[int], small: list[int]) -> bool:
    """Whether every GPU of `small` is still held in `big` (a grow or shrink in place)."""
    rest = list(big)
    for n in small:
        if n not in rest:
            return False
        rest.remove(n)
    return True
