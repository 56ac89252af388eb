"""Our own collectives, and the one exception that says a peer failed in one of them.

The owner tells a fault (a peer died or hung: go on without it) from the user's error (the
run fails) by signals, never by the words of a message: an engine that is gone, a rank that did
not return, or a :class:`PeerFailure` raised here. Every collective this package runs (forming
the process group, the state broadcast, the gradient reduction, the evaluation gather) runs
inside :func:`collective` (also the BatchNorm statistics and the evaluation's buffer
broadcast). Passes of the user's code that run torch.distributed's collectives for us
(FSDP2's all-gathers and reduce-scatters under ``shard=True``, SyncBatchNorm's statistics) run
inside :func:`collectives_within`: there only an error a collective raised is a peer's; other
collectives the user's own code runs are the user's.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")


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


@contextlib.contextmanager
def collectives_within(what: str) -> Iterator[None]:
    """Run the user's code in which torch.distributed's collectives run for us (FSDP2's, in
    the forward and backward passes); a RuntimeError that one of those collectives raised
    (torch's DistError, or any raised from torch.distributed's collective calls: gloo's
    "Connection closed by peer" is a plain RuntimeError) becomes a :class:`PeerFailure`
    naming `what`; the user's own errors pass through unchanged."""
    try:
        yield
    except torch.cuda.OutOfMemoryError:
        raise
    except PeerFailure:
        raise
    except RuntimeError as e:
        if isinstance(e, dist.DistError) or _raised_in_c10d(e):
            raise PeerFailure(f"{what} failed: {e}") from e
        raise


def _raised_in_c10d(e: BaseException) -> bool:
    """Whether `e`'s innermost Python frame is torch.distributed's collective calls."""
    tb, last = e.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and last.tb_frame.f_code.co_filename.endswith(_C10D)
