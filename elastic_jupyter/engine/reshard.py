"""Moving a dim-0 sharded state to another world size in memory: only rows whose owner changes.

FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps each parameter, and the optimizer keeps
each of its moments, as a DTensor sharded on dim 0 the way ``torch.chunk`` cuts it: with ``n``
rows and ``W`` ranks, rank ``r`` holds rows ``[r * c, (r + 1) * c)`` clipped to ``n``, where
``c = ceil(n / W)`` (so the last ranks may hold fewer rows, or none). When the world size
changes, torchrun, Ray Train and DeepSpeed write a checkpoint and read it back at the new size
(DeepSpeed's Universal Checkpointing converts it offline); here the ranks of both layouts hand
each other the rows whose owner changes, point to point, and every other row stays where it is.

:func:`plan` says which rows go from which rank to which; :func:`reshard` carries the plan out
with batched ``isend``/``irecv`` over the current process group. A rank holds at most its old
shard, its new shard and its small pieces' buckets at once: rows of 1 MiB or more travel from
views of the old shard into views of the new one, without a staging copy; smaller ones (norms,
biases) travel together, in buckets of one pair of ranks. The group must hold every rank of both
layouts (leavers hand their rows over before they go: a shrink is a drain).

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from .collective import collective

DIRECT_BYTES = 1 << 20  # a piece this large travels alone, as it is (a view: no copy)
BUCKET_BYTES = 16 << 20  # smaller pieces of one pair of ranks travel together, copied
ALIGN = 16  # a piece's offset in a bucket: a multiple of any dtype's size


def chunk_rows(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of `n` that `rank` holds among `world_size` ranks under
    ``torch.chunk`` (DTensor's ``Shard(0)``, FSDP2's layout)."""
    size = -(-n // world_size) if n else 0
    start = min(rank * size, n)
    return start, min(start + size, n)


@dataclass(frozen=True)
class Layout:
    """Who holds what, by rank of the process group that reshards: ``old[g]`` is group rank
    ``g``'s rank in the layout it leaves (None: a newcomer), ``new[g]`` its rank in the layout
    it joins (None: a leaver). ``copies[g]`` names old ranks that are gone whose rows group rank
    ``g`` holds a copy of (a partner's replica: engine.replicas). Raises ValueError unless the
    old ranks, own and copied, are 0..W-1 once each, and so are the new ones."""

    old: tuple[int | None, ...]
    new: tuple[int | None, ...]
    copies: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        if len(self.old) != len(self.new) or (self.copies and len(self.copies) != len(self.old)):
            raise ValueError("old, new (and copies) must name every rank of the group")
        held = [r for r in self.old if r is not None] + [r for c in self.copies for r in c]
        for name, ranks in (("old", held), ("new", [r for r in self.new if r is not None])):
            if sorted(ranks) != list(range(len(ranks))) or not ranks:
                raise ValueError(f"the {name} layout's ranks must be 0..W-1, each held once: "
                                 f"{self.old if name == 'old' else self.new}")

    @property
    def old_size(self) -> int:
        return sum(r is not None for r in self.old) + sum(len(c) for c in self.copies)

    @property
    def new_size(self) -> int:
        return sum(r is not None for r in self.new)

    def holder(self, old_rank: int) -> int:
        """The group rank that holds old rank `old_rank`'s rows (its own, or a copy)."""
        if old_rank in self.old:
            return self.old.index(old_rank)
        return next(g for g, held in enumerate(self.copies) if old_rank in held)


@dataclass(frozen=True)
class Transfer:
    """Rows ``[start, end)`` of sharded tensor ``tensor``, old rank ``old_rank``'s, go from
    group rank ``src`` to ``dst`` (``src == dst``: a copy within the rank)."""

    tensor: int
    old_rank: int
    src: int
    dst: int
    start: int
    end: int


def plan(rows: Sequence[int], layout: Layout) -> list[Transfer]:
    """Every piece of rows that some rank of the new layout needs, and where it comes from,
    for sharded tensors of `rows[i]` rows each (the same list on every rank); ordered by
    tensor, then row (the order every rank posts its sends and receives in)."""
    takers = {r: g for g, r in enumerate(layout.new) if r is not None}
    out = []
    for i, n in enumerate(rows):
        old = [chunk_rows(n, layout.old_size, r) for r in range(layout.old_size)]
        for new_rank in range(layout.new_size):
            start, end = chunk_rows(n, layout.new_size, new_rank)
            for old_rank, (a, b) in enumerate(old):
                lo, hi = max(a, start), min(b, end)
                if lo < hi:
                    out.append(Transfer(i, old_rank, layout.holder(old_rank),
                                        takers[new_rank], lo, hi))
    return out


def moved_bytes(transfers: Sequence[Transfer], row_bytes: Sequence[int]) -> int:
    """The bytes that travel between ranks (a rank's copies within itself excluded)."""
    return sum((t.end - t.start) * row_bytes[t.tensor] for t in transfers if t.src != t.dst)


def reshard(shards: Sequence[torch.Tensor], rows: Sequence[int], layout: Layout,
            group_rank: int, copies: Mapping[int, Sequence[torch.Tensor]] | None = None,
            into: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor | None]:
    """Carry out :func:`plan` on this rank (`group_rank` of the current process group, which
    holds every rank of `layout`); every rank calls it with the same `rows` and `layout`.

    `shards[i]`: this rank's old shard of tensor i (rows ``chunk_rows(rows[i], ...)`` of its
    old rank, contiguous; on a newcomer a zero-row tensor of the same trailing shape and dtype,
    :func:`empty_like_rows`). `copies`: {old rank: its shards} for the old ranks this rank
    holds copies of (``layout.copies``). `into[i]`, where given: the contiguous tensor of the
    new shard's shape that tensor i's new rows land in (a rebuilt module's parameter: no copy
    after). Returns the new shards (None on a leaver): `into`'s, else new contiguous tensors
    on the old shard's device.
    Raises :class:`~engine.collective.PeerFailure` when a peer fails mid-transfer.
    """
    old_rank, new_rank = layout.old[group_rank], layout.new[group_rank]
    out: list[torch.Tensor | None] = []
    for i, shard in enumerate(shards):
        if new_rank is None:
            out.append(None)
            continue
        start, end = chunk_rows(rows[i], layout.new_size, new_rank)
        given = into[i] if into is not None else None
        if given is not None and (given.shape[0] != end - start or not given.is_contiguous()):
            raise ValueError(f"into[{i}] must be contiguous with {end - start} rows")
        out.append(given if given is not None
                   else shard.new_empty((end - start, *shard.shape[1:])).contiguous())
    ops = []  # posted by every rank in the plan's order: each pair's messages match in order
    local = []  # (new rows, old rows) this rank holds itself
    packs: dict[tuple[int, int], _Packs] = {}  # small pieces, by (src, dst)
    for t in plan(rows, layout):
        if group_rank not in (t.src, t.dst):
            continue
        if t.src == group_rank:
            source = shards if t.old_rank == old_rank else (copies or {})[t.old_rank]
            base = chunk_rows(rows[t.tensor], layout.old_size, t.old_rank)[0]
            piece = source[t.tensor][t.start - base:t.end - base]  # a view: no copy
        if t.dst == group_rank:
            new_shard = out[t.tensor]
            assert new_rank is not None and new_shard is not None
            base = chunk_rows(rows[t.tensor], layout.new_size, new_rank)[0]
            target = new_shard[t.start - base:t.end - base]
        if t.src == t.dst:
            if target.data_ptr() != piece.data_ptr():  # (rows a rank gives up and takes back
                local.append((target, piece))  # as they are: the same tensor, no copy)
            continue
        mine = piece if t.src == group_rank else target
        if mine.numel() * mine.element_size() >= DIRECT_BYTES:
            ops.append(dist.P2POp(dist.isend, piece, t.dst) if t.src == group_rank
                       else dist.P2POp(dist.irecv, target, t.src))
        else:  # small rows travel together: a message per piece costs more than its bytes
            packs.setdefault((t.src, t.dst), _Packs()).add(mine)
    unpack = []
    for (src, dst), pack in packs.items():  # the same order on both sides of each pair
        for flat, pieces in pack.buckets(group_rank == src):
            ops.append(dist.P2POp(dist.isend, flat, dst) if group_rank == src
                       else dist.P2POp(dist.irecv, flat, src))
            if group_rank == dst:
                unpack.append((flat, pieces))
    with collective("resharding"):  # nccl and gloo alike: one batch of point-to-point ops
        works = dist.batch_isend_irecv(ops) if ops else []
        with torch.no_grad():
            for target, piece in local:  # the rows a rank keeps, copied while others travel
                target.copy_(piece)
        for work in works:
            work.wait()
    with torch.no_grad():
        for flat, pieces in unpack:
            for offset, target in pieces:
                n = target.numel() * target.element_size()
                target.copy_(flat[offset:offset + n].view(target.dtype).view(target.shape))
    return out


class _Packs:
    """One pair's small pieces (in the plan's order), cut into buckets of BUCKET_BYTES at
    most, each piece at an offset aligned to ALIGN bytes (any dtype views it there)."""

    def __init__(self):
        self.pieces: list[torch.Tensor] = []

    def add(self, t: torch.Tensor) -> None:
        self.pieces.append(t)

    def buckets(self, sending: bool):
        """(flat uint8 tensor, [(offset, piece)]) per bucket; a sender's filled with its
        pieces, a receiver's to unpack after it arrived."""
        current: list[tuple[int, torch.Tensor]] = []
        size = 0
        for t in [*self.pieces, None]:
            n = t.numel() * t.element_size() if t is not None else 0
            if current and (t is None or size + n > BUCKET_BYTES):
                flat = torch.empty(size, dtype=torch.uint8, device=current[0][1].device)
                if sending:
                    for offset, piece in current:
                        flat[offset:offset + piece.numel() * piece.element_size()].copy_(
                            piece.reshape(-1).view(torch.uint8))
                yield flat, current
                current, size = [], 0
            if t is not None:
                current.append((size, t))
                size += -(-n // ALIGN) * ALIGN


def empty_like_rows(t: torch.Tensor) -> torch.Tensor:
    """A zero-row tensor with `t`'s trailing shape, dtype and device: what a newcomer passes
    to :func:`reshard` for a tensor it holds no rows of."""
    return t.new_empty((0, *t.shape[1:]))
