"""A model sharded with FSDP2 that moves to another world size in memory.

``torch.distributed.fsdp.fully_shard`` binds a module to one device mesh, once: it cannot be
applied again when the generation's process group changes. So :class:`ShardedModel` keeps a
*skeleton* of the cell's model (its structure, every parameter on the meta device: no memory)
and, for each new world size, builds the module again from it, shards it over the new mesh, and
fills each rank's new rows of every parameter and optimizer moment from the old layout with
engine.reshard (only rows whose owner changes travel). The optimizer object stays the user's
(its scheduler holds it): its parameter groups and state are pointed at the new parameters.

How a model is cut: a cell's ``shard_fn(model, mesh)`` applies ``fully_shard`` to the submodules
it chooses; by default each child of the module list that holds the bulk of the parameters (a
transformer's blocks, as torchtitan wraps each one) is sharded on its own, then the root.
Gradients are summed, not averaged, across ranks (``set_gradient_divide_factor(1.0)``): the
engine weights each micro-batch's loss by its share of the global batch, as in the replicated
mode (engine.weighting).

Buffers are not sharded (FSDP2 keeps them whole on every rank): the rebuilt module takes the old
one's. This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from .collective import collective
from .reshard import Layout, reshard

BULK = 0.5  # the share of the parameters a module list must hold for its children to be units


class ShardingError(ValueError):
    """The model cannot be sharded as asked; the message says why and what to do."""


def skeleton_of(model: nn.Module) -> nn.Module:
    """A copy of `model` with every parameter and buffer on the meta device (no storage)."""
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"),
                                   requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def default_units(model: nn.Module) -> list[nn.Module]:
    """The children of the module list (``nn.ModuleList`` or ``nn.Sequential``) with the most
    children among those that hold at least BULK of the parameters (a transformer's blocks,
    not the root that holds them and its embedding); none when no list holds that much."""
    total = sum(p.numel() for p in model.parameters())
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 1 \
                and sum(p.numel() for p in module.parameters()) >= BULK * total \
                and len(module) >= len(best):
            best = list(module.children())
    return [child for child in best if any(True for _ in child.parameters())]


class ShardedModel:
    """The cell's model, sharded over a generation's mesh.

    Args:
        model: the cell's model with its full weights, on the engine's device.
        shard_fn: the cell's ``shard_fn(model, mesh)``, or None for the default units.
        mp_policy: FSDP2's mixed precision policy (None: the parameters' dtypes).

    Attributes:
        module: the sharded module of the current mesh (None until :meth:`shard`).
        names: the parameters' names, in ``named_parameters()`` order (the order shards
            travel in).
    """

    def __init__(self, model: nn.Module, shard_fn: Callable | None = None,
                 mp_policy: MixedPrecisionPolicy | None = None):
        self.skeleton = skeleton_of(model)
        self.shard_fn, self.mp_policy = shard_fn, mp_policy or MixedPrecisionPolicy()
        self.names = [n for n, _ in model.named_parameters()]
        self.shapes = {n: p.shape for n, p in model.named_parameters()}
        self.module: nn.Module | None = None
        self._cell_model: nn.Module | None = model  # sharded in place by the first shard()
        # the parameters the optimizer holds now, by id: the cell's until its first mesh
        self._held = {id(p): n for n, p in model.named_parameters()}

    def _wrap(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if self.shard_fn is not None:
            try:
                self.shard_fn(module, mesh)
            except Exception as e:
                raise ShardingError(f"the cell's shard_fn(model, mesh) raised {type(e).__name__}:"
                                    f" {e}. Fix it, or leave it out to shard each block") from e
        try:
            if self.shard_fn is None:
                for unit in default_units(module):
                    fully_shard(unit, mesh=mesh, mp_policy=self.mp_policy)
            if not isinstance(module, FSDPModule):
                fully_shard(module, mesh=mesh, mp_policy=self.mp_policy)
        except Exception as e:
            raise ShardingError(f"FSDP2 could not shard the model: {type(e).__name__}: {e}. "
                                "Define shard_fn(model, mesh) in the cell to choose the "
                                "submodules, or train without --shard") from e
        for unit in module.modules():  # each unit's reduce-scatter sums, as ReduceOp.SUM
            if isinstance(unit, FSDPModule):  # (gloo has no PREMUL_SUM; nccl's is no faster)
                unit.set_gradient_divide_factor(1.0)
                unit.set_force_sum_reduction_for_comms(True)
        return module

    def shard(self, mesh: DeviceMesh, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        """The first generation: shard the cell's model itself over `mesh` (each rank keeps
        its rows of every parameter; fully_shard replaces the parameters) and point
        `optimizer`, which holds none of its state yet, at the new ones. Returns it."""
        if self._cell_model is None:
            raise RuntimeError("the cell's model is sharded already: use reshard_to")
        self.module, self._cell_model = self._wrap(self._cell_model, mesh), None
        if optimizer is not None:
            self._repoint(optimizer, dict(self.module.named_parameters()), [], [], mesh, {})
        return self.module

    def snapshot(self, optimizer: torch.optim.Optimizer | None) -> Snapshot:
        """This rank's part of the training state as it stands (views: no copies): its rows
        of every parameter and of the optimizer's sharded per-parameter tensors (DTensors:
        AdamW's moments), the optimizer's other per-parameter values (a step counter) and the
        buffers; a rank without a module yet (a newcomer) holds zero-row tensors."""
        if self.module is None:
            return Snapshot([self._empty(n) for n in self.names], [], {}, {})
        params = dict(self.module.named_parameters())
        keys: list[str] = []
        replicated: dict = {}
        for n in self.names:
            held = optimizer.state.get(params[n], {}) if optimizer is not None else {}
            keys += [k for k, v in held.items() if isinstance(v, DTensor) and k not in keys]
            replicated[n] = {k: v for k, v in held.items() if not isinstance(v, DTensor)}
        tensors = [_local(params[n]) for n in self.names]
        for key in keys:
            tensors += [_local(optimizer.state[params[n]][key]) for n in self.names]  # type: ignore
        return Snapshot(tensors, keys, replicated, dict(self.module.named_buffers()))

    def _empty(self, name: str) -> torch.Tensor:
        p = dict(self.skeleton.named_parameters())[name]
        return torch.empty((0, *p.shape[1:]), dtype=p.dtype)

    def rows(self, keys: Sequence[str]) -> list[int]:
        """Dim-0 sizes of a snapshot's tensors with optimizer `keys` (the same on every
        rank)."""
        return [self.shapes[n][0] for n in self.names] * (1 + len(keys))

    def reshard_to(self, mesh: DeviceMesh | None, layout: Layout, group_rank: int,
                   optimizer: torch.optim.Optimizer | None, device: torch.device,
                   held: Snapshot | None = None,
                   copies: dict[int, list[torch.Tensor]] | None = None
                   ) -> nn.Module | None:
        """Move to the layout's new world size over the current process group; every rank of
        both layouts calls it (`mesh`: the new layout's, None on a leaver). Rows whose owner
        changes travel (engine.reshard); the module is built again from the skeleton and
        sharded over `mesh`; `optimizer` is pointed at its parameters, with its moments
        resharded too and its other values (a step counter) and the buffers as old rank 0's
        holder has them. `held`: this rank's part to start from (default: :meth:`snapshot`,
        the state as it stands; engine.replicas gives an older one after a fault), `copies`:
        {old rank: tensors} of lost ranks this rank holds (``layout.copies``). Returns the
        new module (None on a leaver, which holds no rows any more)."""
        held = held if held is not None else self.snapshot(optimizer)
        keys, replicated, buffers = _from_holder(held, layout, group_rank)
        if self.module is None and layout.old[group_rank] is None:  # a newcomer's shapes
            held = Snapshot(held.tensors * (1 + len(keys)), keys, replicated, buffers)
        if layout.new[group_rank] is None or mesh is None:  # a leaver: hands its rows over
            reshard(held.tensors, self.rows(keys), layout, group_rank, copies)
            self.module = None
            return None
        module = copy.deepcopy(self.skeleton)
        self._wrap(module, mesh)
        module.to_empty(device=device)
        for name, buffer in buffers.items():  # whole on every rank: old rank 0's
            _set_buffer(module, name, buffer.to(device))
        params = dict(module.named_parameters())
        # the parameters' rows land in the new module's own storage
        into: list[torch.Tensor | None] = [_local(params[n]).detach() for n in self.names]
        into += [None] * (len(keys) * len(self.names))
        shards = reshard(held.tensors, self.rows(keys), layout, group_rank, copies, into)
        if optimizer is not None:
            self._repoint(optimizer, params, shards[len(self.names):], keys, mesh, replicated)
        self.module = module
        return module

    def _repoint(self, optimizer, params: dict, moments: list, state_keys, mesh,
                 replicated: dict) -> None:
        """Point `optimizer` at `params` (by name); its state becomes `replicated`'s values
        and the `moments` as DTensors on `mesh`."""
        for group in optimizer.param_groups:
            group["params"] = [params[self._held[id(p)]] if id(p) in self._held else p
                               for p in group["params"]]
        k = len(self.names)
        optimizer.state.clear()
        for i, n in enumerate(self.names):
            p = params[n]
            kept = dict(replicated.get(n, {}))
            for j, key in enumerate(state_keys):
                kept[key] = DTensor.from_local(moments[j * k + i], mesh, [Shard(0)],
                                               run_check=False, shape=p.shape,
                                               stride=p.stride())
            if kept:
                optimizer.state[p] = kept
        self._held = {id(p): n for n, p in params.items()}


@dataclass
class Snapshot:
    """A rank's part of a sharded training state: `tensors`, its rows of every parameter then
    of each optimizer key in `keys` (in the model's parameter order); `replicated`, {name:
    the optimizer's other per-parameter values}; `buffers`, {name: buffer} (whole)."""

    tensors: list[torch.Tensor]
    keys: list[str]
    replicated: dict
    buffers: dict


def _from_holder(held: Snapshot, layout: Layout, group_rank: int) -> tuple[list, dict, dict]:
    """(optimizer keys, replicated values, buffers on the CPU) as the holder of old rank 0
    has them: every rank gets them (a step counter and buffers are small, and the same on
    every rank)."""
    box: list = [None]
    if layout.holder(0) == group_rank:
        box[0] = (held.keys, held.replicated, {n: b.cpu() for n, b in held.buffers.items()})
    with collective("resharding"):
        dist.broadcast_object_list(box, src=layout.holder(0))
    return box[0]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _set_buffer(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    target = module.get_submodule(owner) if owner else module
    target._buffers[leaf] = value  # pylint: disable=protected-access
