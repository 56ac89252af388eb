"""Engine processes: what an engine is, whether it runs, and ending processes with psutil.

The pool signals only processes of this user on this host (``Engine.local``); another host's
engine ends with its job or when the controller asks it to exit. Every helper here tolerates a
process that exits at any moment (psutil raises for a gone process: it counts as ended).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable

import psutil

log = logging.getLogger(__name__)


@dataclass
class Engine:
    """One engine process bound to one slot.

    Attributes:
        slot: slot number (with GPUs, the index into the pool's GPU list); None for a warm
            engine, set up on no slot until its run grows (run/warm_engines.py).
        device: "cpu" or "cuda:<physical GPU id>".
        engine_id: ipyparallel engine id; set_id: its engine set.
        pid: process id on `host`; started: wall time (s since the epoch) it registered.
        host: the host it runs on; local: whether it is this user's process on this host
            (the pool signals it itself; other engines end with their job).
        job_id: the scheduler's job that runs it (a Slurm job id; "" elsewhere).
    """

    slot: int | None
    device: str
    engine_id: int
    set_id: str
    pid: int
    started: float
    host: str = ""
    local: bool = True
    job_id: str = ""


def alive(engine: Engine) -> bool:
    """Whether `engine`'s process runs. Another host's engine counts as alive: its death
    reaches us as ipyparallel's ``EngineError`` (its nanny tells the controller)."""
    if not engine.local:
        return True
    try:
        return psutil.Process(engine.pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def rss(pid: int) -> int:
    """Resident memory of this host's process `pid` in bytes (0 when it is gone)."""
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


def kill(engine: Engine) -> None:
    """SIGKILL a lost or hung engine: also closes its sockets, so peers blocked in a collective
    with it fail now instead of at the group timeout. Another host's engine ends with its
    job when the pool removes it."""
    if not engine.local:
        return
    try:
        os.kill(engine.pid, signal.SIGKILL)
    except OSError:
        pass


def processes(pids: list[int]) -> list[psutil.Process]:
    """The processes of `pids` that still exist."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    return procs


def children(proc: psutil.Process) -> list[psutil.Process]:
    """Everything `proc` started, recursively ([] once it exited)."""
    try:
        return proc.children(recursive=True)
    except psutil.Error:  # it exited meanwhile
        return []


def with_descendants(pids: list[int]) -> list[psutil.Process]:
    """The processes and everything they started (an engine's nanny, the controller's
    schedulers)."""
    return [q for p in processes(pids) for q in [p] + children(p)]


def running(proc: psutil.Process) -> bool:
    """Whether `proc` still runs (a zombie has ended)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # it exited between the two checks
        return False


def signal_all(procs: list[psutil.Process], send: Callable[[psutil.Process], None]) -> None:
    """``send(p)`` for each process (``psutil.Process.kill`` or ``.terminate``); gone ones are
    skipped."""
    for p in procs:
        try:
            send(p)
        except psutil.Error:  # already gone
            pass


async def terminate(procs: list[psutil.Process], grace: float = 5.0) -> None:
    """SIGTERM the processes, SIGKILL those still alive after `grace` seconds, and return once
    all are gone (at most a second after the SIGKILL). Never blocks the event loop; a process
    may exit at any moment in between."""
    signal_all(procs, psutil.Process.terminate)
    deadline, killed = time.monotonic() + grace, False
    while procs := [p for p in procs if running(p)]:
        if time.monotonic() > deadline:
            if killed:
                log.warning("elastic_jupyter: process(es) %s survived SIGKILL",
                            ", ".join(str(p.pid) for p in procs))
                return
            signal_all(procs, psutil.Process.kill)
            deadline, killed = time.monotonic() + 1.0, True
        await asyncio.sleep(0.02)
