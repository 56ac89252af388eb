"""This host's launcher: engines are processes of this host, as this user, forked from the
pool's zygote (:mod:`..zygote`) where one runs."""
from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Any, Callable

import psutil
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher

from .. import zygote
from .base import Launcher

log = logging.getLogger(__name__)


class LocalLauncher(Launcher):
    """Engines are processes of this host (ipyparallel's ``LocalEngineSetLauncher``), each
    forked from a zygote that has imported torch and ipyparallel once (set
    ``ELASTIC_JUPYTER_FORK_ENGINES=0`` before the pool starts for a new process per engine)."""

    kind, local = "local", True
    _zygote: str | None = None  # the key of the pool's zygote while the pool runs
    _threads = 1

    @property
    def zygote(self) -> zygote.Zygote | None:
        """The zygote the pool's engines fork from (None: they start as new processes)."""
        return zygote.running(self._zygote)

    def cluster_options(self, folder: str) -> dict[str, Any]:
        return {"engine_launcher_class": ForkedEngineSetLauncher}

    def engine_env(self) -> dict[str, str]:
        return {**super().engine_env(), **({zygote.KEY: self._zygote} if self._zygote else {})}

    def open(self, threads: int) -> None:
        # still open after a start that failed before the pool ran: its zygote serves again
        if self._zygote is None:
            self._threads = threads
            self._zygote = zygote.acquire(threads)  # it imports while the controller starts

    def preload(self, modules: list[str]) -> None:
        if (z := self.zygote) is not None:
            z.preload(modules)

    async def ready(self) -> None:
        if (z := self.zygote) is not None and not z.fits(os.environ):
            # the kernel's environment changed (%env, a library's import): a zygote started
            # in it imports what an engine would, read as a new process would read it
            changed = sorted(k for k in set(os.environ) | set(z.environ)
                             if os.environ.get(k) != z.environ.get(k))
            log.info("elastic_jupyter: the kernel's environment changed (%s): engines fork "
                     "from a new zygote", ", ".join(changed))
            old, self._zygote = self._zygote, zygote.acquire(self._threads)
            zygote.release(old or "")
        if (z := self.zygote) is not None:
            await asyncio.to_thread(z.wait_ready)

    def close(self) -> None:
        if self._zygote is not None:
            zygote.release(self._zygote)
            self._zygote = None

    def arbiter(self, own_jobs: Callable[[], list[str]]) -> None:
        return None


class ForkedEngineLauncher(LocalEngineLauncher):
    """ipyparallel's launcher of one local engine, which forks the engine from its pool's
    zygote (named in its environment) instead of starting ``python -m ipyparallel.engine``:
    the same process, arguments, environment, folder and output file, without the imports.
    Without a zygote ready to fork, with a custom engine command, or once the kernel's
    environment changed since the zygote started, it starts the process as ipyparallel does."""

    def start(self) -> None:
        env = {**os.environ, **self.get_env()}
        z = zygote.running(env.get(zygote.KEY))
        command = [sys.executable, "-m", zygote.ENGINE_MODULE]
        if (z is None or self.engine_cmd[:3] != command or self.state != "before"
                or not z.fits(os.environ)):
            return super().start()
        pid = z.fork(self.args[3:], env, os.path.abspath(self.work_dir), self.output_file)
        if pid is None:  # none to fork from now
            return super().start()
        self.pid = pid
        self.process = psutil.Process(pid)
        self.notify_start(pid)
        self._start_waiting()  # ipyparallel's own watch for its exit
        return None


class ForkedEngineSetLauncher(LocalEngineSetLauncher):
    """ipyparallel's local engine-set launcher, starting each engine with
    :class:`ForkedEngineLauncher`."""

    launcher_class = ForkedEngineLauncher
