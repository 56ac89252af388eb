"""A run's results: its checkpoint files, its state (final, or the newest checkpoint's), the
trained weights as a plain ``state_dict`` and its logs.

Read by the run handle (``run.checkpoints``, ``state_dict()``, ``training_state()``,
``load_into()``, ``export()``, ``logs()``) from any thread; nothing here writes the run.
"""
from __future__ import annotations

import os
import time
from typing import Any, cast

from ..config import UsageError
from ..engine.state import checkpoint as ckpt
from ..engine.sharded import checkpoint_parts as sharded_checkpoint
from ..engine.state.frozen import digest
from ..engine.state.history import whole_history
from ..engine.protocol import TrainingState
from . import streamed_export
from .final_state import FinalState
from .runlog import RunLog

# a folder unchanged for this long keeps its mtime until its next change: far above the file
# systems' timestamp granularity (a clock tick), short beside the time between checkpoints
LISTING_SETTLED_NS = 1_000_000_000

# the submodule torch.compile's OptimizedModule wraps: its name is in every key of a compiled
# model's (or compiled submodule's) state dict
_COMPILED = "_orig_mod"


class RunResults:
    """The results of run `name`, whose checkpoints are in `checkpoint_dir` and logs in
    `log_dir`; `final` holds its final state once it ended, `log` its history."""

    def __init__(self, name: str, checkpoint_dir: str, log_dir: str, log: RunLog,
                 final: FinalState):
        self.name, self.checkpoint_dir, self.log_dir = name, checkpoint_dir, log_dir
        self.log, self.final = log, final
        self._listing: tuple[int, list] | None = None  # the checkpoints, by the folder's mtime

    def checkpoints(self) -> list[dict]:
        """Checkpoint files, oldest first: file, path, step, bytes, time.

        Views ask several times a second: the listing is read again only when the folder's
        mtime changed (adding, pruning or renaming a file changes it). A change within the
        file system's timestamp granularity of the listing may leave the mtime as it was, so
        a listing is kept only once its folder has been quiet for LISTING_SETTLED_NS.
        """
        try:
            stamp = os.stat(self.checkpoint_dir).st_mtime_ns
        except OSError:  # not created yet
            return []
        cached = self._listing  # (stamp, list), one attribute: read by views' threads too
        if cached is not None and cached[0] == stamp:
            return list(cached[1])
        listing = self.final.listing()
        if time.time_ns() - stamp > LISTING_SETTLED_NS:
            self._listing = (stamp, listing)
        return list(listing)

    def state_dict(self, part: str = "model") -> dict:
        """`part`'s state dict, plain-keyed (see TrainingRun.state_dict). Raises UsageError."""
        state = self._state()[1]
        if part == "model":
            return plain_keys(state["model"])
        extra = state.get("extra") or {}
        if part not in extra:
            raise UsageError(f"run {self.name!r} has no part {part!r}: its parts are "
                             f"{', '.join(['model', *extra])} (the cell's extra_state names "
                             "the others)")
        keyed = isinstance(extra[part], dict) and all(isinstance(k, str) for k in extra[part])
        return plain_keys(extra[part]) if keyed else extra[part]

    def training_state(self) -> dict:
        """The full training state with the whole run's history (see TrainingRun)."""
        folder, state = self._state()
        history = self.log.history() if folder is None else whole_history(folder, state)
        return dict(state, history=history)

    def _state(self) -> tuple[str | None, TrainingState]:
        """(None, the final state) once the run ended, else (its folder, the newest
        checkpoint's state); a sharded run's model is read whole from its folder. Raises
        UsageError when there is neither."""
        folder = self._sharded_folder()
        if folder is not None:
            return None, self._read(sharded_checkpoint.load_whole, folder)
        if self.final.state is not None:
            return None, self.final.state
        try:
            path, state, _ = ckpt.load_latest(self.checkpoint_dir)
        except ckpt.CheckpointError as e:
            raise UsageError(f"run {self.name!r} has no state in memory and {e}") from None
        return os.path.dirname(path), state

    def _sharded_folder(self) -> str | None:
        """The checkpoint folder the model is read from one tensor at a time (a sharded
        run's), or None (final_state.FinalState.model_folder). Raises UsageError."""
        return self.final.model_folder(self.name)

    def load_into(self, model: Any, part: str = "model") -> Any:
        """Copy `part`'s weights into the torch.nn.Module `model`; returns it. The run's frozen
        weights (engine.state.frozen: not in its state) are `model`'s own, checked against their
        digests. A sharded run's are read and copied one tensor at a time. Raises UsageError
        when they differ, or when `model` lacks a trained tensor, has other ones or one of
        another shape (nothing is loaded then)."""
        folder = self._sharded_folder() if part == "model" else None
        own = {_plain_key(key): key for key in model.state_dict()}
        if folder is None:
            weights = self.state_dict(part)
            shapes = {own.get(k, k): getattr(v, "shape", None) for k, v in weights.items()}
            state = self._state()[1]
        else:
            layout = self._read(sharded_checkpoint.model_layout, folder)
            shapes = {own.get(k, k): layout[v][0] if isinstance(v, str) else v[0]
                      for k, v in layout.items()}
            rest = self._read(sharded_checkpoint.read_state, folder)
            state = rest if rest is not None else cast(TrainingState, {})
        frozen = state.get("frozen") if part == "model" else None
        self._check_keys(model, shapes, {own.get(_plain_key(k), k): d
                                         for k, d in (frozen or {}).items()})
        if folder is None:
            model.load_state_dict(dict(zip(shapes, weights.values())), strict=not frozen)
        else:
            self._load_streamed(model, folder, layout, own)
        return model

    def _load_streamed(self, model: Any, folder: str, layout: dict, own: dict) -> None:
        """Copy the model in the sharded checkpoint `folder` into `model` one tensor at a time
        (the whole model need not fit the kernel's memory), each under every name `layout`
        gives it (`model` may hold a tied parameter's names apart); `own`: our keys to
        `model`'s."""
        tied: dict[str, list[str]] = {}
        for alias, name in layout.items():
            if isinstance(name, str):
                tied.setdefault(name, []).append(alias)
        try:
            for key, tensor in sharded_checkpoint.read_model(folder, copy=False):
                model.load_state_dict({own.get(k, k): tensor for k in [key, *tied.get(key, ())]},
                                      strict=False)
        except ckpt.CheckpointError as e:
            raise UsageError(f"run {self.name!r}: {e}") from None

    def _check_keys(self, model: Any, shapes: dict, frozen: dict[str, str]) -> None:
        """Raise UsageError unless `model` holds the frozen weights of `frozen` ({key: digest})
        and its other tensors are those of `shapes` ({key: shape, or None for a value that is
        not a tensor}), the trained ones, with their shapes."""
        held = model.state_dict()
        odd = sorted(k for k, d in frozen.items() if k not in held or digest(held[k]) != d)
        if odd:
            raise UsageError(
                f"run {self.name!r} trained with frozen weights that `model` does not hold "
                f"({len(odd)} tensor(s) differ, first {odd[0]!r}): its state holds the trained "
                "tensors only; build the model as the cell did (the same base weights), then "
                "load_into it")
        missing = sorted(held.keys() - shapes.keys() - frozen.keys())
        unexpected = sorted(shapes.keys() - held.keys())
        other = sorted(k for k, shape in shapes.items() if k in held and shape is not None
                       and tuple(getattr(held[k], "shape", ())) != tuple(shape))
        if missing or unexpected or other:
            said = [f"it lacks {len(unexpected)} trained tensor(s), first {unexpected[0]!r}"
                    if unexpected else "",
                    f"{len(missing)} of its tensor(s) are not in the run's state, first "
                    f"{missing[0]!r}" if missing else "",
                    f"its {other[0]!r} is {tuple(held[other[0]].shape)}, the run's "
                    f"{tuple(shapes[other[0]])}" if other else ""]
            raise UsageError(f"`model` is not the architecture run {self.name!r} trained: "
                             + "; ".join(p for p in said if p) + " (nothing was loaded)")

    def export(self, path: str, part: str = "model") -> str:
        """Write `part`'s plain state dict to `path` with ``torch.save``'s format; returns the
        path. A sharded run's model is written one tensor at a time (run.streamed_export):
        it need not fit the kernel's memory."""
        import torch
        folder = self._sharded_folder() if part == "model" else None
        if folder is not None and streamed_export.supported():
            layout = self._read(sharded_checkpoint.model_layout, folder)
            try:
                return streamed_export.write_streamed(
                    path, layout, sharded_checkpoint.read_model(folder, copy=False))
            except ckpt.CheckpointError as e:
                raise UsageError(f"run {self.name!r}: {e}") from None
        path = os.path.abspath(path)
        weights = self.state_dict(part)
        ckpt.atomic_write(path, lambda f: torch.save(weights, f))
        return path

    def _read(self, read, folder: str):
        """`read(folder)`, a sharded checkpoint's manifest read; UsageError if it cannot be."""
        try:
            return read(folder)
        except ckpt.CheckpointError as e:
            raise UsageError(f"run {self.name!r}: its model is in {folder}, and {e}") from None

    def logs(self, tail: int = 40) -> str:
        """The run's log and the last `tail` lines of each engine's log, as text."""
        parts = []
        if os.path.isdir(self.log_dir):
            for name in sorted(os.listdir(self.log_dir)):
                with open(os.path.join(self.log_dir, name), errors="replace") as f:
                    lines = f.read().splitlines()
                parts.append(f"==> {name} <==\n" + "\n".join(lines[-tail:]))
        return "\n\n".join(parts) or "(no logs yet)"


def _plain_key(key: str) -> str:
    """`key` of a state dict without the names torch.compile's wrappers add."""
    return ".".join(part for part in key.split(".") if part != _COMPILED)


def plain_keys(state_dict: dict) -> dict:
    """`state_dict` keyed as the model's would be without torch.compile: ``_orig_mod.0.weight``
    -> ``0.weight`` (also inside a compiled submodule: ``enc._orig_mod.w`` -> ``enc.w``)."""
    return {_plain_key(key): value for key, value in state_dict.items()}
