"""Drain: an engine told to go (SIGTERM) leaves its run at the next step boundary.

A scheduler ends a job with SIGTERM and a grace period before SIGKILL: Slurm on ``scancel
--signal=TERM``, on preemption (``PreemptMode=CANCEL`` with ``GraceTime``) and ahead of a time
limit (``sbatch --signal=TERM@SECONDS``); Kubernetes on pod eviction. While a generation trains,
the signal only marks the engine as draining: its leave flag rides in the step's commit vote
(engine.group.vote), so every rank leaves after the same step and nothing is lost; the generation's
result says the engine drained, and the owner drops it and asks for a replacement. Outside a
generation the engine stops at once as ipengine would (its own SIGTERM handler).

The idea is torchelastic's and Horovod's (a rank leaves at a commit point when told to);
the difference here is that the survivors never restart: they keep training without it.

Python runs signal handlers in the main thread between bytecodes; ipengine runs its tasks there,
so a handler never interrupts a collective half-way: the flag is read at the next boundary.
"""
from __future__ import annotations

import contextlib
import signal
import threading
import time

_previous = None  # the handler before ours (ipengine's stop), used outside generations
_training = False
_requested_at: float | None = None  # wall time of the SIGTERM, while it is not yet served


def install() -> None:
    """Handle SIGTERM as a drain request from now on (once per engine; main thread only:
    elsewhere, as in a plain script's worker thread, signals keep their handlers)."""
    global _previous
    if _previous is not None or threading.current_thread() is not threading.main_thread():
        return
    _previous = signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame) -> None:
    global _requested_at
    if _training:
        _requested_at = _requested_at or time.time()
        return
    if callable(_previous):
        _previous(signum, frame)
    else:  # SIG_DFL: end as the signal would have
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)


def requested() -> bool:
    """Whether a SIGTERM asked this engine to leave its run at the next step boundary."""
    return _requested_at is not None


@contextlib.contextmanager
def training():
    """Within: a SIGTERM is a drain request. A request the generation could not serve (it
    failed before its boundary) stays for the next generation, which leaves after its first
    step."""
    global _training
    _training = True
    try:
        yield
    finally:
        _training = False


def served() -> float | None:
    """The drain was carried out (the rank left its run): returns when it was requested and
    clears it, so a later SIGTERM stops the idle engine."""
    global _requested_at
    at, _requested_at = _requested_at, None
    return at
