"""Who holds the training state, and what that changes in a setup, a step, a generation and a
checkpoint: one interface, :class:`StateMode`, with two implementations.

- engine.modes.replicated.Replicated: every rank holds the whole state; gradients are
  all-reduced (engine.group.reduce); rank 0 writes whole checkpoints
  (engine.state.checkpoint_writer).
- engine.modes.sharded.Sharded (``--shard``): each rank holds its rows of the parameters,
  gradients and optimizer state (FSDP2; the machinery is engine.sharded.lifecycle); they move in
  memory when the world size changes, are copied to a partner rank, and every rank writes its
  part of a checkpoint.

The Worker, its generation (engine.generation) and the engine's entry points call the mode
and never ask which one it is: engine.modes.state_mode chooses it once per Worker. Each method says
when it is called; "collective" means every rank of the generation calls it, in the same
order as every other collective, so the two modes issue the same sequence on all ranks.

The idea of one interface over the ways a state is placed follows torchft's small abstract
seams (``torchft/checkpointing/transport.py``); the methods are this run's protocol steps.

Where the planned work goes, so that it is written once per mode and not as branches:

- A step whose finished micro-batches survive a fault into the next generation: what a rank
  has reduced of the step so far is kept by the mode (the replicated mode's summed gradient;
  the sharded mode's reduce-scattered rows), offered in :meth:`agree` and taken up in
  :meth:`start`, so that :meth:`passes` returns only the passes not yet done.
- More sharded state (an EMA, a gradient scaler, several optimizers): each lifts one refusal
  of engine.modes.sharded.Sharded (``_no_extra_state``, ``_no_fp16``, ``_one_optimizer``) and
  adds its rows to what :meth:`capture`, :meth:`model_loader`, :meth:`checkpoint` and
  :meth:`leave` already carry.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from ...config.run import RunConfig
from ...events import Event
from ..protocol import TrainingState

if TYPE_CHECKING:
    from ..data.batching import BatchPlan
    from ..state.checkpoint_writer import CheckpointWriter
    from ..state.frozen import FrozenWeights
    from ..state.training_state import Progress, Staging
    from ..state.whole_checkpoints import WholeCheckpoints
    from ..step.objects import CellObjects
    from ..step.running_stats import RunningStats

Passes = list[tuple[int, torch.Tensor]]  # a rank's passes of a step: (index, sample indices)


class Worker(Protocol):
    """What a state mode reads and sets of the engine.worker.Worker it serves (a protocol:
    the Worker imports the modes, not the other way round)."""

    config: RunConfig
    slot: int | None  # fault points match it against the armed slots
    model: Any  # the cell's model; the sharded mode sets this generation's module
    optimizer: Any
    device: torch.device
    progress: Progress
    frozen: FrozenWeights
    checkpoints: WholeCheckpoints  # rank 0's, of the whole state (none under --shard)
    running_stats: RunningStats
    total_steps: int

    def capture(self, copy_tensors: bool = True, staging: Staging | None = None
                ) -> TrainingState: ...

    def restore(self, state: TrainingState) -> None: ...


@dataclass(frozen=True)
class Place:
    """A rank's place in the generation the mode's generation calls run in."""

    rank: int
    world_size: int
    generation: int
    timeout: float  # seconds a collective (and a checkpoint part) waits at most


class StateMode(ABC):
    """Where the training state lives. Built by :func:`state_mode` before the Worker places its
    model; :meth:`set_up` is called once the cell's objects are checked."""

    def __init__(self, config: RunConfig):
        self.config = config

    # ---------------------------------------------------------------- when things are due
    # (one rule for both modes: a checkpoint and an evaluation happen at the same steps)

    def checkpoint_due(self, step: int, total_steps: int) -> bool:
        """Whether committed step `step` is checkpointed: every ``checkpoint_every`` steps
        (0: none) and the last, where the run has a checkpoint folder."""
        every = self.config.checkpoint_every or 0
        return bool(self.config.checkpoint_dir) and (
            (every > 0 and step % every == 0) or step >= total_steps)

    def evaluation_due(self, step: int, total_steps: int) -> bool:
        """Whether committed step `step` is evaluated: every ``eval_every`` steps and the last
        (the evaluation itself does nothing without an ``eval_dataset``)."""
        every = self.config.eval_every
        return bool(every and step % every == 0) or step >= total_steps

    # ---------------------------------------------------------------- setup (each engine)

    @abstractmethod
    def check(self, cell: CellObjects, device: torch.device) -> None:
        """First of all, once the cell's objects are read: refuse what this mode cannot train
        yet, each refusal a method of its own (raises engine.step.objects.SetupError saying what
        to change)."""

    @abstractmethod
    def place_model(self, model: nn.Module, device: torch.device) -> None:
        """Move the cell's model to where this mode trains it."""

    @abstractmethod
    def set_up(self, cell: CellObjects, device: torch.device,
               fault: Callable[[], None]) -> None:
        """Build what this mode keeps (raises SetupError for a model it cannot lay out).
        `fault`: a fault point between a step's collectives, for the tests' fault
        injection."""

    @abstractmethod
    def gradient_reducer(self, model: nn.Module, device: torch.device,
                         owners: dict[int, int] | None) -> Any:
        """The step's gradient reduction (engine.group.reduce.GradReducer's interface), `owners`:
        each parameter's optimizer (engine.step.optimizers.owners)."""

    @abstractmethod
    def checkpoint_writer(self, before_write: Callable[[], None]) -> CheckpointWriter | None:
        """Rank 0's writer of whole-state checkpoints, or None (no folder, or each rank writes
        its part itself)."""

    @abstractmethod
    def memory_need(self, optimizer: torch.optim.Optimizer, micro_batches: int,
                    device: torch.device) -> dict | None:
        """At setup: what a rank needs at each world size, for the owner's memory bound
        (run.memory_bound), or None where every rank holds the whole state."""

    @abstractmethod
    def set_aside(self) -> None:
        """At setup of a warm engine (on no slot yet): give back what it need not hold until
        it joins."""

    @abstractmethod
    def check_setup(self, trials: Callable[[], None]) -> None:
        """Run the setup's `trials` (engine.step.trials) where this engine can: not where its
        trained rows were given back (:meth:`set_aside`)."""

    # ---------------------------------------------------------------- the training state

    @abstractmethod
    def capture(self, capture: Callable[..., TrainingState], **options: Any) -> TrainingState:
        """The training state by engine.state.training_state's `capture` with `options`: with the
        model's and the optimizer's rows where this mode keeps them in the state."""

    @abstractmethod
    def model_loader(self, frozen: FrozenWeights, state: TrainingState
                     ) -> Callable[[dict], None]:
        """How :meth:`Worker.restore` loads the model's part of `state`."""

    @abstractmethod
    def load(self, worker: Worker, folder: str, details: list[str]
             ) -> tuple[str, TrainingState, list[str]]:
        """``--resume``, or a fault that left no survivor (rank 0): restore `worker` from the
        newest usable checkpoint of this mode in `folder`; returns (its path, its state,
        warnings naming newer ones skipped). torch's full errors are appended to `details`.
        Raises engine.state.checkpoint.CheckpointError when none is usable."""

    @abstractmethod
    def history_kept_after(self, keep_after: int) -> int:
        """The step after which the Worker keeps records (engine.state.history), given `keep_after`:
        earlier where this rank's own checkpoint write still needs them."""

    # ---------------------------------------------------------------- a generation

    @abstractmethod
    def agree(self, worker: Worker, place: Place, newcomer: bool) -> Event | None:
        """A generation's start, before the state broadcast (collective): agree where each
        rank's state comes from; a rollback's event when the ranks go back to another step."""

    @abstractmethod
    def start(self, worker: Worker, rank: int, world_size: int) -> None:
        """In Worker.start_generation, after the broadcast and the cut (collective): the model
        as this generation trains it (the Worker's model and BatchNorm records follow it)."""

    @abstractmethod
    def started(self, worker: Worker, place: Place) -> None:
        """After the input is positioned, before the first step (collective): what the new
        layout needs at once (the partner copies)."""

    @abstractmethod
    def passes(self, plan: BatchPlan, batch: torch.Tensor, parts: Passes,
               world_size: int) -> Passes:
        """This rank's passes over a step's `batch`, from its micro-batches `parts`."""

    @abstractmethod
    def evaluation_pads(self, own: int, rank0: int) -> int:
        """How many zero chunks a rank evaluates before its `own` chunks, rank 0 evaluating
        `rank0`: where forward passes are collectives (FSDP2's all-gathers), every rank runs
        rank 0's count."""

    @abstractmethod
    def forwards_done(self, model: nn.Module) -> None:
        """After forward passes that no backward follows (an evaluation): leave the model as
        a step finds it (FSDP2 keeps the root gathered after a forward)."""

    @abstractmethod
    def model_runs_at_setup(self, device: torch.device) -> bool:
        """Whether the setup's trials may run the model on `device` (a sharded model on a GPU
        waits on the host for its first mesh: its metric_fn is first called at the first
        evaluation)."""

    @abstractmethod
    def collectives_in_passes(self) -> AbstractContextManager:
        """Where the forward and backward passes run collectives of their own (FSDP2's,
        SyncBatchNorm's): a peer failing there is a fault, as in our collectives."""

    @abstractmethod
    def step_finished(self, worker: Worker, place: Place, step: int) -> None:
        """After committed step `step` is evaluated and recorded (collective)."""

    @abstractmethod
    def checkpoint(self, worker: Worker, place: Place, step: int) -> None:
        """At committed step `step` when :meth:`checkpoint_due` (collective): start writing
        its checkpoint, by rank 0 or by every rank for its part, beside training."""

    @abstractmethod
    def take_events(self, rank: int, wait: bool) -> list[Event]:
        """Rank 0's events of this mode since the last call (its copies, the checkpoint
        writes that ended; with `wait`, every write once it ended); another rank's write
        failures go to its log."""

    @abstractmethod
    def leave(self, worker: Worker, place: Place, drained: bool,
              named: Callable[[], list[int] | None]) -> list[int]:
        """At a generation's end by request (collective): the ranks that leave (`drained`:
        this one was told to go; `named()`: rank 0's read of the owner's leavers) after
        handing over what they hold; [] where nothing is handed over."""

    @abstractmethod
    def abort_writes(self) -> None:
        """A peer failed: give up the writes that wait for it."""

    @abstractmethod
    def end_generation(self) -> None:
        """The generation ended or failed: the writes this rank started are finished."""


def no_collectives() -> AbstractContextManager:
    """collectives_in_passes for passes that run none."""
    return contextlib.nullcontext()
