"""The functions the owner calls on each engine through ipyparallel (``apply_async``).

An engine is a persistent process, so what one call sets up (the engine's slot, the run's
Worker, the rendezvous store connection) must outlive the call: it lives in one ``EngineState``
object, ``_state``, owned by this module and changed only by these functions. ipyparallel
ships each function by reference to this module, so every call on an engine sees the same
``_state``.

This module imports nothing from IPython, ipyparallel or the UI.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import importlib.metadata
import os
import pickle
import platform
import random
import sys
import traceback
import types

import numpy as np
import torch
import torch.distributed as dist

from ..config.environment import OWNER_ADDRESS, SLOT
from ..config.run import RunConfig
from . import publish
from . import workdir as workdir_mod
from .data.fingerprint import dataset_fingerprint
from .generation import run_generation
from .group import drain
from .group.network_interface import use_interface_towards
from .protocol import GenerationResult, GenerationSpec, TrainingState
from .state import history
from .state.checkpoint import CheckpointError
from .worker import SetupError, Worker


class EngineState:
    """What persists on one engine between the owner's calls.

    Attributes:
        slot, device: set by init_engine (None / "cpu" before), a warm engine's by bind_slot.
        warm: init_engine gave it no slot, and no bind_slot has yet.
        worker: the current run's Worker (None between runs).
        store: the connection to the current run's rendezvous store (None before connect_store).
        log_path: the current run's log file for this engine (None: the engine's own output).
        workdir_on_path: the import path entry the current run's setup added (None: none).
    """

    def __init__(self) -> None:
        self.slot: int | None = None
        self.device: str = "cpu"
        self.warm = False  # started on no slot (run/warm_engines.py), not bound yet
        self.worker: Worker | None = None
        self.store: dist.Store | None = None
        self.log_path: str | None = None
        self.workdir_on_path: str | None = None

    def run_worker(self) -> Worker:
        """The current run's Worker. Raises RuntimeError when no run is set up here."""
        if self.worker is None:
            raise RuntimeError("no run is set up on this engine (setup_run did not succeed)")
        return self.worker

    def run_store(self) -> dist.Store:
        """The connection to the run's rendezvous store. Raises RuntimeError before
        connect_store."""
        if self.store is None:
            raise RuntimeError("this engine is not connected to the run's rendezvous store")
        return self.store


_state = EngineState()


@contextlib.contextmanager
def _logging_to(path: str | None):
    """Send this task's prints, warnings and tracebacks to the engine's log file."""
    if not path:
        yield
        return
    with open(path, "a", buffering=1) as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        yield


def _cell_file(source: str, log_path: str | None) -> str:
    """A real file holding the cell, so tracebacks (formatted by IPython on the engine) show
    the cell's lines; it lands beside the engine logs."""
    if not log_path:
        return "<elastic_train cell>"
    path = os.path.join(os.path.dirname(log_path), "cell.py")
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(source)
    os.replace(tmp, path)
    return path


def versions() -> dict:
    """{"python", "torch", "elastic_jupyter"}: what an engine and its owner must share (the
    state they exchange is pickled, the engine code is this package's)."""
    try:
        ours = importlib.metadata.version("elastic-jupyter")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        ours = "not installed"
    return {"python": platform.python_version(), "torch": torch.__version__,
            "elastic_jupyter": ours}


def init_engine(slot: int | None, device: str, threads: int,
                publisher: publish.Publisher | None = None) -> dict:
    """Called once by the pool right after the engine registered: bind it to its slot (None:
    a warm engine, bound later by :func:`bind_slot`), and take the `publisher` through which
    rank 0 streams live records (engine.publish).

    Returns {"pid", "slot", "device", "host", "versions"} (see :func:`versions`).
    """
    torch.set_num_threads(threads)
    # nccl's watchdog, at a collective's timeout, raises the error in the rank (2: clean up
    # only) instead of ending the process (torch's default): a rank whose peer died is a
    # survivor, never a casualty (engine.group.abort ends such waits sooner)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    drain.install()  # a scheduler's SIGTERM: leave the run at a step boundary, then stop
    if owner := OWNER_ADDRESS.get():  # a pool across hosts
        use_interface_towards(owner)
    if device.startswith("cuda"):
        torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES holds exactly this slot's GPU
    _state.slot, _state.device, _state.warm = slot, device, slot is None
    publish.use(publisher)
    _say_bound(slot, device)
    return {"pid": os.getpid(), "slot": slot, "device": device, "host": os.uname().nodename,
            "versions": versions()}


