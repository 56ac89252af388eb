"""Giving a generation's newcomers the training state: tensors in flat buckets, the rest pickled.

``dist.broadcast_object_list`` pickles the whole state, tensors included: the sender serialises
every byte, the bytes travel, every receiver unpickles them, and the pickle of a large model is a
second copy of it in memory on both sides. Here rank 0 (the generation's oldest survivor) sends
the state's structure once, pickled, with each tensor replaced by its index (a few kB whatever
the model's size), and then the tensors themselves, each with ``dist.broadcast`` (which moves
the bytes at the backend's full speed): a tensor of 1 MiB or more as it is, without a copy;
smaller ones (biases, norms, step counters) concatenated into flat buckets of one section, dtype
and device, so a model's hundreds of small tensors cost a few broadcasts. The broadcasts are
issued asynchronously, so a bucket's copy on the sender overlaps the previous one's transfer.
torch's DDP broadcasts parameters in flat buckets in the same way when it wraps a model (its
``_sync_module_states``).

Sections keep memory as DDP's: the model's tensors are copied into the parameters when the state
is loaded and their buffers freed, while the optimizer's tensors (Adam's moments, twice the
model) are kept by the optimizer as loaded, in buffers that hold nothing else.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

DIRECT_BYTES = 2**20  # a tensor this large travels alone, as it is: no copy on the sender
BUCKET_BYTES = 16 * 2**20  # smaller tensors, copied together: one broadcast per bucket
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
    tensor): a tensor of DIRECT_BYTES or more alone (it is sent as it is, without a copy);
    smaller ones of one section, dtype and device type together in order, at most BUCKET_BYTES
    a bucket. Every rank computes the same plan."""
    groups: dict = {}
    buckets = []
    for index, (section, dtype, device_type, shape) in enumerate(meta):
        if _numel(shape) * _element_size(dtype) >= DIRECT_BYTES:
            buckets.append([index])
        else:
            groups.setdefault((section, dtype, device_type), []).append(index)
    for (_, dtype, _), indices in groups.items():
        current, used = [], 0
        for index in indices:
            nbytes = _numel(meta[index][3]) * _element_size(dtype)
            if current and used + nbytes > BUCKET_BYTES:
                buckets.append(current)
                current, used = [], 0
            current.append(index)
            used += nbytes
        buckets.append(current)
    return buckets


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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
    in_flight = []  # (work, bucket, buffer): broadcasts overlap the next bucket's copy
    for bucket in plan_buckets(meta):
        if rank == 0:
            parts = [tensors[i][1].detach().reshape(-1).to(via) for i in bucket]
            flat = parts[0] if len(parts) == 1 else torch.cat(parts)  # one tensor: no copy
        else:
            flat = torch.empty(sum(_numel(meta[i][3]) for i in bucket), dtype=meta[bucket[0]][1],
                               device=via)
        in_flight.append((dist.broadcast(flat, src=0, async_op=True), bucket, flat))
    for work, bucket, flat in in_flight:
        work.wait()
        if rank != 0:
            for index, part in zip(bucket, flat.split([_numel(meta[i][3]) for i in bucket])):
                target = device if meta[index][2] == "cuda" else torch.device("cpu")
                received[index] = part.view(meta[index][3]).to(target)
    return state if rank == 0 else _fill(skeleton, received)
