"""Checkpoints on disk: atomic files, a pointer to the latest complete one, the last N kept.

Layout of a checkpoint folder::

    step-00000040.pt      torch.save of the plain-data state (see engine.state)
    latest.json           {"file", "step", "sha256", "bytes", "time"} of the newest complete file

A file is written to a temporary name, fsynced, then renamed; the pointer is replaced the same
way afterwards, so a crash at any point leaves the previous checkpoint loadable.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import time

import torch

POINTER = "latest.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which file and why."""


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: str, write) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(path))


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def write_checkpoint(folder: str, state: dict, keep: int) -> dict:
    """Write `state` atomically as the checkpoint of ``state["progress"]["step"]``.

    Returns the pointer record ``{"file", "path", "step", "sha256", "bytes", "time"}``.
    Raises CheckpointError (disk full, permission) after removing the partial file.
    """
    step = state["progress"]["step"]
    path = os.path.join(folder, checkpoint_name(step))
    try:
        _atomic_write(path, lambda f: torch.save(state, f))
        record = {"file": os.path.basename(path), "step": step, "sha256": _sha256(path),
                  "bytes": os.path.getsize(path), "time": time.time()}
        _atomic_write(os.path.join(folder, POINTER), lambda f: f.write(json.dumps(record).encode()))
    except OSError as e:
        raise CheckpointError(f"could not write checkpoint {path}: {e.strerror or e}") from e
    _prune(folder, keep)
    return dict(record, path=path)


def _prune(folder: str, keep: int) -> None:
    files = sorted(f for f in os.listdir(folder) if f.startswith("step-") and f.endswith(".pt"))
    for old in files[:-keep] if keep > 0 else []:
        try:
            os.unlink(os.path.join(folder, old))
        except OSError:
            pass


def list_checkpoints(folder: str) -> list[dict]:
    """Checkpoint files in `folder`, oldest first: ``{"file", "path", "step", "bytes", "time"}``."""
    if not os.path.isdir(folder):
        return []
    out = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("step-") and name.endswith(".pt"):
            path = os.path.join(folder, name)
            st = os.stat(path)
            out.append({"file": name, "path": path, "step": int(name[5:-3]),
                        "bytes": st.st_size, "time": st.st_mtime})
    return out


def latest_checkpoint(folder: str) -> str | None:
    """Path of the newest complete checkpoint (the pointer's), or None if there is none."""
    try:
        with open(os.path.join(folder, POINTER)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        files = list_checkpoints(folder)
        return files[-1]["path"] if files else None
    return os.path.join(folder, record["file"])


def load_checkpoint(path: str) -> dict:
    """Load a checkpoint with ``weights_only=True`` (a file that would run code is refused).

    Raises CheckpointError naming the file and the reason.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError...
        raise CheckpointError(f"cannot load checkpoint {path}: {e}") from e


class CheckpointWriter:
    """Writes checkpoints on a background thread so training does not wait for the disk.

    ``submit`` takes a state already copied off the model (engine.state.capture); ``drain``
    waits for pending writes and returns their outcomes as event dicts.
    """

    def __init__(self, folder: str, keep: int, before_write=None):
        self.folder, self.keep, self._before_write = folder, keep, before_write
        self._queue: queue.Queue = queue.Queue()
        self._done: list[dict] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, state: dict) -> None:
        self._queue.put((state, time.time()))

    def _loop(self) -> None:
        while True:
            state, queued = self._queue.get()
            step = state["progress"]["step"]
            try:
                if self._before_write is not None:
                    self._before_write()
                record = write_checkpoint(self.folder, state, self.keep)
                event = {"kind": "checkpoint", "step": step, "path": record["path"],
                         "bytes": record["bytes"], "seconds": time.time() - queued}
            except Exception as e:
                event = {"kind": "checkpoint_failed", "step": step, "message": str(e)}
            with self._lock:
                self._done.append(event)
            self._queue.task_done()

    def take_events(self) -> list[dict]:
        """Outcomes finished since the last call (does not wait)."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def drain(self) -> list[dict]:
        """Wait for every submitted write, then return the outcomes not yet taken."""
        self._queue.join()
        return self.take_events()
