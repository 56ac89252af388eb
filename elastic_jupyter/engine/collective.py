"""Our own collectives, and the one exception that says a peer failed in one of them.

The owner tells a fault (a peer died or hung: go on without it) from the user's error (the
run fails) by signals, never by the words of a message: an engine that is gone, a rank that did
not return, or a :class:`PeerFailure` raised here. Every collective this package runs (forming
the process group, the state broadcast, the gradient reduction, the evaluation gather) runs
inside :func:`collective` (also the BatchNorm statistics and the evaluation's buffer
broadcast); collectives the user's own code runs are the user's.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class PeerFailure(RuntimeError):
    """One of our collectives failed: a peer died, closed its sockets or stayed away past the
    collective timeout. The owner classifies by this type's name (``faults.is_peer_failure``)."""


@contextlib.contextmanager
def collective(what: str, only: type[BaseException] = RuntimeError) -> Iterator[None]:
    """Run one of our collectives; its failure becomes a :class:`PeerFailure` naming `what`.

    gloo and nccl report a dead, closed or late peer as a RuntimeError (torch's DistError
    subclasses it). Out of memory is a RuntimeError too, but it is this rank's own trouble,
    not a peer's: it passes through unchanged. `only` narrows what counts (DistError where the
    block also runs the user's code, whose own RuntimeErrors are the user's).
    """
    try:
        yield
    except torch.cuda.OutOfMemoryError:
        raise
    except only as e:
        raise PeerFailure(f"{what} failed: {e}") from e
