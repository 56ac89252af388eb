"""A model sharded with FSDP2 that moves to another world size in memory.

``torch.distributed.fsdp.fully_shard`` binds a module to one device mesh, once: it cannot be
applied again when the generation's process group changes. So :class:`ShardedModel` keeps a
*skeleton* of the cell's model (its structure, every parameter on the meta device: no memory)
and, for each new world size, builds the module again from it, shards it over the new mesh, and
fills each rank's new rows of every parameter and optimizer moment from the old layout with
engine.sharded.reshard (only rows whose owner changes travel). The optimizer object stays the user's
(its scheduler holds it): its parameter groups and state are pointed at the new parameters.

How a model is cut: a cell's ``shard_fn(model, mesh)`` applies ``fully_shard`` to the submodules
it chooses; by default each child of the module list that holds the bulk of the parameters (a
transformer's blocks, as torchtitan wraps each one) is sharded on its own, then the root.
Gradients are summed, not averaged, across ranks (``set_gradient_divide_factor(1.0)``): the
engine weights each micro-batch's loss by its share of the global batch, as in the replicated
mode (engine.step.weighting).

Buffers are not sharded (FSDP2 keeps them whole on every rank): the rebuilt module takes the old
one's. This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import copy
import ctypes
import gc
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from ..group.collective import collective
from ..state.frozen import frozen_keys
from .memory_need import MemoryNeed, measure
from .reshard import Layout, chunk_rows, reshard

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


def _aliases(model: nn.Module, frozen: dict) -> dict[str, str]:
    """{a tied parameter's other name: the name it travels under}, `frozen` ones left out: a
    state dict has every name (a tied output embedding's too)."""
    first: dict[int, str] = {}
    out = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if n not in frozen and first.setdefault(id(p), n) != n:
            out[n] = first[id(p)]
    return out


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """`t`'s storage; None for a tensor without one of its own (sparse, nested, meta...)."""
    if t.layout != torch.strided or t.is_meta:
        return None
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError):  # a tensor subclass without storage
        return None


def _emptied(t: torch.Tensor) -> bool:
    """Whether `t` holds elements but its storage was freed (:meth:`ShardedModel.release`)."""
    storage = _storage(t)
    return storage is not None and t.numel() > 0 and storage.nbytes() == 0


def released(model: nn.Module) -> bool:
    """Whether `model`'s trained parameters were released (:meth:`ShardedModel.release`)."""
    return any(_emptied(p) for p in model.parameters() if p.requires_grad)


def move_model(model: nn.Module, device: torch.device, sharded: bool = False,
               frozen_stay: bool = True) -> None:
    """``model.to(device)``, leaving the released parameters of a warm engine's model as they
    are (no storage: :meth:`ShardedModel.release`). `sharded` on a GPU: the parameters FSDP2
    will shard stay on the host (it moves each unit there as it shards it, at the first mesh:
    a model larger than the GPU starts): those that require a gradient, and the frozen ones
    unless they stay whole (`frozen_stay`); the others and the buffers go."""
    on_host = (lambda p: p.requires_grad or not frozen_stay) \
        if sharded and device.type == "cuda" else (lambda p: False)
    if not released(model) and not any(on_host(p) for p in model.parameters()):
        model.to(device)
        return
    with torch.no_grad():
        for p in model.parameters():
            if not _emptied(p) and not on_host(p):
                p.data = p.data.to(device)
        for name, b in model.named_buffers():
            _set_buffer(model, name, b.to(device))


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


class HeldParameters:
    """Which of the model's parameters the cell's optimizer holds, by name: the optimizer
    is pointed at each new module's parameters of the same names (one owner: ShardedModel).

    Args:
        model: the cell's model, whose parameters the optimizer holds at the start.
    """

    def __init__(self, model: nn.Module):
        self.ids = {id(p): n for n, p in model.named_parameters()}
        self._let_go: list[list[str]] | None = None  # what it holds while it holds nothing

    def names(self, optimizer: torch.optim.Optimizer | None) -> list[list[str]]:
        """The names of the parameters each of `optimizer`'s groups holds (after
        :meth:`let_go`, until :meth:`repoint`: those it held). Raises ShardingError for a
        tensor that is not one of the model's parameters."""
        if optimizer is None:
            return []
        if self._let_go is not None:
            return self._let_go
        names = []
        for group in optimizer.param_groups:
            unknown = [p for p in group["params"] if id(p) not in self.ids]
            if unknown:
                raise ShardingError(f"the optimizer holds {len(unknown)} tensor(s) that are not "
                                    "the model's parameters: under --shard it must optimize "
                                    "model parameters only")
            names.append([self.ids[id(p)] for p in group["params"]])
        return names

    def let_go(self, optimizer: torch.optim.Optimizer | None) -> list[list[str]]:
        """Before the cell's model is sharded in place: `optimizer` lets go of its parameters
        (their state, keyed by them, too: the rows to keep were taken from it), so that each
        unit's whole tensors, which FSDP2 moves to the GPU to shard them, are freed once
        sharded rather than all kept to the end (a model larger than the GPU). Returns their
        names per group, for :meth:`repoint` (:meth:`names` gives them until then: a
        sharding that fails leaves them for the next try)."""
        names = self.names(optimizer)
        if optimizer is not None:
            optimizer.state.clear()
            for group in optimizer.param_groups:
                group["params"] = []
            self._let_go = names
        return names

    def repoint(self, optimizer: torch.optim.Optimizer, names: list[list[str]], params: dict,
                moments: dict, mesh: DeviceMesh, replicated: dict) -> None:
        """Point `optimizer` at `params` by name (`names`: each group's, :meth:`names`); its
        state becomes `replicated`'s values and the `moments` ({(name, key): local rows}) as
        DTensors on `mesh`."""
        for group, held in zip(optimizer.param_groups, names, strict=True):
            group["params"] = [params[n] for n in held]
        self._let_go = None
        optimizer.state.clear()
        for n, p in params.items():
            kept = dict(replicated.get(n, {}))
            for (name, key), rows in moments.items():
                if name == n:
                    kept[key] = DTensor.from_local(rows, mesh, [Shard(0)], run_check=False,
                                                   shape=p.shape, stride=p.stride())
            if kept:
                optimizer.state[p] = kept
        self.ids = {id(p): n for n, p in params.items()}


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
        aliases: {a tied parameter's other name: its name in ``names``}.
    """

    def __init__(self, model: nn.Module, shard_fn: Callable | None = None,
                 mp_policy: MixedPrecisionPolicy | None = None, frozen_stay: bool = True):
        self.skeleton = skeleton_of(model)
        self.shard_fn, self.mp_policy = shard_fn, mp_policy or MixedPrecisionPolicy()
        # frozen parameters stay whole where the cell built them (FSDP2's ignored_params)
        # (every name of a tied one: each is set in a new module)
        self.frozen = {n: p for n, p in model.named_parameters(remove_duplicate=False)
                       if not p.requires_grad} if frozen_stay else {}
        # buffers each rank keeps as its cell built them: non-persistent ones (a rotary
        # embedding's inv_freq, out of every state dict) and, with the frozen parameters,
        # the buffers of frozen modules (engine.state.frozen)
        persistent = model.state_dict(keep_vars=True).keys()
        stay = set(frozen_keys(model)) if frozen_stay else set()
        self.own_buffers = {n: b for n, b in model.named_buffers()
                            if n not in persistent or n in stay}
        self.names = [n for n, _ in model.named_parameters() if n not in self.frozen]
        self.shapes = {n: p.shape for n, p in model.named_parameters() if n not in self.frozen}
        self.aliases = _aliases(model, self.frozen)
        self.module: nn.Module | None = None
        # sharded in place by the first shard(); none where a warm engine released its rows
        self._cell_model: nn.Module | None = None if released(model) else model
        # the parameters the optimizer holds: the cell's until the first mesh
        self.held = HeldParameters(model)

    def _wrap(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if self.shard_fn is not None:
            try:
                self.shard_fn(module, mesh)
            except Exception as e:
                raise ShardingError(f"the cell's shard_fn(model, mesh) raised {type(e).__name__}:"
                                    f" {e}. Fix it, or leave it out to shard each block") from e
        ignored = {p for p in module.parameters() if not p.requires_grad} \
            if self.frozen else None
        try:
            if self.shard_fn is None:
                for unit in default_units(module):
                    fully_shard(unit, mesh=mesh, mp_policy=self.mp_policy,
                                ignored_params=ignored)
            if not isinstance(module, FSDPModule):
                fully_shard(module, mesh=mesh, mp_policy=self.mp_policy, ignored_params=ignored)
        except Exception as e:
            raise ShardingError(f"FSDP2 could not shard the model: {type(e).__name__}: {e}. "
                                "Define shard_fn(model, mesh) in the cell to choose the "
                                "submodules, or train without --shard") from e
        for unit in module.modules():  # each unit's reduce-scatter sums, as ReduceOp.SUM
            if isinstance(unit, FSDPModule):  # (gloo has no PREMUL_SUM; nccl's is no faster)
                unit.set_gradient_divide_factor(1.0)
                unit.set_force_sum_reduction_for_comms(True)
        return module

    def check(self) -> None:
        """At setup: shard a copy of the skeleton (no storage) over a one-rank group of its own,
        so that a ``shard_fn`` that raises, or a model FSDP2 cannot shard, is refused before
        training starts (ShardingError). Skipped inside a process group (none at setup)."""
        if dist.is_initialized():
            return
        try:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        except Exception:  # pylint: disable=broad-except  # no group here: the first mesh tries
            return
        try:
            group = dist.group.WORLD
            assert group is not None
            self._wrap(copy.deepcopy(self.skeleton), DeviceMesh.from_group(group, "cpu"))
        except ShardingError as e:
            raise ShardingError(f"{e} (tried at setup on a copy without storage, on a CPU mesh "
                                "of one rank)") from e
        finally:
            dist.destroy_process_group()

    def memory_need(self, optimizer: torch.optim.Optimizer | None, micro_batches: int | None,
                    activations: tuple[int, str] = (0, "activations not counted")
                    ) -> MemoryNeed:
        """The memory a rank needs at each world size (engine.sharded.memory_need), counted on the
        skeleton: before the first generation, while `optimizer` holds the cell's model's
        parameters; `micro_batches`: in a full step; `activations`: one micro-batch's
        (engine.sharded.memory_need's ``activation_bytes``). With a ``shard_fn`` the gather buffers
        are counted over the default units (its own are only known on a mesh)."""
        optimized = [[self.held.ids[id(p)] for p in group["params"]
                      if id(p) in self.held.ids and p.requires_grad]
                     for group in (optimizer.param_groups if optimizer else [])]
        return measure(self.skeleton, default_units(self.skeleton), optimizer, optimized,
                       micro_batches, frozen_stay=bool(self.frozen), activations=activations)

    def shard(self, mesh: DeviceMesh, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        """The first generation: shard the cell's model itself over `mesh` (each rank keeps
        its rows of every parameter; fully_shard replaces the parameters) and point
        `optimizer`, which holds none of its state yet, at the new ones. Returns it."""
        if self._cell_model is None:
            raise RuntimeError("the cell's model is sharded already: use reshard_to")
        held = self.held.let_go(optimizer)
        self.module, self._cell_model = self._wrap(self._cell_model, mesh), None
        if optimizer is not None:
            self.held.repoint(optimizer, held, dict(self.module.named_parameters()), {}, mesh, {})
        return self.module

    def snapshot(self, optimizer: torch.optim.Optimizer | None) -> Snapshot:
        """This rank's part of the training state as it stands (views: no copies): its rows
        of every parameter and of the optimizer's sharded per-parameter tensors (DTensors:
        AdamW's moments; parameters without optimizer state have none), the optimizer's other
        per-parameter values (a step counter) and the buffers. A rank without a module yet (a
        newcomer) holds nothing. Raises ShardingError for a layout other than dim-0 shards
        on a 1-D mesh (a shard_fn's Shard(1), a 2-D mesh)."""
        if self.module is None:
            return self._whole_snapshot(optimizer) if self._cell_model is not None \
                else Snapshot({}, {}, {})
        params = dict(self.module.named_parameters())
        parts: dict[tuple[str, str | None], torch.Tensor] = {}
        replicated: dict = {}
        for n in self.names:
            parts[n, None] = _dim0_local(params[n], n, params[n])
        for n in self.names:
            held = optimizer.state.get(params[n], {}) if optimizer is not None else {}
            for key, value in held.items():
                if isinstance(value, DTensor):
                    parts[n, key] = _dim0_local(value, f"{n} ({key})", params[n])
            replicated[n] = {k: v for k, v in held.items() if not isinstance(v, DTensor)}
        return Snapshot(parts, replicated, self._carried(self.module))

    def _whole_snapshot(self, optimizer: torch.optim.Optimizer | None) -> Snapshot:
        """The cell's model before its first mesh as the part of rank 0 of one rank: whole
        parameters, and the optimizer's per-parameter tensors of the parameter's shape (a
        state loaded from a replicated checkpoint) as rows too."""
        assert self._cell_model is not None
        parts: dict[tuple[str, str | None], torch.Tensor] = {}
        replicated: dict = {}
        for n, p in self._cell_model.named_parameters():
            if n in self.frozen:
                continue
            parts[n, None] = p.detach()
            held = optimizer.state.get(p, {}) if optimizer is not None else {}
            rows = {k: v for k, v in held.items() if torch.is_tensor(v) and v.shape == p.shape}
            parts.update({(n, k): v for k, v in rows.items()})
            replicated[n] = {k: v for k, v in held.items() if k not in rows}
        return Snapshot(parts, replicated, self._carried(self._cell_model))

    def _carried(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The buffers that travel with a part (BatchNorm's statistics): not those each rank
        keeps (``own_buffers``)."""
        return {n: b for n, b in module.named_buffers() if n not in self.own_buffers}

    def _sources(self, held: Snapshot, layout: Layout, group_rank: int, device: torch.device,
                 copies: dict | None) -> tuple:
        """What a resharding sends from: (entries, dtypes, replicated, buffers) as old rank
        0's holder has them, each entry's rows, this rank's tensors per entry and those of
        `copies` (zero-row tensors on `device` where it holds none). Rows stay where they are
        (a host copy too): engine.sharded.reshard stages them for nccl a round at a time."""
        entries, dtypes, replicated, buffers = _from_holder(held, layout, group_rank)
        rows = [self.shapes[n][0] for n, _ in entries]

        def listed(parts: dict) -> list[torch.Tensor]:
            return [parts[e] if e in parts else torch.empty(
                (0, *self.shapes[e[0]][1:]), dtype=dtypes[i], device=device)
                for i, e in enumerate(entries)]
        copied = {r: listed(c) for r, c in (copies or {}).items()}
        return entries, dtypes, replicated, buffers, rows, listed(held.parts), copied

    def hand_over(self, layout: Layout, group_rank: int,
                  optimizer: torch.optim.Optimizer | None) -> Snapshot:
        """At a generation's end, where ranks leave (a shrink is a drain): every rank of the
        group moves its rows to `layout`'s new ranks (leavers to None) and keeps them as a
        Snapshot, built into a module at the next generation's start (its mesh does not exist
        yet). The module is freed. Returns this rank's new part (empty on a leaver). Raises
        PeerFailure."""
        held = self.snapshot(optimizer)
        device = next(iter(held.parts.values())).device if held.parts else torch.device("cpu")
        entries, _, replicated, buffers, rows, sources, _ = self._sources(
            held, layout, group_rank, device, None)
        shards = reshard(sources, rows, layout, group_rank, stage=_stage())
        self._free(optimizer)
        if layout.new[group_rank] is None:
            return Snapshot({}, {}, {})
        parts = {e: t for e, t in zip(entries, shards) if t is not None}
        return Snapshot(parts, replicated, buffers)

    def _free(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Hold no module any more (its rows are elsewhere now)."""
        if optimizer is not None:
            optimizer.state.clear()
        self._replace(None)

    def reshard_to(self, mesh: DeviceMesh | None, layout: Layout, group_rank: int,
                   optimizer: torch.optim.Optimizer | None, device: torch.device,
                   held: Snapshot | None = None,
                   copies: dict[int, dict[tuple[str, str | None], torch.Tensor]] | None = None,
                   consume: bool = False) -> nn.Module | None:
        """Move to the layout's new world size over the current process group; every rank of
        both layouts calls it (`mesh`: the new layout's, None on a leaver). Rows whose owner
        changes travel (engine.sharded.reshard); the module is built again from the skeleton and
        sharded over `mesh`; `optimizer` is pointed at its parameters, with its moments
        resharded too and its other values (a step counter) and the buffers as old rank 0's
        holder has them. `held`: this rank's part to start from (default: :meth:`snapshot`,
        the state as it stands; engine.sharded.replicas gives an older one after a fault), `copies`:
        {old rank: parts} of lost ranks this rank holds (``layout.copies``). `consume`: `held`
        is this rank's to give up (rows handed over): where its new rows are those, its
        tensors are taken as the module's rows and the optimizer's, not copied. Rows held on
        the host (a replica, the cell's model on a GPU) land on `device` (with nccl through it
        a round at a time). Returns the new module (None on a leaver, which holds no rows any
        more). Raises ShardingError, or PeerFailure."""
        leaving = layout.new[group_rank] is None
        if leaving != (mesh is None):
            raise ValueError("a rank of the new layout needs its mesh; a leaver has none")
        held = held if held is not None else self.snapshot(optimizer)
        entries, dtypes, replicated, buffers, rows, sources, copied = self._sources(
            held, layout, group_rank, device, copies)
        held_names = self.held.names(optimizer)
        if leaving or mesh is None:  # hands its rows over, then holds nothing of the run
            reshard(sources, rows, layout, group_rank, copied, stage=_stage())
            self._free(optimizer)
            return None
        if self._cell_model is not None:  # the first mesh: the rows travel first, then the
            # cell's model is sharded in place (its whole tensors freed) and takes them
            on_device = [None if key is None else torch.empty(  # the moments' rows (a host
                (_new_rows(rows[i], layout, group_rank), *self.shapes[n][1:]),  # holder's too)
                dtype=dtypes[i], device=device) for i, (n, key) in enumerate(entries)]
            shards = reshard(sources, rows, layout, group_rank, copied, on_device, _stage())
            held_names = self.held.let_go(optimizer)
            module, params = self._in_place(mesh, buffers, device)
            with torch.no_grad():
                for (n, key), shard in zip(entries, shards):
                    if key is None and shard is not None:
                        _local(params[n]).copy_(shard)
        else:  # the rows land in a new module's own storage, and the moments on the device
            kept = consume and layout.old[group_rank] == layout.new[group_rank] \
                and layout.old_size == layout.new_size  # the same rows: the tensors stay
            stay = [kept and t.device == device and t.is_contiguous() for t in sources]
            module, params = self._new_module(mesh, buffers, device, {
                n: sources[i] for i, (n, key) in enumerate(entries) if key is None and stay[i]})
            into = [_local(params[n]).detach() if key is None
                    else sources[i] if stay[i]
                    else torch.empty((_new_rows(rows[i], layout, group_rank),
                                      *self.shapes[n][1:]), dtype=dtypes[i], device=device)
                    for i, (n, key) in enumerate(entries)]
            shards = reshard(sources, rows, layout, group_rank, copied, into, _stage())
        if optimizer is not None:
            moments = {e: t for e, t in zip(entries, shards) if e[1] is not None}
            self.held.repoint(optimizer, held_names, params, moments, mesh, replicated)
        self._replace(module)
        return module

    def _replace(self, module: nn.Module | None) -> None:
        """Hold `module` from now on: the old one's rows are freed at once (the cell's
        namespace still names the first one; FSDP's modules and hooks hold each other)."""
        if self.module is not None and self.module is not module:
            _release(self.module)
        self.module, self._cell_model = module, None
        gc.collect()
        _trim_heap()

    def release(self) -> None:
        """Hold no rows until a generation sends some (a warm engine, run/warm_engines.py,
        which joins as a newcomer): the storage of the cell's model's trained parameters is
        freed (the cell and its optimizer keep the same Parameter objects, without bytes, as
        FSDP2 frees unsharded ones); the frozen ones and the buffers stay."""
        model, self._cell_model = self._cell_model, None
        if model is not None:
            _free_trained(model, self.frozen)

    @property
    def holds_rows(self) -> bool:
        """Whether this rank holds rows of the model: a module, or the cell's whole one."""
        return self.module is not None or self._cell_model is not None

    def _in_place(self, mesh: DeviceMesh, buffers: dict, device: torch.device
                  ) -> tuple[nn.Module, dict]:
        """The cell's model sharded over `mesh` in place (each rank keeps its rows of its own
        tensors, to be overwritten), with `buffers` set; with its parameters."""
        assert self._cell_model is not None
        module = self._wrap(self._cell_model, mesh)
        for name, buffer in buffers.items():
            _set_buffer(module, name, buffer.to(device))
        return module, dict(module.named_parameters())

    def load(self, mesh: DeviceMesh, optimizer: torch.optim.Optimizer | None,
             device: torch.device, parts: dict, replicated: dict, buffers: dict) -> nn.Module:
        """Build the module on `mesh` from this rank's rows read elsewhere (`parts`, {(name,
        None or optimizer key): rows}: engine.sharded.checkpoint_parts's ``read_rows``), with the
        optimizer's other values and the buffers; `optimizer` is pointed at it. Returns it."""
        held_names = self.held.names(optimizer)
        module, params = self._new_module(mesh, buffers, device, {
            n: parts[n, None] for n in self.names
            if parts[n, None].device == device and parts[n, None].is_contiguous()})
        with torch.no_grad():
            for n in self.names:
                if _local(params[n]).data_ptr() != parts[n, None].data_ptr():
                    _local(params[n]).copy_(parts[n, None])
        if optimizer is not None:
            moments = {e: t.to(device) for e, t in parts.items() if e[1] is not None}
            self.held.repoint(optimizer, held_names, params, moments, mesh, replicated)
        self._replace(module)
        return module

    def _new_module(self, mesh: DeviceMesh, buffers: dict, device: torch.device,
                    adopt: dict[str, torch.Tensor] | None = None) -> tuple[nn.Module, dict]:
        """The skeleton built again and sharded over `mesh`, `buffers` set, with its
        parameters. Each parameter's rows are `adopt`'s tensor where it names one (this rank's
        rows, contiguous, on `device`: handed over or read, taken as they are: FSDP2 copies
        only a shard it must pad), else new storage on `device`, their values still to write."""
        module = copy.deepcopy(self.skeleton)
        self._wrap(module, mesh)
        for name in (*self.frozen, *self.own_buffers):  # no storage for them: the rank's own
            owner, _, leaf = name.rpartition(".")  # come after (a frozen base is not
            target = module.get_submodule(owner) if owner else module  # allocated again)
            if hasattr(target, leaf):
                delattr(target, leaf)
        _materialize(module, mesh, device, adopt or {})
        self._keep_own(module, device)
        for name, buffer in buffers.items():  # whole on every rank
            _set_buffer(module, name, buffer.to(device))
        return module, dict(module.named_parameters())

    def _keep_own(self, module: nn.Module, device: torch.device) -> None:
        """Put this rank's own tensors in `module`: the frozen parameters, never moved, and
        the buffers it keeps (``own_buffers``)."""
        for name, buffer in self.own_buffers.items():
            _set_buffer(module, name, buffer.to(device))
        for name, frozen in self.frozen.items():
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner) if owner else module, leaf, frozen)


@dataclass
class Snapshot:
    """A rank's part of a sharded training state: `parts`, {(parameter name, None or an
    optimizer key): its rows}; `replicated`, {name: the optimizer's other per-parameter
    values}; `buffers`, {name: buffer} (whole)."""

    parts: dict[tuple[str, str | None], torch.Tensor]
    replicated: dict
    buffers: dict


def _from_holder(held: Snapshot, layout: Layout, group_rank: int
                 ) -> tuple[list, list[torch.dtype], dict, dict]:
    """(the parts' names, their dtypes, the replicated values, the buffers on the CPU) as the
    holder of old rank 0 has them: every rank gets them (a step counter and buffers are
    small, and the same on every rank). Copies: the state built from them must not share
    tensors with `held` (a replica stays as it was for the next fault)."""
    box: list = [None]
    if layout.holder(0) == group_rank:
        box[0] = (list(held.parts), [t.dtype for t in held.parts.values()],
                  copy.deepcopy(held.replicated),
                  {n: b.detach().to("cpu", copy=True) for n, b in held.buffers.items()})
    with collective("resharding"):
        dist.broadcast_object_list(box, src=layout.holder(0))
    return box[0]


def _dim0_local(t: torch.Tensor, what: str, param: torch.Tensor) -> torch.Tensor:
    """`t`'s local rows, once checked to be dim-0 shards of `param`'s shape on a 1-D mesh
    (what engine.sharded.reshard moves)."""
    if not isinstance(t, DTensor) or t.device_mesh.ndim != 1 \
            or tuple(t.placements) != (Shard(0),) or t.shape != param.shape:
        raise ShardingError(f"{what} is not sharded on dim 0 over a 1-D mesh: --shard resizes "
                            "that layout only (a shard_fn must call fully_shard without "
                            "shard_placement_fn)")
    return t.to_local()


def _materialize(module: nn.Module, mesh: DeviceMesh, device: torch.device,
                 adopt: dict[str, torch.Tensor]) -> None:
    """Storage on `device` for the meta tensors of `module` (sharded over `mesh`), as
    ``nn.Module.to_empty`` gives it, except each parameter `adopt` names: its local rows are
    that tensor (FSDP2's ``_apply`` then takes them as its sharded storage, as it does after
    ``load_state_dict(assign=True)``)."""
    names = {id(p): n for n, p in module.named_parameters()}

    def storage(t: torch.Tensor) -> torch.Tensor:
        n = names.get(id(t))
        if n in adopt:
            return DTensor.from_local(adopt[n], mesh, [Shard(0)], run_check=False,
                                      shape=t.shape, stride=t.stride())
        return torch.empty_like(t, device=device)
    module._apply(storage)  # pylint: disable=protected-access  # (to_empty's own call)


def _stage() -> torch.device | None:
    """Where a resharding's messages must be: the GPU with nccl (engine.sharded.reshard), else
    None."""
    return torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else None


def _new_rows(n: int, layout: Layout, group_rank: int) -> int:
    new_rank = layout.new[group_rank]
    assert new_rank is not None
    start, end = chunk_rows(n, layout.new_size, new_rank)
    return end - start


def reshard_all(module: nn.Module) -> None:
    """Free the gathered parameters of every FSDP2 unit of `module` (after forward passes that
    no backward follows: FSDP2 keeps the root's gathered, expecting one)."""
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def _release(module: nn.Module) -> None:
    """Free the storage of `module`'s local rows (a module this rank no longer trains)."""
    with torch.no_grad():
        for p in module.parameters():
            if isinstance(p, DTensor):
                p.to_local().untyped_storage().resize_(0)


def _free_trained(model: nn.Module, frozen: dict) -> None:
    """Free the storage of `model`'s parameters but the `frozen` ones, and of none that a
    frozen parameter or a buffer views too."""
    kept = {s.data_ptr() for t in (*frozen.values(), *model.buffers())
            if (s := _storage(t)) is not None}
    with torch.no_grad():
        for n, p in model.named_parameters():
            storage = _storage(p)
            if n not in frozen and storage is not None and storage.data_ptr() not in kept:
                storage.resize_(0)
    _trim_heap()


def _trim_heap() -> None:
    """Give the heap's free memory back to the kernel (glibc's ``malloc_trim``): the rows of
    a layout just freed, in blocks below glibc's dynamic mmap threshold (up to 32 MiB: most
    tensors), would stay in the process, counted in its memory, beside the next layout's."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator keeps no such heap
        pass


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _set_buffer(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    target = module.get_submodule(owner) if owner else module
    target._buffers[leaf] = value  # pylint: disable=protected-access
