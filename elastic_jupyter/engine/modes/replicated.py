"""The replicated state mode: every rank holds the whole training state.

Gradients are all-reduced in buckets (engine.group.reduce), a newcomer is sent the whole state by
broadcast (engine.group.state_transfer), and rank 0 writes whole checkpoints beside training
(engine.state.checkpoint_writer). Nothing moves when the world size changes but the broadcast.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...events import Event
from ..group.collective import collectives_within
from ..group.reduce import GradReducer
from ..protocol import TrainingState
from ..sharded import checkpoint_parts as sharded_checkpoint
from ..sharded.resizable_model import move_model
from ..state.checkpoint import CheckpointError, load_latest
from ..state.checkpoint_writer import CheckpointWriter
from .state_mode import Passes, Place, StateMode, Worker, no_collectives

if TYPE_CHECKING:
    from ..data.batching import BatchPlan
    from ..state.frozen import FrozenWeights
    from ..step.objects import CellObjects


class Replicated(StateMode):
    """Every rank holds the whole training state (see the module's docstring)."""

    def place_model(self, model: nn.Module, device: torch.device) -> None:
        move_model(model, device, False, not self.config.move_frozen)

    def check(self, cell: CellObjects, device: torch.device) -> None:
        pass  # every option and cell the run takes trains replicated

    def set_up(self, cell: CellObjects, device: torch.device,
               fault: Callable[[], None]) -> None:
        pass

    def gradient_reducer(self, model: nn.Module, device: torch.device,
                         owners: dict[int, int] | None) -> GradReducer:
        return GradReducer(model, device, owners=owners)

    def checkpoint_writer(self, before_write: Callable[[], None]) -> CheckpointWriter | None:
        folder = self.config.checkpoint_dir
        return CheckpointWriter(folder, self.config.keep_checkpoints,
                                before_write=before_write) if folder else None

    def memory_need(self, optimizer: torch.optim.Optimizer, micro_batches: int,
                    device: torch.device) -> dict | None:
        return None  # each rank holds the whole state whatever the world size

    def set_aside(self) -> None:
        pass  # a warm engine keeps the state its cell built: a join sends it the run's

    def check_setup(self, trials: Callable[[], None]) -> None:
        trials()

    def capture(self, capture: Callable[..., TrainingState], **options: Any) -> TrainingState:
        return capture(rows=True, **options)

    def model_loader(self, frozen: FrozenWeights, state: TrainingState
                     ) -> Callable[[dict], None]:
        return lambda weights: frozen.load(weights, state)

    def load(self, worker: Worker, folder: str, details: list[str]
             ) -> tuple[str, TrainingState, list[str]]:
        try:
            path, state, warnings = load_latest(folder, log=details.append)
        except CheckpointError as e:
            if sharded_checkpoint.latest(folder):
                raise CheckpointError(f"{e}: its checkpoints were written with --shard; resume "
                                      "with --shard") from None
            raise
        worker.restore(state)
        return path, state, warnings

    def history_kept_after(self, keep_after: int) -> int:
        return keep_after  # rank 0's writer counts in the Worker's rule

    def agree(self, worker: Worker, place: Place, newcomer: bool) -> Event | None:
        return None  # the broadcast's source is rank 0, whose state every survivor shares

    def start(self, worker: Worker, rank: int, world_size: int) -> None:
        pass  # the model trains as it is

    def started(self, worker: Worker, place: Place) -> None:
        pass

    def passes(self, plan: BatchPlan, batch: torch.Tensor, parts: Passes,
               world_size: int) -> Passes:
        if self.config.sync_batchnorm and parts:
            # SyncBatchNorm's statistics span what every rank forwards at once: one pass over
            # the rank's whole share gives the global batch (and no rank waits on another)
            return [(parts[0][0], torch.cat([chunk for _, chunk in parts]))]
        return parts

    def evaluation_pads(self, own: int, rank0: int) -> int:
        return 0  # each rank's forwards are its own

    def forwards_done(self, model: nn.Module) -> None:
        pass

    def model_runs_at_setup(self, device: torch.device) -> bool:
        return True

    def collectives_in_passes(self) -> AbstractContextManager:
        if self.config.sync_batchnorm:
            return collectives_within("SyncBatchNorm statistics")
        return no_collectives()

    def step_finished(self, worker: Worker, place: Place, step: int) -> None:
        pass

    def checkpoint(self, worker: Worker, place: Place, step: int) -> None:
        """Rank 0 copies the state (the step waits for the copy only) and its writer writes
        it in the background; the next checkpoint's copy waits for that write (it reuses the
        buffers). The last step's state changes no more (the generation waits for the
        write): no copy."""
        if place.rank == 0:
            worker.checkpoints.write(worker.capture, last=step >= worker.total_steps)

    def take_events(self, rank: int, wait: bool) -> list[Event]:
        return []  # rank 0's writes' events are the Worker's (Worker.checkpoints)

    def leave(self, worker: Worker, place: Place, drained: bool,
              named: Callable[[], list[int] | None]) -> list[int]:
        return []  # every rank holds the whole state: nothing to hand over

    def abort_writes(self) -> None:
        pass  # rank 0's writer waits for no peer

    def end_generation(self) -> None:
        pass
