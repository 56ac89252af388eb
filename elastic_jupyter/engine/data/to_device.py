"""Moving a batch to the rank's device without changing its structure.

``loss_fn`` and ``metric_fn`` receive the batch as ``collate_fn`` built it: a namedtuple stays that
namedtuple, a dataclass that dataclass, a ``Mapping`` subclass (a tokenizer's ``BatchEncoding``,
a ``UserDict``) that subclass, with every tensor inside moved to the device.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from typing import cast

import torch


def to_device(obj, device: torch.device):
    """`obj` with every tensor in it on `device`, its containers rebuilt as the same types.

    Handles tensors, objects with their own ``.to(device)`` (used as they define it), dataclass
    instances, namedtuples, lists, tuples, Mappings, and any nesting of these; other values
    (numbers, strings, None, ...) pass through. Containers are copied, never changed in place.

    Raises:
        TypeError: a read-only Mapping type that cannot be rebuilt from a dict; give it a
            ``.to(device)`` method.
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if callable(getattr(obj, "to", None)) and not isinstance(obj, type):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        clone = copy.copy(obj)
        for f in dataclasses.fields(obj):  # object.__setattr__: frozen dataclasses too
            object.__setattr__(clone, f.name, to_device(getattr(obj, f.name), device))
        return clone
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):  # a namedtuple
        return type(obj)(*(to_device(o, device) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, Mapping):
        return _mapping_to_device(obj, device)
    return obj


def _mapping_to_device(obj: Mapping, device: torch.device) -> Mapping:
    moved = {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, MutableMapping):  # a copy keeps its type and attributes (a factory, ...)
        clone = copy.copy(obj)
        clone.update(moved)
        return clone
    rebuild = cast(Callable[[dict], Mapping], type(obj))  # a Mapping built from a dict
    try:
        return rebuild(moved)
    except TypeError:
        raise TypeError(f"cannot rebuild the batch's {type(obj).__name__} on the device: give "
                        "it a .to(device) method, or make it a MutableMapping") from None
