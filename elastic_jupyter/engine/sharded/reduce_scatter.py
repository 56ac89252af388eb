"""Summing a sharded model's gradients across ranks: FSDP2's reduce-scatter, our step protocol.

Under ``--shard`` each rank holds its rows of every parameter (engine.sharded.resizable_model), and
FSDP2 reduce-scatters the gradients in backward: each rank ends the pass with its rows of the summed
gradient (``set_gradient_divide_factor(1.0)``: summed, as the replicated mode's all-reduce;
engine.step.weighting weighs each micro-batch). :class:`ShardedReducer` drives it with the calls the
Worker makes on engine.group.reduce's GradReducer, so the step loop is the same in both modes:

- a rank's micro-batches before its last are accumulated unsharded, without a reduction
  (``set_requires_gradient_sync(False)``), and the last one's backward reduce-scatters once;
  where a whole unsharded gradient does not fit the rank's memory (engine.sharded.memory_need),
  ``per_pass`` makes every backward reduce-scatter, into the sharded gradient's sum;
- every rank runs the same number of passes (FSDP2's all-gathers and reduce-scatters are
  collectives): a rank with fewer micro-batches first runs zero-weight passes
  (engine.sharded.lifecycle pads them);
- parameters no rank used keep ``.grad = None``, as in plain PyTorch: every rank reduce-scatters
  every parameter (``set_reduce_scatter_unused_params``, zeros where unused, so the collectives
  match, as DDP's ``find_unused_parameters``), and the step's vote sums each rank's "used"
  flags, taken by a post-accumulate-grad hook on each unsharded parameter (FSDP2 keeps one
  unsharded ``nn.Parameter`` per parameter for the module's life; a forward pre-hook, which
  runs after FSDP2's own, finds it in place);
- ``--clip-grad-norm`` clips the whole model's norm without a collective after the vote: each
  rank's sum of squares of its gradient rows rides in the step's vote (torch's
  ``clip_grad_norm_`` over DTensors would all-reduce after the commit, where a peer's death
  must change nothing).

Every rank must run the same FSDP2 units in each pass (their all-gathers pair by order): a
forward whose units differ by rank or by data (LayerDrop, a branch wrapped as a unit of its
own) is not supported; a parameter a pass skips inside a unit that ran is.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

from typing import Callable, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ShardedReducer:
    """The reduction of one sharded module's gradients, with GradReducer's step protocol.

    Per step, on every rank: :meth:`begin_step`, the rank's passes (:meth:`padding` around a
    zero-weight one, :meth:`last_pass` before the last one's backward), :meth:`flush`,
    :meth:`finish`, the commit vote, :meth:`drop_unused` with the vote's sums.

    Attach it to each new sharded module with :meth:`attach` before its first forward.
    """

    def __init__(self, clips: bool = True):
        self.clips = clips  # the vote carries the squared norm (a pass over the gradients)
        self.params: list[nn.Parameter] = []  # the sharded trainable parameters (DTensors)
        self._names: list[str] = []
        self._units: list[FSDPModule] = []
        self._index: dict[int, int] = {}  # id of an unsharded parameter -> its index
        self._used: set[int] = set()  # indices of parameters with a gradient this step
        self._padding = False
        self._handles: list = []
        self._norm_sq = 0.0  # the gradients' squared norm over every rank, once voted
        self.per_pass = False  # each pass reduce-scatters (set for each generation)
        self._syncing = False  # this pass's backward reduce-scatters
        # called as a gradient lands while the pass reduce-scatters (engine.faultpoints)
        self.fault: Callable[[], None] = lambda: None

    def attach(self, module: nn.Module) -> None:
        """Reduce `module`'s gradients from now on (a module engine.sharded.resizable_model built on
        a mesh): every unit reduce-scatters every parameter, and the hooks that take each
        parameter's use are set on its unsharded parameter at its first forward."""
        self.close()
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names, self.params = [n for n, _ in named], [p for _, p in named]
        by_name = {n: i for i, n in enumerate(self._names)}
        self._index = {}
        self._units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        for prefix, unit in module.named_modules():
            if isinstance(unit, FSDPModule):
                unit.set_reduce_scatter_unused_params(True, recurse=False)
                self._handles.append(cast(nn.Module, unit).register_forward_pre_hook(
                    self._pre_forward_hook(prefix, by_name)))

    def _pre_forward_hook(self, prefix: str, by_name: dict[str, int]):
        def hook(unit: nn.Module, _args) -> None:
            for name, p in unit.named_parameters(prefix=prefix):
                # the unit's own parameters are unsharded now (FSDP2's hook ran first); a
                # nested unit's are still DTensors, found by its own hook
                if not isinstance(p, DTensor) and p.requires_grad and id(p) not in self._index \
                        and name.removeprefix(".") in by_name:
                    self._index[id(p)] = by_name[name.removeprefix(".")]
                    self._handles.append(p.register_post_accumulate_grad_hook(self._on_gradient))
        return hook

    def _on_gradient(self, p: torch.Tensor) -> None:
        if not self._padding:
            self._used.add(self._index[id(p)])
        if self._syncing:
            self.fault()

    def close(self) -> None:
        """Remove the hooks (a module that is left behind must not keep this reducer)."""
        for handle in self._handles:
            handle.remove()
        self._handles, self.params, self._units, self._index = [], [], [], {}

    # GradReducer's protocol ------------------------------------------------------------------

    @property
    def overlaps(self) -> bool:
        """FSDP2 reduce-scatters each unit as its backward ends."""
        return True

    def sync_order(self, world_size: int) -> None:
        """Nothing to align: FSDP2's units reduce in the order backward reaches them."""

    def begin_step(self, owner: int | None = None) -> None:
        """Start a step: no gradients; passes accumulate without a reduction until the last
        (unless ``per_pass``). `owner` is GradReducer's: ``--shard`` has one optimizer."""
        for p in self.params:
            p.grad = None
        self._used.clear()
        self._syncing = self.per_pass
        for unit in self._units:
            unit.set_requires_gradient_sync(self.per_pass, recurse=False)

    def padding(self, on: bool) -> None:
        """A zero-weight pass (`on`) runs, or ended: its gradients are zeros, and its
        parameters do not count as used."""
        self._padding = on

    def last_pass(self, overlap: bool) -> None:  # pylint: disable=unused-argument
        """The rank's last backward of the step comes next: it reduce-scatters."""
        self._syncing = True
        for unit in self._units:
            unit.set_requires_gradient_sync(True, recurse=False)

    def forget_pass(self) -> None:
        """The pass that just ran counts as unused (engine.step.weighting's pass without items)."""
        self._used.clear()


    def collective_backward(self, sync_batchnorm: bool) -> tuple[str, str]:
        """Every backward reduce-scatters and all-gathers: FSDP2's collectives."""
        return ("--shard", "FSDP2")

    def backward_at_zero_weight(self, loss: torch.Tensor,
                                backward: Callable[[torch.Tensor], None]) -> None:
        """A padding pass (:meth:`padding`): its gradients are zeros and its parameters do not
        count as used."""
        self.padding(True)
        try:
            backward(loss * 0.0)
        finally:
            self.padding(False)
    def flush(self, world_size: int) -> None:
        """Nothing to start: the reduce-scatters ran in the last backward."""

    def finish(self, world_size: int) -> list[float]:
        """This rank's "has a gradient" flag (1.0 or 0.0) per trainable parameter, in
        ``self.params`` order, then the sum of squares of its gradient rows (0 unless it
        ``clips``): the step's vote sums them."""
        with torch.no_grad():
            norm_sq = sum(float(torch.linalg.vector_norm(_local(p.grad), dtype=torch.float64)
                                ** 2) for p in self.params if p.grad is not None) \
                if self.clips else 0.0
        return [float(i in self._used) for i in range(len(self.params))] + [norm_sq]

    def drop_unused(self, counts: list[float]) -> None:
        """``.grad = None`` for each parameter that no rank used (`counts`: the vote's sums
        of :meth:`finish`'s values)."""
        *counts, self._norm_sq = counts
        for p, n in zip(self.params, counts):
            if not n:
                p.grad = None

    def scale(self, factor: float) -> None:
        """Multiply every gradient by `factor` (engine.step.weighting's MeanOver settlement)."""
        self._norm_sq *= factor * factor
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(factor)

    def clip(self, parameters, max_norm: float) -> None:  # pylint: disable=unused-argument
        """Scale the gradients so that the whole model's norm is at most `max_norm`, as
        ``torch.nn.utils.clip_grad_norm_`` does (its 1e-6, its clamp at 1), from the norm the
        vote summed: no collective."""
        coefficient = min(1.0, max_norm / (self._norm_sq ** 0.5 + 1e-6))
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coefficient)
