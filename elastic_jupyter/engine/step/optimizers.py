"""Several optimizers in one training step: named optimizers, each with its own loss, stepped
in order.

A GAN trains its discriminator and its generator one after the other within a step, each with
its own optimizer and loss (PyTorch's DCGAN example; Lightning's manual optimization). A cell
names them in the order they step, and gives a loss for each:

    optimizer = {"discriminator": opt_d, "generator": opt_g}
    loss_fn = {"discriminator": d_loss, "generator": g_loss}  # each fn(model, batch)
    lr_scheduler = {"generator": sched_g}                     # optional, per optimizer

Each training step is then a sequence of :class:`Substep`\\ s, one per optimizer. In each, every
rank runs its micro-batches of the step through that optimizer's loss (the same samples and the
same random streams in every sub-step: the noise a generator draws is the one it drew in the
sub-step before, as the DCGAN example reuses its fake batch), the gradients are reduced as a
single optimizer's are, the sub-step is committed by its own vote (engine.group.vote), and only that
optimizer steps. ``Progress.substep`` counts the committed sub-steps of the step in flight, so
after a fault the survivors go on at the sub-step in flight; a step's record, its checkpoint,
its evaluation and a resize come once its last sub-step committed.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


class OptimizersError(ValueError):
    """The cell's optimizers, losses or schedulers cannot make sub-steps (engine.step.objects turns
    it into its SetupError)."""


@dataclass(frozen=True)
class Substep:
    """One optimizer's part of a training step: its `name` (None: the cell's only optimizer),
    the `optimizer` and its `loss_fn(model, batch)`."""

    name: str | None
    optimizer: torch.optim.Optimizer
    loss_fn: Callable


class NamedOptimizers:
    """The cell's optimizers by name, in their order, seen as one optimizer by what keeps the
    training state (engine.state.training_state) and by the cell's hooks: ``param_groups`` and
    ``state`` are every optimizer's, ``state_dict()`` is ``{name: its state_dict()}``;
    ``optimizers[name]`` is one of them."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        self.optimizers = dict(optimizers)

    def __getitem__(self, name: str) -> torch.optim.Optimizer:
        return self.optimizers[name]

    @property
    def param_groups(self) -> list[dict]:
        return [group for o in self.optimizers.values() for group in o.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for o in self.optimizers.values() for p, s in o.state.items()}

    def state_dict(self) -> dict:
        return {name: o.state_dict() for name, o in self.optimizers.items()}

    def load_state_dict(self, state: dict) -> None:
        held = "one optimizer" if "param_groups" in state else f"optimizers {sorted(state)}"
        if set(state) != set(self.optimizers):
            raise ValueError(f"the state holds {held}, the cell names optimizers "
                             f"{sorted(self.optimizers)}: resume with the optimizers it was "
                             "trained with")
        for name, o in self.optimizers.items():
            o.load_state_dict(state[name])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers.values():
            o.zero_grad(set_to_none=set_to_none)


def learning_rates(optimizer) -> dict:
    """The learning rates a step record logs: ``lr``, the first param group's, and with more
    groups ``lr_1``, ``lr_2``... (``lr_k`` is ``optimizer.param_groups[k]``'s); with several
    optimizers ``lr_<name>`` (and ``lr_<name>_<k>``) for each one's groups instead. A tensor
    learning rate is logged as a float."""
    def rates(groups: list) -> list:
        return [float(g["lr"]) if torch.is_tensor(g["lr"]) else g["lr"] for g in groups]
    if not isinstance(optimizer, NamedOptimizers):
        lrs = rates(optimizer.param_groups)
        return {"lr": lrs[0], **{f"lr_{k}": lr for k, lr in enumerate(lrs[1:], 1)}}
    out = {}
    for name, o in optimizer.optimizers.items():
        lrs = rates(o.param_groups)
        out.update({f"lr_{name}": lrs[0], **{f"lr_{name}_{k}": lr
                                             for k, lr in enumerate(lrs[1:], 1)}})
    return {"lr": next(iter(out.values())), **out}


