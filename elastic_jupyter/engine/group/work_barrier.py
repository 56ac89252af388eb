"""A barrier after local work of any length: the ranks wait for each other while the ones
still working show they live, not for the collective timeout.

Some work a rank does before a step can take far longer than the collective timeout, and only
some ranks do it: reading a stream again from its epoch's start up to its position
(engine.data.stream_pipeline), at a generation's start after a resize or where a rank first reads a
stream mid-epoch. Were the others to wait for it in a collective,
they would call it hung at the timeout, and the next generation would read again and fail
alike. Here each rank runs its work while a thread adds to its beat key in the generation's
control store; then it marks itself done and waits until every rank is. A rank whose beat stops
moving for the collective timeout (its process is stopped or gone) fails the wait as a hung
peer of a collective would, and the owner's abort ends it at once (engine.group.abort): what the
heartbeats of torchelastic's agents and torchft's lighthouse tell, for one wait.

This module imports only torch and the standard library.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from ..protocol import ABORT_KEY
from .abort import POLL, GenerationAborted
from .collective import collective

BEAT = 0.5  # seconds between a working rank's beats
LOOK = 0.25  # seconds between a waiting rank's reads of the peers' beats


def work_then_wait(control, rank: int, world_size: int, name: str, work: Callable[[], None],
                   timeout: float) -> None:
    """Run `work` on this rank, then wait until every rank of the generation ran its own.

    Call it at the same point on every rank, with the same `name` (its keys': a name once
    per generation). It guarantees that when it returns, every rank's `work` has returned.

    Args:
        control: the generation's control store (a PrefixStore of the rendezvous).
        name: what the ranks do, for the keys and for the error (``"the streams"``).
        timeout: seconds a peer's beat may stay still before it counts as hung (the
            collective timeout).
    Raises: what `work` raises, as it is (the rank's own error); PeerFailure
    (engine.group.collective) when a peer's beat stayed still for `timeout`, when the owner aborted
    the generation, or when the store is gone.
    """
    beats = _Beats(control, f"{name}/beat/{rank}")
    with beats:
        work()
    with collective(f"waiting for every rank to finish {name}"):
        control.set(f"{name}/done/{rank}", "1")
        _wait(control, [r for r in range(world_size) if r != rank], name, timeout)


class _Beats:
    """A thread that adds 1 to `key` every BEAT seconds while the context runs."""

    def __init__(self, control, key: str):
        self.control, self.key = control, key
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="elastic-work-beats",
                                        daemon=True)

    def __enter__(self) -> "_Beats":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while True:
            try:
                self.control.add(self.key, 1)
            except Exception:  # noqa: BLE001 -- the store is gone; the wait reports it
                return
            if self._stop.wait(BEAT):
                return


def _wait(control, peers: list[int], name: str, timeout: float) -> None:
    """Until each of `peers` set its done key; raises GenerationAborted at the owner's abort
    and DistStoreError when a peer's beat stood still for `timeout` seconds. Two store calls
    a poll (every done key at once, the abort key); the peers' beats every LOOK seconds."""
    seen: dict[int, tuple[int, float]] = {}  # peer: (its beat count, when it last moved)
    looked = 0.0
    while peers and not control.check([f"{name}/done/{r}" for r in peers]):
        if control.check([ABORT_KEY]):
            raise GenerationAborted(f"the owner aborted the generation while this rank waited "
                                    f"for every rank to finish {name}: a peer died")
        now = time.monotonic()
        if now - looked >= LOOK:
            looked = now
            peers = [r for r in peers if not control.check([f"{name}/done/{r}"])]
            for r in peers:
                count = control.add(f"{name}/beat/{r}", 0)  # read: add 0
                if seen.get(r, (None, 0.0))[0] != count:
                    seen[r] = (count, now)
                elif now - seen[r][1] > timeout:
                    raise dist.DistStoreError(
                        f"rank {r} showed no sign of life for {timeout:.0f} s while it worked "
                        f"on {name}")
        time.sleep(POLL)
