"""Talking to the machine's arbiter: starting it on demand, one call per request.

Which arbiter, and where, is :mod:`.location`'s. Only in a private folder of this user does a
client start an arbiter; a shared one that does not answer is the admin's to restart, and the
client says so.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import cast

# arbiter_dir and arbiter_configured: their public home before location.py, kept importable
from .location import SOCKET, arbiter_configured, arbiter_dir, locate  # noqa: F401
from .machine_view import MachineView
from .table import ArbiterError, UnknownRun

START_TIMEOUT = 15.0  # seconds for an arbiter started on demand to answer (a Python start)
LINGER_S = 600.0  # an arbiter started on demand exits after this long without runs


def answer_of(reply: dict, where: str = "") -> dict:
    """An arbiter's reply without its ``ok``; raises what it refused with (UnknownRun when
    it does not know the run, else ArbiterError), its message after `where`."""
    if not reply.pop("ok", False):
        error = UnknownRun if reply.get("code") == UnknownRun.code else ArbiterError
        raise error(where + reply.get("error", "the arbiter refused the request"))
    return reply


class ArbiterClient:
    """Requests to the arbiter in `folder` (default :func:`.location.arbiter_dir`).

    Each call opens a connection, sends one request and reads one reply, so an arbiter that
    restarts between calls loses nothing. When nothing answers and the folder is this user's
    private one (`folder` None, and no shared arbiter found), an arbiter is started (in its own session, so it outlives the kernel; it exits after
    ``LINGER_S`` without runs).

    Raises:
        ArbiterError: the arbiter refused the request (its message says why), or no arbiter
            answered within ``timeout`` seconds.
    """

    def __init__(self, folder: str | None = None, timeout: float = START_TIMEOUT):
        if folder is None:
            self.folder, self.startable = locate()
        else:  # a folder named by the caller is served by whoever chose it
            self.folder, self.startable = folder, False
        self.timeout = timeout
        self._started = False

    def call(self, op: str, **arguments) -> dict:
        """Send one request; returns the reply (without ``ok``)."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                reply = self._send({"op": op, **arguments})
                break
            except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError,
                    BrokenPipeError, socket.timeout) as e:
                if time.monotonic() > deadline:
                    raise ArbiterError(self._unreachable(e)) from None
                if self.startable and not self._started:
                    self._start()
                time.sleep(0.05)
            except (OSError, ValueError) as e:  # a socket we may not use, a garbled reply
                raise ArbiterError(f"the slot arbiter at {self.folder} cannot be asked: "
                                   f"{type(e).__name__}: {e}") from None
        self._started = False  # it answers: should it die, the next call starts another
        return answer_of(reply)

    def register(self, run: str, **demand) -> dict:
        return self.call("register", run=run, **demand)

    def poll(self, run: str, active: bool = True, engines: dict | None = None,
             speed: list | None = None) -> dict:
        extra = {} if speed is None else {"speed": [list(pair) for pair in speed]}
        return self.call("poll", run=run, active=active,
                         engines={str(k): v for k, v in (engines or {}).items()}, **extra)

    def release(self, run: str, slots: list[int]) -> dict:
        return self.call("release", run=run, slots=list(slots))

    def unregister(self, run: str) -> None:
        self.call("unregister", run=run)

    def view(self) -> MachineView:
        """The machine as the arbiter sees it (machine_view.MachineView)."""
        return cast(MachineView, self.call("view"))

    def _send(self, request: dict) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5.0)
            sock.connect(os.path.join(self.folder, SOCKET))
            sock.sendall(json.dumps(request).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(1 << 16)
                if not chunk:
                    raise ConnectionResetError("the arbiter closed the connection")
                data += chunk
        return json.loads(data)

    def _start(self) -> None:
        with open(os.path.join(self.folder, "arbiter.log"), "ab") as log:
            subprocess.Popen([sys.executable, "-m", "elastic_jupyter.arbiter", "--dir",
                              self.folder, "--linger", str(LINGER_S)],
                             start_new_session=True, stdin=subprocess.DEVNULL, stdout=log,
                             stderr=log, cwd="/")
        self._started = True

    def _unreachable(self, error: Exception) -> str:
        where = os.path.join(self.folder, SOCKET)
        if self.startable:
            return (f"the slot arbiter at {where} did not answer within {self.timeout:.0f} s "
                    f"({type(error).__name__}); its log is {self.folder}/arbiter.log")
        return (f"the machine's slot arbiter at {where} does not answer ({type(error).__name__}):"
                " ask the machine's admin to start it (docs/arbiter.md)")
