"""What each micro-batch weighs in a step's update: its samples, or its MeanOver items.

The update is the mean gradient of the global batch B whatever the world size: each rank scales
the mean loss of a micro-batch of m samples by m / B, and gradients are summed across ranks. A
loss that is a mean over c items (``MeanOver(loss, c)``) is scaled by c / B instead, the counts
are summed with the gradients (in the commit vote), and the sum is multiplied by B / (total
count): the mean over every item.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import torch

from ..group.reduce import Reducer
from .losses import read_loss, weighted
from .precision import Precision


class StepWeights:
    """The weighting of one rank's micro-batches, step after step.

    Args:
        precision: the run's backward (scaled with fp16).
        reducer: the gradient reduction (a pass that adds nothing leaves its parameters unused).

    Attributes:
        mean_over: whether loss_fn's losses are MeanOver, once seen (None before).
        count: the samples (or MeanOver items) this rank's share weighed this step.
        items: the same summed over the global batch, once the vote summed it.
    """

    def __init__(self, precision: Precision, reducer: Reducer):
        self.precision, self.reducer = precision, reducer
        self.mean_over: bool | None = None
        self.count = 0.0
        self.items = 0.0

    def begin(self) -> None:
        """A new step: nothing weighed yet."""
        self.count = 0.0

    def backward(self, out, samples: int, B: int, step: int,
                 sync_batchnorm: bool) -> tuple[torch.Tensor | float, dict, float]:
        """Backward of one micro-batch's ``loss_fn`` output `out` weighted by its count / `B`
        (its `samples`, or its MeanOver items) at step `step` (1-based in messages: the step
        being trained is ``step + 1``); returns (weighted loss, metrics, weight), the loss as a
        float64 tensor on the device (reading it here would wait for the device). Raises
        TypeError when loss_fn mixes MeanOver and plain losses."""
        loss, metrics, count, mean_over = read_loss(out, samples)
        if self.mean_over is None:
            self.mean_over = mean_over
        elif mean_over != self.mean_over:
            raise TypeError("loss_fn returned MeanOver(loss, count) for some batches and a plain "
                            "loss for others: return the same kind for every batch")
        self.count += count
        if not count:  # nothing to average: its loss (NaN for an empty mean) must not count
            if (collective := self.reducer.collective_backward(sync_batchnorm)) is not None:
                self._backward_for_peers(loss, step, *collective)
            return 0.0, dict.fromkeys(metrics, 0.0), 0.0
        weight = count / B
        self.precision.backward(loss * weight)
        return weighted(loss, weight), metrics, weight

    def _backward_for_peers(self, loss: torch.Tensor, step: int, option: str,
                            layer: str) -> None:
        """With --sync-batchnorm or --shard (`option`, whose `layer` runs collectives in the
        backward), the backward of a pass whose MeanOver count is 0, at weight 0: a rank that
        skipped SyncBatchNorm's or FSDP2's collectives would leave its peers waiting. Its
        parameters count as unused: a parameter no other rank has a gradient for ends with
        ``.grad`` None (engine.group.reduce; with SyncBatchNorm the pass is the rank's only one
        of the step). Tested on CPU with a stand-in for SyncBatchNorm's collective
        (tests/test_gradients.py), not with SyncBatchNorm on GPUs.

        Raises ValueError when `loss` is not finite: 0 * NaN is NaN, which the collectives
        would add into every rank's gradients.
        """
        if not bool(torch.isfinite(loss.detach()).all()):
            raise ValueError(
                f"loss_fn returned a loss of {float(loss.detach())} with a MeanOver count of 0 "
                f"at step {step + 1}: with {option} every rank's pass "
                f"takes part in {layer}'s backward, so loss_fn must return a finite loss "
                "for a batch with no items (e.g. divide by count.clamp(min=1))")
        self.reducer.backward_at_zero_weight(loss, self.precision.backward)

    def zero_weight_backward(self, out) -> None:
        """The backward of a padding pass under --shard (engine.sharded.lifecycle), at weight
        0: FSDP2's all-gathers and reduce-scatters are collectives, so every rank runs as many
        passes as rank 0. Its gradients are zeros and its parameters count as unused (a padding
        pass's loss that is not finite is not refused: it reads rank 0's first micro-batch,
        whose own backward puts the same NaN into every rank's gradients, as in the replicated
        mode)."""
        self.reducer.backward_at_zero_weight(read_loss(out, 1)[0], self.precision.backward)

    def settle(self, total: float, B: int, step: int) -> float | None:
        """The vote summed every rank's count to `total` (the global batch's MeanOver items;
        `B` for plain losses): the factor B / total that makes the update the mean over every
        item, or None when it is 1. Raises ValueError when `total` is 0 (nothing to average)."""
        self.items = total
        if total == B:
            return None
        if not total:
            raise ValueError(f"loss_fn's MeanOver counts sum to 0 over the global batch of "
                             f"step {step + 1}: there is nothing to average")
        return B / total
