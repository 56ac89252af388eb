"""Training state as plain data: what a checkpoint holds and what a newcomer receives.

Everything here is tensors, numbers, strings, lists, tuples and dicts, so a checkpoint loads
with ``torch.load(weights_only=True)`` and a file from a shared folder cannot run code.

Values the safe load refuses are converted when the state is captured: a numpy scalar (a
``numpy.float64`` learning rate, a ``numpy.bool_``) becomes the Python number, a numpy array a
tensor. ``numpy_types`` records where each was and its dtype, and :func:`restore` gives the
user's model, optimizer and scheduler their numpy values back, so a restored optimizer steps
exactly as the captured one. Anything else the safe load refuses (an object of the user's own
class) is left as it is: ``checkpoint.unloadable`` names it, at setup and before every write.
"""
from __future__ import annotations

import collections
import copy
import random
import sys
import threading
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..protocol import ProgressState, TrainingState
from . import shared_memory

FORMAT_VERSION = 1


@dataclass
class Progress:
    """Where the run stands: ``step`` optimizer steps done; ``position`` samples used in
    ``epoch``; ``cut``, how its steps are cut into micro-batches (engine.data.batching.Cut as a
    dict; None until the first generation fixes it); ``pass_cost``, the pass cost that cut
    uses (None unless it balances by one); ``streams``, for an iterable dataset
    (engine.data.stream_split), ``{"count": S, "states": {stream: {"epoch", "offset", "state"}}}``:
    the stream count and each stream's newest committed state to resume reading from; with
    several optimizers (engine.step.optimizers), ``substep`` the sub-steps of step ``step + 1``
    already committed and ``losses`` their ``[loss, *extras]`` by optimizer name."""

    step: int = 0
    epoch: int = 0
    position: int = 0
    samples: int = 0
    metric_names: list = field(default_factory=list)
    pass_cost: float | None = None
    cut: dict | None = None
    streams: dict | None = None
    substep: int = 0
    losses: dict = field(default_factory=dict)

    def as_dict(self) -> ProgressState:
        return ProgressState(step=self.step, epoch=self.epoch, position=self.position,
                    samples=self.samples, metric_names=list(self.metric_names),
                    pass_cost=self.pass_cost,
                    cut=dict(self.cut) if self.cut is not None else None,
                    streams=copy.deepcopy(self.streams), substep=self.substep,
                    losses={k: list(v) for k, v in self.losses.items()})


def rng_state() -> dict:
    """Python, numpy and torch RNG states, converted to tensors and plain numbers."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                  "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict) -> None:
    """Inverse of :func:`rng_state`."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    nps = state["numpy"]
    np.random.set_state((nps["kind"], nps["keys"].numpy().astype(np.uint32), nps["pos"],
                         nps["has_gauss"], nps["cached"]))
    torch.set_rng_state(state["torch"])


# dict and tuple types the safe load accepts, rebuilt as they are; other subclasses (a
# defaultdict, a namedtuple) are left alone for checkpoint.unloadable to name
_DICTS = (dict, collections.OrderedDict, collections.Counter)
_TUPLES = (tuple, torch.Size)


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def _numpy_array_as_tensor(array: np.ndarray):
    """The array as a tensor of the same dtype (a copy), or as nested lists when torch has no
    such dtype (strings, objects)."""
    try:
        return torch.from_numpy(np.array(array, dtype=array.dtype.newbyteorder("=")))
    except (TypeError, ValueError):
        return array.tolist()


