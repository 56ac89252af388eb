"""Run discovery: one owner-only file per run in ``<runtime dir>/elastic-jupyter/``.

Each run writes ``<run id>.json`` with its name, kernel, pid and process start time, notebook
path, checkpoint folder, the path of its control socket (control.py, :func:`socket_path`) and
its latest :class:`~elastic_jupyter.server.snapshot.RunSnapshot` (written at start and at the end, so a
finished run keeps its final figures after its kernel is gone). The folder is mode 0700.

A reader tells a live entry from a stale one by the pid and its start time (a reused pid has
another start time). Entries of ended runs are dismissed by the user or pruned by age and count
(:func:`prune`); their checkpoints are never touched.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import time
import uuid

import psutil

from ..events import EventKind
from .control import ControlServer
from ..host import alive, own_folder, process_start, runtime_folder
from ..owner import background
from .snapshot import FINAL_STATES, last_snapshot


def registry_dir() -> str:
    """The registry's folder: this user's runtime folder (host.runtime_folder)."""
    return runtime_folder()


def kernel_id() -> str | None:
    """The id of the Jupyter kernel this process runs (None outside one)."""
    try:
        from ipykernel import get_connection_file
        name = os.path.basename(get_connection_file())
    except Exception:
        return None
    return name[len("kernel-"):-len(".json")] if name.startswith("kernel-") else name


# A Unix socket's path has room for 107 bytes (sun_path is 108 with its terminating NUL).
SOCKET_PATH_MAX = 107


def socket_path(run_id: str) -> str:
    """Where the control socket of `run_id` goes: a name of fixed length (a hash of the id,
    never the run name) in the registry folder, or, when the runtime dir is so deep that
    the path would not fit in a socket address, in ``/tmp/elastic-jupyter-<uid>/`` (mode
    0700). Readers take the path from the run's entry."""
    name = hashlib.sha256(run_id.encode()).hexdigest()[:16] + ".sock"
    path = os.path.join(registry_dir(), name)
    if len(os.fsencode(path)) <= SOCKET_PATH_MAX:
        return path
    return os.path.join(own_folder(f"/tmp/elastic-jupyter-{os.getuid()}"), name)


class Registration:
    """A run's discovery entry and control channel.

    Attributes:
        run_id: ``<name>-<8 hex>``; path: the entry file; socket_path: the control socket
            (see :func:`socket_path`).
    """

    def __init__(self, run):
        self.run_id = f"{run.name}-{uuid.uuid4().hex[:8]}"
        self.path = os.path.join(registry_dir(), f"{self.run_id}.json")
        self.socket_path = socket_path(self.run_id)
        me = psutil.Process()
        self.entry = {"id": self.run_id, "name": run.name, "pid": me.pid,
                      "pid_start_time": process_start(me.pid), "kernel_id": kernel_id(),
                      "notebook": run.notebook or os.environ.get("JPY_SESSION_NAME"),
                      "checkpoint_dir": run.checkpoint_dir, "started": time.time(),
                      "control": self.socket_path}

    def write(self, run) -> None:
        """Write the entry with the run's snapshot now (atomically, owner-only)."""
        snap = run.snapshot().as_dict()
        entry = dict(self.entry, state=snap["state"], step=snap["step"], snapshot=snap)
        tmp = f"{self.path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, self.path)


def register(run) -> Registration | None:
    """Write the run's entry and start its control channel (on the owner loop)."""
    try:
        reg = Registration(run)
        reg.write(run)
    except OSError as e:
        run.log.event(EventKind.WARNING, message=f"could not register the run for discovery "
                      f"(the side panel and the server will not list it): {e}")
        return None
    background(ControlServer(run, reg.socket_path).start(),
               lambda e: run.log.event(EventKind.WARNING,
                                       message=f"control channel not started: {e}"))
    atexit.register(_unlink, reg.socket_path)
    return reg


def update(reg: Registration | None, run) -> None:
    """Record the run's final snapshot in its entry (the control channel stays open)."""
    if reg is not None:
        try:
            reg.write(run)
        except OSError as e:
            run.log.event(EventKind.WARNING,
                          message=f"could not update the run's discovery entry: {e}")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def read_entry(run_id: str) -> dict | None:
    """The entry of `run_id` with "live" added, or None (one file read, no folder scan)."""
    if not run_id or "/" in run_id or run_id.startswith("."):
        return None
    try:
        with open(os.path.join(registry_dir(), f"{run_id}.json")) as f:
            entry = json.load(f)
        entry["live"] = alive(entry["pid"], entry["pid_start_time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return entry if isinstance(entry.get("checkpoint_dir"), str) else None


def list_runs(forget_gone: bool = False) -> list[dict]:
    """Registry entries of this user, each with "live": whether its process still runs.

    With `forget_gone`, entries of dead processes whose checkpoint folder no longer exists
    (nothing is left to show or resume) are deleted instead of listed.
    """
    out = []
    for name in sorted(os.listdir(registry_dir())):
        entry = read_entry(name[:-len(".json")]) if name.endswith(".json") else None
        if entry is None:
            continue  # unreadable or not one of ours
        if forget_gone and not entry["live"] and not os.path.isdir(entry["checkpoint_dir"]):
            forget(entry)
            continue
        out.append(entry)
    return out


def ended(entry: dict) -> bool:
    """The run is over: its kernel is gone, or it reached a final state."""
    return not entry["live"] or last_snapshot(entry).get("state") in FINAL_STATES


def forget(entry: dict) -> None:
    """Delete an entry (and its socket, when its kernel is gone); checkpoints stay."""
    _unlink(os.path.join(registry_dir(), f"{entry['id']}.json"))
    if not entry["live"]:
        _unlink(entry.get("control") or "")


def prune(entries: list[dict], max_age_s: float, max_count: int) -> list[dict]:
    """Forget ended runs older than `max_age_s` and all but the newest `max_count` ended
    runs; returns the entries kept. Live runs are always kept."""
    now = time.time()
    done = sorted((e for e in entries if ended(e)), key=lambda e: -(e.get("started") or 0))
    drop = {e["id"] for i, e in enumerate(done)
            if i >= max_count or now - (e.get("started") or 0) > max_age_s}
    for entry in done:
        if entry["id"] in drop:
            forget(entry)
    return [e for e in entries if e["id"] not in drop]
