"""Faults without disk for a sharded state: each rank's part kept by its partner in host memory.

A sharded run cannot roll back a lost rank's rows from its survivors: no survivor holds them.
Gemini (SOSP'23) keeps in-memory checkpoints on peers; here every rank keeps, at a committed
step every K steps, a host copy of its own part (engine.sharding.Snapshot) and the part of rank
``(r - 1) mod W``, which sends it (each rank's part is thus on its partner ``(r + 1) mod W``). When
ranks die, the survivors roll back to that step from their own copies, and the lost ranks' rows
come from their partners' copies: :meth:`PartnerReplicas.recovery` says who holds what, and
engine.sharding's ``reshard_to`` moves it into the survivors' layout. A rank lost together with
its partner, or a fault at W = 1, leaves rows nowhere in memory: the run falls back to its
newest checkpoint on disk.

torch 2.13's checkpoint package has an experimental partner replication (``_ReplicationStager``,
rank r mirrored on r + W/2); it assumes an even world size and writes each replica to a folder
on disk, so it fits neither W = 3 nor a recovery without disk.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch
import torch.distributed as dist

from .collective import collective
from .reshard import Layout, chunk_rows
from .sharding import Snapshot


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

    def refresh(self, step: int, part: Snapshot, rows: dict[str, int], rank: int,
                world_size: int, generation: int = 0) -> int:
        """Every rank of the generation, at committed step `step`: copy `part` (this rank's
        Snapshot; `rows`: each parameter's dim-0 size, engine.sharding's ``shapes``) to host
        memory, send it to ``(rank + 1) mod W`` and take ``(rank - 1) mod W``'s. A fault
        during the exchange leaves the previous copies (a rank uses the new ones only once
        both are complete). Returns the bytes this rank sent. Raises PeerFailure."""
        # new host copies, not the last ones overwritten: those stay usable until these are
        own = Snapshot({e: t.detach().to("cpu", copy=True) for e, t in part.parts.items()},
                       copy.deepcopy(part.replicated),
                       {n: b.detach().to("cpu", copy=True) for n, b in part.buffers.items()})
        partner = None
        sent = 0
        if world_size > 1:
            source, target = (rank - 1) % world_size, (rank + 1) % world_size
            partner = {e: t.new_empty((_rows(rows[e[0]], world_size, source), *t.shape[1:]))
                       for e, t in own.parts.items()}
            # nccl sends device memory only: the part itself goes, the partner's arrives on
            # the device and is copied to the host after (gloo sends host copies as they are)
            nccl = dist.get_backend() == "nccl"
            landing = {e: torch.empty_like(p, device=part.parts[e].device) if nccl else p
                       for e, p in partner.items()}
            ops = []
            for e, mine in own.parts.items():  # the same order on every rank
                if mine.numel():
                    ops.append(dist.P2POp(dist.isend, part.parts[e] if nccl else mine, target))
                    sent += mine.numel() * mine.element_size()
                if landing[e].numel():
                    ops.append(dist.P2POp(dist.irecv, landing[e], source))
            with collective("replica refresh"):
                for work in dist.batch_isend_irecv(ops) if ops else []:
                    work.wait()
            if nccl:
                for e, p in partner.items():
                    p.copy_(landing[e])
        self.own, self.partner = own, partner
        self.step, self.rank, self.world_size = step, rank, world_size
        self.generation = generation
        return sent

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


def _rows(n: int, world_size: int, rank: int) -> int:
    start, end = chunk_rows(n, world_size, rank)
    return end - start

