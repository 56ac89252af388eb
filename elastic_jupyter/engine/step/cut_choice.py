"""How a run's steps are cut into micro-batches: the cut its options ask for, and the cut it
records at its first generation (measured first with ``--pass-cost measure``).

The cut itself, and the rule that picks it, are engine.data.batching's; the measurement is
engine.step.calibration's. This owner knows what they need from the cell: the floor a micro-batch
may not go below (the cell's ``min_micro_batch``, BatchNorm's statistics) and a pass to time.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import time
from typing import cast

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm

from ...config.run import RunConfig
from ...events import Event, EventKind
from ..data.batching import BATCHNORM_FLOOR, BatchPlan, Cut, choose_cut
from ..data.randomness import micro_batch_stream
from ..data.to_device import to_device
from ..group.collective import collective
from ..state import training_state as state_mod
from . import calibration
from .losses import read_loss
from .objects import CellObjects, SetupError
from .precision import Precision

CALIBRATION_STREAM = 2**64 - 1  # the random stream of measuring passes: no micro-batch's


class CutChoice:
    """The run's cut, as its options and its cell ask for it.

    Args:
        config: the run's options (global_batch, micro_batch, pass_cost, sync_batchnorm,
            drop_last, pool_min_size, pool_max_size, seed).
        objects: the cell's objects (the model after any SyncBatchNorm conversion).
        device: where the model trains.
        precision: the run's autocast (a measured pass runs as a step's does).
    """

    def __init__(self, config: RunConfig, objects: CellObjects, device: torch.device,
                 precision: Precision):
        self.config, self.objects = config, objects
        self.device, self.precision = device, precision

    def floor(self) -> tuple[int, str]:
        """The fewest samples a micro-batch may hold, and what sets it: the cell's
        ``min_micro_batch``; else BatchNorm in training mode (its statistics are per
        micro-batch: BATCHNORM_FLOOR, and never below 2, where BatchNorm refuses to train),
        except with --sync-batchnorm (statistics over the global batch); else 1."""
        batchnorm = self.per_micro_batch_norm()
        floor = self.objects.min_micro_batch
        if floor is not None:
            if batchnorm and floor < 2:
                return 2, "BatchNorm trains on 2 samples or more (min_micro_batch is 1)"
            return floor, "the cell's min_micro_batch"
        if batchnorm:
            return BATCHNORM_FLOOR, "BatchNorm, whose statistics are per micro-batch"
        return 1, ""

    def per_micro_batch_norm(self) -> bool:
        """Whether a BatchNorm layer (any subclass of torch's _BatchNorm) trains on each
        micro-batch's statistics: in training mode, without --sync-batchnorm."""
        return not self.config.sync_batchnorm and any(
            isinstance(m, _BatchNorm) and m.training for m in self.objects.model.modules())

    def configured(self, pass_cost: float | None = None) -> Cut:
        """The cut the run's options ask for (engine.data.batching.choose_cut); `pass_cost`: the
        measured one with ``--pass-cost measure``. Raises SetupError when the floor cannot be
        met."""
        cfg, samples = self.config, len(self.objects.dataset)
        given = cfg.pass_cost
        if given == "measure":
            given = pass_cost if pass_cost is not None else 0.0
        if cfg.sync_batchnorm and given is None and not cfg.micro_batch:
            given = 0.0  # a rank's share is one pass whatever the cut: balance by samples
        B, batchnorm = cfg.global_batch, self.per_micro_batch_norm()
        if batchnorm and samples % B == 1 and not cfg.drop_last:
            raise SetupError(
                f"the last step of each epoch holds 1 sample ({samples} samples, "
                f"--global-batch {B}), and BatchNorm cannot train on one: add --drop-last, or "
                "choose a --global-batch that leaves a remainder of 0 or at least 2")
        try:  # "measure" was replaced above
            return choose_cut(B, cfg.micro_batch, cast("float | None", given), cfg.pool_min_size,
                              cfg.pool_max_size, *self.floor(),
                              lowest=2 if batchnorm else 1)
        except ValueError as e:
            raise SetupError(str(e)) from None

    def record(self, plan: BatchPlan, progress: state_mod.Progress, rank: int,
               world_size: int) -> Event | None:
        """Fix the run's cut in `progress` and `plan` (a collective with ``--pass-cost
        measure``: rank 0 measures, every rank takes its value; all ranks call it before the
        run's first step).

        Returns, on rank 0, the ``micro_batches`` event saying how steps are cut and why; None
        elsewhere. Measuring passes leave no trace: gradients, buffers and RNG states are as
        before.
        """
        start = time.perf_counter()
        measured = None
        if self.config.pass_cost == "measure":
            cost = torch.zeros(1, dtype=torch.float64, device=self.device)  # nccl: on device
            if rank == 0:
                cost[0] = self._measure_pass_cost(plan, progress)
            if world_size > 1:
                with collective("sharing the pass cost"):
                    dist.broadcast(cost, src=0)
            measured = float(cost[0])
            plan.cut = self.configured(measured)
        progress.cut = plan.cut.as_dict()
        progress.pass_cost = plan.cut.pass_cost
        if rank != 0:
            return None
        B = self.config.global_batch
        message = plan.cut.describe(B)
        if measured is not None:
            message += (f" (measured in {time.perf_counter() - start:.2f} s: another run cuts "
                        f"its steps the same way with --pass-cost {measured:g})")
        if plan.cut.count(B) < plan.cut.max_size:
            message += (f"; at world sizes above {plan.cut.count(B)} some ranks have no "
                        "micro-batch")
        return {"kind": EventKind.MICRO_BATCHES.value, "step": progress.step, "time": time.time(),
                "micro_batches": plan.cut.count(B), "floor": plan.cut.floor,
                "pass_cost": plan.cut.pass_cost, "message": message}

    def _measure_pass_cost(self, plan: BatchPlan, p: state_mod.Progress) -> float:
        """engine.step.calibration's P from passes over the first step's samples: 2 of them, and a
        micro-batch's most (the step's share of one rank at the pool's largest size, at least 8)."""
        B, cell = self.config.global_batch, self.objects
        indices = plan.batch(p.epoch, p.position)  # an epoch's last step may be short
        large = min(len(indices), max(-(-B // self.config.pool_max_size), 8))
        if large < 4:  # micro-batches of 1-3 samples: too few to tell passes from samples
            return 0.0
        model = cell.model
        buffers = [b.detach().clone() for b in model.buffers()]
        rng = state_mod.rng_state()  # the dataset's draws from Python's and numpy's too
        # fetched before the timing: the passes' cost is the model's, not the loading's (which
        # --workers processes may do beside the passes)
        batches = {size: to_device(cell.collate_fn([cell.dataset[int(i)] for i in
                                                    indices[:size]]), self.device)
                   for size in (2, large)}

        def run_pass(size: int) -> None:
            with micro_batch_stream(self.config.seed, p.step, CALIBRATION_STREAM, self.device):
                with self.precision.autocast():
                    loss = read_loss(cell.substeps[0].loss_fn(model, batches[size]), size)[0]
                if loss.requires_grad:
                    loss.backward()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        try:
            return calibration.measure_pass_cost(run_pass, 2, large)
        finally:
            for param in model.parameters():
                param.grad = None
            state_mod.set_rng_state(rng)
            with torch.no_grad():
                for buffer, saved in zip(model.buffers(), buffers):
                    buffer.copy_(saved)
