"""This host's processes and private folders, checked one way by every part that needs them
(the run registry, the slot arbiter and its clients)."""
from __future__ import annotations

import os
import stat

import psutil


def alive(pid: int, start_time: float) -> bool:
    """Whether the process `pid` that started at `start_time` (s since the epoch) still runs:
    a reused pid has another start time, and a zombie has ended."""
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - start_time) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
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
