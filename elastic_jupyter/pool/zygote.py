"""Zygote: one process that has imported torch and ipyparallel, and forks this host's engines.

A local engine started as a new process spends about 1.3 s of CPU importing torch,
ipyparallel and this package before it can register, and then its run's cell imports its own
libraries again; on a machine of few cores, with several engines starting at once, that is most
of a growth's time (BENCHMARKS.md). The zygote imports them once, at the pool's start, and forks
a child per engine that runs ipyparallel's engine with them loaded; once a run's cell has run,
it imports the installed modules the cell imported too (:meth:`Zygote.preload`). The idea is
Android's zygote, and Python's forkserver with preloaded modules
(``multiprocessing.set_forkserver_preload``); that forkserver itself does not fit: its children
are ``multiprocessing`` processes, which the caller joins at exit.

Fork safety. The zygote only imports: torch initialises CUDA lazily, so the zygote holds no
device and a child's environment (``CUDA_VISIBLE_DEVICES``) binds it before first use; no event
loop, zmq context or thread of ours exists yet. A preload that starts a thread or initialises
CUDA ends the zygote (engines then start as new processes, and a warning says why). Each child
gets the environment, folder and ``sys.path[0]`` a new process would have; what the preloaded
libraries read once at load (OpenMP's and BLAS's thread counts) comes from the zygote's own
environment, so a zygote serves one thread count (:func:`acquire`). numpy's global random state
is redrawn in the child: a new process draws it from the OS, a fork would share it.

Protocol: one JSON line each way on the zygote's stdin and stdout, after its line
``{"ready": true}``: ``{"argv": [...], "env": {...}, "cwd": ..., "output": path}`` ->
``{"pid": n}``; ``{"preload": [module, ...]}`` -> ``{"tainted": why or null}``. End of its
stdin (the kernel stopped it, or died) ends the zygote; its engines live on in their own
sessions (the pool stops them, or its reaper).

    python -m elastic_jupyter.pool.zygote
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import sysconfig
import threading
from typing import Any

log = logging.getLogger(__name__)

PRELOAD = ("torch", "ipyparallel.engine.app", "ipykernel.ipkernel",
           "elastic_jupyter.engine.entrypoints")
ENGINE_MODULE = "ipyparallel.engine"
OFF = "ELASTIC_JUPYTER_FORK_ENGINES"  # "0": every engine is a new process (python -m ...)


# ---- the zygote process ----------------------------------------------------------------------

def _serve() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    threads = _threads()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the system reaps ended engines: no zombies
    requests, replies = sys.stdin.buffer, sys.stdout
    print(json.dumps({"ready": True}), file=replies, flush=True)
    for line in requests:
        request = json.loads(line)
        if "preload" in request:
            tainted = _preload(request["preload"], threads)
            print(json.dumps({"tainted": tainted}), file=replies, flush=True)
            if tainted:
                return
            continue
        pid = os.fork()
        if pid == 0:
            _become(**request)
            from ipyparallel.engine.app import main
            main(argv=request["argv"])
            sys.exit(0)  # the interpreter's exit from here on, atexit included, as a new process
        print(json.dumps({"pid": pid}), file=replies, flush=True)


def _preload(names: list[str], threads: int) -> str | None:
    """Import the installed modules among `names` (a run's imports, in their order); the
    notebook's own modules stay unloaded, so an edit to them reaches the next engine. Returns
    why the zygote can no longer fork safely (a thread started, CUDA initialised), else None."""
    libraries = tuple(sysconfig.get_path(k)
                      for k in ("stdlib", "platstdlib", "purelib", "platlib"))
    installed: dict[str, bool] = {}
    for name in names:
        top = name.partition(".")[0]
        if name in sys.modules or top == "__main__":
            continue
        if top not in installed:
            installed[top] = _installed(top, libraries)
        if installed[top]:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - an engine imports it again, and says why
                pass
    if _threads() > threads:
        return f"importing the run's modules started {_threads() - threads} thread(s)"
    if (torch := sys.modules.get("torch")) is not None and torch.cuda.is_initialized():
        return "importing the run's modules initialised CUDA"
    return None


def _installed(top: str, libraries: tuple[str, ...]) -> bool:
    """Whether the top-level module `top` comes with Python or an installed package (not
    from the notebook's folder, or an editable install's source tree)."""
    spec = importlib.util.find_spec(top)
    if spec is None:
        return False
    where = spec.origin or next(iter(spec.submodule_search_locations or []), "")
    return where in ("built-in", "frozen") or where.startswith(libraries)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _become(argv: list[str], env: dict[str, str], cwd: str, output: str) -> None:
    """In the forked child: become the process ``python -m ipyparallel.engine *argv`` would be
    (its session, standard streams, folder, environment, random state)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()  # as ipyparallel's Popen(start_new_session=True): the kernel's signals skip it
    out = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, to in ((null, 0), (out, 1), (out, 2)):
        os.dup2(fd, to)
    os.close(out)
    os.close(null)
    os.chdir(cwd)
    sys.path[0] = cwd  # python -m puts its folder first
    os.environ.clear()
    os.environ.update(env)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = [ENGINE_MODULE, *argv]


# ---- the kernel's side -----------------------------------------------------------------------

class ZygoteError(RuntimeError):
    """The zygote did not answer (it exited or failed); it forks no more engines."""


class Zygote:
    """The kernel's handle on one zygote process (thread-safe; one request at a time).

    Args:
        env: the zygote's environment (the engines' thread counts: OMP_NUM_THREADS and
            MKL_NUM_THREADS are read once, as libraries load).
    """

    def __init__(self, env: dict[str, str]):
        self._lock = threading.Lock()  # held by a request and its reply
        self._proc = subprocess.Popen(
            [sys.executable, "-u", "-m", __name__], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
        self._broken: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._request, args=(None,), daemon=True,
                         name="zygote-start").start()

    def _request(self, request: dict | None, wait: bool = True) -> dict | None:
        """Send `request` (None: only read, the zygote's first line) and return the reply;
        None without `wait` while another request is under way. Raises ZygoteError (from
        then on the zygote counts as broken)."""
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            try:
                assert self._proc.stdin is not None and self._proc.stdout is not None
                if request is not None:
                    self._proc.stdin.write(json.dumps(request).encode() + b"\n")
                    self._proc.stdin.flush()
                line = self._proc.stdout.readline()
                if not line:
                    raise ZygoteError(f"it exited (code {self._proc.poll()})")
                return json.loads(line)
            except (OSError, ValueError, ZygoteError) as e:
                self._stop_forking(f"the zygote failed: {e}")
                raise ZygoteError(str(e)) from e
        finally:
            self._ready.set()
            self._lock.release()

    def _stop_forking(self, why: str) -> None:
        if self._broken is None:
            self._broken = why
            if why:
                log.warning("elastic_jupyter: this kernel's engines start as new processes "
                            "from now on (%s)", why)

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """Block until the zygote has imported what it preloads and no other request is under
        way (at most `timeout` s); False when it failed or is still busy then."""
        if not self._ready.wait(timeout) or self._broken is not None:
            return False
        if self._lock.acquire(timeout=timeout):
            self._lock.release()
            return self._broken is None
        return False

    def fork(self, argv: list[str], env: dict[str, str], cwd: str, output: str) -> int | None:
        """Fork an engine that runs ``python -m ipyparallel.engine *argv`` in `env` and `cwd`,
        its output appended to `output`; returns its pid. Returns None at once, for the caller
        to start a new process, while the zygote imports or when it is gone: this never
        waits."""
        if self._broken is not None or not self._ready.is_set():
            return None
        try:
            reply = self._request({"argv": argv, "env": env, "cwd": cwd, "output": output},
                                  wait=False)
        except ZygoteError:
            return None
        return None if reply is None else int(reply["pid"])

    def preload(self, modules: list[str]) -> None:
        """Import the installed ones among `modules` (what a run's cell imported on an
        engine, in order) in the background, so engines forked later have them loaded.
        Should that make forking unsafe (a thread started, CUDA initialised), the zygote
        ends and engines start as new processes, with a warning saying why."""
        def load() -> None:
            try:
                reply = self._request({"preload": modules}) if self.wait_ready() else None
                if reply is not None and reply["tainted"]:
                    self._stop_forking(f"the zygote stopped: {reply['tainted']}")
            except ZygoteError:
                pass  # said once, by _stop_forking
        if self._broken is None:
            threading.Thread(target=load, daemon=True, name="zygote-preload").start()

    def close(self) -> None:
        """End the zygote now, even mid-import (its engines go on: it holds nothing of
        theirs)."""
        self._stop_forking("")  # closed: nothing to warn of
        self._proc.kill()
        self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:  # a request's bytes it never read
                pass


_zygotes: dict[int, Zygote] = {}  # by the engines' thread count
_users: dict[int, int] = {}
_zygotes_lock = threading.Lock()


def acquire(threads: int) -> bool:
    """Start this kernel's zygote for engines of `threads` threads unless it runs; returns
    False, starting none, when forking is off (``ELASTIC_JUPYTER_FORK_ENGINES=0``). Pair a
    True with :func:`release`."""
    if os.environ.get(OFF, "1") == "0":
        return False
    with _zygotes_lock:
        if threads not in _zygotes:
            env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
            _zygotes[threads] = Zygote(env)
        _users[threads] = _users.get(threads, 0) + 1
    return True


def running(threads: int) -> Zygote | None:
    """The zygote :func:`acquire` started for `threads` (None: none runs)."""
    with _zygotes_lock:
        return _zygotes.get(threads)


def release(threads: int) -> None:
    """One user of the zygote for `threads` is done; the last one ends it."""
    with _zygotes_lock:
        _users[threads] -= 1
        if _users[threads] == 0:
            del _users[threads]
            _zygotes.pop(threads).close()


if __name__ == "__main__":
    _serve()
