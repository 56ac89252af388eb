"""The jupyter-server extension: every run of this user in one REST API, under the server's base URL.

    GET    {base}elastic/api/runs                    {"runs": [model, ...]}
    GET    {base}elastic/api/runs/<id>               model
    PATCH  {base}elastic/api/runs/<id>               {"world_size": n} -> 202 model (pending)
    DELETE {base}elastic/api/runs/<id>               stop after the current step -> 202 model
    GET    {base}elastic/api/runs/<id>/history?since=STEP&events_since=N
                                                     {"columns", "data", "events", "next"}
    GET    {base}elastic/api/runs/<id>/logs          {"text": ...}

A model: id, name, notebook, state ("lost" when the kernel died), step, total_steps,
world_size, requested_size, min_size, max_size, loss, recent_loss (sparkline), slots,
checkpoints (each with ``browser_path`` relative to the server root when inside it), error.

The server finds runs through the registry files and reaches a live run over its Unix-socket
control channel (registry.py); it never starts or stops engines itself. Every handler requires
Jupyter authentication (token, or cookie + XSRF for writes) and asks the server's Authorizer
(resource "elastic"). A run whose kernel lives but does not answer is "unresponsive" (writes
answer 503, so the notebook dashboard falls back to its comm).
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

from . import registry, series
from .engine.checkpoint import list_checkpoints

ACTIVE_STATES = ("starting", "training", "resizing")
FINAL_STATES = ("finished", "failed", "stopped")
ID_PATTERN = r"(?P<run_id>[^/]+)"


class _RunsBase(APIHandler):
    auth_resource = "elastic"  # what a custom Authorizer sees (read: GET, write: PATCH/DELETE)

    def _entry(self, run_id: str) -> dict:
        for entry in registry.list_runs():
            if entry["id"] == run_id:
                return entry
        raise web.HTTPError(404, f"no run with id {run_id!r}; GET elastic/api/runs lists them")

    async def _model(self, entry: dict) -> dict:
        model = None
        if entry["live"]:
            try:
                model = await registry.arequest(entry["control"], {"op": "status"}, timeout=3)
            except (OSError, asyncio.TimeoutError, ValueError):
                model = None
            if model is not None and "code" in model:  # the channel's error reply
                model = None
        if model is None:
            model = _offline_model(entry)
        model.update(id=entry["id"], notebook=model.get("notebook") or entry.get("notebook"),
                     kernel_id=entry.get("kernel_id"), started=entry.get("started"))
        root = self.settings.get("server_root_dir") or os.getcwd()
        for c in model.get("checkpoints", []):
            rel = os.path.relpath(c["path"], os.path.expanduser(root))
            c["browser_path"] = None if rel.startswith("..") else rel
        return model

    def _write_error(self, status: int, message: str) -> None:
        self.set_status(status)
        self.finish({"message": message})


def _offline_model(entry: dict) -> dict:
    """A run whose control channel does not answer: its last recorded state, "unresponsive"
    while its kernel process lives, else "lost"."""
    checkpoints = list_checkpoints(entry["checkpoint_dir"])
    if entry.get("state") in FINAL_STATES:
        state = entry["state"]
    else:
        state = "unresponsive" if entry["live"] else "lost"
    step = max([entry.get("step") or 0] + [c["step"] for c in checkpoints])
    model = {"name": entry["name"], "state": state, "step": step, "world_size": 0,
             "requested_size": 0, "checkpoints": checkpoints, "recent_loss": [], "slots": [],
             "checkpoint_dir": entry["checkpoint_dir"], "total_steps": None, "loss": None,
             "error": None}
    if state == "unresponsive":
        model["error"] = ("its kernel runs but the run does not answer on its control channel; "
                          "the notebook's own dashboard can still reach it")
    if state == "lost":
        model["error"] = (
            "the kernel that ran it is gone" +
            (f"; continue from the checkpoint at step {checkpoints[-1]['step']} with "
             f"%%elastic_train --name {entry['name']} --resume (same cell and options)"
             if checkpoints else "; it wrote no checkpoint, so it must start again"))
    return model


class RunsHandler(_RunsBase):
    @web.authenticated
    @authorized
    async def get(self):
        entries = registry.list_runs(forget_gone=True)
        models = [m for m in await asyncio.gather(*(self._model(e) for e in entries),
                                                  return_exceptions=True)
                  if not isinstance(m, BaseException)]  # one broken entry hides only itself
        # live runs first, then the newest
        models.sort(key=lambda m: (m["state"] not in ACTIVE_STATES, -(m.get("started") or 0)))
        self.finish({"runs": models})


class RunHandler(_RunsBase):
    @web.authenticated
    @authorized
    async def get(self, run_id):
        self.finish(await self._model(self._entry(run_id)))

    @web.authenticated
    @authorized
    async def patch(self, run_id):
        entry = self._entry(run_id)
        try:
            body = json.loads(self.request.body or b"")
        except ValueError:
            return self._write_error(400, 'the body must be JSON, like {"world_size": 3}')
        size = body.get("world_size") if isinstance(body, dict) else None
        if isinstance(size, bool) or not isinstance(size, int):
            return self._write_error(400, f'"world_size" must be an integer, got {size!r}')
        await self._forward(entry, {"op": "resize", "world_size": size})

    @web.authenticated
    @authorized
    async def delete(self, run_id):
        await self._forward(self._entry(run_id), {"op": "stop"})

    async def _forward(self, entry: dict, request: dict) -> None:
        model = await self._model(entry)
        if model["state"] == "unresponsive":  # 503: the dashboard falls back to its comm
            return self._write_error(503, f"run is unresponsive: {model['error']}")
        if model["state"] not in ACTIVE_STATES:
            reason = model.get("error") or f"run {entry['name']!r} is {model['state']}"
            return self._write_error(409, f"run is {model['state']}: {reason}")
        try:
            reply = await registry.arequest(entry["control"], request, timeout=3)
        except (OSError, asyncio.TimeoutError, ValueError) as e:
            return self._write_error(503, f"run {entry['name']!r} does not answer: {e}")
        if "error" in reply:
            return self._write_error(reply.get("code", 400), reply["error"])
        self.set_status(202)
        self.finish(await self._model(entry))


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
            records = (await registry.arequest(
                entry["control"], {"op": "history", "since": since}, timeout=5))["records"]
            events = (await registry.arequest(
                entry["control"], {"op": "events", "since": events_since}, timeout=5))["events"]
        except (OSError, asyncio.TimeoutError, ValueError) as e:
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


def _load_jupyter_server_extension(serverapp) -> None:
    base = url_path_join(serverapp.web_app.settings["base_url"], "elastic", "api", "runs")
    serverapp.web_app.add_handlers(".*$", [
        (base, RunsHandler),
        (url_path_join(base, ID_PATTERN), RunHandler),
        (url_path_join(base, ID_PATTERN, "history"), HistoryHandler),
        (url_path_join(base, ID_PATTERN, "logs"), LogsHandler),
    ])
    serverapp.log.info("elastic-jupyter: runs API at %s", base)
