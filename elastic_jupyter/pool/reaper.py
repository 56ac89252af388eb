"""Reaper: ends a pool's controller and engines when the process that owns them dies.

A graceful kernel shutdown stops the pool itself (atexit), but a kernel killed by SIGKILL or the
out-of-memory killer runs no code, and its ipyparallel processes would linger as orphans holding
memory and GPUs. Each pool starts one small reaper process in its own session; it watches the
owner (pid and start time, so a reused pid is not mistaken for it) and, once the owner is gone,
kills every process listed in the pool's pid file and cancels its engines' batch jobs (Slurm). A
pool that stops normally deletes the file, and the reaper exits.

    python -m elastic_jupyter.pool.reaper OWNER_PID OWNER_START_TIME PIDFILE

The packages it imports on the way (``elastic_jupyter``, ``elastic_jupyter.pool``) load nothing
heavy: torch would cost the reaper seconds of CPU and hundreds of MB for nothing.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Sequence

import psutil

from ..host import alive, process_start

POLL = 0.5  # seconds


def _kill_listed(pidfile: str) -> None:
    try:
        with open(pidfile) as f:
            listed = json.load(f)
    except (OSError, ValueError):
        return
    if listed["jobs"]:
        try:
            subprocess.run(["scancel", *listed["jobs"]], timeout=60,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            pass
    for pid, start_time in listed["pids"]:
        try:
            proc = psutil.Process(pid)
            if process_start(pid) == start_time:
                # the controller runs its schedulers as child processes
                for child in proc.children(recursive=True) + [proc]:
                    try:
                        child.kill()
                    except psutil.Error:
                        pass
        except (psutil.Error, OSError):
            pass
    os.unlink(pidfile)


def main(owner_pid: int, owner_start: float, pidfile: str) -> None:
    while os.path.exists(pidfile):
        if not alive(owner_pid, owner_start):
            _kill_listed(pidfile)
            return
        time.sleep(POLL)


def write_pidfile(pidfile: str, pids: list[int], jobs: Sequence[str] = ()) -> None:
    """Record the processes the reaper must end (with their start times) and the Slurm jobs it
    must cancel, atomically."""
    listed = []
    for pid in pids:
        try:
            listed.append((pid, process_start(pid)))
        except (psutil.Error, OSError):
            pass
    tmp = f"{pidfile}.tmp"
    with open(tmp, "w") as f:
        json.dump({"pids": listed, "jobs": list(jobs)}, f)
    os.replace(tmp, pidfile)


def start_reaper(pidfile: str) -> subprocess.Popen:
    """Start the reaper for this process; it outlives us (own session, no pipes)."""
    me = psutil.Process()
    # -m finds this package where this process found it (a source checkout on sys.path, not
    # installed, included): its parent folder goes first on the reaper's path
    parent = str(pathlib.Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (parent, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.Popen(
        [sys.executable, "-m", __name__, str(me.pid), repr(process_start(me.pid)),
         pidfile], start_new_session=True, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


class Reaper:
    """A pool's reaper process and the pid file it reads; the only writer of both (owner
    loop). ``pidfile`` is None until :meth:`start` and after :meth:`close`."""

    def __init__(self) -> None:
        self.pidfile: str | None = None
        self._process: subprocess.Popen | None = None

    def start(self, pidfile: str, pids: list[int]) -> None:
        """List `pids` in `pidfile`, then start the reaper that reads it."""
        self.pidfile = pidfile
        self.list(pids)
        self._process = start_reaper(pidfile)

    def list(self, pids: list[int], jobs: Sequence[str] = ()) -> None:
        """What the reaper must end should this process die now (write_pidfile)."""
        if self.pidfile is not None:
            write_pidfile(self.pidfile, pids, jobs)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def close(self) -> None:
        """Delete the pid file (a reaper still running exits) and end the reaper."""
        if self.pidfile is not None and os.path.exists(self.pidfile):
            os.unlink(self.pidfile)
        self.pidfile = None
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
        self._process = None  # Popen reaps it: no zombie is left behind


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3])
