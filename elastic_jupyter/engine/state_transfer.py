"""Giving a generation's newcomers the training state: tensors in flat buckets, the rest pickled.

``dist.broadcast_object_list`` pickles the whole state, tensors included: the sender serialises
every byte, the bytes travel, every receiver unpickles them, and the pickle of a large model is a
second copy of it in memory on both sides. Here rank 0 (the generation's oldest survivor) sends
the state's structure once, pickled, with each tensor replaced by its index (a few kB whatever
the model's size), and then the tensors themselves: grouped by section, dtype and device,
concatenated into flat buckets of at most :data:`BUCKET_BYTES` and sent with one
``dist.broadcast`` each, which moves the bytes at the backend's full speed. torch's DDP
broadcasts parameters in flat buckets in the same way when it wraps a model (its
``_sync_module_states``).

Sections keep memory as DDP's: the model's tensors are copied into the parameters when the state
is loaded and their buckets freed, while the optimizer's tensors (Adam's moments, twice the
model) are kept by the optimizer as loaded, as views of buckets that hold nothing else.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 * 2**20  # a bucket is one broadcast, and one extra copy on the sender
SECTIONS = ("model", "optimizer")  # the state's parts with their own buckets; the rest share


class _Ref:
    """Where a tensor was in the state: its index in the list of tensors sent."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _strip(obj, section: str, found: list):
    """`obj` with every dense tensor replaced by a :class:`_Ref`; the tensors are appended to
    `found` as (section, tensor). Containers are rebuilt, never changed in place."""
    if isinstance(obj, torch.Tensor) and obj.layout == torch.strided:
        found.append((section, obj))
        return _Ref(len(found) - 1)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # its type and attributes (a state_dict's _metadata) kept
        for k, v in obj.items():  # not update(): a Counter's (milestones) adds up
            out[k] = _strip(v, section, found)
        return out
    if isinstance(obj, list):
        return [_strip(v, section, found) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_strip(v, section, found) for v in obj)
    return obj  # numbers, strings, a sparse tensor (pickled with the structure)


def _fill(obj, tensors: list):
    """Inverse of :func:`_strip`: each :class:`_Ref` replaced by its received tensor."""
    if isinstance(obj, _Ref):
        return tensors[obj.index]
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = _fill(v, tensors)
        return out
    if isinstance(obj, list):
        return [_fill(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_fill(v, tensors) for v in obj)
    return obj


def plan_buckets(meta: list) -> list[list[int]]:
    """Tensor indices per bucket, from ``meta`` ((section, dtype, device type, shape) per
    tensor): tensors of one section, dtype and device type in order, at most BUCKET_BYTES a
    bucket (a larger tensor gets a bucket of its own). Every rank computes the same plan."""
    groups: dict = {}
    for index, (section, dtype, device_type, _) in enumerate(meta):
        groups.setdefault((section, dtype, device_type), []).append(index)
    buckets = []
    for (_, dtype, _), indices in groups.items():
        size = torch.empty((), dtype=dtype).element_size()
        current, used = [], 0
        for index in indices:
            nbytes = _numel(meta[index][3]) * size
            if current and used + nbytes > BUCKET_BYTES:
                buckets.append(current)
                current, used = [], 0
            current.append(index)
            used += nbytes
        buckets.append(current)
    return buckets


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def broadcast_state(state: dict | None, rank: int, device: torch.device) -> dict:
    """Send rank 0's `state` (a dict of plain data and tensors, engine.state's capture) to every
    rank of the current process group; all ranks call it. Returns the state on every rank (rank
    0's own object there). `device` is this rank's training device: tensors captured on a GPU
    arrive on it, CPU tensors on the CPU. With nccl the buckets travel through `device`.

    Raises what the collectives raise (the caller turns a peer's failure into PeerFailure).
    """
    tensors: list = []
    box = [None]
    if rank == 0:
        skeleton = {key: _strip(value, key if key in SECTIONS else "other", tensors)
                    for key, value in state.items()}
        meta = [(section, t.dtype, t.device.type, tuple(t.shape)) for section, t in tensors]
        box = [(skeleton, meta)]
    nccl = dist.get_backend() == "nccl"
    via = device if nccl else torch.device("cpu")
    dist.broadcast_object_list(box, src=0, device=via if nccl else None)
    skeleton, meta = box[0]
    received: list = [None] * len(meta)
    for bucket in plan_buckets(meta):
        dtype = meta[bucket[0]][1]
        if rank == 0:
            flat = torch.cat([tensors[i][1].detach().reshape(-1).to(via) for i in bucket])
        else:
            flat = torch.empty(sum(_numel(meta[i][3]) for i in bucket), dtype=dtype, device=via)
        dist.broadcast(flat, src=0)
        if rank != 0:
            parts = flat.split([_numel(meta[i][3]) for i in bucket])
            for index, part in zip(bucket, parts):
                target = device if meta[index][2] == "cuda" else torch.device("cpu")
                received[index] = part.view(meta[index][3]).to(target)
        del flat
    return state if rank == 0 else _fill(skeleton, received)