def bind_slot(slot: int, gpu: int | None, threads: int) -> dict:
    """Called on a warm engine (started without a slot: run/warm_engines.py) when its run
    grows into `slot`: bind it there, as :func:`init_engine` binds a fresh engine. A CPU slot
    sets the thread count. A GPU slot makes `gpu` (the machine's id, ``CUDA_DEVICE_ORDER``
    from the engine's start) the only visible device, which CUDA reads when it initialises:
    the warm engine never initialised it (it starts with no device visible and
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, so ``torch.cuda.is_available()`` asks NVML instead);
    the run's Worker, built on the host by the cell, is then built again on the device.

    Returns {"pid", "slot", "device", "host", "versions"}, as :func:`init_engine`.
    Raises SetupError when CUDA was initialised before the bind (the cell touched a GPU while
    none was visible) or the device cannot be bound; the engine is then of no use to the run.
    """
    device = "cpu" if gpu is None else _bind_gpu(gpu)
    worker = _state.worker
    if worker is not None and device != "cpu":  # the cell's objects go from the host there
        with _logging_to(_state.log_path):
            namespace = sys.modules["__elastic_cell__"].__dict__
            worker = _state.worker = worker.moved_to(namespace, device, slot)
    torch.set_num_threads(threads)
    os.environ.update({SLOT.name: str(slot), "OMP_NUM_THREADS": str(threads)})
    _state.slot, _state.device, _state.warm = slot, device, False
    if worker is not None:
        worker.slot = slot  # fault points match it
    _say_bound(slot, device)
    return {"pid": os.getpid(), "slot": slot, "device": device, "host": os.uname().nodename,
            "versions": versions()}


def _bind_gpu(gpu: int) -> str:
    """Make `gpu` this engine's only device before CUDA initialises; its device string.
    Raises SetupError when CUDA was initialised already or does not see exactly that GPU."""
    if torch.cuda.is_initialized():
        raise SetupError("the cell initialised CUDA on a warm engine, before it had a GPU: "
                         "build the model on the host (the engine moves it)")
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    count = getattr(torch.cuda.device_count, "cache_clear", None)
    if count is not None:  # torch < 2.4 keeps the count it saw first (pytorch#95073)
        count()
    try:
        if torch.cuda.device_count() != 1:
            raise RuntimeError(f"CUDA sees {torch.cuda.device_count()} devices")
        torch.cuda.init()  # fails here, not mid-step, where a library initialised it unseen
        torch.cuda.set_device(0)
    except RuntimeError as e:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # as it started: no device
        raise SetupError(f"GPU {gpu} could not be bound on this warm engine ({e})") from None
    return f"cuda:{gpu}"


def _say_bound(slot: int | None, device: str) -> None:
    """One line to the process's stderr descriptor (the engine's log), below Python.

    Under ipengine, a thread of ipykernel forwards what C code writes there (torch's c10d
    warnings) and opens a zmq socket, one eventfd, at its first write. Without this line that
    first write comes mid-run (the first vote read that times out while a peer hangs) and the
    process ends the run with one descriptor more, which a leak check cannot tell from a leak
    (benchmarks/soak.py)."""
    try:
        where = "no slot yet (warm)" if slot is None else f"slot {slot}"
        os.write(2, f"elastic-jupyter: engine {os.getpid()} bound to {where} ({device})\n"
                 .encode())
    except OSError:  # no stderr: nothing to say it to
        pass


def _run_setup(source: str | None, setup_fn: bytes | None, pushed: dict,
               log_path: str | None) -> dict:
    """The user's objects: from the cloudpickled `setup_fn`, or by running the cell `source`."""
    # a real module, as a notebook's __main__ is: dataclasses, typing and pickle look up the
    # cell's classes in sys.modules by their __module__
    module = types.ModuleType("__elastic_cell__")
    module.__dict__.update(pushed)
    sys.modules[module.__name__] = module
    namespace = module.__dict__
    if setup_fn is not None:
        # cloudpickle's loads is pickle's: its payload imports what it needs to rebuild
        objects = pickle.loads(setup_fn)()
        if not isinstance(objects, dict):
            raise SetupError("the setup function must return a dict with model, optimizer, "
                             f"dataset and loss_fn; it returned {type(objects).__name__}")
        namespace.update(objects)
        return namespace
    if source is None:
        raise SetupError("the run has neither a cell nor a setup function")
    try:
        # dont_inherit: the cell is compiled as a notebook compiles it, not with this module's
        # `from __future__ import annotations` (string annotations break a cell's dataclasses)
        exec(compile(source, _cell_file(source, log_path), "exec", dont_inherit=True), namespace)
    except NameError as e:
        raise NameError(f"{e}. Engines cannot see notebook variables: send them with "
                        "--push NAME (or push={'NAME': value} in the Python API)") from None
    return namespace


