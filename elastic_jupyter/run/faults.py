"""Telling faults from errors when a generation ends badly.

A *fault* is an engine that died (SIGKILL, out-of-memory kill, segfault: ipyparallel reports
``EngineError`` within milliseconds) or hung (a rank that did not return while its peers' collective
timed out). The run survives a fault: survivors keep the last step every rank voted for
(engine.group.vote) and go on without the lost engine. An *error* is an exception raised by the
user's code on a live engine; it ends the run. A peer's failure makes the other ranks fail inside
the collective; those secondary errors are neither.

Faults are told from errors by signals only: an engine that is gone, a rank that did not return,
or the engine-side ``PeerFailure`` (engine.group.collective), raised when one of this package's own
collectives fails. The words of a message never count: a dataset raising
``TimeoutError("read timed out")`` is the user's error. Any other exception on a live rank, the
user's or this package's own, is an error: it fails the run with its traceback even when the
other ranks only wait for it (hung) or failed because of it. And a failure that is none of these
but comes back the same after a retry (the same exception types and messages, no engine lost,
no step made) is an error too (:meth:`Outcome.signature`): retrying it cannot help.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..engine.protocol import GenerationResult
from ..pool.processes import alive

HANG_GRACE = 3.0  # seconds the owner waits for the other ranks once one has failed
MAX_SLOT_FAULTS = 3  # faults of one slot within FAULT_WINDOW that leave it out for a cooldown
FAULT_WINDOW = 60.0  # seconds
COOLDOWN = (10.0, 600.0)  # seconds a slot stays out: the first time, and at most (doubling)
MAX_START_FAILURES = 2  # failed starts in a row that leave a slot out for good
MIN_WAIT_TIMEOUT = 120.0  # seconds to wait for replacements when fewer than --min survive


def is_engine_death(error: BaseException) -> bool:
    """ipyparallel's report of an engine that went away while running the task."""
    name = getattr(error, "ename", None) or type(error).__name__
    return name in ("EngineError", "DeadEngineError")


def is_peer_failure(error: BaseException) -> bool:
    """One of our collectives failed on this rank because a peer did (not the cause itself):
    the engine raised ``engine.group.collective.PeerFailure`` (ipyparallel names its type
    ``ename``)."""
    return (getattr(error, "ename", None) or type(error).__name__) == "PeerFailure"


@dataclass
class Outcome:
    """How each rank's generation task ended."""

    # engine_id -> its rank's result (finished normally)
    results: dict[int, GenerationResult] = field(default_factory=dict)
    lost: list = field(default_factory=list)  # Engines that died or hung
    hung: list = field(default_factory=list)  # the subset that hung
    errors: list = field(default_factory=list)  # (Engine, error) raised by user code
    collective: list = field(default_factory=list)  # (Engine, error) secondary failures

    @property
    def fault(self) -> bool:
        """An engine died, or no live rank raised an error of its own (ranks only hung or
        failed in a collective)."""
        dead = [e for e in self.lost if e not in self.hung]
        return bool(dead) or (not self.errors and bool(self.hung or self.collective))

    def signature(self) -> frozenset | None:
        """What a fault with no engine lost looked like: the (type, message) of each failed
        collective (None when an engine was lost or hung: that is a fault whatever it said)."""
        if self.lost or not self.collective:
            return None
        return frozenset(_words(error) for _, error in self.collective)


def _words(error: BaseException) -> tuple[str, str]:
    """(type, message) with numbers left out: a peer's address and port, a round's number
    change from one generation to the next while the failure is the same."""
    message = str(getattr(error, "evalue", None) or error)
    return (getattr(error, "ename", None) or type(error).__name__, re.sub(r"\d+", "#", message))


def classify(members, futures) -> Outcome:
    """Sort the ranks of a generation by how their tasks ended (futures not done = hung)."""
    out = Outcome()
    for engine, fut in zip(members, futures):
        if not fut.done():
            out.lost.append(engine)
            out.hung.append(engine)
            continue
        if fut.cancelled():  # the client dropped the task: the engine is out of reach
            out.lost.append(engine)
            continue
        error = fut.exception()
        if error is None:
            out.results[engine.engine_id] = fut.result()
        elif is_engine_death(error) or not alive(engine):
            out.lost.append(engine)
        elif is_peer_failure(error):
            out.collective.append((engine, error))
        else:
            out.errors.append((engine, error))
    return out
