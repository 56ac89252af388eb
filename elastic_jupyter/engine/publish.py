"""Live updates from rank 0 to the owner while a generation runs (its records and events).

How an update travels is the launcher's business, not the engine's: the owner hands each engine
its publisher at :func:`~.entrypoints.init_engine` (under ipyparallel, ``publish_data``, which
the owner's client keeps the newest of). An engine that was given none (engine code run from a
script or a test) publishes nothing. So engine/ never imports ipyparallel.
"""
from __future__ import annotations

import sys
from typing import Callable

Publisher = Callable[[dict], None]
_publisher: Publisher | None = None  # this engine's, set once at init_engine


def use(publisher: Publisher | None) -> None:
    """Set this engine's publisher (None: publish nothing)."""
    global _publisher
    _publisher = publisher


def publish(data: dict) -> None:
    """Stream `data` to the owner through this engine's publisher; best effort (the generation's
    result carries everything a missed update had)."""
    if _publisher is None:
        return
    try:
        _publisher(data)
    except Exception as e:  # noqa: BLE001 -- live updates are best effort; the result has all
        print(f"publishing live records failed: {e}", file=sys.stderr)
