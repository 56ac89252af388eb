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

from .losses import read_loss, weighted
from .precision import Precision
from .reduce import GradReducer
from .sharded_reduce import ShardedReducer


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

    def __init__(self, precision: Precision, reducer: GradReducer | ShardedReducer):
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
            if sync_batchnorm:
                self._backward_for_peers(loss, step)
            return 0.0, dict.fromkeys(metrics, 0.0), 0.0
        weight = count / B
        self.precision.backward(loss * weight)
        return weighted(loss, weight), metrics, weight

    def _backward_for_peers(self, loss: torch.Tensor, step: int) -> None:
        """With --sync-batchnorm, the backward of a pass whose MeanOver count is 0, at weight 0:
        SyncBatchNorm's backward is a collective, and a rank that skipped it would leave its
        peers waiting. The pass is this rank's only one of the step (its whole share in one
        pass), so its parameters count as unused: a parameter no other rank has a gradient for
        ends with ``.grad`` None (engine.reduce). Tested on CPU with a stand-in for
        SyncBatchNorm's collective (tests/test_gradients.py), not with SyncBatchNorm on GPUs.
        Raises ValueError when `loss` is not finite (:meth:`_at_weight_zero`)."""
        self._at_weight_zero(loss, step, "--sync-batchnorm", "with a MeanOver count of 0")
        self.reducer.forget_pass()

    def zero_weight_backward(self, out, step: int) -> None:
        """The backward of a padding pass under --shard (engine.sharded_mode), at weight 0:
        FSDP2's all-gathers and reduce-scatters are collectives, so every rank runs as many
        passes as rank 0. Its gradients are zeros and its parameters count as unused
        (engine.sharded_reduce). Raises ValueError when its loss is not finite."""
        loss = read_loss(out, 1)[0]
        reducer = self.reducer
        assert isinstance(reducer, ShardedReducer), "padding passes run under shard=True only"
        reducer.padding(True)
        try:
            self._at_weight_zero(loss, step, "--shard", "in a padding pass")
        finally:
            reducer.padding(False)

    def _at_weight_zero(self, loss: torch.Tensor, step: int, option: str, where: str) -> None:
        """Backward of `loss` * 0 (its collectives run; it adds nothing). Raises ValueError
        when `loss` is not finite: 0 * NaN is NaN, which the reduction would add to every
        rank's gradients."""
        if not bool(torch.isfinite(loss.detach()).all()):
            raise ValueError(
                f"loss_fn returned a loss of {float(loss.detach())} {where} at step {step + 1}: "
                f"with {option} every rank's pass takes part in the collectives of backward, so "
                "loss_fn must return a finite loss there (for a mean over no items, divide by "
                "count.clamp(min=1))")
        self.precision.backward(loss * 0.0)

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
