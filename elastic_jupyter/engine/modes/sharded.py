"""The sharded state mode (``--shard``): each rank holds its rows of the parameters, gradients
and optimizer state, sharded with FSDP2 over each generation.

This class is the mode's part in the run's protocol; the machinery it drives is
engine.sharded.lifecycle.ShardedMode (:attr:`Sharded.sharded`): the layout agreed at each
generation's start, the rows resharded in memory, handed over by leavers, copied to partner
ranks every ``--replica-every`` steps and written one part per rank at checkpoints.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...config.run import RunConfig
from ...events import Event, EventKind
from ..data.stream_split import Streams
from ..faultpoints import fault_point
from ..group.collective import collectives_within
from ..protocol import TrainingState
from ..sharded import checkpoint_parts as sharded_checkpoint
from ..sharded.checkpoint_parts import PART_TIMEOUT_S
from ..sharded.lifecycle import ShardedMode
from ..sharded.resizable_model import move_model, reshard_all
from ..state.checkpoint import CheckpointError, latest_checkpoint
from ..state.checkpoint_writer import CheckpointWriter
from ..step.objects import SetupError
from ..step.running_stats import RunningStats
from .state_mode import Passes, Place, StateMode, Worker

if TYPE_CHECKING:
    from ..data.batching import BatchPlan
    from ..state.frozen import FrozenWeights
    from ..step.objects import CellObjects


class Sharded(StateMode):
    """Each rank holds its rows of the training state (see the module's docstring).

    Attributes:
        sharded: the machinery (engine.sharded.lifecycle.ShardedMode), once :meth:`set_up` ran.
    """

    _sharded: ShardedMode | None = None
    _written: int | None = None  # the step of this rank's last checkpoint part

    def __init__(self, config: RunConfig):
        super().__init__(config)
        self._noted: list[Event] = []  # rank 0's events of its copies, for take_events

    @property
    def sharded(self) -> ShardedMode:
        assert self._sharded is not None, "set_up builds the sharded machinery first"
        return self._sharded

    def place_model(self, model: nn.Module, device: torch.device) -> None:
        # on a GPU, the rows FSDP2 shards stay on the host until it shards them
        move_model(model, device, True, not self.config.move_frozen)

    # ---------------------------------------------------------------- what it refuses (yet)

    def check(self, cell: CellObjects, device: torch.device) -> None:
        for refusal in (self._one_optimizer, self._map_style_dataset, self._measured_cut,
                        self._no_sync_batchnorm, self._no_fp16, self._dense_plain_model,
                        self._no_extra_state, self._replica_cadence):
            refusal(cell, device)

    def _one_optimizer(self, cell: CellObjects, device: torch.device) -> None:
        if cell.substeps[0].name is not None:  # named optimizers, even one: a dict of them
            raise SetupError("--shard trains one optimizer: several optimizers would each need "
                             "their own sharded state; train without --shard")

    def _map_style_dataset(self, cell: CellObjects, device: torch.device) -> None:
        if isinstance(cell.dataset, Streams):
            raise SetupError("--shard does not read iterable datasets yet: a sharded step pads "
                             "passes with other ranks' samples, which a stream cannot fetch "
                             "cheaply. Use a map-style dataset, or train without --shard")

    def _measured_cut(self, cell: CellObjects, device: torch.device) -> None:
        if self.config.pass_cost == "measure" and device.type == "cuda":
            raise SetupError("--pass-cost measure is not supported with shard=True on a GPU: "
                             "the passes would run the whole model, which stays on the host "
                             "until sharded; give --pass-cost N (samples) or --micro-batch N")

    def _no_sync_batchnorm(self, cell: CellObjects, device: torch.device) -> None:
        if self.config.sync_batchnorm:
            raise SetupError("--sync-batchnorm is not supported with shard=True yet: "
                             "SyncBatchNorm's collectives run once per rank's share, not per "
                             "padded pass")

    def _no_fp16(self, cell: CellObjects, device: torch.device) -> None:
        if self.config.precision == "fp16":
            raise SetupError("--precision fp16 is not supported with shard=True yet (its "
                             "GradScaler over sharded gradients is not wired): use bf16")

    def _dense_plain_model(self, cell: CellObjects, device: torch.device) -> None:
        model = cell.model
        if any(getattr(m, "sparse", False) for m in model.modules()
               if isinstance(m, (nn.Embedding, nn.EmbeddingBag))):
            raise SetupError("sparse gradients (an Embedding with sparse=True) are not "
                             "supported with --shard: FSDP2 reduce-scatters dense gradients; "
                             "use sparse=False")
        if any(name.split(".")[-1] == "_orig_mod" for name, _ in model.named_modules()):
            raise SetupError("a torch.compile'd model is not supported with --shard yet: FSDP2 "
                             "must shard the plain module, which is then rebuilt at each "
                             "resize; leave torch.compile out of the cell")

    def _no_extra_state(self, cell: CellObjects, device: torch.device) -> None:
        if cell.extra_state or cell.after_step is not None:
            raise SetupError("extra_state and after_step are not supported with shard=True "
                             "yet: an EMA of a sharded model must be sharded alike")

    def _replica_cadence(self, cell: CellObjects, device: torch.device) -> None:
        if self.config.replica_every < 1:
            raise SetupError(f"replica_every must be a positive number of steps, got "
                             f"{self.config.replica_every}")

    # ---------------------------------------------------------------- setup

    def set_up(self, cell: CellObjects, device: torch.device,
               fault: Callable[[], None]) -> None:
        self._sharded = ShardedMode(cell, self.config, device)  # SetupError: FSDP2 cannot
        self.sharded.reducer.fault = fault  # between reduce-scatters, in backward

    def gradient_reducer(self, model: nn.Module, device: torch.device,
                         owners: dict[int, int] | None) -> Any:
        return self.sharded.reducer

    def checkpoint_writer(self, before_write: Callable[[], None]) -> CheckpointWriter | None:
        return None  # every rank writes its part (:meth:`checkpoint`)

    def memory_need(self, optimizer: torch.optim.Optimizer, micro_batches: int,
                    device: torch.device) -> dict | None:
        return self.sharded.count_memory(optimizer, micro_batches, device)

    def set_aside(self) -> None:
        self.sharded.model.release()  # a warm engine is sent its rows at its join

    def check_setup(self, trials: Callable[[], None]) -> None:
        if self.sharded.model.holds_rows:  # released rows cannot run them (they ran at setup)
            trials()

    def capture(self, capture: Callable[..., TrainingState], **options: Any) -> TrainingState:
        return capture(rows=False, **options)  # the rows travel apart: resharding, parts

    def model_loader(self, frozen: FrozenWeights, state: TrainingState
                     ) -> Callable[[dict], None]:
        return lambda weights: None  # the rows come at the generation's start

    def load(self, worker: Worker, folder: str, details: list[str]
             ) -> tuple[str, TrainingState, list[str]]:
        """The newest sharded checkpoint in `folder`: its rest of the state restored here;
        every rank reads its rows at the next generation's start."""
        path, warnings = sharded_checkpoint.usable_latest(folder)
        if path is None:
            hint = (": its checkpoints were written without --shard; resume without it"
                    if latest_checkpoint(folder) else "")
            raise CheckpointError(f"no usable sharded checkpoint (step-*.shards) in {folder}"
                                  f"{hint}" + "".join(f"\n  {line}" for line in warnings))
        state = sharded_checkpoint.read_state(path)
        assert state is not None
        worker.frozen.check(state)  # the frozen weights it was trained with: this cell's?
        worker.restore(state)
        self.sharded.resume(path)
        return path, state, warnings

    def history_kept_after(self, keep_after: int) -> int:
        if self.sharded.folder:  # every rank writes its part, with the records since
            return min(keep_after, self.sharded.writer.saved_step or 0)
        return keep_after

    # ---------------------------------------------------------------- a generation

    def agree(self, worker: Worker, place: Place, newcomer: bool) -> Event | None:
        # a checkpoint part of an earlier generation may have been given up (a peer failed):
        # a leave point of this one writes its step again
        self._written = None
        self._noted = []  # a failed generation's copies are of its own timeline
        # survivors of a lost rank's rows go back to their replicas' step before newcomers
        # are sent the state
        event = self.sharded.agree(place.world_size, newcomer, worker.progress.step,
                                   worker.restore)
        if event is not None:
            event["generation"] = place.generation
        return event

    def start(self, worker: Worker, rank: int, world_size: int) -> None:
        # measured on the whole model (the cut); the rows come now
        worker.model = self.sharded.start(rank, world_size, worker.optimizer, worker.device)
        worker.running_stats = RunningStats(worker.model)

    def started(self, worker: Worker, place: Place) -> None:
        self._refresh(worker, place)  # replicas of the new layout, at once

    def _refresh(self, worker: Worker, place: Place) -> None:
        """Every rank: its part and the rest of the state copied, the part sent to its
        partner; rank 0 notes the bytes sent, the seconds and the host memory held."""
        start = time.perf_counter()
        fault_point("refresh", worker)
        sent = self.sharded.refresh(worker.progress.step, place.rank, place.world_size,
                                    worker.optimizer, worker.capture, place.generation)
        if place.rank == 0:
            self._noted.append({
                "kind": EventKind.REPLICAS.value, "step": worker.progress.step, "bytes": sent,
                "seconds": round(time.perf_counter() - start, 3),
                "host_bytes": self.sharded.host_bytes})

    def passes(self, plan: BatchPlan, batch: torch.Tensor, parts: Passes,
               world_size: int) -> Passes:
        return self.sharded.padded(plan, batch, parts, world_size)  # rank 0's count

    def evaluation_pads(self, own: int, rank0: int) -> int:
        return rank0 - own  # FSDP2's all-gathers in each forward: rank 0's count everywhere

    def forwards_done(self, model: nn.Module) -> None:
        reshard_all(model)  # FSDP2 keeps the root gathered after a forward no backward follows

    def model_runs_at_setup(self, device: torch.device) -> bool:
        return device.type != "cuda"  # on a GPU the rows wait on the host for the first mesh

    def collectives_in_passes(self) -> AbstractContextManager:
        return collectives_within("FSDP2's all-gather or reduce-scatter")

    def step_finished(self, worker: Worker, place: Place, step: int) -> None:
        self.sharded.settle()  # every rank finished the last refresh: older copies go
        if step % self.config.replica_every == 0:
            self._refresh(worker, place)

    def checkpoint(self, worker: Worker, place: Place, step: int) -> None:
        """Every rank starts writing its part of step `step`'s checkpoint beside training,
        from the host copy of a refresh at that step (one more when the last was of another
        step); rank 0's events come when the writes end (:meth:`take_events`)."""
        self._written = step  # every rank: the same decision at a leave point
        worker.frozen.verify()  # a frozen tensor that changed fails the run (engine.state.frozen)
        s = self.sharded
        if s.replicas.step != step or s.replicas.generation != place.generation:
            self._refresh(worker, place)
        s.checkpoint(step, place.rank, place.world_size, worker.capture,
                     self.config.keep_checkpoints, place.generation,
                     max(place.timeout, PART_TIMEOUT_S))

    def take_events(self, rank: int, wait: bool) -> list[Event]:
        if wait:
            self.sharded.writer.wait()
        noted, self._noted = self._noted, []
        events = self.sharded.writer.take_events()
        for e in events if rank != 0 else []:
            print(f"elastic-jupyter: {e.get('message', e)}", file=sys.stderr)
        return noted + events if rank == 0 else []

    def leave(self, worker: Worker, place: Place, drained: bool,
              named: Callable[[], list[int] | None]) -> list[int]:
        """Rows go to the ranks that stay, and the Worker keeps the model's skeleton (no
        memory) until the next generation builds it; when every rank leaves (each told to
        go), a checkpoint instead."""
        fault_point("handover", worker)
        going = self.sharded.leave(place.rank, place.world_size, drained,
                                   named() if place.rank == 0 else None, worker.optimizer)
        if len(going) < place.world_size:
            worker.model = self.sharded.model.skeleton
        elif self.sharded.folder is not None and self._written != worker.progress.step:
            self.checkpoint(worker, place, worker.progress.step)
        return going

    def abort_writes(self) -> None:
        self.sharded.writer.abort()  # a dead peer's checkpoint part never comes

    def end_generation(self) -> None:
        self.sharded.writer.wait()
