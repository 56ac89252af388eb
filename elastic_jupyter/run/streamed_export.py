"""A state dict written to a ``torch.save`` file one tensor at a time.

A sharded run's model may be larger than the kernel's memory, and its whole state dict is
never in one place; ``torch.save`` needs every tensor in memory at once. Here the file is laid
out first: ``torch.serialization.skip_data`` saves fake tensors of every shape and dtype (the
archive, with each tensor's bytes reserved but not written), then the file is mapped shared
(``torch.load(mmap=True)`` under ``set_default_mmap_options(MAP_SHARED)``) and each tensor is
copied into its place as it comes. The kernel writes the pages back as they fill; at most one
tensor is held at once. The result is ``torch.save``'s format, which
``torch.load(weights_only=True)`` reads; its CRC32 fields are left out (before torch 2.7:
stale), as in the engine's checkpoints: torch.load never checks them, a zip tool would.
(``skip_data``, torch 2.5+, is the save-then-fill method torch's own documentation gives.)

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import mmap
import os
import threading
from typing import Iterable

import torch

from ..engine.state import checkpoint as ckpt

# key: (shape, dtype), or the key whose tensor it names too (a tied parameter's other name)
Layout = dict[str, "tuple[tuple[int, ...], torch.dtype] | str"]
# torch.load's mmap flags are one setting of the process: set and put back by one export at a
# time (another thread's torch.load(mmap=True) in that instant would map its file shared too)
_MMAP_FLAGS = threading.Lock()


def supported() -> bool:
    """Whether this torch lays a file out without its bytes (``skip_data``: torch 2.5+); where
    not, a sharded run's export gathers the model whole first."""
    return hasattr(torch.serialization, "skip_data")


def write_streamed(path: str, layout: Layout, tensors: Iterable[tuple[str, torch.Tensor]]
                   ) -> str:
    """Write the state dict whose keys, shapes and dtypes `layout` gives to `path`, taking its
    tensors from `tensors` ((key, tensor) in any order, each key once; not the keys that name
    another's tensor, which share its storage in the file), atomically: a file with `path`'s
    name is whole. Returns the absolute path.

    Raises ValueError when `tensors` gives a key `layout` lacks, a key twice or a tensor of
    another shape or dtype, or misses a key (no file is left then); the errors of
    ``tensors`` (a damaged checkpoint) and OSError pass through, also leaving no file."""
    path = os.path.abspath(path)
    from torch._subclasses.fake_tensor import FakeTensorMode  # skip_data's documented use

    with FakeTensorMode():
        skeleton = {key: torch.empty(kind[0], dtype=kind[1]) for key, kind in layout.items()
                    if not isinstance(kind, str)}
    skeleton.update({key: skeleton[kind] for key, kind in layout.items()
                     if isinstance(kind, str)})  # one storage in the file, as torch.save keeps

    def write(f) -> None:
        with torch.serialization.skip_data(materialize_fake_tensors=True), ckpt.without_crc32():
            torch.save(skeleton, f)  # (no CRC32: the bytes land after it would be computed)
        f.flush()
        _fill(f.name, layout, tensors)

    ckpt.atomic_write(path, write)
    return path


def _fill(file: str, layout: Layout, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy `tensors` into the laid-out `file` through a shared mapping, which goes when
    this returns (the caller's fsync then covers every page)."""
    with _MMAP_FLAGS, torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        places = torch.load(file, mmap=True, weights_only=True)
    seen = set()
    try:
        for key, tensor in tensors:
            if key not in layout or key in seen or isinstance(layout[key], str):
                raise ValueError(f"{key!r} is not a key of the state dict being written, or "
                                 "came twice")
            place = places[key]
            if place.shape != tensor.shape or place.dtype != tensor.dtype:
                raise ValueError(f"{key!r} is {tuple(tensor.shape)} {tensor.dtype}, the file "
                                 f"laid out {tuple(place.shape)} {place.dtype}")
            with torch.no_grad():
                place.copy_(tensor)
            seen.add(key)
    finally:  # no mapping outlives the call, even in a kept traceback (the file goes)
        places = place = None  # noqa: F841
        getattr(tensors, "close", lambda: None)()  # a generator's own mappings
    missing = sorted(k for k in layout.keys() - seen if not isinstance(layout[k], str))
    if missing:
        raise ValueError(f"no tensor came for {len(missing)} key(s), first {missing[0]!r}")