def _plain(obj, path: list | None, numpy_types: list | None, tensor):
    """`obj` with tensors passed through `tensor` and numpy values converted to plain ones,
    each recorded in `numpy_types` as ``[key path, "scalar" | "array", dtype]`` (when given:
    then `path` is `obj`'s key path)."""
    if isinstance(obj, torch.Tensor):
        return tensor(obj)
    if isinstance(obj, (np.generic, np.ndarray)):
        if numpy_types is not None:
            kind = "scalar" if isinstance(obj, np.generic) else "array"
            numpy_types.append([path, kind, obj.dtype.str])
        return obj.item() if isinstance(obj, np.generic) else _numpy_array_as_tensor(obj)
    keep = numpy_types is not None  # build key paths only when they are recorded
    if type(obj) in _DICTS:
        out = {}
        for k, v in obj.items():
            # a numpy key becomes the Python number: it hashes and compares equal, so lookups
            # find it as before
            k = k.item() if isinstance(k, np.generic) else k
            out[k] = _plain(v, [*path, k] if keep and path is not None else None, numpy_types,
                            tensor)
        return type(obj)(out)
    if type(obj) is list or type(obj) in _TUPLES:
        return type(obj)([_plain(v, [*path, i] if keep and path is not None else None,
                                 numpy_types, tensor) for i, v in enumerate(obj)])
    if type(obj) is set:
        return {_plain(v, None, None, tensor) for v in obj}
    return obj


_SCALARS = frozenset({float, int, str, bool, type(None)})


def _plain_records(records: list, tensor) -> list:
    """History records as plain data. A capture copies every held record, so a record that is
    plain already (nearly all) is kept after a check at C speed rather than walked."""
    return [r if _SCALARS.issuperset(map(type, r.values())) else _plain(r, None, None, tensor)
            for r in records]


def _as_numpy(value, kind: str, dtype: str):
    if kind == "scalar":
        return np.dtype(dtype).type(value)
    if isinstance(value, torch.Tensor):
        return value.numpy().astype(dtype)
    return np.array(value, dtype=dtype)


def _replaced(obj, path: list, fn):
    """A copy of `obj` whose value at `path` is ``fn(value)``; only the containers along the
    path are copied (restoring must leave the caller's state as captured)."""
    if not path:
        return fn(obj)
    key, rest = path[0], path[1:]
    if isinstance(obj, tuple):
        return type(obj)([_replaced(v, rest, fn) if i == key else v for i, v in enumerate(obj)])
    out = copy.copy(obj)
    out[key] = _replaced(obj[key], rest, fn)
    return out


def with_numpy_values(state: TrainingState) -> TrainingState:
    """`state` (from :func:`capture`) with the numpy values capture converted given back their
    numpy types, where the user's objects hold them (model, optimizer, scheduler)."""
    out: Any = state  # _replaced copies along each path: the same schema, rebuilt
    for path, kind, dtype in state.get("numpy_types", ()):
        out = _replaced(out, path, lambda v, kind=kind, dtype=dtype: _as_numpy(v, kind, dtype))
    return out


