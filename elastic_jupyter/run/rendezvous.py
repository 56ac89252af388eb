"""The rendezvous store the owner serves to its engines, kept off other networks.

``torch.distributed.TCPStore(is_master=True)`` listens on every interface even when given
127.0.0.1 (measured; see shared/DESIGN.md). We bind the listening socket ourselves to one
address and hand its descriptor to the store: loopback for a single-host pool, unreachable from
the network; the named interface's address for a pool across hosts
(pool/launchers/base.py:listen_address). The store has no authentication: anyone who reaches
that address can write into the rendezvous.
Each generation reads and writes only under its own prefix ``gen<g>/``: no key of an old
generation is ever read by a new one.
"""
from __future__ import annotations

import datetime
import socket
from collections.abc import Sequence

import torch.distributed as dist

from ..engine.protocol import (ABORT_KEY, ACKNOWLEDGED_KEY, END_AT_KEY, LEAVERS_KEY,
                               VERSION_KEY, encode_end_at, generation_prefix)

LOOPBACK = "127.0.0.1"


class Rendezvous:
    """A TCPStore server in this process, listening on ``host`` (loopback by default).

    Attributes:
        host, port: the address engines connect to.
    """

    def __init__(self, host: str = LOOPBACK, timeout: float = 60.0):
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((host, 0))
        listener.listen(512)
        self.host, self.port = host, listener.getsockname()[1]
        # the store takes ownership of the descriptor and closes it when it is destroyed
        self.store: dist.TCPStore | None = dist.TCPStore(
            host, self.port, is_master=True, wait_for_workers=False,
            master_listen_fd=listener.detach(), timeout=datetime.timedelta(seconds=timeout))

    def control(self, generation: int) -> dist.PrefixStore:
        """The store seen by generation `generation` (its own key prefix). Raises RuntimeError
        once closed."""
        if self.store is None:
            raise RuntimeError("the rendezvous store is closed")
        return dist.PrefixStore(generation_prefix(generation), self.store)

    def request_end(self, generation: int, end_at: int | None,
                    leavers: Sequence[int] = ()) -> None:
        """Ask the ranks of `generation` to leave after step `end_at` (0: after the current
        step; None: keep training). Rank 0 reads it at its next step boundary. `leavers`: the
        ranks that go then (a sharded run's hand their rows over first)."""
        control = self.control(generation)
        control.set(LEAVERS_KEY, ",".join(map(str, leavers)))
        control.set(END_AT_KEY, encode_end_at(end_at))
        control.add(VERSION_KEY, 1)

    def acknowledge(self, generation: int, step: int) -> None:
        """Tell generation `generation`'s ranks that the run log holds every record up to
        `step`: they may forget those (engine.state.history). Call before its ranks start, and again
        whenever the run log's complete step moved."""
        self.control(generation).set(ACKNOWLEDGED_KEY, str(step))

    def abort(self, generation: int) -> None:
        """Tell the ranks of `generation` that one of them failed: a rank waiting for a vote
        that will not come aborts the step now instead of at the collective timeout
        (engine.group.vote)."""
        self.control(generation).set(ABORT_KEY, "1")

    def close(self) -> None:
        self.store = None
