"""The arbiter process: the slot table served on a Unix socket, one JSON line each way.

    python -m elastic_jupyter.arbiter [--dir FOLDER] [--config FILE]

Every request is answered on one thread, in arrival order, so no two requests interleave and
no slot is ever leased twice. Who asks is read from the socket (``SO_PEERCRED``: the kernel
vouches for the pid and uid), never from the request, so a user can neither pose as another
nor change another user's run; the run's holder is the connecting process (its kernel).

The folder holds ``arbiter.sock``, ``arbiter.lock`` (held by the live arbiter, so a second
one started at the same time exits) and ``state.json`` (the leases, saved at every change and
loaded at start: a restarted arbiter keeps every lease). Every half second the arbiter drops
runs whose process is gone (their leases are free within a second) and asks its provider
which slots are busy outside.

The wire (requests carry ``"op"``; replies ``"ok"`` and, when false, ``"error"``):

=============  ==========================================================  =================
op             arguments                                                   reply
=============  ==========================================================  =================
register       run, name, notebook, min, max, weight, auto, wanted,        the run's grant
               standby, lend (false: never lend its slots)
poll           run, active (it trains), engines ({slot: pid}),              grant + events
               speed ([[world size, samples/s], ...]: arbiter/value.py)
release        run, slots                                                   the run's grant
unregister     run                                                          —
view           —                                                            the machine
=============  ==========================================================  =================

A grant is :meth:`.table.SlotTable.grant`'s dict.
"""
from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import logging
import os
import pwd
import socket
import struct
import sys
import time

import psutil

from ..host import alive, own_folder, process_start
from .location import LOCK, SOCKET, STATE, arbiter_dir
from .providers import SlotProvider, provider
from .settings import SYSTEM_CONFIG, Settings
from .table import ArbiterError, SlotTable

WATCH_S = 0.5  # liveness and outside slots: a dead run's leases are free within a second
MAX_LINE = 1 << 20

log = logging.getLogger("elastic_jupyter.arbiter")


