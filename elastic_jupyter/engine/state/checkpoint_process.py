"""The checkpoint writer process: serializes, writes, fsyncs and hashes a checkpoint beside the
engine, so that none of that work takes the engine's interpreter lock.

A write on a thread of the engine stalls training even with a core to spare: ``torch.save``
pickles in Python, and every time the training thread gets the lock back from it, it waits.
Here the engine's writer thread (engine.state.checkpoint_writer.CheckpointWriter) sends the state to
a process of its own, started on the first large checkpoint and kept for the engine's run: the
tensors already lie in shared memory (engine.state.shared_memory, filled by
engine.state.training_state.Staging), so what crosses the socket is their place, the rest of the
state pickled, and the descriptors of the chunks. torch.distributed.checkpoint's process-based async
save (``AsyncCheckpointerType.PROCESS``) takes the same way out of the lock.

The process dies with the engine thread that started it (``PR_SET_PDEATHSIG``): a killed
engine leaves no writer that could still publish a checkpoint behind its recovery.

Wire (a socketpair): each frame is an 8-byte big-endian length, then that many bytes;
descriptors ride on a frame's length (``SCM_RIGHTS``). Engine to writer: a header frame
``{"folder", "keep", "chunks": [(chunk id, bytes)]}`` carrying the chunks' descriptors, then
the state frame. Writer to engine: ``("done", record)`` with
engine.state.checkpoint.write_checkpoint's record, or ``("failed", message)``. The writer maps the
chunks for the one write and keeps nothing of them after it: memory the engine frees (a
finished run's buffers) is not held beside it.
"""
from __future__ import annotations

import ctypes
import io
import os
import pickle
import signal
import socket
import subprocess
import sys
import types

import torch

from ..protocol import TrainingState
from .checkpoint import CheckpointError, write_checkpoint
from .shared_memory import Arena, Mapped

START_TIMEOUT = 60.0  # seconds for the process to import torch and answer, on a busy host
_MAX_FDS = 250  # chunks a header may carry (the kernel's limit is 253): 62 GiB of state


class WriterLost(RuntimeError):
    """The writer process ended (killed, out of memory) before it answered."""


class Unsendable(TypeError):
    """This state does not go to the process (the message says why): write it on the thread,
    where engine.state.checkpoint.unloadable names a value that is not plain data by its key
    path."""