class Staging:
    """CPU buffers that captures for checkpoints copy tensors into, kept from one capture to
    the next: memory is allocated once, not at every checkpoint, and page-locked for GPU
    tensors, so their copies run asynchronously and the capture waits for the device once. The
    buffers lie in shared memory (:attr:`arena`, where the host has it) for the writer process
    (engine.state.checkpoint_process) to read in place; there they are locked after the first
    capture, whose copies are synchronous.

    CPU tensors that only the optimizer step changes (the parameters it trains, its state) are
    copied on a background thread while the next step's forward and backward run; the step
    calls :meth:`wait` before it updates them (engine.worker), and the writer calls
    :meth:`ready` before it reads the buffers. torch.distributed.checkpoint's asynchronous stagers
    make the same contract (``synchronize_staging`` before the state changes). It assumes the loss
    function changes no parameter in place, as the optimizer alone should.

    A capture's result holds these buffers: the next capture overwrites them, so its writer
    must be done with the previous one first (engine.generation waits for it).
    """

    def __init__(self):
        self.arena = shared_memory.Arena() if shared_memory.available() else None
        self._buffers: list[torch.Tensor] = []
        self._next = 0
        self._device: torch.device | None = None  # a GPU the copies came from
        self._deferrable: AbstractSet[tuple] = set()  # tensors only the step changes (_identity)
        self._deferred: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, tensor)
        self._copier: threading.Thread | None = None
        self._copy_error: BaseException | None = None

    def begin(self, deferrable: AbstractSet[tuple] = frozenset()) -> None:
        """Start a capture; CPU tensors whose :func:`_identity` is in `deferrable` may be
        copied after :meth:`end`, until :meth:`wait`."""
        self.wait()
        self._next, self._device, self._deferrable, self._deferred = 0, None, deferrable, []

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """`t` copied into the capture's next buffer (tensors come in the same order each
        capture; a buffer of another shape or dtype is replaced)."""
        if t.layout != torch.strided or t.is_quantized or t.numel() == 0:
            return _cpu_copy(t)
        t = t.detach()
        i, self._next = self._next, self._next + 1
        buffer = self._buffers[i] if i < len(self._buffers) else None
        if buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype:
            buffer = self._new_buffer(t)
            if i == len(self._buffers):
                self._buffers.append(buffer)
            else:
                self._buffers[i] = buffer
        if t.is_cuda:
            buffer.copy_(t, non_blocking=True)
            self._device = t.device
        elif _identity(t) in self._deferrable:
            self._deferred.append((buffer, t))
        else:
            buffer.copy_(t)
        return buffer

    def _new_buffer(self, t: torch.Tensor) -> torch.Tensor:
        if self.arena is not None:
            try:
                return self.arena.tensor(t.shape, t.dtype)
            except OSError as e:
                self._unshare(e)
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)

    def _unshare(self, error: Exception) -> None:
        """Stage in private memory from now on (the checkpoint writer thread writes then)."""
        self.arena = None
        print(f"elastic-jupyter: checkpoint buffers are not shared: {error}", file=sys.stderr,
              flush=True)

    def end(self) -> None:
        """Wait for the GPU's copies and start the deferred ones; buffers past this capture's
        last are freed."""
        del self._buffers[self._next:]
        if self.arena is not None:
            self.arena.keep_only(self._buffers)
        if self._device is not None:
            torch.cuda.synchronize(self._device)
            if self.arena is not None:
                try:
                    self.arena.pin_used()
                except RuntimeError as e:
                    self._unshare(e)
        if self._deferred:
            deferred, self._deferred = self._deferred, []
            self._copier = threading.Thread(target=self._copy_all, args=(deferred,),
                                            name="checkpoint-copy", daemon=True)
            self._copier.start()

    def wait(self) -> None:
        """Return once every copy of the last capture is done (at once when none is left).
        The training thread and the writer may both call it at once."""
        copier = self._copier
        if copier is not None:
            copier.join()

    def ready(self) -> None:
        """:meth:`wait`, for the writer: raises what a copy raised (the buffers then hold an
        older state, which must not be written)."""
        self.wait()
        if self._copy_error is not None:
            raise RuntimeError("copying the state for a checkpoint failed") from self._copy_error

    def _copy_all(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._copy_error = None
        try:
            for buffer, t in pairs:
                buffer.copy_(t)  # torch releases the interpreter lock for the copy
        except BaseException as e:  # noqa: BLE001 -- re-raised by ready()
            self._copy_error = e


def capture(model, optimizer, lr_scheduler, progress: Progress, history: list, config: dict,
            *, copy_tensors: bool = True, grad_scaler=None, staging: Staging | None = None,
            extra: dict | None = None, frozen: Mapping[str, str] | None = None,
            rows: bool = True) -> TrainingState:
    """A deep copy, on the CPU, of everything needed to continue training exactly.

    Returns a dict of plain data (see the module docstring); the copy is safe to write from
    another thread while training goes on (with `staging`, once ``staging.wait()`` returned).
    With ``copy_tensors=False`` the tensors are the
    live ones (to inspect the state without copying the model). With `staging`, tensors are
    copied into its reused buffers (see :class:`Staging`). `extra`: the cell's ``extra_state``
    ({name: object with ``state_dict()``}, an EMA of the weights), captured under ``"extra"``.
    `frozen`: {key: digest} of the model's frozen tensors (engine.state.frozen), left out of
    ``"model"`` and recorded under ``"frozen"``. ``rows=False`` (a sharded model,
    engine.sharded.lifecycle, whose parameters and moments travel by resharding): no ``"model"``
    and no per-parameter optimizer state, the rest as always.
    """
    if staging is not None:  # the optimizer step alone changes these (see Staging)
        staging.begin({_identity(t) for t in _step_changes(optimizer)})
    tensor = (staging.copy if staging is not None else _cpu_copy) if copy_tensors \
        else (lambda t: t)
    numpy_types: list = []
    weights = model.state_dict() if rows else {}  # a new dict each call (its _metadata kept)
    for key in frozen or ():
        weights.pop(key, None)  # (no rows at all: a sharded model's)
    optimizer_state = optimizer.state_dict()
    if not rows:
        optimizer_state["state"] = {}
    objects = {"model": weights, "optimizer": optimizer_state,
               "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
               "extra": {name: obj.state_dict() for name, obj in (extra or {}).items()}}
    plain = {part: _plain(value, [part], numpy_types, tensor) for part, value in objects.items()}
    state = TrainingState(
        format=FORMAT_VERSION, model=plain["model"], optimizer=plain["optimizer"],
        lr_scheduler=plain["lr_scheduler"], extra=plain["extra"],
        progress=progress.as_dict(),
        rng=rng_state(),
        history=_plain_records(history, tensor),  # records never change once appended
        config=_plain(dict(config), None, None, tensor),
        numpy_types=numpy_types,
        # fp16's torch.amp.GradScaler: scale and growth tracker, plain numbers
        grad_scaler=(_plain(grad_scaler.state_dict(), None, None, tensor)
                     if grad_scaler is not None else None))
    if frozen:
        state["frozen"] = dict(frozen)
    if staging is not None:
        staging.end()
    return state


def _step_changes(optimizer):
    """The tensors that the optimizer step changes and nothing else does between steps: the
    parameters it trains (a frozen one may be changed by the forward pass, as a VQ-VAE's
    moving-average codebook is) and its own state."""
    for group in optimizer.param_groups:
        yield from (p for p in group["params"] if p.requires_grad)
    for per_parameter in optimizer.state.values():
        yield from (v for v in per_parameter.values() if isinstance(v, torch.Tensor))


def _identity(t: torch.Tensor) -> tuple:
    """What tells a tensor from another that starts at the same address (a view of it)."""
    return t.data_ptr(), t.shape, t.stride(), t.dtype


def restore(state: TrainingState, model, optimizer, lr_scheduler, grad_scaler=None,
            extra: dict | None = None, load_model=None) -> tuple[Progress, list]:
    """Load `state` (from :func:`capture`) into the objects; returns (progress, history). An
    `extra` object the state has no entry for (a checkpoint written before the cell declared
    it) keeps what the cell gave it. `load_model(weights)` loads the model's part (default:
    ``model.load_state_dict``; engine.state.frozen's takes a state without the frozen tensors)."""
    state = with_numpy_values(state)
    (load_model or model.load_state_dict)(state["model"])  # first: it may refuse the state
    for name, obj in (extra or {}).items():
        if name in state.get("extra", {}):
            obj.load_state_dict(state["extra"][name])
    optimizer.load_state_dict(state["optimizer"])
    if lr_scheduler is not None and state.get("lr_scheduler") is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    if grad_scaler is not None and state.get("grad_scaler"):
        grad_scaler.load_state_dict(state["grad_scaler"])
    set_rng_state(state["rng"])
    return Progress(**state["progress"]), list(state["history"])
