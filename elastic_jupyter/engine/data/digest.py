"""Hashes of samples by value: equal samples give equal digests on every engine (a dataset's
fingerprint, engine.data.fingerprint; a stream's trials at setup, engine.data.stream_split).

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping

import numpy as np
import torch


def items_digest(items: list) -> str:
    """A hash of `items` by value (as a fingerprint's): equal items, equal digests."""
    digest = hashlib.sha256()
    for item in items:
        feed(digest, item)
    return digest.hexdigest()


def feed(digest, obj) -> None:
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
            feed(digest, obj[key])
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            digest.update(field.name.encode())
            feed(digest, getattr(obj, field.name))
    elif isinstance(obj, (list, tuple)):
        digest.update(f"seq{len(obj)}".encode())
        for item in obj:
            feed(digest, item)
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
