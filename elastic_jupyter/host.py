"""This host's processes and private folders, checked one way by every part that needs them
(the run registry, the pools' folders, the slot arbiter and its clients)."""
from __future__ import annotations

import os
import stat

import psutil


def process_start(pid: int) -> float:
    """When process `pid` started, as a stamp that tells it from a later process with its pid:
    on Linux its start after boot in clock ticks (``/proc/<pid>/stat``, field 22), which no
    clock adjustment moves; elsewhere psutil's ``create_time`` (s since the epoch). Not
    ``create_time`` on Linux: it adds the boot time that /proc/stat derives from the adjusted
    wall clock, in whole seconds, so it moves by a second as the clock is slewed, and a live
    kernel would read as gone. Raises psutil.NoSuchProcess when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            raise psutil.NoSuchProcess(pid) from None
        return psutil.Process(pid).create_time()
    # the command name (field 2) may hold spaces and parentheses: count from the last ")"
    return float(stat_line[stat_line.rindex(b")") + 2:].split()[19])


def alive(pid: int, start: float) -> bool:
    """Whether the process `pid` whose :func:`process_start` was `start` still runs: a reused
    pid has another start, and a zombie has ended."""
    try:
        return process_start(pid) == start and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, OSError):
        return False


def own_folder(path: str, mode: int = 0o700) -> str:
    """`path` as a folder of this user with `mode` (created if missing); refused with OSError
    when it is a link or another user's (a shared /tmp must not let anyone else plant our
    sockets or state). Returns `path`."""
    os.makedirs(path, mode=mode, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise OSError(f"{path} is not a folder of this user")
    os.chmod(path, mode)
    return path


def runtime_folder() -> str:
    """This user's folder in Jupyter's runtime dir, ``<runtime dir>/elastic-jupyter/`` (mode
    0700, created if missing): runs' discovery entries and control sockets, pools' private
    folders and pid files."""
    from jupyter_core.paths import jupyter_runtime_dir
    path = os.path.join(jupyter_runtime_dir(), "elastic-jupyter")
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path