class WriterProcess:
    """The engine's handle on its writer process (used from one thread: the writer thread)."""

    def __init__(self):
        self._process: subprocess.Popen | None = None
        self._socket: socket.socket | None = None
        self._last_code: int | None = None  # how the last process ended

    def write(self, folder: str, keep: int, state: TrainingState, arena: Arena) -> dict:
        """Write `state`, whose tensors lie in `arena` (others are pickled by value), as
        engine.state.checkpoint.write_checkpoint does, and return its record.

        Starts the process on first use. Raises CheckpointError when the write failed (its
        message), Unsendable before sending a state that holds values other than plain data
        (or is in too many chunks), WriterLost when the process ended (the next call starts
        another), OSError when it cannot be started.
        """
        chunks = arena.chunks()
        if len(chunks) > _MAX_FDS:
            raise Unsendable(f"{len(chunks)} chunks of shared memory, more than {_MAX_FDS}")
        state_data = _dumps(state, arena)
        sock = self._connection()
        header = {"folder": os.path.abspath(folder), "keep": keep,
                  "chunks": [(i, size) for i, (_, size) in chunks.items()]}
        try:
            _send_frame(sock, pickle.dumps(header), [fd for fd, _ in chunks.values()])
            _send_frame(sock, state_data)
            outcome, detail = pickle.loads(_recv_frame(sock)[0])
        except (OSError, EOFError) as e:
            self.close()
            raise WriterLost("the checkpoint writer process ended before it finished "
                             f"({_exit_text(self._last_code)})") from e
        if outcome == "failed":
            raise CheckpointError(detail)
        return detail

    def _connection(self) -> socket.socket:
        """The socket to the writer process, started here when none runs. Raises OSError when
        it cannot be started."""
        if self._process is None or self._process.poll() is not None:
            self._start()
        if self._socket is None:
            raise OSError("the checkpoint writer process started without a connection")
        return self._socket

    def _start(self) -> None:
        self.close()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        ours, theirs = socket.socketpair()
        with theirs:
            try:  # from /, not the notebook's folder: its .py files must not shadow modules
                self._process = subprocess.Popen(
                    [sys.executable, "-c", _BOOT, str(theirs.fileno()), str(os.getpid()), root],
                    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, cwd="/")
            except BaseException:
                ours.close()
                raise
        self._socket = ours
        ours.settimeout(START_TIMEOUT)
        try:
            if _recv_frame(ours)[0] != b"ready":
                raise EOFError
        except (OSError, EOFError) as e:
            why = (f"it did not answer within {START_TIMEOUT:.0f} s"
                   if isinstance(e, socket.timeout) else None)
            self.close()
            raise OSError("the checkpoint writer process did not start "
                          f"({why or _exit_text(self._last_code)})") from e
        ours.settimeout(None)

    def close(self) -> None:
        """End the process (it finishes the write it is in: the engine waits for it first)."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._process is not None:
            try:
                self._last_code = self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._last_code = self._process.wait()
            self._process = None


def _exit_text(code: int | None) -> str:
    if code is None:
        return "it did not answer"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# ------------------------------------------------------------------------------ the wire

def _send_frame(sock: socket.socket, data: bytes, fds=()) -> None:
    prefix = len(data).to_bytes(8, "big")
    if fds:
        socket.send_fds(sock, [prefix], list(fds))
    else:
        sock.sendall(prefix)
    sock.sendall(data)


def _recv_frame(sock: socket.socket) -> tuple[bytes, list[int]]:
    """(data, received descriptors); raises EOFError when the peer closed the socket."""
    prefix, fds, flags, _ = socket.recv_fds(sock, 8, _MAX_FDS)
    if flags & socket.MSG_CTRUNC:  # out of descriptors here
        for fd in fds:
            os.close(fd)
        raise OSError("the chunks' descriptors did not all arrive (too many open files?)")
    if not prefix:
        raise EOFError
    prefix += _recv_exact(sock, 8 - len(prefix))
    return _recv_exact(sock, int.from_bytes(prefix, "big")), fds


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buffer = bytearray(n)
    view, got = memoryview(buffer), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError
        got += k
    return bytes(buffer)


# --------------------------------------------------- tensors as places in shared memory

_mapped: Mapped | None = None  # in the writer process: the chunks of the write in progress


def _staged(chunk_id: int, offset: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    if _mapped is None:  # only a write's unpickling calls it, with its chunks mapped
        raise RuntimeError("a staged tensor outside a checkpoint write")
    return _mapped.tensor(chunk_id, offset, dtype, shape)


# the types a checkpoint may hold come from these; classes and functions pickle by name, and
# the writer would import (and run) a module of the user's to rebuild them
_PLAIN_MODULES = {"builtins", "collections", "torch"}
_BY_NAME = (type, types.FunctionType, types.BuiltinFunctionType)


class _Pickler(pickle.Pickler):
    """Pickles a state with each tensor of `arena` as its place. Only values other than the
    built-in containers and scalars call back into Python (``reducer_override``)."""

    def __init__(self, file, arena: Arena):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._arena = arena

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            where = self._arena.locate(obj)
            if where is None:
                return NotImplemented  # pickled by value
            return _staged, (*where, obj.dtype, tuple(obj.shape))
        if obj is _staged:
            return NotImplemented
        module = (getattr(obj, "__module__", None) if isinstance(obj, _BY_NAME)
                  else type(obj).__module__) or ""
        if module.partition(".")[0] not in _PLAIN_MODULES:
            raise Unsendable(f"a {type(obj).__qualname__} of {module or 'no module'}")
        return NotImplemented


def _dumps(state: TrainingState, arena: Arena) -> bytes:
    buffer = io.BytesIO()
    try:
        _Pickler(buffer, arena).dump(state)
    except Unsendable:
        raise
    except Exception as e:  # a value pickle refuses: the thread's check names it
        raise Unsendable(f"{type(e).__name__}: {e}") from e
    return buffer.getvalue()


# ------------------------------------------------------------------- the process itself

def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the engine died before the line above
        os._exit(1)


def _serve(sock: socket.socket) -> None:
    global _mapped
    _send_frame(sock, b"ready")
    while True:
        try:
            data, fds = _recv_frame(sock)
        except EOFError:
            return
        header = pickle.loads(data)
        state_data = _recv_frame(sock)[0]
        reply: tuple[str, dict | str]
        try:
            _mapped = Mapped(header["chunks"], fds)
            state = pickle.loads(state_data)
            reply = ("done", write_checkpoint(header["folder"], state, header["keep"]))
        except CheckpointError as e:
            reply = ("failed", str(e))
        except Exception as e:  # noqa: BLE001 -- the engine reports it as a failed checkpoint
            reply = ("failed", f"could not write checkpoint: {type(e).__name__}: {e}")
        state = _mapped = None  # unmapped with its last tensor
        _send_frame(sock, pickle.dumps(reply))


NICENESS = 10  # the write yields the cores to training ranks when they compete for them


def _main(argv: list[str]) -> None:
    _die_with_parent(int(argv[2]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the engine's group: its call
    os.nice(NICENESS)
    torch.set_num_threads(1)
    _serve(socket.socket(fileno=int(argv[1])))


# argv: the socket's descriptor, the engine's pid, the folder holding elastic_jupyter (last on
# the path: an installed package is found first, and nothing shadows the standard library)
_BOOT = ("import sys; del sys.path[0]; sys.path.append(sys.argv[3]); "
         "from elastic_jupyter.engine.state.checkpoint_process import _main; _main(sys.argv)")
