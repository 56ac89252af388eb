"""What ``loss_fn`` returns, and what each micro-batch's loss counts for in the update."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MeanOver:
    """A loss that is a mean over `count` items of the batch (tokens, pixels, ...) rather than
    over its samples. Return it from ``loss_fn``, alone or as ``(MeanOver(loss, count), metrics)``.

    The update is then the mean over every item of the global batch, at any world size and
    micro-batch split: each micro-batch's loss is weighted by its count, the counts are summed
    across ranks with the gradients, and the gradients are divided by that sum afterwards. The
    logged loss and extra metrics are weighted the same way.

    Args:
        loss: scalar tensor, the mean over this batch's `count` items.
        count: how many items the mean is over (int, float or scalar tensor), >= 0. A batch
            with count 0 adds nothing (its loss, NaN for an empty mean, is not used; with
            --sync-batchnorm it must be finite, e.g. a sum divided by count.clamp(min=1)).
    """

    loss: torch.Tensor
    count: int | float | torch.Tensor


def read_loss(out, samples: int) -> tuple[torch.Tensor, dict, float, bool]:
    """Split ``loss_fn``'s output for a micro-batch of `samples` samples.

    Returns (loss, metrics, count, is_mean_over): a plain loss is a mean over `samples`.
    Raises TypeError for a loss that is not a scalar tensor, ValueError for a negative count.
    """
    loss, metrics = out if isinstance(out, tuple) else (out, {})
    mean_over = isinstance(loss, MeanOver)
    loss, count = (loss.loss, float(loss.count)) if mean_over else (loss, float(samples))
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        raise TypeError("loss_fn must return a scalar loss tensor, (loss, {'name': value}) or "
                        f"MeanOver(loss, count); got {type(loss).__name__}")
    if count < 0:
        raise ValueError(f"MeanOver count must be >= 0, got {count}")
    return loss, metrics, count, mean_over
