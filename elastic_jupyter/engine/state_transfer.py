"""Giving a generation's newcomers the training state: tensors in flat buckets, the rest pickled.

``dist.broadcast_object_list`` pickles the whole state, tensors included: the sender serialises
every byte, the bytes travel, every receiver unpickles them, and the pickle of a large model is a
second copy of it in memory on both sides. Here rank 0 (the generation's oldest survivor) sends
the state's structure once, pickled, with each tensor replaced by its index (a few kB whatever
the model's size), and then the tensors themselves, each with ``dist.broadcast`` (which moves
the bytes at the backend's full speed): a tensor of 1 MiB or more as it is, without a copy;
smaller ones (biases, norms, step counters) copied into flat buckets of one section and device,
so a model's hundreds of small tensors cost a few broadcasts. Tensors travel as bytes, so any
dtype does (gloo cannot reduce or send int16 or uint32; nccl has no 16-bit integers). The broadcasts are
issued asynchronously, so a bucket's copy on the sender overlaps the previous one's transfer.
torch's DDP broadcasts parameters in flat buckets in the same way when it wraps a model (its
``_sync_module_states``).

Memory stays as DDP's: a receiver's model tensors take the bytes in place (``into``), while the
optimizer's large tensors (Adam's moments, twice the model) are kept by the optimizer as
received, each in a buffer of its own; a bucket's small tensors are copied out of it.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist

DIRECT_BYTES = 2**20  # a tensor this large travels alone, as it is: no copy on the sender
BUCKET_BYTES = 16 * 2**20  # smaller tensors, copied together: one broadcast per bucket
SECTIONS = ("model", "optimizer")  # the state's parts with their own buckets; the rest share
ALIGN = 16  # byte offset of a tensor in a bucket: a multiple of any dtype's size


class _Ref:
    """Where a tensor was in the state: its index in the list of tensors sent."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _strip(obj, section: str, found: list):
    """`obj` with every dense tensor replaced by a :class:`_Ref`; the tensors are appended to
    `found` as (section, tensor). Containers are rebuilt, never changed in place."""
    if isinstance(obj, torch.Tensor) and obj.layout == torch.strided and not obj.is_quantized:
        found.append((section, obj))
        return _Ref(len(found) - 1)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # its type and attributes (a state_dict's _metadata) kept
        for k, v in obj.items():  # not update(): a Counter's (milestones) adds up
            out[k] = _strip(v, section, found)
        return out
    if isinstance(obj, list):
        return [_strip(v, section, found) for v in obj]
    if isinstance(obj, tuple):
        return _same_tuple(obj, [_strip(v, section, found) for v in obj])
    return obj  # numbers, strings, a sparse or quantized tensor (pickled with the structure)


def _same_tuple(obj: tuple, items: list) -> tuple:
    """`items` as a tuple of `obj`'s own type (a namedtuple, torch.Size)."""
    return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)


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
        return _same_tuple(obj, [_fill(v, tensors) for v in obj])
    return obj


