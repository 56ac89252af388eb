"""Training state as plain data: what a checkpoint holds and what a newcomer receives.

Everything here is tensors, numbers, strings, lists and dicts, so a checkpoint loads with
``torch.load(weights_only=True)`` and a file from a shared folder cannot run code.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

FORMAT_VERSION = 1


@dataclass
class Progress:
    """Where the run stands: ``step`` optimizer steps done; ``position`` samples used in ``epoch``."""

    step: int = 0
    epoch: int = 0
    position: int = 0
    samples: int = 0
    metric_names: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(step=self.step, epoch=self.epoch, position=self.position,
                    samples=self.samples, metric_names=list(self.metric_names))


def rng_state() -> dict:
    """Python, numpy and torch RNG states, converted to tensors and plain numbers."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict) -> None:
    """Inverse of :func:`rng_state`."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    nps = state["numpy"]
    np.random.set_state((nps["kind"], nps["keys"].numpy().astype(np.uint32), nps["pos"],
                         nps["has_gauss"], nps["cached"]))
    torch.set_rng_state(state["torch"])


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def capture(model, optimizer, lr_scheduler, progress: Progress, history: list, config: dict,
            grad_scaler=None) -> dict:
    """A deep copy, on the CPU, of everything needed to continue training exactly.

    Returns a dict of plain data (see the module docstring); the copy is safe to write from
    another thread while training goes on.
    """
    return {
        "format": FORMAT_VERSION,
        "model": _to_cpu(model.state_dict()),
        "optimizer": _to_cpu(optimizer.state_dict()),
        "lr_scheduler": _to_cpu(lr_scheduler.state_dict()) if lr_scheduler is not None else None,
        "progress": progress.as_dict(),
        "rng": rng_state(),
        "history": list(history),  # records are never changed once appended
        "config": dict(config),
        # fp16's torch.amp.GradScaler: scale and growth tracker, plain numbers
        "grad_scaler": grad_scaler.state_dict() if grad_scaler is not None else None,
    }


def restore(state: dict, model, optimizer, lr_scheduler, grad_scaler=None) -> tuple[Progress, list]:
    """Load `state` (from :func:`capture`) into the objects; returns (progress, history)."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if lr_scheduler is not None and state.get("lr_scheduler") is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    if grad_scaler is not None and state.get("grad_scaler"):
        grad_scaler.load_state_dict(state["grad_scaler"])
    set_rng_state(state["rng"])
    return Progress(**state["progress"]), list(state["history"])
