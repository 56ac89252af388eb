"""Checkpoints on disk: atomic files, a pointer to the latest complete one, the last N kept.

Layout of a checkpoint folder::

    step-00000040.pt      torch.save of the plain-data state (see engine.state.training_state)
    step-00000040.json    {"file", "step", "sha256", "bytes", "time"} of that file
    latest.json           the same record for the newest complete file
    history.jsonl         the run's per-step records, appended by each write (engine.state.history)

A file is written to a temporary name, fsynced, then renamed; its record and the pointer are
replaced the same way afterwards, so a crash at any point leaves the previous checkpoint
loadable. Loading checks the SHA-256 and falls back to the previous checkpoint when a file is
torn or corrupted. A state is checked before it is written (:func:`unloadable`), so every file
written here loads with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import IO, Any, cast

from ..protocol import TrainingState
from . import history
from .direct_io import DirectFile, open_for_writing

POINTER = "latest.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which file and why.

    ``reason`` is the why alone; ``detail`` the full underlying error when the message
    shortens it (torch's can run to a paragraph)."""

    def __init__(self, message: str, detail: str = "", reason: str = ""):
        super().__init__(message)
        self.detail, self.reason = detail, reason or message


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write, direct: bool = False) -> None:
    """Write `path` through ``write(file)`` to a temporary name, fsync, rename. `direct`: past
    the page cache (engine.state.direct_io), for a large file written once."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with (open_for_writing(tmp) if direct else open(tmp, "wb")) as f:
            write(f)
            if isinstance(f, DirectFile):
                f.finish()  # its tail: a flush cannot write a partial block
            else:
                f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(path))


def without_crc32():
    """A context in which torch.save skips the zip records' CRC32: torch.load never checks it
    and the record's SHA-256 covers the file, while computing it held the interpreter lock for
    about half of a 0.6 GB save, stalling the training thread. torch before 2.7 has no such
    setting: there the CRC stays."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        return contextlib.nullcontext()
    settings: Any = config  # torch adds patch() to the module when it loads: untyped
    return settings.patch({"save.compute_crc32": False})


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        # large reads: each chunk retakes the interpreter lock, which training holds often
        for chunk in iter(lambda: f.read(16 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class _Hashing:
    """A file that feeds what is written to it to `digest` too: the hash costs no second read
    of the file (torch.save writes its zip front to back, never seeking back). Each slice is
    hashed while the write has just brought it into the cache: memory bandwidth, not the
    cores, is what a background write takes from training."""

    SLICE = 1 << 20  # bytes: fits a core's L2 cache

    def __init__(self, file, digest):
        self._file, self._digest = file, digest

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        for start in range(0, len(data), self.SLICE):
            piece = data[start:start + self.SLICE]
            self._file.write(piece)
            self._digest.update(piece)
        return len(data)

    def flush(self) -> None:
        self._file.flush()


def save_hashed(path: str, obj) -> str:
    """``torch.save(obj)`` to `path` atomically (:func:`atomic_write`), past the page cache,
    hashed as it is written: returns its SHA-256 (no CRC32, no second read of the file).
    Raises OSError, RuntimeError."""
    import torch  # here, not at the top: the server lists checkpoints without torch
    digest = hashlib.sha256()
    with without_crc32():
        # torch.save needs only a file's write(): _Hashing is one
        atomic_write(path, lambda f: torch.save(obj, cast(IO[bytes], _Hashing(f, digest))),
                     direct=True)
    return digest.hexdigest()


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def write_checkpoint(folder: str, state: TrainingState, keep: int) -> dict:
    """Write `state` atomically as the checkpoint of ``state["progress"]["step"]``.

    Returns the pointer record ``{"file", "path", "step", "sha256", "bytes", "time"}``.
    Raises CheckpointError (disk full, permission) after removing the partial file, or before
    writing when the state holds a value the safe load would refuse (see :func:`unloadable`).
    """
    step = state["progress"]["step"]
    path = os.path.join(folder, checkpoint_name(step))
    problem = unloadable(_newest_record_only(state))
    if problem:  # a file nothing could load is not written: the previous one stays the latest
        raise CheckpointError(f"could not write checkpoint {path}: {problem}")
    try:
        # the records the folder's history file lacks, before the file that needs them lands
        history.append(folder, state.get("history") or [])
        sha256 = save_hashed(path, state)
        record = {"file": os.path.basename(path), "step": step, "sha256": sha256,
                  "bytes": os.path.getsize(path), "time": time.time()}
        data = json.dumps(record).encode()
        atomic_write(path[:-3] + ".json", lambda f: f.write(data))
        atomic_write(os.path.join(folder, POINTER), lambda f: f.write(data))
    except (OSError, RuntimeError) as e:
        # torch.save reports a full disk as its own RuntimeError; the OSError is its context
        cause: BaseException = e
        while not isinstance(cause, OSError) and cause.__context__ is not None:
            cause = cause.__context__
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)
        raise CheckpointError(f"could not write checkpoint {path}: {reason}") from e
    _prune(folder, keep)
    return dict(record, path=path)


def _prune(folder: str, keep: int) -> None:
    names = os.listdir(folder)
    files = sorted(f for f in names if f.startswith("step-") and f.endswith(".pt"))
    doomed = [f for old in files[:-keep] for f in (old, old[:-3] + ".json")]
    # records whose checkpoint is gone (a writer killed between the two deletions)
    doomed += [f for f in names if f.startswith("step-") and f.endswith(".json")
               and f[:-5] + ".pt" not in names]
    # temporary files of writers that died mid-write
    doomed += [f for f in names if ".tmp-" in f and not _pid_alive(f.rsplit("-", 1)[-1])]
    for name in doomed:
        try:
            os.unlink(os.path.join(folder, name))
        except OSError:
            pass


def _pid_alive(text: str) -> bool:
    try:
        os.kill(int(text), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def list_checkpoints(folder: str) -> list[dict]:
    """Checkpoint files in `folder`, oldest first: ``{"file", "path", "step", "bytes", "time"}``."""
    if not os.path.isdir(folder):
        return []
    out = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("step-") and name.endswith(".pt") and name[5:-3].isdigit():
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
            except OSError:  # pruned (--keep) while we list
                continue
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


def verify(path: str) -> str | None:
    """Why the file at `path` cannot be trusted (its record's size or SHA-256 differs), or None."""
    try:
        with open(path[:-3] + ".json") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None  # written before records existed: the load itself will tell
    if not os.path.exists(path):
        return "the file is missing"
    if os.path.getsize(path) != record["bytes"] or _sha256(path) != record["sha256"]:
        return "torn or corrupted (its SHA-256 differs from the one recorded when it was written)"
    return None


def load_latest(folder: str, log=None) -> tuple[str, TrainingState, list[str]]:
    """Load the newest checkpoint of `folder` that verifies and loads, newest first.

    Args:
        log: called with the full error of each file that fails to load (torch's messages run
            to a paragraph; the warnings and the error keep one short line per file).
    Returns (path, state, warnings): one line per newer file that was skipped, saying why
    (torn or corrupted, or holding a type the safe load refuses).
    Raises CheckpointError when none can be used, with one such line per file.
    """
    candidates = [c["path"] for c in reversed(list_checkpoints(folder))]
    pointed = latest_checkpoint(folder)
    if pointed in candidates:
        candidates.remove(pointed)
        candidates.insert(0, pointed)
    skipped: list[tuple[str, str]] = []  # (path, why)
    for path in candidates:
        problem = verify(path)
        if problem is None:
            try:
                return path, load_checkpoint(path), [f"skipped checkpoint {p}: {why}"
                                                     for p, why in skipped]
            except CheckpointError as e:
                problem = e.reason
                if log is not None:
                    log(f"cannot load checkpoint {path}: {e.detail}")
        skipped.append((path, problem))
    raise CheckpointError(f"no usable checkpoint in {folder}" +
                          "".join(f"\n  cannot load checkpoint {p}: {why}" for p, why in skipped))


def load_checkpoint(path: str) -> TrainingState:
    """Load a checkpoint with ``weights_only=True`` (a file that would run code is refused).

    Raises CheckpointError naming the file and the reason in one line (``reason``), with
    torch's full message as ``detail``.
    """
    try:
        import torch
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError, KeyError...
        reason = _why_unloadable(e)
        raise CheckpointError(f"cannot load checkpoint {path}: {reason}",
                              detail=f"{type(e).__name__}: {e}", reason=reason) from e


# ---------------------------------------------------------------- what the safe load refuses

_HINT = ("convert it to plain data where the cell creates it (a Python number or string, a "
         "list, tuple or dict of them, or a tensor), e.g. float(x), list(x) or torch.tensor(x)")


def unloadable(state) -> str | None:
    """Why ``torch.load(weights_only=True)`` would refuse `state`, or None when it loads.

    A real ``torch.save`` and safe load round trip in memory, with every plain tensor replaced
    by an empty one of its dtype (no copy of the model). The reason names the key path of the
    first refused value (``optimizer.param_groups[0].betas``), its type and what to change.
    """
    light = _stand_ins(state)
    if _round_trips(light):
        return None
    path, value = _first_refused(light, [])
    kind = type(value)
    return (f"{_key_path(path)} is a {kind.__module__}.{kind.__qualname__}, which the safe load "
            f"(torch.load(weights_only=True)) refuses: {_HINT}")


def _newest_record_only(state: TrainingState) -> TrainingState:
    """`state` with its history cut to the newest record: the records all come from the same
    code, and the safe load of a long history takes seconds."""
    history = state.get("history")
    if not isinstance(history, list):
        return state
    newest = state.copy()
    newest["history"] = history[-1:]
    return newest


def _stand_ins(obj):
    import torch
    if isinstance(obj, torch.Tensor):
        plain = type(obj) in (torch.Tensor, torch.nn.Parameter)
        if plain and obj.layout == torch.strided and not obj.is_quantized:
            return torch.empty(0, dtype=obj.dtype)
        return obj
    if type(obj) in (dict, OrderedDict, Counter):
        return type(obj)({k: _stand_ins(v) for k, v in obj.items()})
    if type(obj) in (list, tuple):
        return type(obj)(_stand_ins(v) for v in obj)
    return obj


def _round_trips(obj) -> bool:
    import torch
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:  # pickling errors, UnpicklingError: refused either way
        return False
    return True


def _first_refused(obj, path: list) -> tuple[list, object]:
    """(key path, value) of the innermost value in `obj` that does not round-trip; `obj` itself
    when none of its parts is refused alone (its own type, or one of its keys)."""
    parts: Iterable[tuple[Any, Any]] = ()
    if isinstance(obj, dict):
        parts = obj.items()
    elif isinstance(obj, (list, tuple, set)):
        parts = enumerate(obj)
    for key, value in parts:
        if not _round_trips(value):
            return _first_refused(value, path + [key])
    return path, obj


def _key_path(path: list) -> str:
    """``optimizer.param_groups[0].betas`` for ["optimizer", "param_groups", 0, "betas"]."""
    text = ""
    for key in path:
        if isinstance(key, str) and key.isidentifier():
            text += f".{key}" if text else key
        else:
            text += f"[{key!r}]"
    return text or "the state"


def _why_unloadable(error: Exception) -> str:
    """One short line for why ``torch.load(weights_only=True)`` failed: the file holds a type
    the safe load refuses, or it is torn or corrupted (its first line of error)."""
    text = str(error)
    refused = re.search(r"GLOBAL ([\w.]+)", text)
    if refused and "Weights only load failed" in text:
        return (f"it holds a type the safe load (weights_only) refuses: {refused.group(1)} "
                "(a value that is not plain data, not damage)")
    unpickler = re.search(r"WeightsUnpickler error: (.*)", text)  # e.g. an unknown opcode
    cause = unpickler.group(1) if unpickler else (text.strip().splitlines() or [""])[0]
    cause = cause.split(". ")[0][:120]
    return f"torn or corrupted ({type(error).__name__}{': ' + cause if cause else ''})"
