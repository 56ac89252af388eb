"""The jupyter-server extension: every run of this user in one REST API, under the server's base URL.

    GET    {base}elastic/api/runs                    {"runs": [snapshot, ...]}
    GET    {base}elastic/api/runs/<id>               snapshot
    PATCH  {base}elastic/api/runs/<id>               {"world_size": n} -> 202 snapshot (pending);
                                                     {"auto": bool[, "weight": w]}: auto mode
    GET    {base}elastic/api/machine                 the machine's slots and runs from its
                                                     arbiter (arbiter.table.SlotTable.view plus
                                                     kind, util, memory_mib), or
                                                     {"available": false, "message"}
    DELETE {base}elastic/api/runs/<id>               stop after the current step -> 202 snapshot
    POST   {base}elastic/api/runs/<id>/dismiss       forget an ended run -> 204 (409 if active)
    GET    {base}elastic/api/runs/<id>/history?since=STEP&events_since=N
                                                     {"columns", "data", "events", "next"}
    GET    {base}elastic/api/runs/<id>/logs          {"text": ...}

A snapshot is snapshot.RunSnapshot's wire model (state "lost" when the kernel died,
"unresponsive" when it lives but the run does not answer), plus kernel_id, started and each
checkpoint's ``browser_path`` relative to the server root (None outside it).

Handlers are thin: the server finds runs through the registry files (registry.py) and reaches a
live run over its Unix-socket control channel (control.py) in one round trip per request; it
never starts or stops engines itself. Every handler requires Jupyter authentication (token, or
cookie + XSRF for writes) and asks the server's Authorizer (resource "elastic"). Writes to an
unresponsive run answer 503, so the notebook dashboard falls back to its comm. Ended runs are
listed until dismissed or pruned (:class:`RunRegistry`).
"""
from __future__ import annotations

import asyncio
import json
import os
import re

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web
from traitlets import Float, Int
from traitlets.config import LoggingConfigurable

from . import control, registry, series
from ..arbiter.client import ArbiterClient
from ..arbiter.location import SOCKET, arbiter_dir
from ..arbiter.table import ArbiterError
from .snapshot import ACTIVE_STATES, of_entry

ID_PATTERN = r"(?P<run_id>[^/]+)"
CHANNEL_ERRORS = (OSError, asyncio.TimeoutError, ValueError)


class RunRegistry(LoggingConfigurable):
    """How long ended runs stay listed (``c.RunRegistry.max_age_days = 7`` in
    jupyter_server_config.py). Their checkpoints are never deleted."""

    max_age_days = Float(30.0, config=True, help="Forget ended runs older than this (days).")
    max_ended = Int(50, config=True, help="Keep at most this many ended runs listed.")


class _RunsBase(APIHandler):
    auth_resource = "elastic"  # what a custom Authorizer sees (read: GET, write: PATCH/DELETE)

    def _entry(self, run_id: str) -> dict:
        entry = registry.read_entry(run_id)
        if entry is None:
            raise web.HTTPError(404, f"no run with id {run_id!r}; GET elastic/api/runs lists them")
        return entry

    async def _snapshot(self, entry: dict) -> dict:
        """The run's snapshot from its control channel, else from its entry (lost, ended or
        unresponsive), presented for this server."""
        snap = None
        if entry["live"]:
            try:
                snap = await control.arequest(entry["control"], {"op": "status"}, timeout=3)
            except CHANNEL_ERRORS:
                snap = None
            if snap is not None and "code" in snap:  # the channel's error reply
                snap = None
        return self._present(entry, snap if snap is not None else of_entry(entry).as_dict())

    def _present(self, entry: dict, snap: dict) -> dict:
        """The one serializer: a snapshot plus what only the server knows (the registry id,
        kernel, start time, checkpoint paths relative to the server root)."""
        snap.update(id=entry["id"], notebook=snap.get("notebook") or entry.get("notebook"),
                    kernel_id=entry.get("kernel_id"), started=entry.get("started"))
        root = os.path.expanduser(self.settings.get("server_root_dir") or os.getcwd())
        for c in snap.get("checkpoints", []):
            rel = os.path.relpath(c["path"], root)
            c["browser_path"] = None if rel.startswith("..") else rel
        return snap

    def _write_error(self, status: int, message: str) -> None:
        self.set_status(status)
        self.finish({"message": message})


class RunsHandler(_RunsBase):
    @web.authenticated
    @authorized
    async def get(self):
        limits = self.settings["elastic_registry"]
        entries = registry.prune(registry.list_runs(forget_gone=True),
                                 limits.max_age_days * 86400, limits.max_ended)
        snaps = [m for m in await asyncio.gather(*(self._snapshot(e) for e in entries),
                                                 return_exceptions=True)
                 if not isinstance(m, BaseException)]  # one broken entry hides only itself
        # live runs first, then the newest
        snaps.sort(key=lambda m: (m["state"] not in ACTIVE_STATES, -(m.get("started") or 0)))
        self.finish({"runs": snaps})


