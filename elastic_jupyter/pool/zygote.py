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

Fork safety. The zygote only imports: torch initialises CUDA lazily (and asks NVML, not CUDA,
whether a GPU is there: ``PYTORCH_NVML_BASED_CUDA_CHECK``), so the zygote holds no device and a
child's environment (``CUDA_VISIBLE_DEVICES``) binds it before first use; no event loop, zmq
context or thread exists (OpenBLAS, which starts its workers as it loads, is told to use one
thread; a child gets its count back through threadpoolctl where installed). Imports that load
the CUDA driver, or a preload that starts a thread, make the zygote refuse every fork from
then on (engines then start as new processes, and a warning says why). Each child gets the
folder, ``sys.path[0]`` and environment a new process would have. What libraries read once,
as they load (OpenMP's thread count, ``TORCH_LOGS``, a library's settings from the
environment), comes from the zygote's start, so a zygote serves one thread count and one
environment of the kernel (:func:`acquire`): once the kernel's environment changes, its pools'
engines fork from a new zygote started in it. numpy's global random state is redrawn in the
child: a new process draws it from the OS, a fork would share it.

Protocol: one JSON line each way on the zygote's stdin and its stdout (moved off file
descriptor 1, so what an import prints goes elsewhere): ``{"argv": [...], "env": {...}, "cwd":
..., "output": path}`` -> ``{"pid": n or null}`` (null: it refuses); ``{"preload": [module,
...]}`` -> ``{"tainted": why or null}``. Its first line is ``{"ready": true}``, or
``{"ready": false, "why": ...}``. End of its stdin (the kernel stopped it, or died) ends the
zygote; its engines live on in their own
sessions (the pool stops them, or its reaper). A zygote that refuses forks still runs: it
reaps its engines as they end.

    python -m elastic_jupyter.pool.zygote
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any

from ..config.environment import ARROW_MALLOC, FORK_ENGINES, ZYGOTE
from ..engine.workdir import installed_file

log = logging.getLogger(__name__)

PRELOAD = ("torch", "ipyparallel.engine.app", "ipykernel.ipkernel",
           "elastic_jupyter.engine.entrypoints")
