"""A dataset's identity across engines: its length and a hash of a few of its items.

Every engine builds the run's dataset itself, by running the cell. If one built another (a
file that changed, a path that resolved elsewhere, an unseeded random split), its samples and
even its number of steps would differ from its peers' without any error; comparing these
fingerprints catches that at setup.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Mapping

import numpy as np
import torch

from . import state as state_mod
from .streams import Streams

SEED = 0  # random augmentations in __getitem__ draw the same on every engine


def dataset_fingerprint(dataset) -> dict:
    """``{"samples": len(dataset), "hash": 16 hex digits}``: the hash covers items 0, n // 2
    and n - 1 (an iterable's first three, engine.streams; its samples: the declared length or
    None) (the bytes, dtypes and shapes of their tensors and arrays, their numbers and
    strings, inside sequences, mappings and dataclasses). The items are read with every RNG
    seeded, and the RNG states are restored after.
    """
    stream = isinstance(dataset, Streams)
    n = dataset.length if stream else len(dataset)  # a stream's declared one, or None
    digest = hashlib.sha256(str(n).encode())
    saved = state_mod.rng_state()
    try:
        random.seed(SEED)
        np.random.seed(SEED)
        torch.default_generator.manual_seed(SEED)  # the CPU's only: CUDA's is not restored
        # a stream is read forwards: its first items
        for item in dataset.head(3) if stream else (
                dataset[i] for i in sorted({0, n // 2, n - 1})):
            _feed(digest, item)
    finally:
        state_mod.set_rng_state(saved)
    return {"samples": n, "hash": digest.hexdigest()[:16]}


def _feed(digest, obj) -> None:
    """Add `obj` to the digest by value; an object of unknown type adds its type name only,
    never its repr (which may hold a memory address, different on every engine)."""
    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu()
        if obj.layout != torch.strided:
            obj = obj.to_dense()
        digest.update(f"tensor{obj.dtype}{tuple(obj.shape)}".encode())
        digest.update(obj.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, Mapping):  # also a UserDict (a tokenizer's BatchEncoding)
        for key in sorted(obj, key=str):
            digest.update(str(key).encode())
            _feed(digest, obj[key])
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            digest.update(field.name.encode())
            _feed(digest, getattr(obj, field.name))
    elif isinstance(obj, (list, tuple)):
        digest.update(f"seq{len(obj)}".encode())
        for item in obj:
            _feed(digest, item)
    elif isinstance(obj, (int, float, complex, str, bytes, bool, type(None), np.generic)):
        digest.update(repr(obj).encode())
    else:
        array = np.asarray(obj) if hasattr(obj, "__array_interface__") or isinstance(
            obj, np.ndarray) else None  # numpy arrays, PIL images
        if array is not None and array.dtype != object:
            digest.update(f"array{array.dtype.str}{array.shape}".encode())
            digest.update(np.ascontiguousarray(array).tobytes())
        else:
            digest.update(type(obj).__qualname__.encode())
