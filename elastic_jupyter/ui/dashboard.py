"""The live training dashboard: an anywidget with a pool-size slider, loss chart and status line.

Traffic (kernel -> front end): a feeder thread wakes at most ``UPDATES_PER_S`` times a second
and sends only what is new: per-step records as binary ``append`` messages (one float64 buffer
per column, never the whole history; ``after`` names the step a view must already hold, else it
asks for the gap with ``hello``), ``status`` and ``events`` traits when they changed, and a
``beat`` each second so a front end can tell a dead kernel from an idle one (``ended`` when the
run is over and the feeder stops). The ``history``
trait holds a decimated copy of the whole run (at most ``SNAPSHOT_POINTS`` rows), refreshed at
most once a second, from which a new view or a reloaded page starts; ``range`` requests return
full-resolution rows for a zoomed span.

Front end -> kernel: ``resize`` (slider), ``stop``, ``auto`` (the auto toggle), ``hello`` (a new view asks for the rows after
its snapshot), ``range`` and ``logs``. A resize goes straight to ``run.resize`` (which validates
it; the run's sizer coalesces a drag's requests: sizing.COALESCE_S); the view only debounces its
slider. Where the server extension answers, the view sends
resize and stop over its REST API instead (never through the kernel's shell); this comm path is
the fallback (VS Code, no server extension).
"""
from __future__ import annotations

import pathlib
import threading
import time
from typing import TYPE_CHECKING, Any

import anywidget
import numpy as np
import traitlets

from ..config import UsageError
from ..events import MARKED, Event, EventKind
from ..server import series
from ..server.snapshot import RunState

if TYPE_CHECKING:
    from ..run.run import TrainingRun

STATIC = pathlib.Path(__file__).parent.parent / "static"  # built by npm beside the package's folders
UPDATES_PER_S = 5
SNAPSHOT_PERIOD_S = 1.0
SNAPSHOT_POINTS = 2000
RANGE_POINTS = 50_000
MARKER_KINDS = frozenset(kind.value for kind in MARKED)


