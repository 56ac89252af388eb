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
    """

    start: float
    grow: float
    shrink: float
    trains_while_growing: bool
    label: str = ""

    def of(self, old: tuple[int, ...], new: tuple[int, ...], moved: bool) -> float:
        if not old or moved:
            return self.start
        return self.grow if sum(new) > sum(old) else self.shrink


# The Pollux study's simulator: every (re)placement is a 30 s restart from a checkpoint.
PAPER_COSTS = Costs(start=30.0, grow=30.0, shrink=30.0, trains_while_growing=False,
                    label="paper's 30 s restarts")


@dataclass
class SimJob:
    """One job of a workload.

    Attributes:
        name, app, submitted (s), gpus: the GPUs it asked for, batch: its global batch.
        placement: GPUs per node now (() while it holds none); nodes: the node of each GPU.
        progress, epoch, completed (s or None), restarts: placement changes after the first.
        measured: GPUs -> steps per second the job last trained at with that many (what a run
        of this product reports as its speed).
    """

    name: str
    app: Application
    submitted: float
    gpus: int
    batch: int
    placement: tuple[int, ...] = ()
    nodes: list[int] = field(default_factory=list)
    progress: float = 0.0
    epoch: int = 0
    completed: float | None = None
    restarts: int = 0
    measured: dict[int, float] = field(default_factory=dict)
    _clock: float = 0.0
    _paused: float = 0.0  # seconds of the current change still to pay
    _old: tuple[int, ...] = ()  # the placement it trains on while growing

    @property
    def done(self) -> bool:
        return self.completed is not None

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
        """Make progress on `placement` for `seconds`, crossing epochs (the job ends after its
        last). The clock moves only as far as training went."""
        start = self._clock
        while seconds > 0 and not self.done:
            goodput = self._goodput(placement)
            goal = self.app.progress_at(self.epoch + 1)
            if self.progress + goodput * seconds < goal:
                self.progress += goodput * seconds
                break
            spent = (goal - self.progress) / goodput
            self.progress, self.epoch = goal, self.epoch + 1
            seconds -= spent
            self._clock += spent
            if self.epoch >= self.app.epochs:
                self.completed = self._clock
        self._clock = start if not self.done else self._clock

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
