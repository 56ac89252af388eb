"""A run's checkpoint folder: created, probed and locked for the run's life, so two live runs
never write into one folder; a resume finds its checkpoint there.

Every failure is a :class:`UsageError` that says what to do.
"""
from __future__ import annotations

import fcntl
import json
import os
import time

from ..config import UsageError
from ..engine.state import checkpoint as ckpt
from ..engine.sharded import checkpoint_parts as sharded_checkpoint
from ..server.registry import kernel_id

LOCK_FILE = ".lock"


class FolderLock:
    """This process's exclusive hold on a checkpoint folder for a run's life, so two live runs
    never write into one folder (even two kernels starting the same name at the same moment).

    ``fcntl.flock`` on ``<folder>/.lock``, which records the holder (pid, kernel, notebook,
    run name, start time); the lock goes with :meth:`release` or with the process.

    Raises UsageError naming the holder when another run holds the folder.
    """

    def __init__(self, folder: str, name: str, notebook: str | None = None):
        self.path = os.path.join(folder, LOCK_FILE)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise UsageError(f"checkpoint folder {folder} is in use by {holder}: two live runs "
                             "cannot share a checkpoint folder; stop that run first, or choose "
                             "another --name (or --checkpoint-dir)") from None
        self._fd: int | None = fd
        me = {"pid": os.getpid(), "kernel": kernel_id(), "notebook": notebook, "name": name,
              "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)

    def release(self) -> None:
        """Let other runs use the folder (closing the file ends the lock); idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _read_holder(fd: int) -> str:
    """Who holds the lock, in words. The holder writes its record right after it took the
    lock, so a racing reader may find the file still empty for a moment."""
    for _ in range(40):
        try:
            h = json.loads(os.pread(fd, 4096, 0))
            break
        except ValueError:
            time.sleep(0.05)
    else:
        return "another process"
    where = ", ".join(filter(None, [f"process {h.get('pid')}",
                                    h.get("kernel") and f"kernel {h['kernel']}",
                                    h.get("notebook") and f"notebook {h['notebook']}"]))
    since = time.strftime("%H:%M:%S", time.localtime(h.get("since") or 0))
    return f"run {h.get('name')!r} ({where}) since {since}"


def prepare_checkpoint_dir(folder: str, log_dir: str, name: str, resume: bool,
                           notebook: str | None = None) -> tuple[str | None, FolderLock]:
    """Create, probe and lock `folder`; returns (the checkpoint to resume from or None, the
    lock, which the run holds until it ends).

    Raises UsageError: not writable, held by another live run, checkpoints present without
    `resume`, none with it.
    """
    try:
        os.makedirs(log_dir, exist_ok=True)
        probe = os.path.join(folder, f".write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"checkpoint folder {folder} is not writable ({e.strerror or e}); pass "
                         "--checkpoint-dir (checkpoint_dir=) with a writable folder") from None
    lock = FolderLock(folder, name, notebook)
    latest = ckpt.latest_checkpoint(folder) or sharded_checkpoint.latest(folder)
    if latest and not resume:
        lock.release()
        raise UsageError(f"run name {name!r} already has checkpoints in {folder}: pass --resume "
                         "(resume=True) to continue it, or choose another --name")
    if resume and not latest:
        lock.release()
        raise UsageError(f"--resume: no checkpoint of run {name!r} in {folder}")
    return latest, lock