class NamedSchedulers:
    """The cell's schedulers by optimizer name, stepped together once per training step;
    ``state_dict()`` is ``{name: its state_dict()}``."""

    def __init__(self, schedulers: dict[str, Any]):
        self.schedulers = dict(schedulers)

    def __getitem__(self, name: str):
        return self.schedulers[name]

    def step(self) -> None:
        for s in self.schedulers.values():
            s.step()

    def state_dict(self) -> dict:
        return {name: s.state_dict() for name, s in self.schedulers.items()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != set(self.schedulers):
            raise ValueError(f"the state holds other schedulers than the cell's "
                             f"{sorted(self.schedulers)}: resume with the schedulers it was "
                             "trained with")
        for name, s in self.schedulers.items():
            s.load_state_dict(state[name])


def substeps(optimizer: Any, loss_fn: Any) -> list[Substep]:
    """The sub-steps of the cell's `optimizer` and `loss_fn`: one for a single optimizer, one
    per name, in order, for a dict of them. Raises OptimizersError saying what to change."""
    if not isinstance(optimizer, dict):
        if isinstance(loss_fn, dict):
            raise OptimizersError("loss_fn is a dict of losses but optimizer is one optimizer: "
                                  "give optimizer = {name: optimizer} with the same names")
        return [Substep(None, optimizer, loss_fn)]
    if not optimizer or not all(isinstance(k, str) and k for k in optimizer):
        raise OptimizersError("optimizer must be a torch.optim.Optimizer, or a dict {name: "
                              "optimizer} of them (stepped in its order), with non-empty "
                              "string names")
    for name, o in optimizer.items():
        if not isinstance(o, torch.optim.Optimizer):
            raise OptimizersError(f"optimizer[{name!r}] must be a torch.optim.Optimizer, got "
                                  f"{type(o).__name__}")
    if not isinstance(loss_fn, dict):
        raise OptimizersError(
            f"with several optimizers, loss_fn must be a dict {{name: loss_fn(model, batch)}}, "
            f"one for each of {', '.join(map(repr, optimizer))}, got {type(loss_fn).__name__}")
    missing = [name for name in optimizer if name not in loss_fn]
    if missing:
        raise OptimizersError(f"loss_fn has no loss for optimizer {', '.join(map(repr, missing))}: "
                              f"give loss_fn = {{name: loss_fn(model, batch)}} for each of "
                              f"{', '.join(map(repr, optimizer))}")
    extra = [name for name in loss_fn if name not in optimizer]
    if extra:
        raise OptimizersError(f"loss_fn names {', '.join(map(repr, extra))}, which no optimizer "
                              f"has: the optimizers are {', '.join(map(repr, optimizer))}")
    for name, fn in loss_fn.items():
        if not callable(fn):
            raise OptimizersError(f"loss_fn[{name!r}] must be a function loss_fn(model, batch)")
    _check_disjoint(optimizer)
    return [Substep(name, o, loss_fn[name]) for name, o in optimizer.items()]


def check_resumed(steps: list[Substep], substep: int, losses: dict) -> None:
    """Raise ValueError when a state taken between sub-steps (``substep`` committed, their
    `losses` by name) is not of these sub-steps: another order or other names would step an
    optimizer twice and skip another."""
    done = [s.name or "" for s in steps[:substep]]
    if list(losses) != done:
        raise ValueError(f"the state was taken after the sub-steps of {list(losses)} in its "
                         f"step, but the cell's optimizers step in the order "
                         f"{[s.name for s in steps]}: resume with the optimizers in the order "
                         "it was trained with")


def optimized(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters `optimizer` steps, in its groups' order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def owners(steps: list[Substep]) -> dict[int, int]:
    """``{id(parameter): its sub-step's index}`` with several optimizers (engine.group.reduce sums
    a sub-step's own parameters only), else ``{}``."""
    if len(steps) < 2:
        return {}
    return {id(p): k for k, sub in enumerate(steps) for p in optimized(sub.optimizer)}


def _check_disjoint(optimizers: dict[str, torch.optim.Optimizer]) -> None:
    owner: dict[int, str] = {}
    for name, o in optimizers.items():
        for group in o.param_groups:
            for p in group["params"]:
                other = owner.setdefault(id(p), name)
                if other != name:
                    raise OptimizersError(
                        f"optimizer {name!r} holds a parameter (shape {tuple(p.shape)}) that "
                        f"optimizer {other!r} holds too: each parameter is stepped by one "
                        "optimizer (give each the parameters of its part of the model)")


def schedulers(lr_scheduler: Any, optimizers: dict[str, torch.optim.Optimizer]
               ) -> NamedSchedulers | None:
    """The cell's `lr_scheduler` for several `optimizers`: None, or a dict {name: scheduler}
    of some of them, each over its own optimizer. Raises OptimizersError."""
    if lr_scheduler is None:
        return None
    if not isinstance(lr_scheduler, dict):
        raise OptimizersError("with several optimizers, lr_scheduler must be a dict {name: "
                              "scheduler} (for some of the optimizers' names)")
    for name, s in lr_scheduler.items():
        if name not in optimizers:
            raise OptimizersError(f"lr_scheduler[{name!r}] names no optimizer: the optimizers "
                                  f"are {', '.join(map(repr, optimizers))}")
        if isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise OptimizersError(f"lr_scheduler[{name!r}] is a ReduceLROnPlateau, which steps "
                                  "on a metric: with several optimizers, schedulers step once "
                                  "per training step; use a step-wise scheduler")
        if getattr(s, "optimizer", None) is not optimizers[name]:
            raise OptimizersError(f"lr_scheduler[{name!r}] does not schedule "
                                  f"optimizer[{name!r}]: build it over that optimizer")
    return NamedSchedulers(lr_scheduler)
