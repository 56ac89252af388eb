"""Run discovery and the control channel other processes of this user reach a run through.

Each run writes ``<runtime dir>/elastic-jupyter/<run id>.json`` (owner-only permissions) with its
name, kernel, pid and process start time, notebook path and checkpoint folder, and serves a Unix
socket ``<run id>.sock`` beside it. The folder is mode 0700, so only this user can connect; the
socket never touches the network. Protocol: one JSON request per line, one JSON reply per line:

    {"op": "status"}                      -> the run's model (see run_model)
    {"op": "resize", "world_size": n}     -> {"ok": true} or {"error": "...", "code": 400|409}
    {"op": "stop"}                        -> {"ok": true}
    {"op": "history", "since": step}      -> {"records": [...records after step...]}
    {"op": "events", "since": n}          -> {"events": [...events from index n...]}

The channel stays open after the run ended (its status, history and events can still be read;
resize and stop answer 409) until the kernel exits.

A reader tells a live entry from a stale one by the pid and its start time (a reused pid has
another start time).
"""
from __future__ import annotations

import asyncio
import atexit
import json
import os
import time
import uuid

import psutil

from . import series
from .config import UsageError


def registry_dir() -> str:
    from jupyter_core.paths import jupyter_runtime_dir
    path = os.path.join(jupyter_runtime_dir(), "elastic-jupyter")
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def _kernel_id() -> str | None:
    try:
        from ipykernel import get_connection_file
        name = os.path.basename(get_connection_file())
    except Exception:
        return None
    return name[len("kernel-"):-len(".json")] if name.startswith("kernel-") else name


SPARKLINE_POINTS = 60


def run_model(run) -> dict:
    """The JSON-able description of a run that the registry, the control channel and the
    server extension share."""
    last = run._records.get(run.step, {})
    recent = run.records_since(max(0, run.step - 10 * SPARKLINE_POINTS))[::10][-SPARKLINE_POINTS:]
    reg = run._registration
    return {"id": reg.run_id if reg else None, "name": run.name, "notebook": run.notebook,
            "state": run.state, "step": run.step,
            "total_steps": run.total_steps, "world_size": run.world_size,
            "requested_size": run.requested_size, "min_size": run.pool.min_size,
            "max_size": run.pool.max_size, "backend": run.pool.backend,
            "loss": series.finite(last.get("loss")), "error": run.error,
            "checkpoint_dir": run.checkpoint_dir, "checkpoints": run.checkpoints,
            "slots": [m.device for m in run.members],
            "recent_loss": [series.finite(r["loss"]) for r in recent]}


class Registration:
    def __init__(self, run):
        self.run_id = f"{run.name}-{uuid.uuid4().hex[:8]}"
        folder = registry_dir()
        self.path = os.path.join(folder, f"{self.run_id}.json")
        self.socket_path = os.path.join(folder, f"{self.run_id}.sock")
        self.server = None
        me = psutil.Process()
        self.entry = {"id": self.run_id, "name": run.name, "pid": me.pid,
                      "pid_start_time": me.create_time(), "kernel_id": _kernel_id(),
                      "notebook": run.notebook or os.environ.get("JPY_SESSION_NAME"),
                      "checkpoint_dir": run.checkpoint_dir, "started": time.time(),
                      "control": self.socket_path}

    def write(self, run) -> None:
        entry = dict(self.entry, state=run.state, step=run.step, world_size=run.world_size)
        tmp = f"{self.path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, self.path)


def register(run) -> Registration | None:
    """Write the run's entry and start its control channel (called on the owner loop)."""
    try:
        reg = Registration(run)
        reg.write(run)
    except OSError as e:
        run._log(f"could not register the run for discovery: {e}")
        return None

    async def serve():
        old_umask = os.umask(0o177)  # the socket file itself: owner read/write only
        try:
            reg.server = await asyncio.start_unix_server(
                lambda r, w: _handle(run, r, w), path=reg.socket_path)
        finally:
            os.umask(old_umask)

    asyncio.ensure_future(serve())
    atexit.register(_unlink, reg.socket_path)
    return reg


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def update(reg: Registration | None, run) -> None:
    """Record the run's final state in its entry (the control channel stays open)."""
    if reg is not None:
        reg.write(run)


def _answer(run, request: dict) -> dict:
    op = request.get("op")
    if op == "status":
        return run_model(run)
    if op == "history":
        since = int(request.get("since", 0))
        return {"records": run.records_since(since)}
    if op == "events":
        return {"events": run.events[int(request.get("since", 0)):]}
    if op in ("resize", "stop") and not run.active:
        return {"error": f"run {run.name!r} is {run.state}", "code": 409}
    if op == "resize":
        try:
            run.resize(request.get("world_size"))
        except UsageError as e:
            return {"error": str(e), "code": 400}
        return {"ok": True}
    if op == "stop":
        run.stop()
        return {"ok": True}
    return {"error": f"unknown op {op!r}", "code": 400}


async def _handle(run, reader, writer) -> None:
    try:
        while line := await reader.readline():
            try:
                reply = _answer(run, json.loads(line))
            except (ValueError, TypeError) as e:
                reply = {"error": f"bad request: {e}", "code": 400}
            except Exception as e:  # the channel must answer, whatever went wrong
                reply = {"error": f"{type(e).__name__}: {e}", "code": 500}
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
    finally:
        writer.close()


def request(socket_path: str, message: dict, timeout: float = 5.0) -> dict:
    """Send one request to a run's control channel (blocking; for other processes)."""
    import socket
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


def list_runs(forget_gone: bool = False) -> list[dict]:
    """Registry entries of this user, each with "live": whether its process still runs.

    With `forget_gone`, entries of dead processes whose checkpoint folder no longer exists
    (nothing is left to show or resume) are deleted instead of listed.
    """
    out = []
    for name in sorted(os.listdir(registry_dir())):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(registry_dir(), name)) as f:
                entry = json.load(f)
            entry["live"] = _alive(entry["pid"], entry["pid_start_time"])
            folder = entry["checkpoint_dir"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable or not one of ours
        if forget_gone and not entry["live"] and not os.path.isdir(folder):
            _unlink(os.path.join(registry_dir(), name))
            _unlink(entry.get("control") or "")
            continue
        out.append(entry)
    return out


def _alive(pid: int, start_time: float) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() - start_time) < 1.0
    except psutil.Error:
        return False