def setup_run(config: dict, source: str | None, setup_fn: bytes | None, pushed: dict,
              log_path: str | None, workdir: str) -> dict:
    """Called when a run starts (or adds an engine): free any earlier run, enter the run's
    working folder `workdir` (the notebook's, see engine.workdir), run the cell `source` (or
    the cloudpickled `setup_fn`) with the run's seed and keep the Worker it defines.

    `config`: the run's options as plain data (``RunConfig.as_dict()``, read back with
    ``RunConfig.from_dict``).
    Returns {"samples", "total_steps", "parameters", "eval_samples", "dataset", "frozen",
    "workdir", "memory", "imported"}: "memory" is a sharded run's memory need per rank and
    budget (engine.sharded.lifecycle's ``count_memory``; None when replicated); "frozen" is the
    frozen weights' manifest (engine.state.frozen: their digests, bytes and hashing time), which
    the owner compares across engines; "imported"
    names the installed modules the setup loaded, in order (for pool.zygote; not the
    notebook's own, see engine.workdir);
    "dataset" is the dataset's fingerprint (engine.data.fingerprint), which the owner compares
    across engines; the Worker keeps it too, so checkpoints record it in their config. "workdir" is
    the folder the cell ran in: `workdir`, or, on a host where the notebook's folder does not exist,
    the engine's own (the run's folder must exist there: it is shared). Raises SetupError (also when
    the training state holds a value no checkpoint could load, naming its key path) or the cell's
    own exception (the owner shows its traceback); the engine then holds no Worker.
    """
    _forget_run()
    loaded = set(sys.modules)
    logs = log_path and os.path.dirname(log_path)  # <the run's folder>/logs
    if logs and not os.path.isdir(logs):  # another host, without a shared folder
        raise SetupError(f"the run's folder {os.path.dirname(logs)} does not exist on host "
                         f"{os.uname().nodename}: every engine writes its log there, and rank "
                         "0 (any engine) its checkpoints; name a folder the hosts share with "
                         "--checkpoint-dir (checkpoint_dir=)")
    if not os.path.isdir(workdir):  # the notebook's folder is the kernel host's own
        workdir = os.getcwd()
    _state.log_path = log_path
    _state.workdir_on_path, dropped = workdir_mod.enter(workdir, _state.workdir_on_path)
    with _logging_to(log_path):
        if dropped:
            print(f"re-importing from {workdir}: {', '.join(sorted(dropped))}", file=sys.stderr)
        options = RunConfig.from_dict(config)
        seed = options.seed
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        namespace = _run_setup(source, setup_fn, pushed, log_path)
        worker = Worker(namespace, options, _state.device, slot=_state.slot)
        try:
            worker.check_setup()
            dataset = dataset_fingerprint(worker.dataset)
        except BaseException:
            worker.close()
            raise
    worker.fingerprint = dataset  # checkpoints carry it, resumes check it
    _state.worker = w = worker
    reply = {"samples": len(w.dataset), "total_steps": w.total_steps,
             "parameters": sum(p.numel() for p in w.model.parameters()),
             "eval_samples": len(w.eval_dataset) if w.eval_dataset is not None else 0,
             "dataset": dataset, "frozen": w.frozen.manifest(), "workdir": workdir,
             "memory": w.mode.memory_need(w.optimizer, w.plan.micro_batch_count(min(
                 w.plan.global_batch, w.plan.n)), w.device),
             "imported": [m for m, module in list(sys.modules.items()) if m not in loaded
                          and workdir_mod.installed_file(getattr(module, "__file__", None))]}
    if _state.warm:
        w.mode.set_aside()  # a warm engine of a sharded run is sent its rows at its join
    return reply


def _forget_run() -> None:
    """Drop this engine's run and free its memory: the model, optimizer and data of a run
    re-run on the same pool must not stay beside the new one's."""
    worker, _state.worker = _state.worker, None
    if worker is not None:
        worker.close()
    del worker
    cell = sys.modules.pop("__elastic_cell__", None)  # its namespace holds model and data
    if cell is not None:
        cell.__dict__.clear()
    del cell
    # a failed task's traceback keeps its frames, and with them the run's objects
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()
    if _state.device.startswith("cuda"):
        torch.cuda.empty_cache()


