"""Arrivals: which newly registered engine came from which engine-set start.

Each engine set is started with its id in the engine's environment (``ELASTIC_JUPYTER_SET``),
so starts under way at once (a run's boots of batch jobs, a warm engine beside a slot's)
tell their engines apart, and an engine of a start that failed, registering late, is never
taken for a new one: it is shut down. Each registered engine is asked its set once.
:class:`Arrivals` is the only writer of what is known of them (owner loop).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable


class Arrivals:
    """The pool's registered engines not in it yet, by the engine set that started them.

    Args:
        client: returns ipyparallel's client (``ids``, ``shutdown``).
        ask: ``ask(engine_id)`` submits the question to that engine and returns its
            AsyncResult (``ready()``, ``get()``): :meth:`.EngineCalls.engine_set`.
    """

    def __init__(self, client: Callable[[], Any], ask: Callable[[int], Any]):
        self._client, self._ask = client, ask
        self._set_of: dict[int, str | None] = {}  # engine id -> its set, asked once
        self._asking: dict[int, Any] = {}  # engine id -> its reply to that question, not in yet
        self._forgotten: set[str] = set()  # sets of failed starts

    def look(self, known: Iterable[int]) -> dict[int, str | None]:
        """engine id -> engine set of the registered engines not in `known` (the pool's), as
        far as their answers came in; asks each new one (no waiting)."""
        client, known = self._client(), set(known)
        for i in client.ids:
            if i not in known and i not in self._set_of and i not in self._asking:
                try:
                    self._asking[i] = self._ask(i)
                except (KeyError, IndexError):  # unregistered since: nothing to ask
                    continue
        for i, reply in list(self._asking.items()):
            if reply.ready():
                del self._asking[i]
                try:
                    self._set_of[i] = reply.get()
                except Exception:  # noqa: BLE001 -- it went away: not one of ours to wait for
                    self._set_of[i] = None
                if self._set_of[i] in self._forgotten:  # a failed start's, registered late
                    self._set_of[i] = None
                    self._shut_down(client, i)
        return {i: self._set_of.get(i) for i in client.ids
                if i not in known and i in self._set_of}

    @staticmethod
    def _shut_down(client: Any, engine_id: int) -> None:
        try:
            client.shutdown(targets=[engine_id], hub=False, block=False)
        except (KeyError, IndexError):  # unregistered since (its start's stop ended it)
            pass

    def forget(self, set_ids: set[str]) -> None:
        """These starts failed: an engine of theirs, now or later, is no arrival."""
        self._set_of.update({i: None for i, s in self._set_of.items() if s in set_ids})
        self._forgotten |= set_ids

    def gone(self, engine_id: int) -> None:
        """The pool removed this engine: while still registered it is no new arrival."""
        self._set_of[engine_id] = None

    def clear(self) -> None:
        """The cluster stopped: nothing of it is remembered."""
        self._set_of, self._asking, self._forgotten = {}, {}, set()
