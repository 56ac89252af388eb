"""The owner thread: one thread that owns the ipyparallel cluster and client and every run.

The ipyparallel client is not thread-safe, and the ``_sync`` cluster methods misbehave outside a
running event loop, so everything that touches them runs as a coroutine on this thread's asyncio
loop. Requests from any thread (magics, the Python API, the widget, the server's control channel)
are queued onto that loop with :meth:`Owner.call` or :meth:`Owner.post`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading


class Owner:
    """A daemon thread running an asyncio loop."""

    def __init__(self, name: str = "elastic-owner"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def in_owner_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro) -> concurrent.futures.Future:
        """Schedule a coroutine on the owner loop; returns a thread-safe future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro, timeout: float | None = None):
        """Run a coroutine on the owner loop and wait for its result (re-raising its error)."""
        if self.in_owner_thread():
            raise RuntimeError("Owner.call from the owner thread would deadlock; await instead")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    def post(self, fn, *args) -> None:
        """Run a plain function on the owner loop soon, without waiting."""
        self.loop.call_soon_threadsafe(fn, *args)

    def flush(self, timeout: float | None = 10.0) -> None:
        """Wait until everything posted before this call has run (the loop runs callbacks in
        the order they were posted)."""
        self.call(asyncio.sleep(0), timeout)


def background(coro, report) -> asyncio.Task:
    """Run `coro` as a task on the running loop; if it fails, `report(one line)` is called, so
    no task ends with an exception nobody retrieved."""
    task = asyncio.ensure_future(coro)

    def done(t: asyncio.Task) -> None:
        if not t.cancelled() and t.exception() is not None:
            report(f"{type(t.exception()).__name__}: {t.exception()}")

    task.add_done_callback(done)
    return task


_owner: Owner | None = None
_lock = threading.Lock()


def get_owner() -> Owner:
    """The process-wide owner thread, started on first use."""
    global _owner
    with _lock:
        if _owner is None:
            _owner = Owner()
        return _owner