def load_state(folder: str) -> dict:
    """Called on rank 0 for ``--resume``, and after a fault that left no survivor: restore this
    engine's Worker from the newest usable checkpoint in `folder`.

    Returns {"path", "warnings", "progress", "config", "history", "pending"} (the whole
    history: the folder's history file with the checkpoint's own records; "pending": the
    checkpoint's last step is still to finish, its record not in the history yet: one written
    before the final evaluation, engine.generation); warnings name newer files that were
    skipped, one short line each; torch's full errors go to the engine's log.
    Raises CheckpointError when none is usable.
    """
    w = _state.run_worker()
    details: list[str] = []
    try:  # a sharded run's rows are read by every rank at the next generation's start
        path, state, warnings = w.mode.load(w, folder, details)
    except CheckpointError as e:
        if details and _state.log_path:
            raise CheckpointError(f"{e}\n(torch's full errors: {_state.log_path})") from None
        raise
    finally:
        with _logging_to(_state.log_path):
            for text in details:
                print(text, file=sys.stderr)
    return {"path": path, "warnings": warnings, "progress": w.progress.as_dict(),
            "config": state["config"], "history": history.whole_history(folder, state),
            "pending": w.pending is not None}


def connect_store(host: str, port: int, timeout: float) -> None:
    """Called after setup_run: connect to the owner's rendezvous store (kept for the life of
    the engine's run; every generation's process group forms through it)."""
    _state.store = dist.TCPStore(host, port, is_master=False,
                                 timeout=datetime.timedelta(seconds=timeout))


def train_generation(spec: GenerationSpec, log_path: str | None) -> GenerationResult:
    """Called on every member at the start of each generation: train until the run ends or
    every rank agreed to leave (see generation.run_generation for `spec` and the result).
    Errors carry this engine's traceback, also written to its log."""
    with _logging_to(log_path):
        try:
            return run_generation(_state.run_worker(), spec, _state.run_store())
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            _release_frames(e)
            raise


def _release_frames(error: BaseException) -> None:
    """Clear the local variables of the frames `error` (and its causes) went through. The
    engine's kernel keeps errors it reported alive, and those locals
    hold the failed group's pending collectives, which hold its gloo or nccl connections,
    listening socket and threads: without this a survivor kept such a set for some of its
    faults (benchmarks/soak.py found it)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        one = todo.pop()
        if one is None or id(one) in seen:
            continue
        seen.add(id(one))
        traceback.clear_frames(one.__traceback__)
        todo += [one.__cause__, one.__context__]


def training_state() -> TrainingState:
    """Called on rank 0 when the run ends (finished, stopped, or failed by an error), for the
    final weights: the Worker's full state as plain data on the CPU, with its last committed
    step still to finish as ``pending`` (None unless an error hit its evaluation). A CPU engine
    sends its live tensors, which no step changes any more: the reply's serialization is the
    only copy. Raises engine.state.frozen's FrozenWeightsError when a frozen tensor changed (the
    state leaves them out: it would not resume as this run went on)."""
    w = _state.run_worker()
    w.frozen.verify()
    state = w.capture(copy_tensors=w.device.type != "cpu")
    state["pending"] = w.pending
    return state


def drop_run() -> None:
    """Called when a run ends or an engine leaves it: wait for pending checkpoint writes and
    forget the run, freeing its memory (the engine stays, ready for the next one)."""
    _forget_run()


def progress() -> dict:
    """Called on the survivors after a fault: where this engine's Worker stands.

    Returns {"step": committed steps, "in_flight": whether a step had begun and was not
    committed (the work the fault lost), "pending": whether the last step's evaluation is
    still to do, "holds_state": False when the fault caught it before it had loaded the
    state it was to receive (its model may hold part of it)}. The commit vote gives every survivor
    that holds the state the same step (engine.group.vote).
    """
    w = _state.run_worker()
    return {"step": w.progress.step, "in_flight": w.in_flight, "pending": w.pending is not None,
            "holds_state": w.holds_state}


def history_since(step: int, pending: bool = False) -> list[dict]:
    """Called on rank 0 after a fault, for the records the live stream had not delivered:
    this engine's history records after `step` (it holds every one the owner lacks:
    engine.state.history). With `pending` (a run that ends with an error), also the record of a
    committed step whose evaluation is still to do (``Worker.pending``: the error hit it)."""
    w = _state.run_worker()
    records = w.history.since(step)
    if pending and w.pending is not None and w.pending["step"] > step \
            and (not records or records[-1]["step"] < w.pending["step"]):
        records.append(w.pending)
    return records
