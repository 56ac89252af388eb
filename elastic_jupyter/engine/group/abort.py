"""The owner's abort, as a rank sees it: waits that end when the owner says a peer died.

The owner sets a generation's ``abort`` key (rendezvous.Rendezvous.abort) as soon as it sees a
rank die. A survivor waiting for that rank must stop waiting then, not at the collective
timeout: the owner cannot tell a survivor waiting that long from a hung rank, and the run
would lose the time (or the survivor). This is the "abort the rendezvous watches" of
torchelastic's and torchft's designs: a waiter never judges a peer alone when the one who saw
it die can tell it. Three waits watch it:

- the commit vote (engine.group.vote) reads it between its slices;
- forming the process group waits on the rendezvous for every peer's address (gloo) or rank
  0's unique id (nccl): it forms through :class:`AbortableStore`, whose waits look at
  ``abort`` too, so a peer that died before it wrote its key fails the others at once with a
  :class:`~engine.group.collective.PeerFailure` the owner counts as secondary;
- nccl collectives (the state broadcast, a reduction) do not fail when a peer dies: they wait
  for their timeout. :class:`AbortWatch` aborts the process group when ``abort`` is set, which
  fails them now. gloo's fail at once on the dead peer's closed socket and need no watch.

The waits poll with ``check`` (one round trip each, about 0.1 ms here) instead of blocking
reads with short timeouts: torch's TCPStore client stalls for seconds after some reads that
time out (engine.group.vote).
"""
from __future__ import annotations

import datetime
import sys
import threading
import time

import torch.distributed as dist

from ..protocol import ABORT_KEY

POLL = 0.01  # seconds between looks at a missing key and the abort key
WATCH_POLL = 0.05  # seconds between an AbortWatch's looks at the abort key


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
            if self.control.check([ABORT_KEY]):
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


class AbortWatch:
    """A thread that calls `abort` once `control` holds ``abort`` (use as a context manager
    around the collectives of a generation on nccl).

    Args:
        control: the generation's control store.
        abort: what to call, once: the process group's ``abort`` (its blocked collectives
            raise, which the rank reports as a PeerFailure).
    """

    def __init__(self, control, abort):
        self.control, self.abort = control, abort
        self.fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="elastic-abort-watch",
                                        daemon=True)

    def __enter__(self) -> "AbortWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_POLL):
            try:
                if not self.control.check([ABORT_KEY]):
                    continue
            except Exception:  # noqa: BLE001 -- the store is gone: the owner ended the run
                return
            self.fired = True
            try:
                self.abort()
            except Exception as e:  # noqa: BLE001 -- reported; the collective's timeout stays
                print(f"aborting the process group failed: {e}", file=sys.stderr)
            return
