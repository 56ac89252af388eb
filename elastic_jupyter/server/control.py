"""The control channel: a Unix socket per run through which other processes of this user
(the Jupyter server extension, scripts) read and steer the run.

The server runs on the owner loop, so a request is answered and applied in one step, without
a hop back onto the loop. The socket lives in the registry folder, or in a short private one
when that is too deep for a socket address (registry.socket_path; mode 0700 either way: only
this user can connect), and never touches the network. Protocol: one JSON request per line, one JSON reply
per line:

    {"op": "status"}                     -> the run's snapshot (snapshot.RunSnapshot.as_dict)
    {"op": "resize", "world_size": n}    -> {"ok": true} or {"error": "...", "code": 400|409}
    {"op": "stop"}                       -> {"ok": true} or {"error": ..., "code": 409}
    {"op": "auto", "auto": bool, "weight": w (optional)}
                                         -> auto mode on/off (lease mode), as "resize"
    {"op": "history", "since": step}     -> {"records": [...records after step...]}
    {"op": "events", "since": n}         -> {"events": [...events from index n...]}

A write (resize, stop) with ``"snapshot": true`` answers ``{"ok": true, "snapshot": {...}}``
with the run's snapshot after the request was taken, so a client needs one round trip. The
channel stays open after the run ended (status, history and events can still be read; writes
answer 409) until the kernel exits.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
from typing import Any, Protocol

from ..config import UsageError
from .snapshot import RunSnapshot


class ControlledRun(Protocol):
    """What the channel reads and steers: a run.run.TrainingRun (server/ never imports run/)."""

    name: str

    @property
    def state(self) -> str: ...

    @property
    def active(self) -> bool: ...

    @property
    def events(self) -> list[dict]: ...

    def snapshot(self) -> RunSnapshot: ...

    def records_since(self, step: int) -> list[dict]: ...

    def resize(self, n: Any, at_step: int | None = None) -> None:
        """`n`: a request's world_size as it came (JSON): the run validates it."""

    def auto(self, on: bool = True, weight: float | None = None) -> None: ...

    def stop(self) -> None: ...


def answer(run: ControlledRun, request: dict[str, Any]) -> dict:
    """The reply to one request (on the owner loop)."""
    op = request.get("op")
    if op == "status":
        return run.snapshot().as_dict()
    if op == "history":
        return {"records": run.records_since(int(request.get("since", 0)))}
    if op == "events":
        return {"events": run.events[int(request.get("since", 0)):]}
    if op not in ("resize", "stop", "auto"):
        return {"error": f"unknown op {op!r}", "code": 400}
    if not run.active:
        return {"error": f"run {run.name!r} is {run.state}", "code": 409}
    try:
        if op == "resize":
            run.resize(request.get("world_size"))
        elif op == "auto":
            if not isinstance(request.get("auto"), bool):
                raise UsageError(f'"auto" must be true or false, got {request.get("auto")!r}')
            run.auto(request["auto"], request.get("weight"))
        else:
            run.stop()
    except UsageError as e:
        return {"error": str(e), "code": 400}
    if request.get("snapshot"):
        return {"ok": True, "snapshot": run.snapshot().as_dict()}
    return {"ok": True}


class ControlServer:
    """Serves `run` on the Unix socket `path` (owner-only permissions)."""

    def __init__(self, run: ControlledRun, path: str):
        self.run, self.path = run, path
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        old_umask = os.umask(0o177)  # the socket file itself: owner read/write only
        try:
            self._server = await asyncio.start_unix_server(self._handle, path=self.path)
        finally:
            os.umask(old_umask)

    async def _handle(self, reader, writer) -> None:
        try:
            while line := await reader.readline():
                try:
                    reply = answer(self.run, json.loads(line))
                except (ValueError, TypeError) as e:
                    reply = {"error": f"bad request: {e}", "code": 400}
                except Exception as e:  # the channel must answer, whatever went wrong
                    reply = {"error": f"{type(e).__name__}: {e}", "code": 500}
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except ConnectionError:
            pass  # the client went away mid-request
        finally:
            writer.close()


def request(socket_path: str, message: dict, timeout: float = 5.0) -> dict:
    """Send one request to a run's control channel (blocking; for other processes)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path)
        s.sendall(json.dumps(message).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return json.loads(data)


async def arequest(socket_path: str, message: dict, timeout: float = 5.0) -> dict:
    """`request` for asyncio callers (the server extension)."""
    reader, writer = await asyncio.wait_for(
        asyncio.open_unix_connection(socket_path, limit=2 ** 28), timeout)  # replies can be long
    try:
        writer.write(json.dumps(message).encode() + b"\n")
        await writer.drain()
        return json.loads(await asyncio.wait_for(reader.readline(), timeout))
    finally:
        writer.close()
