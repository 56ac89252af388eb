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
biases) travel together, in buckets of one pair of ranks. nccl sends device memory only: rows
held on the host (a partner's copy after a fault, the cell's whole model before the first mesh,
which may be larger than a GPU) go through the device in rounds of ROUND_BYTES. The group must
hold every rank of both layouts (leavers hand their rows over before they go: a shrink is a
drain).

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from ..group.collective import collective

DIRECT_BYTES = 1 << 20  # a piece this large travels alone, as it is (a view: no copy)
BUCKET_BYTES = 16 << 20  # smaller pieces of one pair of ranks travel together, copied
ALIGN = 16  # a piece's offset in a bucket: a multiple of any dtype's size
# with nccl, rows held on the host travel through the device: this much of them at a time
ROUND_BYTES = 256 << 20


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
    ``g`` holds a copy of (a partner's replica: engine.sharded.replicas). Raises ValueError unless
    the old ranks, own and copied, are 0..W-1 once each, and so are the new ones."""

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
            into: Sequence[torch.Tensor | None] | None = None,
            stage: torch.device | None = None) -> list[torch.Tensor | None]:
    """Carry out :func:`plan` on this rank (`group_rank` of the current process group, which
    holds every rank of `layout`); every rank calls it with the same `rows`, `layout` and
    `stage`.

    `shards[i]`: this rank's old shard of tensor i (rows ``chunk_rows(rows[i], ...)`` of its
    old rank, contiguous; on a newcomer a zero-row tensor of the same trailing shape and dtype,
    :func:`empty_like_rows`). `copies`: {old rank: its shards} for the old ranks this rank
    holds copies of (``layout.copies``). `into[i]`, where given: the contiguous tensor of the
    new shard's shape that tensor i's new rows land in (a rebuilt module's parameter: no copy
    after). `stage`: the device every message must be on (nccl's GPU), or None (gloo: any
    tensor travels as it is). With a `stage`, rows held elsewhere (a host copy, the cell's
    whole model before the first mesh) travel through it in rounds of at most ROUND_BYTES
    staged there, so a rank never holds more than a round of them on the device.
    Returns the new shards (None on a leaver): `into`'s, else new contiguous tensors on the
    old shard's device.
    Raises :class:`~engine.group.collective.PeerFailure` when a peer fails mid-transfer.
    """
    new_rank = layout.new[group_rank]
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
    transfers = plan(rows, layout)
    if stage is None:
        rounds = [transfers]
    else:  # every rank cuts the same rounds: each message's two ends post it in the same one
        row_bytes = [math.prod(s.shape[1:]) * s.element_size() for s in shards]
        rounds = _rounds(transfers, row_bytes)
    for transfers in rounds:
        _carry(transfers, _Ends(shards, copies or {}, out, rows, layout, group_rank), stage)
    return out


@dataclass
class _Ends:
    """One rank's tensors at both ends of a resharding: its old shards and the copies it
    holds (where pieces come from), its new shards (where they land)."""

    shards: Sequence[torch.Tensor]
    copies: Mapping[int, Sequence[torch.Tensor]]
    out: list[torch.Tensor | None]
    rows: Sequence[int]
    layout: Layout
    group_rank: int

    def piece(self, t: Transfer) -> torch.Tensor:
        """The rows `t` sends, a view of the old shard (or copy) that holds them."""
        layout = self.layout
        source = self.shards if t.old_rank == layout.old[self.group_rank] \
            else self.copies[t.old_rank]
        base = chunk_rows(self.rows[t.tensor], layout.old_size, t.old_rank)[0]
        return source[t.tensor][t.start - base:t.end - base]

    def target(self, t: Transfer) -> torch.Tensor:
        """Where the rows `t` takes land, a view of the new shard."""
        new_rank, new_shard = self.layout.new[self.group_rank], self.out[t.tensor]
        assert new_rank is not None and new_shard is not None
        base = chunk_rows(self.rows[t.tensor], self.layout.new_size, new_rank)[0]
        return new_shard[t.start - base:t.end - base]


def _carry(transfers: Sequence[Transfer], ends: _Ends, stage: torch.device | None) -> None:
    """The `transfers` this rank takes part in, as one batch of point-to-point ops (each
    message staged on `stage` where it is not there), and its copies within itself."""
    me = ends.group_rank
    ops = []  # posted by every rank in the plan's order: each pair's messages match in order
    local = []  # (new rows, old rows) this rank holds itself
    landed = []  # (new rows, where they arrive on the stage)
    packs: dict[tuple[int, int], _Packs] = {}  # small pieces, by (src, dst)
    for t in transfers:
        if me not in (t.src, t.dst):
            continue
        piece = ends.piece(t) if t.src == me else None
        target = ends.target(t) if t.dst == me else None
        if piece is not None and target is not None:
            if target.data_ptr() != piece.data_ptr():  # (rows a rank gives up and takes back
                local.append((target, piece))  # as they are: the same tensor, no copy)
            continue
        mine = piece if piece is not None else target
        assert mine is not None
        if mine.numel() * mine.element_size() < DIRECT_BYTES:
            # small rows travel together: a message per piece costs more than its bytes
            packs.setdefault((t.src, t.dst), _Packs()).add(mine)
        elif piece is not None:
            ops.append(dist.P2POp(dist.isend, _on(piece, stage), t.dst))
        else:
            assert target is not None
            arrive = target if stage is None or target.device == stage \
                else torch.empty(target.shape, dtype=target.dtype, device=stage)
            if arrive is not target:
                landed.append((target, arrive))
            ops.append(dist.P2POp(dist.irecv, arrive, t.src))
    unpack = []
    for (src, dst), pack in packs.items():  # the same order on both sides of each pair
        for flat, pieces in pack.buckets(me == src, stage):
            ops.append(dist.P2POp(dist.isend, flat, dst) if me == src
                       else dist.P2POp(dist.irecv, flat, src))
            if me == dst:
                unpack.append((flat, pieces))
    with collective("resharding"):  # nccl and gloo alike: one batch of point-to-point ops
        works = dist.batch_isend_irecv(ops) if ops else []
        with torch.no_grad():
            for target, piece in local:  # the rows a rank keeps, copied while others travel
                target.copy_(piece)
        for work in works:
            work.wait()
    with torch.no_grad():
        for target, arrived in landed:
            target.copy_(arrived)
        for flat, pieces in unpack:
            for offset, target in pieces:
                n = target.numel() * target.element_size()
                target.copy_(flat[offset:offset + n].view(target.dtype).view(target.shape))


def _on(t: torch.Tensor, stage: torch.device | None) -> torch.Tensor:
    """`t` where a message must be (a staged copy when it is elsewhere)."""
    return t if stage is None or t.device == stage else t.to(stage)


def _rounds(transfers: Sequence[Transfer], row_bytes: Sequence[int]) -> list[list[Transfer]]:
    """`transfers` in the plan's order, cut into rounds of at most ROUND_BYTES (a transfer
    larger than that is cut by rows first; a row larger than that travels alone)."""
    rounds: list[list[Transfer]] = [[]]
    size = 0
    for t in transfers:
        step = max(1, ROUND_BYTES // max(row_bytes[t.tensor], 1))  # rows per round at most
        for start in range(t.start, t.end, step):
            piece = replace(t, start=start, end=min(start + step, t.end))
            n = (piece.end - piece.start) * row_bytes[t.tensor]
            if rounds[-1] and size + n > ROUND_BYTES:
                rounds.append([])
                size = 0
            rounds[-1].append(piece)
            size += n
    return rounds


class _Packs:
    """One pair's small pieces (in the plan's order), cut into buckets of BUCKET_BYTES at
    most, each piece at an offset aligned to ALIGN bytes (any dtype views it there)."""

    def __init__(self):
        self.pieces: list[torch.Tensor] = []

    def add(self, t: torch.Tensor) -> None:
        self.pieces.append(t)

    def buckets(self, sending: bool, stage: torch.device | None = None):
        """(flat uint8 tensor, [(offset, piece)]) per bucket, on `stage` (else where the
        pieces are); a sender's filled with its pieces, a receiver's to unpack after it
        arrived."""
        current: list[tuple[int, torch.Tensor]] = []
        size = 0
        for t in [*self.pieces, None]:
            n = t.numel() * t.element_size() if t is not None else 0
            if current and (t is None or size + n > BUCKET_BYTES):
                flat = torch.empty(size, dtype=torch.uint8, device=stage or current[0][1].device)
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