class RunHandler(_RunsBase):
    @web.authenticated
    @authorized
    async def get(self, run_id):
        self.finish(await self._snapshot(self._entry(run_id)))

    @web.authenticated
    @authorized
    async def patch(self, run_id):
        entry = self._entry(run_id)
        try:
            body = json.loads(self.request.body or b"")
        except ValueError:
            return self._write_error(400, 'the body must be JSON, like {"world_size": 3}')
        if isinstance(body, dict) and "auto" in body:
            return await self._forward(entry, {"op": "auto", "auto": body["auto"],
                                               "weight": body.get("weight")})
        size = body.get("world_size") if isinstance(body, dict) else None
        if isinstance(size, bool) or not isinstance(size, int):
            return self._write_error(400, f'"world_size" must be an integer, got {size!r}')
        await self._forward(entry, {"op": "resize", "world_size": size})

    @web.authenticated
    @authorized
    async def delete(self, run_id):
        await self._forward(self._entry(run_id), {"op": "stop"})

    async def _forward(self, entry: dict, request: dict) -> None:
        """One round trip: the run applies the request and answers with its snapshot."""
        if not entry["live"]:
            return await self._refuse(entry)
        try:
            reply = await control.arequest(entry["control"], dict(request, snapshot=True),
                                           timeout=3)
        except CHANNEL_ERRORS as e:  # 503: the dashboard falls back to its comm
            return self._write_error(503, f"run is unresponsive: {entry['name']!r} does not "
                                     f"answer on its control channel ({e})")
        if reply.get("code") == 409:
            return await self._refuse(entry)
        if "error" in reply:
            return self._write_error(reply.get("code", 400), reply["error"])
        self.set_status(202)
        self.finish(self._present(entry, reply["snapshot"]))

    async def _refuse(self, entry: dict) -> None:
        snap = await self._snapshot(entry)
        reason = snap.get("error") or f"run {entry['name']!r} is {snap['state']}"
        self._write_error(409, f"run is {snap['state']}: {reason}")


class DismissHandler(_RunsBase):
    @web.authenticated
    @authorized
    async def post(self, run_id):
        """Forget an ended run's entry (its checkpoints stay): 204; 409 while it is active."""
        entry = self._entry(run_id)
        if not registry.ended(entry):
            return self._write_error(409, f"run {entry['name']!r} is active: stop it first")
        registry.forget(entry)
        self.set_status(204)
        self.finish()


class HistoryHandler(_RunsBase):
    @web.authenticated
    @authorized
    async def get(self, run_id):
        entry = self._entry(run_id)
        since = self._int_argument("since")
        events_since = self._int_argument("events_since")
        if not entry["live"]:
            return self.finish({"columns": [], "data": [], "events": [],
                                "next": {"since": since, "events_since": events_since}})
        try:
            records = (await control.arequest(
                entry["control"], {"op": "history", "since": since}, timeout=5))["records"]
            events = (await control.arequest(
                entry["control"], {"op": "events", "since": events_since}, timeout=5))["events"]
        except CHANNEL_ERRORS as e:
            raise web.HTTPError(503, f"run {entry['name']!r} does not answer: {e}") from None
        names = series.column_names(records)
        self.finish({"columns": names,
                     "data": [[series.finite(r.get(n)) for r in records] for n in names],
                     "events": events,
                     "next": {"since": records[-1]["step"] if records else since,
                              "events_since": events_since + len(events)}})

    def _int_argument(self, name: str) -> int:
        text = self.get_argument(name, "0")
        if not re.fullmatch(r"[0-9]+", text):
            raise web.HTTPError(400, f"{name} must be a step number (a non-negative integer)")
        return int(text)


class LogsHandler(_RunsBase):
    @web.authenticated
    @authorized
    async def get(self, run_id):
        folder = os.path.join(self._entry(run_id)["checkpoint_dir"], "logs")
        text = await asyncio.get_running_loop().run_in_executor(None, _tails, folder)
        self.finish({"text": text or "(no logs yet)"})


class MachineHandler(APIHandler):
    """The machine's slots from its arbiter; never starts one (a pool with --auto does)."""

    auth_resource = "elastic"

    @web.authenticated
    @authorized
    async def get(self):
        try:
            view = await asyncio.get_running_loop().run_in_executor(None, _machine)
        except (ArbiterError, OSError) as e:
            view = {"available": False, "message": f"no slot arbiter answers on this machine "
                    f"({e}); pools started with --auto start one"}
        self.finish(view)


def _machine() -> dict:
    folder = arbiter_dir()
    if not os.path.exists(os.path.join(folder, SOCKET)):
        raise ArbiterError(f"no socket in {folder}")
    return {"available": True, **ArbiterClient(folder, timeout=1.0).view()}


def _tails(folder: str, lines: int = 200, window: int = 64 * 1024) -> str:
    """The last `lines` lines of each log file in `folder` (read from the end, not whole)."""
    parts = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - window))
            tail = f.read().decode(errors="replace").splitlines()[-lines:]
        parts.append(f"==> {name} <==\n" + "\n".join(tail))
    return "\n\n".join(parts)


def routes(base_url: str) -> list[tuple[str, type[APIHandler]]]:
    """The extension's REST routes under the server's `base_url`: (pattern, handler)."""
    base = url_path_join(base_url, "elastic", "api", "runs")
    return [
        (base, RunsHandler),
        (url_path_join(base, ID_PATTERN), RunHandler),
        (url_path_join(base, ID_PATTERN, "dismiss"), DismissHandler),
        (url_path_join(base, ID_PATTERN, "history"), HistoryHandler),
        (url_path_join(base, ID_PATTERN, "logs"), LogsHandler),
        (url_path_join(base_url, "elastic", "api", "machine"), MachineHandler),
    ]


def _load_jupyter_server_extension(serverapp) -> None:
    base_url = serverapp.web_app.settings["base_url"]
    serverapp.web_app.settings["elastic_registry"] = RunRegistry(parent=serverapp)
    serverapp.web_app.add_handlers(".*$", routes(base_url))
    serverapp.log.info("elastic-jupyter: runs API at %s", routes(base_url)[0][0])
