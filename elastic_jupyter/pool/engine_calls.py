"""Every call from the owner into the engines, typed: the only user of ``apply_async``.

Each method submits an engine-side entry point (``engine.entrypoints``) through the pool's
ipyparallel client and awaits it on the owner loop. Calls to several engines are submitted to
all of them before any is awaited: collectives (forming a group, a broadcast) need every rank
to enter concurrently. Errors arrive as ipyparallel ``RemoteError``; :func:`remote_message` and
:func:`remote_summary` turn them into the engine's traceback and a one-line summary.
"""
from __future__ import annotations

import asyncio
import re
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..engine import entrypoints
from ..engine.protocol import GenerationSpec, TrainingState

if TYPE_CHECKING:
    from .processes import Engine

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    """`text` without terminal colour codes (IPython colours engine tracebacks)."""
    return _ANSI.sub("", text)


def remote_message(error: BaseException) -> str:
    """The engine-side traceback of an ipyparallel RemoteError (plain text), or the error."""
    tb = getattr(error, "traceback", None)
    if not tb:
        return strip_ansi(f"{type(error).__name__}: {error}")
    text = strip_ansi(tb if isinstance(tb, str) else "\n".join(tb))
    # drop ipyparallel's own frames (the task wrapper): they say nothing about the user's code
    blocks = [b for b in text.split("\n\n")
              if not (b.startswith("File <string>") or
                      (b.startswith("File ") and "/ipyparallel/" in b.splitlines()[0]))]
    return "\n\n".join(blocks)


def remote_summary(error: BaseException) -> str:
    """One line: the remote exception's type and message."""
    ename, evalue = getattr(error, "ename", None), getattr(error, "evalue", None)
    return strip_ansi(f"{ename}: {evalue}" if ename else f"{type(error).__name__}: {error}")


class GenerationTask:
    """One rank's running ``train_generation`` task.

    Attributes:
        future: asyncio future of the task's result (its error is always retrieved, so an
            abandoned hung rank never logs "exception was never retrieved").
    """

    def __init__(self, async_result: Any):  # ipyparallel's AsyncResult
        self._ar = async_result
        self.future = asyncio.wrap_future(async_result)
        self.future.add_done_callback(lambda f: f.cancelled() or f.exception())

    def live_data(self) -> dict:
        """The newest update the task published (records and events); {} before the first."""
        return self._ar.data or {}

    def error(self) -> BaseException | None:
        """The task's error once it ended with one (a cancelled task: CancelledError), else
        None."""
        if self.future.cancelled():
            return asyncio.CancelledError()
        return self.future.exception() if self.future.done() else None


class EngineCalls:
    """Typed calls into a pool's engines; `engine` arguments are :class:`~.processes.Engine`
    objects.

    Args:
        client: returns the pool's ipyparallel client (its engine sets own it; None until the
            pool started).
    """

    def __init__(self, client: Callable[[], Any]):
        self._client = client

    @property
    def client(self) -> Any:
        return self._client()

    def _submit(self, engine: Engine, fn: Callable[..., Any], *args: Any) -> Any:
        return self.client[engine.engine_id].apply_async(fn, *args)

    async def _each(self, engines: Sequence[Engine], fn: Callable[..., Any], *args: Any,
                    return_exceptions: bool = False) -> list:
        futures = [asyncio.wrap_future(self._submit(e, fn, *args)) for e in engines]
        return await asyncio.gather(*futures, return_exceptions=return_exceptions)

    async def init_engines(self, engine_ids: list[int]) -> list[dict]:
        """Bind fresh engines to the slot in their environment; [{"pid", "slot", "device",
        "host", "versions"}] in `engine_ids` order."""
        from ipyparallel.datapub import publish_data  # the engines' live-update channel
        ar = self.client[engine_ids].apply_async(_init_from_env, entrypoints.init_engine,
                                                 publish_data)
        return await asyncio.wrap_future(ar)

    async def bind_slot(self, engine: Engine, slot: int, gpu: int | None,
                        threads: int) -> dict:
        """Bind a warm engine (started without a slot) to `slot`; {"pid", "slot", "device",
        "host", "versions"}."""
        return await asyncio.wrap_future(self._submit(engine, entrypoints.bind_slot, slot, gpu,
                                                      threads))

    async def setup_run(self, engines: Sequence[Engine], config: dict, source: str | None,
                        setup_bytes: bytes | None, push: dict,
                        log_path: Callable[[Engine], str], workdir: str) -> list:
        """Run the cell on every engine, in `workdir`; one result dict or exception per
        engine."""
        futures = [asyncio.wrap_future(self._submit(
            e, entrypoints.setup_run, config, source, setup_bytes, push, log_path(e), workdir))
            for e in engines]
        return await asyncio.gather(*futures, return_exceptions=True)

    async def connect_store(self, engines: Sequence[Engine], host: str, port: int,
                            timeout: float) -> None:
        await self._each(engines, entrypoints.connect_store, host, port, timeout)

    def train_generation(self, engine: Engine, spec: GenerationSpec,
                         log_path: str) -> GenerationTask:
        return GenerationTask(self._submit(engine, entrypoints.train_generation, spec, log_path))

    async def load_state(self, engine: Engine, folder: str) -> dict:
        """Restore `engine` from the newest usable checkpoint in `folder`."""
        return await asyncio.wrap_future(self._submit(engine, entrypoints.load_state, folder))

    async def training_state(self, engine: Engine) -> TrainingState:
        return await asyncio.wrap_future(self._submit(engine, entrypoints.training_state))

    async def progress(self, engines: Sequence[Engine]) -> list[dict]:
        return await self._each(engines, entrypoints.progress)

    async def history_since(self, engine: Engine, step: int, pending: bool = False) -> list[dict]:
        return await asyncio.wrap_future(self._submit(engine, entrypoints.history_since, step,
                                                      pending))

    def engine_set(self, engine_id: int) -> Any:
        """Ask a registered engine which engine set started it (its ``ELASTIC_JUPYTER_SET``);
        returns ipyparallel's AsyncResult at once (``ready()``, ``get()``): the pool's look at
        arrivals polls it rather than awaiting it."""
        return self.client[engine_id].apply_async(_set_from_env)

    async def drop_run(self, engines: Sequence[Engine]) -> None:
        """Make the engines forget the run (errors ignored: an engine may be gone)."""
        await self._each(engines, entrypoints.drop_run, return_exceptions=True)


def _init_from_env(init_engine: Callable[..., dict], publisher: Callable[[dict], None]) -> dict:
    import os
    import torch
    from elastic_jupyter.config.environment import SLOT
    slot_text = SLOT.get()
    slot = int(slot_text) if slot_text else None  # "": a warm engine
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    device = f"cuda:{gpu}" if gpu and torch.cuda.is_available() else "cpu"
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    return init_engine(slot, device, threads, publisher)


def _set_from_env() -> str:
    from elastic_jupyter.config.environment import ENGINE_SET
    return ENGINE_SET.get() or ""
