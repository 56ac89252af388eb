"""Giving a generation's newcomers the training state: storages in flat buckets, the rest pickled.

``dist.broadcast_object_list`` pickles the whole state, tensors included: the sender serialises
every byte, the bytes travel, every receiver unpickles them, and the pickle of a large model is a
second copy of it in memory on both sides. Here rank 0 (the generation's oldest survivor) sends
the state's structure once, pickled, with each tensor replaced by its place (a few kB whatever
the model's size), and then the bytes of the tensors' storages, each with ``dist.broadcast``
(which moves the bytes at the backend's full speed): a storage of 1 MiB or more as it is,
without a copy; smaller ones (biases, norms, step counters) copied into flat buckets of one
section and device, so a model's hundreds of small tensors cost a few broadcasts. Bytes travel,
so any dtype does (gloo cannot reduce or send int16 or uint32; nccl has no 16-bit integers).
The broadcasts are issued asynchronously, so a bucket's copy on the sender overlaps the previous
one's transfer. torch's DDP broadcasts parameters in flat buckets in the same way when it wraps
a model (its ``_sync_module_states``).

**Storages, not tensors, travel** (as ``torch.save`` writes them): each storage once, the span of
its bytes that the state's tensors use, and every tensor is rebuilt on the receiver as a view of
its storage with the sender's shape, strides and offset. So every layout arrives as it was sent:
any strides (a transposed positional-encoding table that torch calls contiguous), views that
share a storage (a tied embedding and output layer stay one storage), empty and 0-dim tensors.
Conjugate and negative views travel resolved.

Memory stays as DDP's: a receiver's model tensors take the bytes in place (``into``) when its
own tensors lie in one storage as the sender's do; else they are copied into from the received
storage, which is then freed. The optimizer's large tensors (Adam's moments, twice the model)
are kept by the optimizer as received, each span in a buffer of its own; a bucket's small spans
are copied out of it.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import copy
import math
import pickle
from typing import Any

import torch
import torch.distributed as dist

from ..protocol import TrainingState
from .collective import collective

DIRECT_BYTES = 2**20  # a storage span this large travels alone, as it is: no copy on the sender
BUCKET_BYTES = 16 * 2**20  # smaller spans, copied together: one broadcast per bucket
SECTIONS = ("model", "optimizer")  # the state's parts with their own buckets; the rest share
ALIGN = 16  # a span's start in its storage and in a bucket: a multiple of any dtype's size


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
    """Buckets of (item index, byte offset), from ``meta`` ((section, dtype, device type,
    shape) per item; the items are storage spans: uint8 of their byte count): an item of
    DIRECT_BYTES or more alone (sent as it is, without a copy); smaller ones of one section and
    device type together in order, each at an offset aligned to ALIGN bytes, at most
    BUCKET_BYTES a bucket. Every rank computes the same plan."""
    groups: dict = {}
    buckets = []
    for index, (section, dtype, device_type, shape) in enumerate(meta):
        if _nbytes(meta[index]) >= DIRECT_BYTES:
            buckets.append([(index, 0)])
        else:
            groups.setdefault((section, device_type), []).append(index)
    for indices in groups.values():
        current: list[tuple[int, int]] = []  # (tensor index, byte offset in the bucket)
        used = 0
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


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes [start, end) of `t`'s storage that `t` reads (end == start when it is empty)."""
    start = int(t.storage_offset()) * t.element_size()
    if t.numel() == 0:
        return start, start
    last = sum((int(size) - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def _storage_bytes(t: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
    """Bytes [start, start + nbytes) of `t`'s storage as a uint8 tensor (a view: no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        t.untyped_storage(), start, (nbytes,), (1,))


def _view(storage_bytes: torch.Tensor, dtype: torch.dtype, shape, stride, offset: int
          ) -> torch.Tensor:
    """A tensor of `dtype`, `shape` and `stride` at element `offset` of `storage_bytes`'s
    storage (which starts at a multiple of ALIGN bytes)."""
    return torch.empty(0, dtype=dtype, device=storage_bytes.device).set_(
        storage_bytes.untyped_storage(), storage_bytes.storage_offset() // dtype.itemsize
        + offset, tuple(shape), tuple(stride))


def _spans(tensors: list) -> tuple[list, list, list]:
    """Group the state's tensors ((section, tensor) each) by storage.

    Returns (sources, span_meta, tensor_meta): per span its bytes (a uint8 view of the
    storage) and ``(section, torch.uint8, device type, (nbytes,))`` (the bytes from its first
    used byte rounded down to ALIGN up to its last used byte); per tensor ``(span index or None
    when empty, dtype, shape, stride, element offset in its span, device type)``. Conjugate
    and negative views are sent resolved.
    """
    sent: list[torch.Tensor] = []
    # (device, storage address): (first used byte, end, section of its first tensor)
    by_storage: dict[tuple, tuple[int, int, str]] = {}
    extents: list[tuple[tuple | None, int]] = []  # per tensor: (its storage's key, first byte)
    for section, t in tensors:
        t = t.detach()
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        sent.append(t)
        start, end = _extent(t)
        key = None
        if end > start:
            key = (t.device, t.untyped_storage().data_ptr())
            low, high, first = by_storage.get(key, (start, end, section))
            by_storage[key] = (min(low, start), max(high, end), first)
        extents.append((key, start))
    order = {key: i for i, key in enumerate(by_storage)}
    lows = {key: low - low % ALIGN for key, (low, _, _) in by_storage.items()}
    span_meta = [(section, torch.uint8, key[0].type, (high - lows[key],))
                 for key, (_, high, section) in by_storage.items()]
    sources: dict = {}
    tensor_meta = []
    for t, (key, start) in zip(sent, extents):
        offset = (start - lows[key]) // t.element_size() if key is not None else 0
        if key is not None and order[key] not in sources:
            sources[order[key]] = _storage_bytes(t, lows[key], _nbytes(span_meta[order[key]]))
        tensor_meta.append((order[key] if key is not None else None, t.dtype, tuple(t.shape),
                            t.stride(), offset, t.device.type))
    return [sources[i] for i in range(len(span_meta))], span_meta, tensor_meta


def _targets(skeleton, into, out: dict) -> None:
    """Fill `out` with {tensor index: the tensor of `into` at the same place in the structure}."""
    if isinstance(skeleton, _Ref):
        if isinstance(into, torch.Tensor) and into.layout == torch.strided \
                and not into.is_quantized and not into.is_conj() and not into.is_neg():
            out[skeleton.index] = into
    elif isinstance(skeleton, dict) and isinstance(into, dict):
        for key, value in skeleton.items():
            if key in into:
                _targets(value, into[key], out)


def _same_place(tensor_meta: list, span_meta: list, targets: dict, device: torch.device
                ) -> dict[int, tuple[torch.Tensor, int]]:
    """{span: (a target tensor, byte offset of the span in its storage)} for the spans whose
    every tensor has a target that lies in one storage on its device as the sender's tensors
    lie in theirs (same dtype, shape, strides and relative offsets): their bytes can land in
    the targets' storage as they are."""
    found: dict = {}
    bad = set()
    for index, (span, dtype, shape, stride, offset, device_type) in enumerate(tensor_meta):
        if span is None or span in bad:
            continue
        x = targets.get(index)
        key = None
        if x is not None and x.dtype == dtype and tuple(x.shape) == shape \
                and x.stride() == stride and x.device == _on(device_type, device):
            low = x.storage_offset() * x.element_size() - offset * dtype.itemsize
            if 0 <= low and low + _nbytes(span_meta[span]) <= x.untyped_storage().nbytes():
                key = (x.untyped_storage().data_ptr(), low)
        if key is None or found.get(span, (None, key))[1] != key:
            bad.add(span)
            found.pop(span, None)
        else:
            found[span] = (x, key)
    return {span: (x, key[1]) for span, (x, key) in found.items()}


def _on(device_type: str, device: torch.device) -> torch.device:
    """Where a tensor the sender held on `device_type` lives on this rank."""
    return device if device_type == "cuda" else torch.device("cpu")


def broadcast_state(state: TrainingState | None, rank: int, device: torch.device,
                    into: TrainingState | None = None, sent: dict | None = None
                    ) -> TrainingState:
    """Send rank 0's `state` (a dict of plain data and tensors, engine.state.training_state's
    capture) to every rank of the current process group; all ranks call it. Returns the state on
    every rank (rank 0's own object there). `device` is this rank's training device: tensors
    captured on a GPU arrive on it, CPU tensors on the CPU. With nccl the bytes travel through
    `device`. Every tensor arrives with the sender's dtype, shape, strides and storage sharing (see
    the module docstring).

    `into`, on a receiving rank: its own live state (a capture without copies). A tensor at the
    same place, of the same dtype and shape, ends up holding the received values (in place when
    its storage is laid out as the sender's: no new memory to fault in) and is the one returned
    there. Such a tensor holds a mix of old and new values if the transfer fails, so the caller
    treats its state as lost until the transfer completes.

    `sent`, on rank 0: filled with ``{"bytes": the structure's pickle and the tensors' spans,
    "tensor_bytes": the spans alone}`` (what each receiver is sent).

    Raises :class:`~engine.group.collective.PeerFailure` when a collective fails (a peer died or
    stayed away); any other exception is this rank's own error.
    """
    sources: list = []
    box: list[Any] = [None]
    if rank == 0:
        if state is None:
            raise ValueError("rank 0 sends the state: it cannot be None")
        tensors: list = []
        skeleton = {key: _strip(value, key if key in SECTIONS else "other", tensors)
                    for key, value in state.items()}
        sources, span_meta, tensor_meta = _spans(tensors)
        box = [(skeleton, span_meta, tensor_meta)]
        if sent is not None:
            spans_bytes = sum(_nbytes(meta) for meta in span_meta)
            sent.update(bytes=len(pickle.dumps(box[0])) + spans_bytes, tensor_bytes=spans_bytes)
    nccl = dist.get_backend() == "nccl"
    via = device if nccl else torch.device("cpu")
    with collective("state broadcast"):
        dist.broadcast_object_list(box, src=0, device=via if nccl else None)
    skeleton, span_meta, tensor_meta = box[0]
    targets: dict = {}
    if rank != 0 and into is not None:
        _targets(skeleton, into, targets)
    in_place = _same_place(tensor_meta, span_meta, targets, device) if targets else {}
    spans: list = [None] * len(span_meta)  # each span's bytes on the receiver
    in_flight = []  # (work, bucket, buffer): broadcasts overlap the next bucket's copy
    for bucket in plan_buckets(span_meta):
        last, offset = bucket[-1]
        size = offset + _nbytes(span_meta[last])
        if rank == 0 and len(bucket) == 1:
            flat = sources[last].to(via)  # no copy when the storage is on `via` already
        elif rank == 0:
            flat = torch.zeros(size, dtype=torch.uint8, device=via)
            for span, start in bucket:
                flat[start:start + _nbytes(span_meta[span])].copy_(sources[span])
        elif len(bucket) == 1 and last in in_place and in_place[last][0].device == via:
            x, low = in_place[last]
            flat = _storage_bytes(x, low, size)  # the bytes land in the target's storage
        else:
            flat = torch.empty(size, dtype=torch.uint8, device=via)
        with collective("state broadcast"):
            in_flight.append((dist.broadcast(flat, src=0, async_op=True), bucket, flat))
    for work, bucket, flat in in_flight:
        with collective("state broadcast"):
            work.wait()
        if rank != 0:
            for span, start in bucket:
                spans[span] = _land(flat, start, span_meta[span], in_place.get(span), device,
                                    alone=len(bucket) == 1)
    if rank == 0 and state is not None:  # rank 0's state is never None (checked above)
        return state
    received = [_rebuilt(spans, meta, targets.get(index), device)
                for index, meta in enumerate(tensor_meta)]
    return _fill(skeleton, received)


def _land(flat: torch.Tensor, start: int, meta, in_place, device: torch.device, alone: bool
          ) -> torch.Tensor:
    """A received span's bytes where they stay: in the target's storage, in `flat` itself when
    the span travelled alone, else copied out of the bucket into storage of their own (the
    bucket is freed, and code that reads a storage from its start, torch.set_rng_state, reads
    it)."""
    _, _, device_type, _ = meta
    nbytes = _nbytes(meta)
    value = flat[start:start + nbytes]
    if in_place is not None:
        x, low = in_place
        dest = _storage_bytes(x, low, nbytes)
        if dest.data_ptr() != value.data_ptr():
            dest.copy_(value)  # uint8 views of storages: autograd never sees them
        return dest
    target = _on(device_type, device)
    if alone:
        return value.to(target)
    return value.to(target, copy=True)


def _rebuilt(spans: list, meta, target: torch.Tensor | None, device: torch.device
             ) -> torch.Tensor:
    """One received tensor: a view of its span with the sender's layout; `target` (the
    receiver's own tensor at its place) when the bytes landed in it, or copied into it when it
    has the same dtype and shape (the received storage is then freed with the structure)."""
    span, dtype, shape, stride, offset, device_type = meta
    if span is None:
        value = torch.empty_strided(shape, stride, dtype=dtype, device=_on(device_type, device))
    else:
        value = _view(spans[span], dtype, shape, stride, offset)
    if target is None or target.dtype != dtype or tuple(target.shape) != tuple(shape) \
            or target.device != value.device:
        return value
    if target.data_ptr() != value.data_ptr() or target.stride() != value.stride():
        with torch.no_grad():  # a leaf that requires grad takes values too
            target.copy_(value)
    return target