def plan_buckets(meta: list) -> list[list[tuple[int, int]]]:
    """Buckets of (tensor index, byte offset), from ``meta`` ((section, dtype, device type,
    shape) per tensor): a tensor of DIRECT_BYTES or more alone (sent as it is, without a
    copy); smaller ones of one section and device type together in order, each at an offset
    aligned to ALIGN bytes, at most BUCKET_BYTES a bucket. Every rank computes the same plan."""
    groups: dict = {}
    buckets = []
    for index, (section, dtype, device_type, shape) in enumerate(meta):
        if _nbytes(meta[index]) >= DIRECT_BYTES:
            buckets.append([(index, 0)])
        else:
            groups.setdefault((section, device_type), []).append(index)
    for indices in groups.values():
        current, used = [], 0
        for index in indices:
            if current and used + _nbytes(meta[index]) > BUCKET_BYTES:
                buckets.append(current)
                current, used = [], 0
            current.append((index, used))
            used += -(-_nbytes(meta[index]) // ALIGN) * ALIGN
        buckets.append(current)
    return buckets


def _nbytes(entry) -> int:
    _, dtype, _, shape = entry
    return dtype.itemsize * math.prod(shape)


def _as_bytes(t: torch.Tensor, via: torch.device) -> torch.Tensor:
    """`t`'s values as a flat uint8 tensor on `via` (a view when it is already contiguous
    there): bytes travel on every backend, whatever the dtype (gloo has no int16 or uint32)."""
    return t.detach().to(via).contiguous().view(-1).view(torch.uint8)


def _targets(skeleton, into, meta: list, device: torch.device, out: dict) -> None:
    """Fill `out` with {tensor index: a tensor of `into` at the same place in the structure}
    where that tensor can take the bytes as they arrive: same dtype, shape and device,
    contiguous."""
    if isinstance(skeleton, _Ref):
        _, dtype, device_type, shape = meta[skeleton.index]
        target = device if device_type == "cuda" else torch.device("cpu")
        if isinstance(into, torch.Tensor) and into.dtype == dtype and \
                tuple(into.shape) == shape and into.device == target and into.is_contiguous():
            out[skeleton.index] = into
    elif isinstance(skeleton, dict) and isinstance(into, dict):
        for key, value in skeleton.items():
            if key in into:
                _targets(value, into[key], meta, device, out)


def broadcast_state(state: dict | None, rank: int, device: torch.device,
                    into: dict | None = None) -> dict:
    """Send rank 0's `state` (a dict of plain data and tensors, engine.state's capture) to every
    rank of the current process group; all ranks call it. Returns the state on every rank (rank
    0's own object there). `device` is this rank's training device: tensors captured on a GPU
    arrive on it, CPU tensors on the CPU. With nccl the bytes travel through `device`.

    `into`, on a receiving rank: its own live state (a capture without copies). A tensor at the
    same place, of the same dtype, shape and device, receives the bytes in place (the model's
    parameters and buffers): no new memory to fault in and no copy when the state is loaded.
    Such a tensor holds a mix of old and new values if the transfer fails, so the caller
    treats its state as lost until the transfer completes.

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
    targets: dict = {}
    if rank != 0 and into is not None:
        _targets(skeleton, into, meta, device, targets)
    in_flight = []  # (work, bucket, buffer): broadcasts overlap the next bucket's copy
    for bucket in plan_buckets(meta):
        last, offset = bucket[-1]
        size = offset + _nbytes(meta[last])
        if rank == 0 and len(bucket) == 1:
            flat = _as_bytes(tensors[last][1], via)  # no copy
        elif rank == 0:
            flat = torch.zeros(size, dtype=torch.uint8, device=via)
            for index, start in bucket:
                flat[start:start + _nbytes(meta[index])].copy_(_as_bytes(tensors[index][1], via))
        elif len(bucket) == 1 and last in targets and targets[last].device == via:
            flat = _as_bytes(targets[last], via)  # a view: the bytes land in the tensor
        else:
            flat = torch.empty(size, dtype=torch.uint8, device=via)
        in_flight.append((dist.broadcast(flat, src=0, async_op=True), bucket, flat))
    for work, bucket, flat in in_flight:
        work.wait()
        if rank != 0:
            for index, start in bucket:
                section, dtype, device_type, shape = meta[index]
                target = device if device_type == "cuda" else torch.device("cpu")
                value = flat[start:start + _nbytes(meta[index])].view(dtype).view(shape)
                if index in targets:
                    received[index] = targets[index].copy_(value)  # a no-op if received there
                else:  # a small tensor gets storage of its own: the bucket is freed, and
                    # code that reads a storage from its start (torch.set_rng_state) reads it
                    received[index] = (value.clone() if len(bucket) > 1 else value).to(target)
    return state if rank == 0 else _fill(skeleton, received)
