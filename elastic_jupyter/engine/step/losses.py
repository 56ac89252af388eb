"""What ``loss_fn`` and ``metric_fn`` return, and what each micro-batch's loss (each evaluation
chunk's metric) counts for."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MeanOver:
    """A loss that is a mean over `count` items of the batch (tokens, pixels, ...) rather than
    over its samples. Return it from ``loss_fn``, alone or as ``(MeanOver(loss, count), metrics)``,
    or as a value of ``metric_fn``'s dict (:func:`read_metrics`: its evaluation is then the mean
    over every item of the eval set).

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


def read_metrics(out, samples: int) -> dict:
    """Split ``metric_fn``'s output for an evaluation chunk of `samples` samples into
    ``{name: (value, weight)}``: a plain value (a number or a one-element tensor) is a mean over
    the chunk's samples, so its weight is `samples`; a ``MeanOver(value, count)`` is a mean over
    `count` items (tokens), its weight. Tensors are kept as they are (reading a GPU tensor waits
    for the device): the caller reads them all at once.

    Raises TypeError for an output that is not a dict of such values.
    """
    if not isinstance(out, Mapping):
        raise TypeError("metric_fn must return a dict {name: value}, each value a number, a "
                        f"one-element tensor or MeanOver(value, count); got {type(out).__name__}")
    metrics = {}
    for name, value in out.items():
        value, weight = (value.loss, value.count) if isinstance(value, MeanOver) else \
            (value, samples)
        for what, x in (("value", value), ("MeanOver count", weight)):
            if isinstance(x, torch.Tensor) and x.numel() == 1:
                continue
            if not isinstance(x, torch.Tensor):
                try:
                    float(x)
                    continue
                except (TypeError, ValueError):
                    pass
            got = (f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor)
                   else type(x).__name__)
            raise TypeError(f"metric_fn's {name!r}: its {what} must be a number or a "
                            f"one-element tensor (a mean over the batch, or MeanOver(value, "
                            f"count) for a mean over count items); got {got}")
        metrics[name] = (value, weight)
    return metrics


def weighted(value, weight: float) -> torch.Tensor | float:
    """`value` (a metric or loss: a one-element tensor, or a number) times `weight`: a float64
    tensor on the value's GPU (reading it now would wait for the device), else a float."""
    if torch.is_tensor(value) and value.device.type != "cpu":
        return value.detach().double().reshape(()) * weight  # it may still require grad
    return float(value.detach() if torch.is_tensor(value) else value) * weight


def floats(values: list) -> list[float]:
    """`values` (floats, or tensors from :func:`weighted`) as floats; the tensors are read in
    one transfer, so the step waits for its device once."""
    at = [i for i, v in enumerate(values) if torch.is_tensor(v)]
    out = [float(v) if not torch.is_tensor(v) else 0.0 for v in values]
    if at:
        device = values[at[0]].device  # a metric may sit elsewhere than the loss
        for i, v in zip(at, torch.stack([values[i].to(device) for i in at]).tolist()):
            out[i] = v
    return out
