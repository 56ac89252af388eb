"""BatchNorm running statistics in micro-batch order, whatever the world size.

In training mode a BatchNorm layer normalises with the statistics s of the samples of one
forward pass, here one micro-batch (the same at every world size, see engine.data.batching), and
folds them into its buffers: R <- (1 - f) R + f s, with f the momentum (or 1 / batches tracked
when the momentum is None). A single process running a step's K micro-batches in order applies
K such updates in sequence; with W ranks, each rank sees only its own micro-batches.

So during a step each training-mode layer runs with momentum 1, which leaves exactly s_k in its
buffers after micro-batch k; the rank copies them into row k of a table. One all-reduce sums the
tables of all ranks (each row has one contributor and zeros elsewhere, so the sum is exact), and
every rank replays the K updates in micro-batch order from the buffers the step started with.
Every rank ends the step with the buffers a single process would have, to float round-off.

A layer that runs several times in one micro-batch (a GAN's discriminator on the real batch,
then on the fake one) has each call's statistics recorded by a forward hook, and its row holds
their updates folded into one: C calls with momentum f move R to (1 - f)^C R + sum_j f (1 -
f)^(C-1-j) s_j, which the replay applies. With momentum None (a cumulative average, whose factor
depends on the count so far) a layer must run at most once per micro-batch; more raises RuntimeError
on every rank. SyncBatchNorm layers are left alone: their statistics already span the global
batch.
"""
from __future__ import annotations

import contextlib
import functools
from typing import cast

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm

from ..group.collective import collective


def _record(seen: list, module: _BatchNorm, inputs, output) -> None:
    """A forward hook: the call's statistics (the buffers, at momentum 1)."""
    if module.training:
        seen.append((cast(torch.Tensor, module.running_mean).clone(),
                     cast(torch.Tensor, module.running_var).clone()))


def _folded(seen: list, momentum: float | None, like: torch.Tensor) -> tuple:
    """(calls, mean, var) of a micro-batch's row: one call's statistics as they are; several
    calls' updates with momentum f folded, sum_j f (1 - f)^(C-1-j) s_j (combine applies them
    after (1 - f)^C of the buffers); none, zeros."""
    if not seen:
        return 0, torch.zeros_like(like), torch.zeros_like(like)
    if len(seen) == 1 or momentum is None:  # several without a momentum: refused in combine
        return len(seen), seen[-1][0], seen[-1][1]
    count = len(seen)
    weights = [momentum * (1 - momentum) ** (count - 1 - j) for j in range(count)]
    return (count, sum(w * mean.double() for w, (mean, _) in zip(weights, seen)),
            sum(w * var.double() for w, (_, var) in zip(weights, seen)))


class RunningStats:
    """Records each micro-batch's BatchNorm statistics and combines them across ranks.

    Per step, on every rank: :meth:`begin`, then :meth:`micro_batch` around each of the rank's
    micro-batches, then :meth:`combine` (a collective every rank calls, also one without
    micro-batches; no collective when no layer is in training mode); :meth:`undo` when the
    step is not committed.

    Args:
        model: the module whose BatchNorm layers (not SyncBatchNorm) tracking running
            statistics are handled; the list is fixed here.
    """

    def __init__(self, model: torch.nn.Module):
        self.layers = [(name, m) for name, m in model.named_modules()
                       if isinstance(m, _BatchNorm) and not isinstance(m, torch.nn.SyncBatchNorm)
                       and m.track_running_stats]
        self._start: list = []  # (name, layer, mean, var, batches tracked) of training layers
        self._rows: dict = {}  # micro-batch index -> [(calls, mean, var)] per training layer

    def begin(self) -> None:
        """Note the buffers the step starts with, for the layers in training mode (the same on
        every rank)."""
        # the layers track running statistics (see __init__): their buffers are tensors
        self._start = [(name, m, cast(torch.Tensor, m.running_mean).clone(),
                        cast(torch.Tensor, m.running_var).clone(),
                        int(cast(torch.Tensor, m.num_batches_tracked)))
                       for name, m in self.layers if m.training]
        self._rows = {}

    @contextlib.contextmanager
    def micro_batch(self, index: int):
        """Run the block (micro-batch `index`'s forward and backward) recording its statistics:
        each training layer's, call by call (a forward hook)."""
        momenta = [m.momentum for _, m, *_ in self._start]
        calls: list[list] = [[] for _ in self._start]
        hooks = [m.register_forward_hook(functools.partial(_record, seen))
                 for (_, m, *_), seen in zip(self._start, calls)]
        for _, m, *_ in self._start:
            m.momentum = 1.0  # the buffers then hold exactly the call's statistics
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            for (_, m, *_), momentum in zip(self._start, momenta):
                m.momentum = momentum
        self._rows[index] = [_folded(seen, momentum, mean)
                             for (_, _, mean, _, _), seen, momentum
                             in zip(self._start, calls, momenta)]

    def combine(self, count: int) -> None:
        """Gather the statistics of the step's `count` micro-batches from every rank and set
        every layer's buffers to the result of applying them in micro-batch order.

        Raises RuntimeError (on every rank) if a layer without a momentum ran more than once
        in one micro-batch.
        """
        if not self._start:
            return
        table = self._table(count)
        if dist.is_initialized() and dist.get_world_size() > 1:
            with collective("BatchNorm statistics all-reduce"):
                dist.all_reduce(table)
        offset = 0
        for name, m, mean, var, tracked in self._start:
            width = mean.numel()
            for row in table[:, offset:offset + 1 + 2 * width]:
                calls = int(row[0])
                if calls > 1 and m.momentum is None:
                    raise RuntimeError(
                        f"BatchNorm layer {name!r} (momentum=None: a cumulative average) ran "
                        f"{calls} times in training mode in one micro-batch: give it a "
                        "momentum, or call it once per micro-batch")
                if calls > 1:  # the row holds its calls' updates folded (_folded)
                    tracked += calls
                    keep = (1 - m.momentum) ** calls
                    mean = row[1:1 + width].to(mean.dtype) + mean * keep
                    var = row[1 + width:].to(var.dtype) + var * keep
                elif calls:
                    tracked += 1
                    f = m.momentum if m.momentum is not None else 1.0 / tracked
                    mean = row[1:1 + width].to(mean.dtype) * f + mean * (1 - f)
                    var = row[1 + width:].to(var.dtype) * f + var * (1 - f)
            m.running_mean.copy_(mean)
            m.running_var.copy_(var)
            m.num_batches_tracked.fill_(tracked)
            offset += 1 + 2 * width

    def undo(self) -> None:
        """Put back the buffers the step started with: a step that was not committed (a peer
        failed, or the vote aborted) leaves the model as it found it (engine.group.vote)."""
        with torch.no_grad():
            for _, m, mean, var, tracked in self._start:
                m.running_mean.copy_(mean)
                m.running_var.copy_(var)
                m.num_batches_tracked.fill_(tracked)

    def _table(self, count: int) -> torch.Tensor:
        """Rows 0..count-1: [calls, mean, var] of every training layer, zero for micro-batches
        of other ranks; float64, which holds the buffers' values exactly."""
        device = self._start[0][1].running_mean.device
        width = sum(1 + 2 * mean.numel() for _, _, mean, _, _ in self._start)
        table = torch.zeros(count, width, dtype=torch.float64, device=device)
        for index, layers in self._rows.items():
            table[index] = torch.cat([torch.cat([mean.new_tensor([calls]), mean, var]).double()
                                      for calls, mean, var in layers])
        return table