class Dashboard(anywidget.AnyWidget):
    """Live view of a TrainingRun; ``run.dashboard()`` makes one.

    Synced traits: ``name``, ``min_size``/``max_size`` (slider bounds), ``status`` (the run's
    snapshot: snapshot.RunSnapshot's wire model), ``events`` (markers), ``history`` (decimated columns), ``notice`` (the last
    request that was refused, with the reason).
    """

    _esm = STATIC / "dashboard.js"
    _css = STATIC / "dashboard.css"

    name = traitlets.Unicode().tag(sync=True)
    run_id = traitlets.Unicode(allow_none=True).tag(sync=True)  # the registry id, for the REST path
    min_size = traitlets.Int(1).tag(sync=True)
    max_size = traitlets.Int(1).tag(sync=True)
    status = traitlets.Dict().tag(sync=True)
    events: traitlets.List[dict] = traitlets.List().tag(sync=True)
    history = traitlets.Dict().tag(sync=True)
    notice = traitlets.Unicode().tag(sync=True)

    def __init__(self, run: TrainingRun, feed: bool | None = None):
        super().__init__(name=run.name, run_id=run.run_id,
                         min_size=run.pool.config.min_size,
                         max_size=run.pool.config.max_size)
        self.run = run
        self._store = series.ColumnStore()  # everything sent so far, for snapshots
        self._sent_upto = 0  # newest step in the store (sent as an append or in a snapshot)
        self._snapshot_time = 0.0
        self._send_lock = threading.RLock()  # one sender at a time: feeder or a request
        self._closed = threading.Event()
        if self.comm is not None and hasattr(self.comm, "_reply_subshell_for"):
            # ipykernel 7.4 routes a comm's incoming messages to the shell that last sent on
            # it (the main shell, for our feeder thread), so slider moves would wait behind a
            # running cell; keep the subshell the front end chose instead. (Private API: the
            # browser tests drag the slider with the kernel busy and idle.)
            self.comm._reply_subshell_for = lambda data, default: default
            self.comm.on_close(lambda _msg: self._closed.set())
        self.on_msg(self._on_message)
        with self._send_lock:  # what exists now goes in the first snapshot, not in appends
            self._take(run.records_since(0))
            self._sync_events()
            self.status = self._status()
            self._snapshot()
        if feed is None:  # feed live front ends only: a terminal shows the text summary
            feed = getattr(_shell(), "kernel", None) is not None
        if feed:
            threading.Thread(target=self._feed, name=f"dashboard-{run.name}", daemon=True).start()

    def __repr__(self) -> str:  # what a plain-text front end shows instead of the widget
        return self.run.summary()

    def close(self) -> None:
        self._closed.set()
        super().close()

    # ------------------------------------------------------------------ kernel -> front end

    def _feed(self) -> None:
        """Until the comm closes or the run has ended (one last update is then sent)."""
        last_beat = 0.0
        while not self._closed.wait(1 / UPDATES_PER_S):
            try:
                ended = not self.run.active and self.run.state != RunState.CREATED
                self.tick(force=ended)
                if ended:
                    self.send({"type": "ended"})  # the view stops expecting beats
                    return
                if time.monotonic() - last_beat >= 1:
                    self.send({"type": "beat"})
                    last_beat = time.monotonic()
            except Exception as e:  # a dashboard must never take the kernel down
                self.notice = f"dashboard update failed: {e!r}"

    def tick(self, force: bool = False) -> None:
        """Send what changed since the last tick (the feeder thread calls this); `force`
        refreshes the snapshot even within its period."""
        with self._send_lock:
            self._tick(force)

    def _tick(self, force: bool) -> None:
        run = self.run
        for event in self._sync_events():
            if event["kind"] == EventKind.FAULT and event.get("rolled_back_to") is not None:
                self._truncate(event["rolled_back_to"])
        if run.step < self._sent_upto:
            self._truncate(run.step)
        after = self._sent_upto
        rows = self._take(run.records_since(after))
        if rows:
            self._send_rows("append", rows, after=after)
        status = self._status()
        if status != self.status:
            self.status = status
        if force or (rows and time.monotonic() - self._snapshot_time >= SNAPSHOT_PERIOD_S):
            self._snapshot()

    def _take(self, rows: list[dict]) -> list[dict]:
        if rows:
            self._store.add(rows)
            self._sent_upto = rows[-1]["step"]
        return rows

    def _sync_events(self) -> list[dict]:
        """Refresh the markers trait; returns the events that are new to it."""
        known = len(self.events)
        markers = [_marker(e) for e in list(self.run.events) if e["kind"] in MARKER_KINDS]
        if len(markers) != known:
            self.events = markers
        return markers[known:]

    def _truncate(self, step: int) -> None:
        self.send({"type": "truncate", "after": step})
        self._store.truncate(step)
        self._sent_upto = min(self._sent_upto, step)

    def _send_rows(self, kind: str, rows: list[dict], **fields) -> None:
        """One binary message: a float64 buffer per column, in ``columns`` order. An append's
        ``after`` is the step the view must hold already, else it asks with "hello"."""
        names = list(self._store.names)
        cols = series.columns(rows, names)
        self.send({"type": kind, "columns": names, "rows": len(rows), **fields},
                  buffers=[np.ascontiguousarray(cols[n]).data for n in names])

    def _snapshot(self) -> None:
        cols = self._store.arrays()
        keep = series.decimate(cols, SNAPSHOT_POINTS)
        names = list(self._store.names)
        self.history = {"columns": names, "data": [[series.finite(float(v)) for v in cols[n][keep]]
                                                   for n in names]}
        self._snapshot_time = time.monotonic()

    def _status(self) -> dict:
        return self.run.snapshot().as_dict()

    # ------------------------------------------------------------------ front end -> kernel

    def _on_message(self, _widget, content: dict, buffers) -> None:
        kind = str(content.get("type"))
        try:
            with self._send_lock:
                self._handle(kind, content)
        except (UsageError, ValueError, KeyError, TypeError) as e:
            what = f"resize to {content.get('world_size')}" if kind == "resize" else kind
            self.notice = f"{what} refused: {e}"

    def _handle(self, kind: str, content: dict) -> None:
        if kind == "resize":
            self.request_resize(content.get("world_size"))
        elif kind == "stop":
            self.run.stop()
        elif kind == "auto":
            self.run.auto(bool(content.get("auto")))
        elif kind == "hello":  # a view holding steps up to `after` asks for the rest
            after = int(content.get("after", 0))
            rows = [r for r in self.run.records_since(after) if r["step"] <= self._sent_upto]
            self._send_rows("append", rows, after=after, reply=True)
        elif kind == "range":
            self._send_range(int(content["from"]), int(content["to"]))
        elif kind == "logs":
            self.send({"type": "logs", "text": self.run.logs()})

    def request_resize(self, n: Any) -> None:
        """Ask the run for world size `n` (the newest request wins); clears the notice.
        Raises UsageError at once (outside the pool's bounds, the run not training)."""
        self.run.resize(n)
        self.notice = ""

    def _send_range(self, first: int, last: int) -> None:
        rows = [r for r in self.run.records_since(max(0, first - 1)) if r["step"] <= last]
        if len(rows) > RANGE_POINTS:
            cols = series.columns(rows, self._store.names)
            rows = [rows[i] for i in series.decimate(cols, RANGE_POINTS)]
        self._send_rows("range", rows, **{"from": first, "to": last})


def _shell():
    from IPython import get_ipython
    return get_ipython()


def _marker(event: Event) -> dict[str, Any]:
    keep = ("kind", "step", "from", "to", "latency_s", "path", "message", "rolled_back_to",
            "lost_steps", "scheduled")
    return {k: v for k, v in event.items() if k in keep}
