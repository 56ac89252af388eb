"""The store a generation's process group forms through: its waits end when the owner aborts.

Forming a group waits on the rendezvous store for every peer's address (gloo) or rank 0's
unique id (nccl). A peer that died before it wrote its key leaves the others waiting there
until the collective timeout, and the owner cannot tell such a survivor from a hung rank. So
every wait of this store looks at the generation's ``abort`` key too, which the owner sets as
soon as it sees a rank die (rendezvous.Rendezvous.abort): the survivors fail at once, with a
:class:`~engine.collective.PeerFailure` the owner counts as secondary, and keep their state.
This is the "abort the rendezvous watches" of torchelastic's and torchft's designs: a waiter
never judges a peer alone when the one who saw it die can tell it.

The waits poll with ``check`` (one round trip each, about 0.1 ms here) instead of blocking
reads with short timeouts: torch's TCPStore client stalls for seconds after some reads that
time out (engine.vote).
"""
from __future__ import annotations

import datetime
import time

import torch.distributed as dist

POLL = 0.01  # seconds between looks at a missing key and the abort key


class GenerationAborted(RuntimeError):
    """The owner aborted the generation (a peer died) while this rank waited for a key."""


class AbortableStore(dist.Store):
    """`inner`'s keys, with waits that end when `control` holds ``abort``.

    Args:
        inner: the store the group's keys live in (a PrefixStore of the rendezvous).
        control: the generation's control store, where the owner writes ``abort``.
        timeout: seconds a wait lasts at most (the collective timeout).
    Raises (from ``get`` and ``wait``): GenerationAborted once ``abort`` is set;
    ``dist.DistStoreError`` after `timeout`.
    """

    def __init__(self, inner, control, timeout: float):
        super().__init__()
        self.inner, self.control = inner, control
        self._timeout = datetime.timedelta(seconds=timeout)

    # ---------------------------------------------------------------- waits

    def get(self, key: str) -> bytes:
        self._wait([key], self._timeout)
        return self.inner.get(key)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._wait(keys, timeout or self._timeout)

    def _wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        while not self.inner.check(keys):
            if self.control.check(["abort"]):
                raise GenerationAborted(f"the owner aborted the generation while this rank "
                                        f"waited for {keys}: a peer died")
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"waited {timeout.total_seconds():.0f} s for {keys}")
            time.sleep(POLL)

    # ---------------------------------------------------------------- the rest: `inner`'s

    def set(self, key: str, value) -> None:
        self.inner.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout
