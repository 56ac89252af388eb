"""The commit vote: a step's update is applied only once every rank's reduction succeeded.

A rank that finished summing a step's gradients posts its vote (with the step's few scalars:
the leave flag, the sample or item count, loss, extra metrics, which parameters had gradients)
under its own key in the generation's rendezvous store, then reads every rank's key. It applies
the optimizer step only when it read a vote from every rank; a rank that reads an abort, or
gives up waiting, raises :class:`StepAborted` and leaves its model as the step found it. This
is torchft's ``Manager.should_commit`` (github.com/pytorch/torchft, ``torchft/manager.py``),
which asks its own lighthouse service; here the store the process groups form through serves.

Why survivors cannot disagree. Each key is written once, with ``compare_set(key, "", value)``:
by its rank (the vote) or, once a waiter gave up on it, by that waiter (``ABORT``), whichever
comes first; the store serialises the two, so every reader sees the same final value. A rank
commits only after reading W votes, so once one rank commits no key can become an abort, and
every rank that reads them commits too. A rank that dies *after* voting changes nothing: its
vote stands, the survivors commit, and its own state is discarded with it. A rank that dies
*during the optimizer step* has voted, so the same holds; the step itself is local (no
collective), so no survivor can fail in it because of a peer. A rank that dies *before*
voting leaves its key empty: the waiters abort it (at once when the owner, which saw the
death, sets ``abort``; else at the collective timeout) and every survivor keeps the state the
step started with. So after any fault all survivors hold the same step, and at most the step
in flight is lost; no rank keeps a copy of the state to roll back to.

The gather replaces the all-reduce of the step's scalars: one compare-and-set and one
multi-get per rank (rank 0 reads the owner's requests in the same multi-get), plus deleting the
rank's key of two rounds before, which every rank has read by then. On this machine that is
about 0.2 ms at two ranks against 1.2 ms for gloo's all-reduce of the same few numbers.

The same gather sums the evaluation's metrics, so an evaluation also ends alike everywhere.
"""
from __future__ import annotations

import datetime
import pickle
import time

import numpy as np
import torch.distributed as dist

from ..protocol import ABORT_KEY, vote_key
from .collective import PeerFailure

ABORT = b"\x00abort"  # a vote is b"v" + payload, so never equal to it
# seconds between looks at the owner's abort while a vote is missing: a rank killed before it
# voted costs up to this much more (1.0 s made that fault 2.3 s against 1.1 s now, in
# benchmarks/fault_matrix.py); not much shorter: torch's TCPStore client stalled for 5 s after
# some waits that timed out within ~10 ms (not seen at 0.25 s)
POLL = 0.25


class StepAborted(PeerFailure):
    """The vote did not reach every rank: this rank leaves the state as the round found it."""


class Vote:
    """Rounds of an all-gather through the store, with one outcome on every rank.

    Every rank of the generation runs the same rounds in the same order (:meth:`sum` once per
    step, :meth:`gather` once per evaluation), numbered from 0 within the generation.

    Args:
        store: the generation's control store (a PrefixStore of the rendezvous TCPStore; any
            torch Store with compare_set and multi_get), or None with one rank. Its ``abort``
            key, set by the owner when a rank died, ends a wait early.
        rank, world_size: this rank and the generation's size.
        timeout: seconds to wait for a missing vote before aborting it (the collective timeout).
        read: keys of the store this rank reads in every round's trip (rank 0: the owner's
            request); their values, as bytes, are in :attr:`read_values` after each round.
    """

    def __init__(self, store, rank: int, world_size: int, timeout: float,
                 read: tuple[str, ...] = ()):
        self.store = store
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.read = list(read)
        self.read_values: list[bytes] = []
        self.round = 0

    def sum(self, values: list[float]) -> list[float]:
        """Every rank's `values` summed elementwise in float64, in rank order (so the sums are
        bit-identical on every rank). Raises StepAborted (see :meth:`_round`)."""
        payloads = self._round(np.asarray(values, dtype=np.float64).tobytes())
        total = np.zeros(len(values), dtype=np.float64)
        for payload in payloads:
            total += np.frombuffer(payload, dtype=np.float64)
        return total.tolist()

    def gather(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order. Raises StepAborted."""
        return [pickle.loads(p) for p in self._round(pickle.dumps(obj))]

    def _round(self, payload: bytes) -> list[bytes]:
        """Post `payload` for this round and return every rank's, in rank order.

        Call it after every collective of the round succeeded: a vote says "my part is done".
        Raises StepAborted when some rank's vote is missing past the timeout or the owner
        aborted the generation; every rank that returns gets the same payloads (module
        docstring). Raises PeerFailure when the store itself fails (the owner is gone).
        """
        n, self.round = self.round, self.round + 1
        if self.world_size == 1:
            self.read_values = list(self.store.multi_get(self.read)) if self.read else []
            return [payload]
        keys = [vote_key(n, r) for r in range(self.world_size)]
        vote = b"v" + payload
        try:
            if self.store.compare_set(keys[self.rank], "", vote) != vote:
                raise StepAborted(f"a peer gave up waiting for this rank's vote in round {n}")
            values = self._read(keys)
            if n >= 2:  # every rank read round n-2 before any could post round n-1
                self.store.delete_key(vote_key(n - 2, self.rank))
        except dist.DistError as e:  # the store itself is gone: the owner ended the run
            raise PeerFailure(f"the commit vote failed: {e}") from e
        votes, self.read_values = values[:len(keys)], values[len(keys):]
        if ABORT in votes:
            raise StepAborted(f"the vote of round {n} was aborted: rank "
                              f"{votes.index(ABORT)} did not finish its part in time")
        return [v[1:] for v in votes]

    def _read(self, keys: list[str]) -> list[bytes]:
        """The votes and the `read` keys in one trip, waiting for missing votes in slices of
        POLL seconds; after the owner's abort or the timeout, missing votes become ABORT."""
        deadline = time.monotonic() + self.timeout
        before = self.store.timeout  # the TCPStore's own: a PrefixStore passes it through
        self.store.set_timeout(datetime.timedelta(seconds=POLL))
        try:
            while True:
                try:
                    return self.store.multi_get(keys + self.read)
                except RuntimeError:  # the slice ran out (TCPStore's DistStoreError, FileStore's
                    # RuntimeError); a store that is gone fails again in check()
                    if time.monotonic() < deadline and not self.store.check([ABORT_KEY]):
                        continue
                for key in keys:  # first writer wins: a vote that lands meanwhile stands
                    self.store.compare_set(key, "", ABORT)
                return self.store.multi_get(keys + self.read)
        finally:
            self.store.set_timeout(before)
