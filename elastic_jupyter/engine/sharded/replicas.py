"""Faults without disk for a sharded state: each rank's part kept by its partner in host memory.

A sharded run cannot roll back a lost rank's rows from its survivors: no survivor holds them.
Gemini (SOSP'23) keeps in-memory checkpoints on peers; here every rank keeps, at a committed
step every K steps, a host copy of its own part (engine.sharded.resizable_model.Snapshot) and the
part of rank ``(r - 1) mod W``, which sends it (each rank's part is thus on its partner ``(r + 1)
mod W``). When ranks die, the survivors roll back to that step from their own copies, and the lost
ranks' rows come from their partners' copies: :meth:`PartnerReplicas.recovery` says who holds what,
and engine.sharded.resizable_model's ``reshard_to`` moves it into the survivors' layout. A rank lost
together with its partner, or a fault at W = 1, leaves rows nowhere in memory: the run falls back to
its newest checkpoint on disk.

torch 2.13's checkpoint package has an experimental partner replication (``_ReplicationStager``,
rank r mirrored on r + W/2); it assumes an even world size and writes each replica to a folder
on disk, so it fits neither W = 3 nor a recovery without disk.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import copy
import math
from typing import Sequence

import torch
import torch.distributed as dist

from ..group.collective import collective
from .reshard import Layout, chunk_rows
from .resizable_model import Snapshot


class PartnerReplicas:
    """This rank's copies: its own part and its partner's, of the same committed step.

    Attributes:
        step: the step they hold (None before the first refresh).
        world_size, rank: the layout they were taken in; generation: the generation that
            took them (two refreshes of one step and size may map its ranks differently).
        own: this rank's part (a Snapshot of host tensors).
        partner: rank ``(rank - 1) mod world_size``'s parts (host), None at W = 1.
    """

    def __init__(self):
        self.step: int | None = None
        self.world_size = 0
        self.generation = -1
        self.rank = 0
        self.own: Snapshot | None = None
        self.partner: dict[tuple[str, str | None], torch.Tensor] | None = None
        self.buffers: list[torch.Tensor] = []  # the flat host buffers `own` and `partner` view

    def refresh(self, step: int, part: Snapshot, rows: dict[str, int], rank: int,
                world_size: int, generation: int = 0, spare: HostBuffers | None = None
                ) -> int:
        """Every rank of the generation, at committed step `step`: copy `part` (this rank's
        Snapshot; `rows`: each parameter's dim-0 size, engine.sharded.resizable_model's ``shapes``)
        to host memory, send it to ``(rank + 1) mod W`` and take ``(rank - 1) mod W``'s. A fault
        during the exchange leaves the previous copies (a rank uses the new ones only once
        both are complete). `spare`: buffers of copies no longer needed, reused where their size
        fits. Returns the bytes this rank sent. Raises PeerFailure."""
        # new host copies, not the last ones overwritten: those stay usable until these are.
        # Each side is a flat buffer per dtype, reused from `spare`: first touching new memory
        # (its page faults) made a refresh 13 x slower than one into buffers touched before
        # (BENCHMARKS.md)
        spare = spare or HostBuffers()
        own_flats, parts = _packed(part.parts, {e: t.shape for e, t in part.parts.items()},
                                   spare)
        self.buffers = list(own_flats)  # counted in nbytes from now on (a sampler reads it)
        pinned = any(flat.is_pinned() for flat in own_flats)
        with torch.no_grad():
            for e, t in part.parts.items():
                parts[e].copy_(t.detach(), non_blocking=pinned)
        if pinned:
            torch.cuda.synchronize()  # the device-to-host copies landed
        own = Snapshot(parts, copy.deepcopy(part.replicated),
                       {n: b.detach().to("cpu", copy=True) for n, b in part.buffers.items()})
        partner = None
        sent = 0
        if world_size > 1:
            source, target = (rank - 1) % world_size, (rank + 1) % world_size
            flats, partner = _packed(part.parts, {e: (_rows(rows[e[0]], world_size, source),
                                                     *t.shape[1:])
                                                 for e, t in part.parts.items()}, spare)
            self.buffers = self.buffers + flats  # one rebinding: a sampler may read it
            if dist.get_backend() == "nccl":
                sent = _exchange_nccl(part.parts, own.parts, partner, source, target)
            else:
                sent = _exchange_flat(own_flats, flats, source, target)
        self.own, self.partner = own, partner
        self.step, self.rank, self.world_size = step, rank, world_size
        self.generation = generation
        return sent

    @property
    def nbytes(self) -> int:
        """The host memory of these copies' rows (own and partner's)."""
        return sum(t.numel() * t.element_size() for t in self.buffers)

    def recovery(self, lost: set[int]) -> tuple[tuple[int, ...], dict[int, dict]] | None:
        """After ranks `lost` (of the replicas' layout) died: (the old ranks whose rows this
        rank holds copies of, {old rank: their parts}), or None when some lost rank's copy
        is lost too (its partner died with it, or W = 1): then no survivor can recover."""
        if self.step is None or any((r + 1) % self.world_size in lost for r in lost) \
                or self.world_size == 1:
            return None
        mine = (self.rank - 1) % self.world_size
        if mine in lost and self.partner is not None:
            return (mine,), {mine: self.partner}
        return (), {}

    @staticmethod
    def layout(old: Sequence[int | None], new: Sequence[int | None],
               copies: Sequence[tuple[int, ...]]) -> Layout:
        """The Layout of a recovery: each group rank's old rank (None: a newcomer), new rank,
        and the lost old ranks it holds copies of (:meth:`recovery`, gathered)."""
        return Layout(tuple(old), tuple(new), tuple(copies))


class HostBuffers:
    """The flat host buffers of the last replicas no longer needed (:meth:`keep`), for the
    next refresh (:meth:`take`): one owner, engine.sharded.lifecycle, gives them back once no fault
    and no checkpoint write can read those copies."""

    def __init__(self):
        self._free: list[torch.Tensor] = []

    def keep(self, replicas: PartnerReplicas) -> None:
        """`replicas`' buffers, which nothing reads any longer (older kept ones go)."""
        self._free = replicas.buffers
        replicas.buffers, replicas.own, replicas.partner = [], None, None

    @property
    def nbytes(self) -> int:
        """The host memory the kept buffers hold."""
        return sum(t.numel() * t.element_size() for t in self._free)

    def take(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """A 1-D host buffer of `numel` elements of `dtype`: a kept one that matches, else a
        new one."""
        for i, flat in enumerate(self._free):
            if flat.numel() == numel and flat.dtype == dtype and flat.is_pinned() == pinned:
                return self._free.pop(i)
        # kept ones of another layout (a resize since) fit no later take either: they go
        # before the new one is made, not beside it
        self._free = []
        return torch.empty(numel, dtype=dtype, pin_memory=pinned)


def _packed(like: dict[tuple[str, str | None], torch.Tensor], shapes: dict, spare: HostBuffers
            ) -> tuple[list[torch.Tensor], dict[tuple[str, str | None], torch.Tensor]]:
    """One flat host buffer per dtype (from `spare`; pinned where `like` is on a GPU), in the
    order the dtypes first come in `like`, and {key: a view of its dtype's buffer with
    `shapes[key]`}. Both sides of an exchange compute the same buffers and offsets from the
    same keys, in order. A buffer per dtype, not one for all: torch.save (a checkpoint's part)
    refuses views of one storage as different types."""
    sizes: dict[torch.dtype, int] = {}
    offsets = {}
    for e, t in like.items():
        offsets[e] = sizes.get(t.dtype, 0)
        sizes[t.dtype] = offsets[e] + math.prod(shapes[e])
    pinned = any(t.is_cuda for t in like.values())
    flats = {dtype: spare.take(n, dtype, pinned) for dtype, n in sizes.items()}
    views = {e: flats[t.dtype][offsets[e]:offsets[e] + math.prod(shapes[e])].view(shapes[e])
             for e, t in like.items()}
    return list(flats.values()), views


def _exchange_flat(own: list[torch.Tensor], partner: list[torch.Tensor], source: int,
                   target: int) -> int:
    """gloo: this rank's flat copies to `target`, `source`'s into `partner`, one message per
    buffer. Returns the bytes sent."""
    ops = [dist.P2POp(dist.isend, t, target) for t in own if t.numel()]
    ops += [dist.P2POp(dist.irecv, t, source) for t in partner if t.numel()]
    with collective("replica refresh"):
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
    return sum(t.numel() * t.element_size() for t in own)


def _exchange_nccl(parts: dict, own: dict, partner: dict, source: int, target: int) -> int:
    """nccl sends device memory only: each part goes from the device, the partner's arrive
    on the device and are copied to their host views after. One message per tensor: nccl
    fuses a batch of them into one group launch, and a flat device buffer to send from would
    cost one more shard of device memory. Returns the bytes sent."""
    landing = {e: torch.empty(p.shape, dtype=p.dtype, device=parts[e].device)
               for e, p in partner.items()}
    ops, sent = [], 0
    for e, mine in parts.items():  # the same order on every rank
        if mine.numel():
            ops.append(dist.P2POp(dist.isend, mine.detach().contiguous(), target))
            sent += own[e].numel() * own[e].element_size()
        if landing[e].numel():
            ops.append(dist.P2POp(dist.irecv, landing[e], source))
    with collective("replica refresh"):
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
    with torch.no_grad():
        for e, p in partner.items():
            p.copy_(landing[e])
    return sent


def _rows(n: int, world_size: int, rank: int) -> int:
    start, end = chunk_rows(n, world_size, rank)
    return end - start