class Arbiter:
    """Serves one machine's slots from `folder`.

    Args:
        folder: where the socket, lock and state live (created; mode 0755 when `shared`).
        settings: the admin's settings.
        slots: the provider (default: the one the settings ask for).
        shared: whether other users may connect (the socket is then mode 0666; identities
            still come from the kernel).
    """

    def __init__(self, folder: str, settings: Settings, slots: SlotProvider | None = None,
                 shared: bool = False):
        self.folder, self.settings, self.shared = folder, settings, shared
        self.provider = slots or provider(settings)
        self._table: SlotTable | None = None  # loaded once the folder's lock is ours
        self._users: dict[int, str] = {}
        self._idle_since = time.monotonic()
        self._lock_fd: int | None = None

    @property
    def table(self) -> SlotTable:
        """The leases, loaded by :meth:`acquire`; RuntimeError before (nothing is served
        without the folder's lock)."""
        if self._table is None:
            raise RuntimeError(f"the arbiter of {self.folder} has not acquired its folder")
        return self._table

    # ------------------------------------------------------------------ process

    def acquire(self) -> bool:
        """Take the folder's lock (writing our pid into it) and load the state; False when
        another arbiter holds it. Raises OSError when the folder is not this user's own."""
        own_folder(self.folder, 0o755 if self.shared else 0o700)
        fd = os.open(os.path.join(self.folder, LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW,
                     0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        self._table = SlotTable(self.provider.slots(), os.path.join(self.folder, STATE),
                                cap=self.settings.cap, weights=self.settings.weights,
                                hold_s=self.settings.hold_s, idle_s=self.settings.idle_s,
                                alive=alive, by_value=self.settings.by_value,
                                lend_s=self.settings.lend_s)
        return True

    async def serve(self, linger_s: float | None = None) -> None:
        """Answer requests until cancelled, or until no run has been registered for
        `linger_s` seconds (an arbiter started on demand)."""
        path = os.path.join(self.folder, SOCKET)
        if os.path.exists(path):
            os.unlink(path)  # a dead arbiter's: we hold the lock
        server = await asyncio.start_unix_server(self._connection, path, limit=MAX_LINE)
        os.chmod(path, 0o666 if self.shared else 0o600)
        log.info("arbiter: %d %s slot(s), serving %s", len(self.table.slots),
                 self.provider.kind, path)
        async with server:
            while True:
                self._watch()
                if linger_s is not None and self._lingered(linger_s):
                    log.info("arbiter: no run for %.0f s, exiting", linger_s)
                    return
                await asyncio.sleep(WATCH_S)

    def _watch(self) -> None:
        try:
            self.table.reap()
            self.table.set_outside(self.provider.outside(self._placed()))
        except Exception as e:  # noqa: BLE001 -- nothing may end the machine's arbiter
            log.exception("arbiter: watching runs and slots failed: %s: %s",
                          type(e).__name__, e)

    def _placed(self) -> dict[int, set[int]]:
        """slot -> the processes that may use it: every process its holder's process started
        (an engine that opens the GPU before its run reports it is still the holder's own),
        and the engines it reports that are its user's, with theirs: a pool of another host
        asks through a relay (relay.py), which did not start the engines (a run cannot vouch
        for another user's process)."""
        placed: dict[int, set[int]] = {}
        started: dict[str, set[int]] = {}  # run -> its process's descendants
        for lease in self.table.leases.values():
            run = self.table.runs[lease.run]
            if run.id not in started:
                started[run.id] = _descendants(run.pid).union(*(
                    _own_with_descendants(int(pid), run.uid) for pid in run.engines.values()))
            placed[lease.slot] = started[run.id]
        return placed

    def _lingered(self, linger_s: float) -> bool:
        if self.table.runs:
            self._idle_since = time.monotonic()
        return time.monotonic() - self._idle_since > linger_s

    # ------------------------------------------------------------------ requests

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        pid, uid, _ = struct.unpack("3i", sock.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        try:
            while line := await reader.readline():
                writer.write(json.dumps(self.answer(pid, uid, line)).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass  # the client went away, or sent a line beyond MAX_LINE
        finally:
            writer.close()

    def answer(self, pid: int, uid: int, line: bytes) -> dict:
        """The reply to one request line from process `pid` of user `uid`."""
        try:
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ArbiterError("a request is a JSON object with an \"op\"")
            return {"ok": True, **(self.dispatch(pid, uid, request) or {})}
        except ArbiterError as e:
            return {"ok": False, "error": str(e), "code": getattr(e, "code", None)}
        except json.JSONDecodeError as e:
            return {"ok": False, "error": f"not JSON: {e}"}
        except Exception as e:  # noqa: BLE001 -- a request must never end the arbiter
            log.exception("arbiter: request %r failed", line[:200])
            return {"ok": False, "error": f"the arbiter failed on this request: "
                                          f"{type(e).__name__}: {e}"}

    def dispatch(self, pid: int, uid: int, request: dict) -> dict | None:
        op = request.pop("op", None)
        if op not in ARGUMENTS:
            raise ArbiterError(f"unknown op {op!r}: {', '.join(ARGUMENTS)}")
        _check_arguments(op, request)
        table = self.table
        if op == "register":
            start = _start_time(pid)
            return table.register(uid, self._user(uid), pid, start, **request)
        if op == "poll":
            return table.poll(uid, **request)
        if op == "release":
            return table.release(uid, **request)
        if op == "unregister":
            table.unregister(uid, **request)
            return None
        view = table.view()  # the one op left: "view"
        view["kind"] = self.provider.kind
        usage = self.provider.usage()
        for slot in view["slots"]:
            seen = usage.get(slot["slot"], {})
            if "util" in seen:
                slot["util"] = seen["util"]
            if "memory_mib" in seen:
                slot["memory_mib"] = seen["memory_mib"]
        return dict(view)

    def _user(self, uid: int) -> str:
        if uid not in self._users:
            try:
                self._users[uid] = pwd.getpwuid(uid).pw_name
            except KeyError:
                self._users[uid] = str(uid)
        return self._users[uid]


# op -> argument -> its type; "run" is required where it is listed, the rest optional
ARGUMENTS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "register": {"run": str, "name": str, "notebook": str, "min": int, "max": int,
                 "weight": (int, float), "auto": bool, "wanted": (int, type(None)),
                 "standby": int, "active": bool, "engines": dict, "lend": bool},
    "poll": {"run": str, "active": bool, "engines": dict, "speed": list},
    "release": {"run": str, "slots": list},
    "unregister": {"run": str},
    "view": {},
}


def _check_arguments(op: str, request: dict) -> None:
    """Only the arguments of `op`, of their types: a client cannot set anything else (the
    time, the user, the pid)."""
    kinds = ARGUMENTS[op]
    unknown = sorted(set(request) - set(kinds))
    if unknown:
        raise ArbiterError(f"{op} takes {', '.join(kinds) or 'no arguments'}; "
                           f"unknown: {', '.join(unknown)}")
    if kinds and "run" not in request:
        raise ArbiterError(f"{op} needs the run's id (\"run\")")
    for key, value in request.items():
        if not isinstance(value, kinds[key]) or (isinstance(value, bool)
                                                 and kinds[key] is not bool):
            raise ArbiterError(f"{op}: {key} has the wrong type ({type(value).__name__})")
    ints = request.get("slots", []) + [v for kv in request.get("engines", {}).items()
                                       for v in kv]
    if not all(_natural(v) for v in ints):
        raise ArbiterError(f"{op}: slots and engine pids are integers from 0 to {MAX_ID}")


MAX_ID = 1 << 22  # pid_max's limit on Linux


def _natural(v) -> bool:
    if isinstance(v, str) and v.isascii() and v.isdigit():
        v = int(v)
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_ID


def _start_time(pid: int) -> float:
    try:
        return process_start(pid)
    except psutil.Error:
        raise ArbiterError(f"process {pid} ended while registering") from None


def _descendants(pid: int) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except (psutil.Error, ValueError):
        return set()


def _own_with_descendants(pid: int, uid: int) -> set[int]:
    """`pid` and its descendants when it is a process of user `uid`, else nothing."""
    try:
        if psutil.Process(pid).uids().real != uid:
            return set()
    except (psutil.Error, ValueError):
        return set()
    return {pid} | _descendants(pid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elastic-jupyter-arbiter",
                                     description="The machine's slot arbiter.")
    parser.add_argument("--dir", help="folder for the socket, lock and state "
                        "(default: the one clients look in first)")
    parser.add_argument("--config", help=f"the admin's settings (default {SYSTEM_CONFIG})")
    parser.add_argument("--shared", action="store_true",
                        help="let every user of the machine connect (a system arbiter)")
    parser.add_argument("--linger", type=float, default=None,
                        help="exit after this many seconds without runs (default: never)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    settings = Settings.load(args.config)
    arbiter = Arbiter(args.dir or arbiter_dir(), settings, shared=args.shared)
    if not arbiter.acquire():
        log.info("arbiter: another arbiter serves %s", arbiter.folder)
        return 0
    try:
        asyncio.run(arbiter.serve(args.linger))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
