"""A sharded run's memory per rank at each world size, counted from the model before training.

Under ``--shard`` each rank holds 1/W of the parameters, of their gradients and of the
optimizer's state, plus what no world size divides: the units FSDP2 gathers whole (the root,
from the forward through the backward, the one running and the one prefetched), the unsharded
gradient of the unit whose backward ends, the buffers and the frozen parameters (they stay
whole where each cell built them).
A rank that runs more than one pass in a step accumulates an unsharded gradient of the whole
trainable model unless it reduce-scatters after each pass (engine.sharded.reduce_scatter's
``per_pass``). :class:`MemoryNeed` holds these counts; the owner derives the smallest world
size that fits a rank's budget from them (run.memory_bound), and each generation decides
whether its passes must reduce-scatter one by one.

What is counted are the model states and gather buffers, as DeepSpeed's
``estimate_zero3_model_states_mem_needs`` counts them, and one micro-batch's activations: the
tensors the cell's forward saves for its backward (``torch.autograd.graph.saved_tensors_hooks``),
counted by running ``loss_fn`` on the model's meta copy with a micro-batch of the first samples
moved to the meta device (no storage, no compute; the transient tensors of the backward are not
counted, and autocast does not apply there, so a bf16 run's are counted in the parameters'
dtype). A forward that cannot run on the meta device (one that reads a value) leaves them
uncounted, and the count says why. The optimizer's state is measured by one step of a
copy of the cell's optimizer over the model's parameters on the meta device (no storage);
an optimizer whose step cannot run there (one that reads a value, as Adafactor does) is
counted as AdamW's two moments, and the count says it is an estimate.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import copy
import inspect
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import torch
from torch import nn

GiB = 2**30


@dataclass(frozen=True)
class MemoryNeed:
    """The memory a sharded run's rank needs, in bytes, split by how it scales.

    Attributes:
        parameters: the parameters divided over the ranks (frozen ones too with
            ``--move-frozen``).
        frozen: the frozen parameters every rank holds whole (they stay where the cell
            built them).
        gradients: the trainable parameters' gradients, divided over the ranks.
        optimizer: the optimizer's state, divided over the ranks.
        gathers: what every rank holds whatever the world size: the root unit gathered
            whole (from the forward through the backward), two other units gathered whole and
            the largest unit's unsharded gradient; and the buffers (whole on every rank).
        accumulation: the whole trainable model's unsharded gradient, held by a rank that
            accumulates more than one pass before it reduce-scatters.
        micro_batches: micro-batches in a full step (None: the cut is measured at the start).
        optimizer_estimated: the optimizer's state is AdamW's two moments, not measured.
        activations: what one micro-batch's forward saves for its backward (every rank
            holds one micro-batch's at a time, whatever the world size).
        activations_unknown: why the activations are not counted ("" where they are).
    """

    parameters: int
    gradients: int
    optimizer: int
    gathers: int
    accumulation: int
    micro_batches: int | None
    optimizer_estimated: bool = False
    frozen: int = 0
    activations: int = 0
    activations_unknown: str = "activations not counted"

    def passes(self, world_size: int) -> int:
        """Passes per rank in a full step at `world_size` (every rank runs rank 0's)."""
        return -(-self.micro_batches // world_size) if self.micro_batches else 1

    def at(self, world_size: int, per_pass: bool = False) -> int:
        """Bytes per rank at `world_size`; `per_pass`: passes reduce-scatter one by one."""
        sharded = self.parameters + self.gradients + self.optimizer
        accumulates = self.passes(world_size) > 1 and not per_pass
        return (-(-sharded // world_size) + self.frozen + self.gathers + self.activations
                + self.accumulation * accumulates)

    def fits(self, world_size: int, budget: int | None) -> bool:
        """Whether a rank fits `budget` bytes at `world_size`, reduce-scattering per pass
        where it must (no budget: always)."""
        return budget is None or self.at(world_size, per_pass=True) <= budget

    def per_pass(self, world_size: int, budget: int | None) -> bool:
        """Whether a generation at `world_size` must reduce-scatter after each pass to fit
        `budget` (accumulating is the fewer collectives, so it is kept where it fits)."""
        return budget is not None and self.at(world_size) > budget

    def smallest_world(self, budget: int | None, largest: int) -> int | None:
        """The smallest world size up to `largest` whose rank fits `budget`; None if none."""
        return next((w for w in range(1, largest + 1) if self.fits(w, budget)), None)

    def describe(self, world_size: int) -> str:
        """One line: the bytes per rank at `world_size` and what they are."""
        parts = (f"{self.parameters / GiB / world_size:.2f} parameters, "
                 f"{self.gradients / GiB / world_size:.2f} gradients, "
                 f"{self.optimizer / GiB / world_size:.2f} optimizer state"
                 f"{' (estimated as AdamW)' if self.optimizer_estimated else ''}, "
                 f"{self.gathers / GiB:.2f} gather buffers"
                 + (f", {self.frozen / GiB:.2f} frozen" if self.frozen else "")
                 + (f"; {self.activations_unknown}" if self.activations_unknown
                    else f", {self.activations / GiB:.2f} activations"))
        return (f"{self.at(world_size, per_pass=True) / GiB:.2f} GiB per rank at world size "
                f"{world_size} ({parts})")

    def as_dict(self) -> dict:
        return asdict(self)


def measure(skeleton: nn.Module, units: list[nn.Module], optimizer: torch.optim.Optimizer |
            None, optimized: list[list[str]], micro_batches: int | None,
            frozen_stay: bool = False,
            activations: tuple[int, str] = (0, "activations not counted")) -> MemoryNeed:
    """Count the need of `skeleton` (the cell's model on the meta device,
    engine.sharded.resizable_model's ``skeleton_of``) sharded in `units` (the root holds the rest)
    and trained by a copy of `optimizer`, whose parameter groups hold the parameters named
    `optimized`; `micro_batches`: in a full step (None: not known yet); `frozen_stay`: the frozen
    parameters stay whole on every rank, gathered by no unit; `activations`: one
    micro-batch's (:func:`activation_bytes`)."""
    params = list(skeleton.parameters())
    frozen = [p for p in params if not p.requires_grad] if frozen_stay else []
    params = [p for p in params if p.requires_grad or not frozen_stay]
    trainable = [p for p in params if p.requires_grad]
    inside = {id(p) for unit in units for p in unit.parameters()}
    root = [p for p in params if id(p) not in inside]
    kept = {id(p) for p in params}  # what FSDP2 gathers: not the frozen ones that stay
    gathered = [[p for p in unit.parameters() if id(p) in kept] for unit in units]
    largest = max((_bytes(ps) for ps in gathered), default=0)
    largest_grad = max((_bytes([p for p in ps if p.requires_grad]) for ps in gathered + [root]),
                       default=0)
    named = dict(skeleton.named_parameters())
    state, estimated = _optimizer_state(optimizer, [[named[n] for n in g] for g in optimized])
    return MemoryNeed(parameters=_bytes(params), gradients=_bytes(trainable), optimizer=state,
                      gathers=_bytes(root) + 2 * largest + largest_grad
                      + _bytes(skeleton.buffers()), accumulation=_bytes(trainable),
                      micro_batches=micro_batches, optimizer_estimated=estimated,
                      frozen=_bytes(frozen), activations=activations[0],
                      activations_unknown=activations[1])


def activation_bytes(skeleton: nn.Module, loss_fn: Callable, batch) -> tuple[int, str]:
    """(bytes of the tensors that ``loss_fn(skeleton, batch)`` saves for its backward, "") with
    `skeleton` and `batch` on the meta device, each storage counted once and the model's own
    parameters left out; or (0, why they are not counted) where the forward raises there. It
    runs on a copy: a forward may keep tensors in its modules (a cache), which must not reach
    the modules built from `skeleton`."""
    saved: dict[int, torch.Tensor] = {}  # kept: a freed storage's identity may come again

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[_key(t)] = t
        return t
    try:
        copied = copy.deepcopy(skeleton)
        # a storage's identity: meta tensors have no address to tell them apart by
        own = {_key(p) for p in copied.parameters()}
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_fn(copied, batch)
    except Exception as e:  # pylint: disable=broad-except  # any cell's forward
        return 0, (f"activations not counted: the forward could not run on the meta device "
                   f"({type(e).__name__}: {str(e)[:120]})")
    return sum(t.untyped_storage().nbytes() for k, t in saved.items() if k not in own), ""


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # pylint: disable=protected-access


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _optimizer_state(optimizer: torch.optim.Optimizer | None,
                     groups: list[list[nn.Parameter]]) -> tuple[int, bool]:
    """(bytes of a copy of `optimizer`'s state over the meta parameters of its `groups`;
    whether it is estimated instead)."""
    trainable = [p for group in groups for p in group]
    if optimizer is None or not trainable:
        return 0, False
    try:
        # the constructor's own arguments (``defaults`` may hold more), each group's settings
        accepted = inspect.signature(type(optimizer)).parameters
        copy = type(optimizer)(
            [dict({k: v for k, v in g.items() if k != "params"}, params=ps)
             for g, ps in zip(optimizer.param_groups, groups)],
            **{k: v for k, v in optimizer.defaults.items() if k in accepted})
        for p in trainable:
            p.grad = torch.empty_like(p)
        copy.step()
        state = sum(t.numel() * t.element_size() for s in copy.state.values()
                    for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        return state, False
    except Exception:  # pylint: disable=broad-except  # any optimizer's own checks
        return 2 * _bytes(trainable), True
    finally:
        for p in trainable:
            p.grad = None
