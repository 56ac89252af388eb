"""A sharded training state on disk: each rank writes its own part; any world size reads it.

A checkpoint of step S is the folder ``step-SSSSSSSS.shards/`` in the run's checkpoint folder:
``part-RRRRR.pt`` from each rank R of the W that wrote it (its rows of every parameter and
optimizer moment: engine.sharded.resizable_model's Snapshot), and ``manifest.pt``, which rank 0
writes last: the step, W, every parameter's shape, the parts' names and dtypes, the optimizer's
values that are the same on every rank (a step counter) and the buffers, a tied parameter's other
names, each file's bytes and SHA-256, and ``state``, the rest of the training state
(engine.state.training_state's capture without rows: progress, history, scheduler, random
generators, the run's options). The ranks write into ``step-SSSSSSSS.shards.G.tmp/`` (G: the
generation that writes it), each beside training (engine.sharded.part_writer), fsync each file and
leave a marker beside its part; rank 0, once every marker is there, writes the manifest and renames
the folder: a folder with its final name is complete, and one a crash left behind keeps its ``.tmp``
name (it is never read, and the next checkpoint removes it).

Everything in them is tensors, numbers, strings, lists and dicts: both load with
``torch.load(weights_only=True)``. A reader at another world size takes, for each of its new
rows, the overlapping rows of the parts that hold them: only those parts are opened (hashed
in full, then mapped with ``torch.load(mmap=True)``, so only the rows it takes are copied).
torch.distributed.checkpoint reads such layouts too, but loads its ``.metadata`` with
``pickle.load``, which would break the ``weights_only`` promise.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from typing import Iterator, cast

import torch

from ..protocol import TrainingState
from ..state.checkpoint import CheckpointError, _fsync_dir, _sha256, atomic_write, save_hashed
from .reshard import chunk_rows
from .resizable_model import Snapshot

FORMAT_VERSION = 1
MARKER_POLL_S = 0.05  # rank 0 looks for the other ranks' markers this often
# the least rank 0 waits for the other parts after its own (a peer's disk may be slower; a dead
# peer ends the wait sooner, through the generation's PeerFailure)
PART_TIMEOUT_S = 600.0
_ATTEMPT = re.compile(r"step-(\d+)\.shards\.(\d+)\.tmp")
SEP = "\t"  # joins a part's parameter name and optimizer key in a file (str keys only)


def folder_name(step: int) -> str:
    return f"step-{step:08d}.shards"


def _key(entry: tuple[str, str | None]) -> str:
    return f"{entry[0]}{SEP}{entry[1] or ''}"


def _entry(key: str) -> tuple[str, str | None]:
    name, _, opt = key.partition(SEP)
    return name, opt or None


def write_part(folder: str, step: int, attempt: int, part: Snapshot, rank: int,
               world_size: int) -> None:
    """One rank of the W that write step `step`'s checkpoint, in attempt `attempt` (the
    generation: a run that went back writes a step again under another): write this rank's
    `part` (host tensors, which nothing changes meanwhile) into the attempt's ``.tmp`` folder,
    then its marker, ``part-RRRRR.done`` (the file's bytes and SHA-256, or the error that
    stopped it), which :func:`commit` waits for. No collective: it runs beside training
    (engine.sharded.part_writer). Raises CheckpointError when the part was not written (after its
    marker said so, where the marker could be written)."""
    tmp = _attempt(folder, step, attempt)
    name = f"part-{rank:05d}.pt"
    body = {"format": FORMAT_VERSION, "step": step, "rank": rank, "world_size": world_size,
            "parts": {_key(e): t.detach().cpu() for e, t in part.parts.items()}}
    error: Exception | None = None
    try:
        os.makedirs(tmp, exist_ok=True)
        sha256 = save_hashed(os.path.join(tmp, name), body)
        mine = {"file": name, "bytes": os.path.getsize(os.path.join(tmp, name)),
                "sha256": sha256}
    except Exception as e:  # noqa: BLE001 -- rank 0 is told through the marker, then raised
        mine, error = {"file": name, "error": f"{type(e).__name__}: {e}"}, e
    try:
        atomic_write(os.path.join(tmp, f"part-{rank:05d}.done"),
                     lambda f: f.write(json.dumps(mine).encode()))
    except OSError as e:
        raise CheckpointError(f"checkpoint {step}: {name} not written: {e}") from e
    if error is not None:
        raise CheckpointError(f"checkpoint {step}: {name} not written: {mine['error']}") \
            from error


def commit(folder: str, step: int, attempt: int, world_size: int, part: Snapshot,
           shapes: dict[str, torch.Size], state: TrainingState | None,
           abort: threading.Event,
           timeout: float, aliases: dict[str, str] | None = None) -> str:
    """Rank 0, after its own :func:`write_part`: wait for every rank's marker, write the
    manifest (`part`: rank 0's, for its replicated values, buffers and names; `shapes`: each
    parameter's whole shape; `state`: the rest of the training state; `aliases`: a tied
    parameter's other names, engine.sharded.resizable_model's ``aliases``) and give the folder its
    final name; older attempts' leftovers go. Returns the checkpoint's path. Raises
    CheckpointError when a rank could not write its part, when a marker did not come within
    `timeout` seconds, or when `abort` is set (a peer failed: its part may never come)."""
    tmp, final = _attempt(folder, step, attempt), os.path.join(folder, folder_name(step))
    markers = [os.path.join(tmp, f"part-{r:05d}.done") for r in range(world_size)]
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(m) for m in markers):
        if abort.wait(MARKER_POLL_S):
            raise CheckpointError(f"checkpoint {step} not written: the generation ended first")
        if time.monotonic() > deadline:
            missing = [os.path.basename(m) for m in markers if not os.path.exists(m)]
            raise CheckpointError(f"checkpoint {step} not written: {missing[0]} did not come "
                                  f"within {timeout:.0f} s")
    files = []
    for m in markers:
        with open(m, "rb") as f:
            files.append(json.loads(f.read()))
    failed = [g for g in files if "error" in g]
    if failed:
        raise CheckpointError(f"checkpoint {step} not written: {failed[0]['file']}: "
                              f"{failed[0]['error']}")
    manifest = {"format": FORMAT_VERSION, "step": step, "world_size": world_size,
                "shapes": {n: list(shape) for n, shape in shapes.items()},
                "entries": [_key(e) for e in part.parts],
                "replicated": part.replicated,
                "buffers": {n: b.detach().cpu() for n, b in part.buffers.items()},
                "dtypes": [str(t.dtype).removeprefix("torch.") for t in part.parts.values()],
                "files": files, "state": state, "aliases": dict(aliases or {})}
    try:
        atomic_write(os.path.join(tmp, "manifest.pt"), lambda f: torch.save(manifest, f))
        for m in markers:
            os.unlink(m)
        if os.path.isdir(final):  # this step written before (a run that went back to an
            os.replace(final, final + ".old")  # older checkpoint): ours replaces it
        os.replace(tmp, final)
        _fsync_dir(folder)
    except OSError as e:
        raise CheckpointError(f"checkpoint {step} not written: {e}") from e
    shutil.rmtree(final + ".old", ignore_errors=True)
    for name in os.listdir(folder):  # attempts a fault cut short
        older = _ATTEMPT.fullmatch(name)
        if older and int(older[1]) <= step:  # (a rank may be writing a newer step already)
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    return final


def _attempt(folder: str, step: int, attempt: int) -> str:
    return os.path.join(folder, f"{folder_name(step)}.{attempt}.tmp")


class _Reader:
    """The checkpoint folder `path`, read for rows: its manifest, and each part opened when
    first needed (hashed in full, then mapped: only the rows taken are copied). Raises
    CheckpointError naming the file when one is missing, damaged or of another format."""

    def __init__(self, path: str):
        self.path = path
        self.manifest = _load(os.path.join(path, "manifest.pt"))
        self.entries = [_entry(k) for k in self.manifest["entries"]]
        self._opened: dict[int, dict] = {}

    def _part(self, old_rank: int) -> dict:
        if old_rank not in self._opened:
            listed = self.manifest["files"][old_rank]
            file = os.path.join(self.path, listed["file"])
            if not os.path.exists(file) or _sha256(file) != listed["sha256"]:
                raise CheckpointError(f"{file} is missing or damaged (its SHA-256 differs "
                                      "from the manifest's)")
            self._opened[old_rank] = _load(file, mmap=True)
        return self._opened[old_rank]

    def open_all(self) -> None:
        """Open every part now (a reader of the whole model needs them all)."""
        for old_rank in range(self.manifest["world_size"]):
            self._part(old_rank)

    def rows(self, entry: tuple[str, str | None], dtype: str, rank: int, world_size: int,
             copy: bool = True) -> torch.Tensor:
        """`entry`'s rows that `rank` holds at `world_size`: a new tensor, or without `copy`
        a view of a mapped part where one part holds them all."""
        shape = self.manifest["shapes"][entry[0]]
        old_size = self.manifest["world_size"]
        start, end = chunk_rows(shape[0], world_size, rank)
        pieces = []
        for old_rank in range(old_size):
            a, b = chunk_rows(shape[0], old_size, old_rank)
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                pieces.append(self._part(old_rank)["parts"][_key(entry)][lo - a:hi - a])
        if len(pieces) == 1 and not copy:
            return pieces[0]
        return torch.cat(pieces) if pieces else torch.empty(
            (0, *shape[1:]), dtype=getattr(torch, dtype))


def read_rows(path: str, rank: int, world_size: int) -> tuple[dict, dict, dict]:
    """This rank's rows at world size `world_size` from the checkpoint folder `path`: (parts,
    {(name, None or key): rows}; the optimizer's replicated values; the buffers). Only the
    parts that hold its rows are read (and their hashes checked). Raises CheckpointError
    naming the file when one is missing, damaged or of another format."""
    reader = _Reader(path)
    out = {entry: reader.rows(entry, dtype, rank, world_size)
           for entry, dtype in zip(reader.entries, reader.manifest["dtypes"])}
    return out, reader.manifest["replicated"], reader.manifest["buffers"]


def stamp(path: str) -> tuple[int, int, int] | None:
    """The identity of the checkpoint folder `path`'s manifest (device, inode, mtime): another
    once the folder was replaced; None once it is gone."""
    try:
        st = os.stat(os.path.join(path, "manifest.pt"))
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns


def read_state(path: str) -> TrainingState | None:
    """The rest of the training state the checkpoint folder `path` holds (its manifest's).
    Raises CheckpointError when the manifest is missing or damaged."""
    return _load(os.path.join(path, "manifest.pt"))["state"]


def model_layout(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype] | str]:
    """{key: (shape, dtype)} of the model's state dict that the checkpoint folder `path` holds
    (its trained parameters whole, then its buffers), and {key: key} for a tied parameter's
    other names (the tensor they name); read from the manifest alone. Raises
    CheckpointError."""
    manifest = _load(os.path.join(path, "manifest.pt"))
    out: dict[str, tuple[tuple[int, ...], torch.dtype] | str] = {}
    for key, dtype in zip(manifest["entries"], manifest["dtypes"]):
        name, opt = _entry(key)
        if opt is None:
            out[name] = (tuple(manifest["shapes"][name]), getattr(torch, dtype))
    out.update({n: (tuple(b.shape), b.dtype) for n, b in manifest["buffers"].items()})
    out.update(manifest.get("aliases", {}))
    return out


def read_model(path: str, copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state dict that the checkpoint folder `path` holds, one tensor at a time:
    each trained parameter whole (its rows gathered from the parts that hold them; without
    `copy`, a view of a mapped part where one holds them all), then the buffers; in
    :func:`model_layout`'s order. No more than one parameter is in memory at once unless
    the caller keeps them. Every part is opened (hashed, mapped) before the first tensor: a
    prune meanwhile cannot cut the model short. Raises CheckpointError."""
    reader = _Reader(path)
    reader.open_all()
    for entry, dtype in zip(reader.entries, reader.manifest["dtypes"]):
        if entry[1] is None:
            yield entry[0], reader.rows(entry, dtype, 0, 1, copy)
    yield from reader.manifest["buffers"].items()


def load_whole(path: str) -> TrainingState:
    """The checkpoint folder `path` as a replicated state reads: the rest of the training
    state with ``"model"``, every parameter whole under each of its names and the buffers
    (the whole model in memory: :func:`read_model` gives it one tensor at a time). The
    optimizer's moments stay in the parts. Raises CheckpointError."""
    manifest = _load(os.path.join(path, "manifest.pt"))
    model = dict(read_model(path))
    model.update({alias: model[name] for alias, name in manifest.get("aliases", {}).items()})
    return cast(TrainingState, {**(manifest["state"] or {}), "model": model})


def prune(folder: str, keep: int) -> None:
    """Remove all but the newest `keep` complete sharded checkpoints in `folder`."""
    done = sorted(d for d in os.listdir(folder) if d.endswith(".shards"))
    for name in done[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def folder_bytes(path: str) -> int:
    """The bytes of the files in checkpoint folder `path`."""
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def list_parts(folder: str) -> list[dict]:
    """Complete sharded checkpoints in `folder`, oldest first, as engine.state.checkpoint's
    ``list_checkpoints`` lists files: ``{"file", "path", "step", "bytes", "time"}``."""
    out = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.startswith("step-") and name.endswith(".shards") and name[5:-7].isdigit():
            path = os.path.join(folder, name)
            try:
                files = [os.stat(os.path.join(path, f)) for f in os.listdir(path)]
            except OSError:  # pruned while we list
                continue
            out.append({"file": name, "path": path, "step": int(name[5:-7]),
                        "bytes": sum(st.st_size for st in files),
                        "time": max((st.st_mtime for st in files), default=0.0)})
    return out


def usable_latest(folder: str) -> tuple[str | None, list[str]]:
    """The newest complete sharded checkpoint in `folder` whose manifest reads and whose
    parts' SHA-256 match it (every part read once), newest first: (its path or None, one
    line per newer one skipped, saying why), as engine.state.checkpoint's ``load_latest`` does for
    replicated files."""
    skipped = []
    for listed in reversed(list_parts(folder)):
        path = listed["path"]
        try:
            manifest = _load(os.path.join(path, "manifest.pt"))
            for file in manifest["files"]:
                where = os.path.join(path, file["file"])
                if not os.path.exists(where) or _sha256(where) != file["sha256"]:
                    raise CheckpointError(f"{file['file']} is missing or damaged (its SHA-256 "
                                          "differs from the manifest's)")
        except CheckpointError as e:
            skipped.append(f"skipped checkpoint {path}: {e}")
            continue
        return path, skipped
    return None, skipped


def latest(folder: str) -> str | None:
    """The newest complete sharded checkpoint in `folder` (its path), or None."""
    done = sorted(d for d in os.listdir(folder) if d.endswith(".shards")) \
        if os.path.isdir(folder) else []
    return os.path.join(folder, done[-1]) if done else None


def _load(file: str, mmap: bool = False) -> dict:
    try:
        loaded = torch.load(file, weights_only=True, mmap=mmap)
    except (OSError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"{file} cannot be read: {e}") from e
    if not isinstance(loaded, dict) or loaded.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{file} is not a sharded checkpoint of format {FORMAT_VERSION}")
    return loaded