ENGINE_MODULE = "ipyparallel.engine"
OFF = FORK_ENGINES.name  # "0": every engine is a new process (python -m ...)
KEY = ZYGOTE.name  # in an engine's environment: the zygote of its pool
READY_WAIT_S = 5.0  # an engine start waits this long at most for the zygote's imports
# variables that change in a kernel without changing what an import reads: pytest's current
# test, and the OpenMP settings scikit-learn (and joblib) set when imported
VOLATILE = ("PYTEST_CURRENT_TEST", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK")


# ---- the zygote process ----------------------------------------------------------------------

def _serve() -> None:
    replies = os.fdopen(os.dup(1), "w")  # what imports print goes to fd 1, now stderr's
    os.dup2(2, 1)
    if not getattr(sys.flags, "safe_path", False):
        del sys.path[0]  # the folder python -m put first: a child puts its own there
    started_with = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    refusing = _cuda_loaded()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the system reaps ended engines: no zombies
    _reply(replies, {"ready": not refusing, "why": refusing})
    for line in sys.stdin.buffer:
        request = json.loads(line)
        if "preload" in request:
            why = None if refusing else _preload(request["preload"])
            refusing = refusing or why
            _reply(replies, {"tainted": why})
            continue
        pid = None if refusing else os.fork()
        if pid == 0:
            replies.close()
            # what imports set (os.environ.setdefault) a new process would have set too
            set_by_imports = {k: v for k, v in os.environ.items() if started_with.get(k) != v}
            _become(**{**request, "env": {**set_by_imports, **request["env"]}})
            from ipyparallel.engine.app import main
            # its default folder is where the zygote imported it; later arguments win
            main(argv=[f"--work-dir={request['cwd']}", *request["argv"]])
            sys.exit(0)  # the interpreter's exit from here on, atexit included, as a new process
        _reply(replies, {"pid": pid})


def _reply(replies: IO[str], message: dict) -> None:
    print(json.dumps(message), file=replies, flush=True)


def _preload(names: list[str]) -> str | None:
    """Import the installed modules among `names` (a run's imports, in their order); the
    notebook's own modules stay unloaded, so an edit to them reaches the next engine. Returns
    why the zygote can no longer fork safely (a thread started, the CUDA driver loaded), else
    None."""
    threads = set(os.listdir("/proc/self/task"))
    installed: dict[str, bool] = {}
    for name in names:
        top = name.partition(".")[0]
        if name in sys.modules or top in ("__main__", "__mp_main__"):
            continue
        try:
            if top not in installed:
                installed[top] = _installed(top)
            if installed[top]:
                importlib.import_module(name)
        except (Exception, SystemExit):  # noqa: BLE001 - an engine imports it, and says why
            installed[top] = False
    if started := set(os.listdir("/proc/self/task")) - threads:
        return (f"importing the run's modules started {len(started)} thread(s): "
                f"{', '.join(sorted(_thread_name(t) for t in started))}")
    return _cuda_loaded()


def _installed(top: str) -> bool:
    """Whether the top-level module `top`, as this process would import it, is installed
    code (engine.workdir.installed_file), not a module of some notebook's folder."""
    spec = importlib.util.find_spec(top)
    if spec is None:
        return False
    if spec.origin in (None, "built-in", "frozen"):  # built in, or a namespace package
        return installed_file(next(iter(spec.submodule_search_locations or []), None))
    return bool(installed_file(spec.origin))


def _thread_name(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:  # it ended meanwhile
        return tid


def _cuda_loaded() -> str | None:
    """Why this process cannot fork children that use CUDA: the CUDA driver is loaded."""
    with open("/proc/self/maps") as f:
        if "libcuda.so" in f.read():
            return "the CUDA driver is loaded (an import initialised CUDA)"
    return None


def _become(argv: list[str], env: dict[str, str], cwd: str, output: str) -> None:
    """In the forked child: become the process ``python -m ipyparallel.engine *argv`` would be
    (its session, standard streams, folder, import path, environment, random state)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()  # as ipyparallel's Popen(start_new_session=True): the kernel's signals skip it
    out = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)  # the umask decides
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, to in ((null, 0), (out, 1), (out, 2)):
        os.dup2(fd, to)
    os.close(out)
    os.close(null)
    os.chdir(cwd)
    if not getattr(sys.flags, "safe_path", False):
        sys.path.insert(0, os.getcwd())  # python -m puts its folder first
    os.environ.clear()
    os.environ.update(env)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
        _blas_threads(int(env.get("OPENBLAS_NUM_THREADS") or env.get("OMP_NUM_THREADS") or 1))
    sys.argv = [ENGINE_MODULE, *argv]


def _blas_threads(n: int) -> None:
    """Give the loaded BLAS libraries the `n` threads they would have read as they loaded,
    through threadpoolctl where it is installed (without it they keep one)."""
    if n > 1:
        try:
            from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]
        except ImportError:
            return
        threadpool_limits(n, user_api="blas")


# ---- the kernel's side -----------------------------------------------------------------------

class ZygoteError(RuntimeError):
    """The zygote did not answer (it exited or failed); it forks no more engines."""


class Zygote:
    """The kernel's handle on one zygote process (thread-safe; one request at a time).

    Args:
        environ: the kernel's environment, which the zygote starts with (:meth:`fits`).
        threads: its engines' thread count (OMP_NUM_THREADS and MKL_NUM_THREADS are read once,
            as libraries load).
    """

    def __init__(self, environ: dict[str, str], threads: int):
        self.environ = environ
        # OpenBLAS (numpy's, scipy's) starts its worker threads as it loads: one, so the
        # zygote stays without threads; each engine gets its count back (_become). pyarrow's
        # jemalloc (pandas and datasets import it) starts a purging thread as it loads, unless
        # told to purge as it allocates
        env = dict(environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   OPENBLAS_NUM_THREADS="1", PYTORCH_NVML_BASED_CUDA_CHECK="1")
        env.setdefault(ARROW_MALLOC.name, "background_thread:false")
        self._lock = threading.Lock()  # held by a request and its reply
        self._proc = subprocess.Popen(
            [sys.executable, "-u", "-m", __name__], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
        self._broken: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._start, daemon=True, name="zygote-start").start()

    def _start(self) -> None:
        try:
            first = self._request(None)
            if first is not None and not first["ready"]:
                self._stop_forking(f"the zygote refuses to fork: {first['why']}")
        except ZygoteError:
            pass  # said once, by _stop_forking

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

    def fits(self, environ: Any) -> bool:
        """Whether an engine started in the kernel's environment `environ` may be forked: it
        is the one the zygote started with (but for :data:`VOLATILE` variables)."""
        return stable(environ) == stable(self.environ)

    def wait_ready(self, timeout: float = READY_WAIT_S) -> bool:
        """Block until the zygote has imported what it preloads and no other request is under
        way (at most `timeout` s); False when it failed or is still busy then."""
        deadline = time.monotonic() + timeout
        if not self._ready.wait(timeout) or self._broken is not None:
            return False
        if self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            self._lock.release()
            return self._broken is None
        return False

    def fork(self, argv: list[str], env: dict[str, str], cwd: str, output: str) -> int | None:
        """Fork an engine that runs ``python -m ipyparallel.engine *argv`` in `env` and the
        absolute folder `cwd`, its output appended to `output`; returns its pid. Returns None
        at once, for the caller to start a new process, while the zygote imports, when it
        refuses or when it is gone: this never waits."""
        if self._broken is not None or not self._ready.is_set():
            return None
        try:
            reply = self._request({"argv": argv, "env": env, "cwd": cwd, "output": output},
                                  wait=False)  # a preload under way: a new process
        except ZygoteError:
            return None
        return None if reply is None or reply["pid"] is None else int(reply["pid"])

    def preload(self, modules: list[str]) -> None:
        """Import the installed ones among `modules` (what a run's setup imported on an
        engine, in order) in the background, so engines forked later have them loaded.
        Should that make forking unsafe (a thread started, the CUDA driver loaded), the
        zygote refuses every fork from then on, with a warning saying why."""
        def load() -> None:
            try:
                reply = self._request({"preload": modules}) if self.wait_ready(60.0) else None
                if reply is not None and reply["tainted"]:
                    self._stop_forking(f"the zygote refuses to fork: {reply['tainted']}")
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


_zygotes: dict[str, Zygote] = {}  # by key: thread count and kernel environment
_users: dict[str, int] = {}
_zygotes_lock = threading.Lock()


def acquire(threads: int) -> str | None:
    """Start this kernel's zygote for engines of `threads` threads in its environment now,
    unless one runs; returns its key (for :func:`running` and :func:`release`), or None,
    starting none, when forking is off (``ELASTIC_JUPYTER_FORK_ENGINES=0``)."""
    if FORK_ENGINES.get() == "0":
        return None
    environ = dict(os.environ)
    digest = hashlib.sha256(json.dumps(sorted(stable(environ).items())).encode()).hexdigest()
    key = f"{threads}-{digest[:12]}"
    with _zygotes_lock:
        if key not in _zygotes:
            _zygotes[key] = Zygote(environ, threads)
        _users[key] = _users.get(key, 0) + 1
    return key


def stable(environ: Any) -> dict[str, str]:
    """The environment `environ` but for its :data:`VOLATILE` variables."""
    return {k: v for k, v in environ.items() if k not in VOLATILE}


def running(key: str | None) -> Zygote | None:
    """The zygote :func:`acquire` started as `key` (None: none runs)."""
    with _zygotes_lock:
        return _zygotes.get(key or "")


def release(key: str) -> None:
    """One user of the zygote `key` is done; the last one ends it."""
    with _zygotes_lock:
        _users[key] -= 1
        if _users[key] == 0:
            del _users[key]
            _zygotes.pop(key).close()


if __name__ == "__main__":
    _serve()
